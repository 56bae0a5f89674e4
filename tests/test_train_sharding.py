"""Mesh, sharding rules, and the same loss/gradients on a 1-device and an 8-device FSDP mesh.

Why: the train step must be device-count agnostic — losses are written on the global batch and XLA
inserts the collectives — so the numbers on a pod equal the numbers on a laptop. The 8-device check runs
in a subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (fake CPU devices).
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tipsito.train import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mesh_shape_resolution():
  assert sharding.mesh_shape({"data": 1, "fsdp": -1, "model": 1}, 8) == (1, 8, 1)
  assert sharding.mesh_shape({"data": 2, "fsdp": -1, "model": 2}, 8) == (2, 2, 2)
  with pytest.raises(ValueError, match="at most one axis"):
    sharding.mesh_shape({"data": -1, "fsdp": -1, "model": 1}, 8)
  with pytest.raises(ValueError, match="uses 4 devices but 8"):
    sharding.mesh_shape({"data": 2, "fsdp": 2, "model": 1}, 8)


def test_rules_fsdp_and_regex():
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "model": 1}, jax.devices()[:1])
  tree = {
    "image": {
      "block_0": {
        "kernel": jax.ShapeDtypeStruct((64, 128), np.float32),
        "bias": jax.ShapeDtypeStruct((128,), np.float32),
      }
    },
    "step": jax.ShapeDtypeStruct((), np.int32),
  }
  sh = sharding.tree_shardings(tree, mesh, [("bias", "replicate")], min_size=16)
  assert sh["step"].spec == P()
  assert sh["image"]["block_0"]["bias"].spec == P()
  # fsdp size 1: everything replicated.
  assert sh["image"]["block_0"]["kernel"].spec == P()
  # Spec logic with a pretend fsdp axis of 8 (largest divisible dim gets 'fsdp').
  fake = type("M", (), {"shape": {"data": 1, "fsdp": 8, "model": 1}})()
  assert sharding._fsdp_spec((64, 128), fake, 16) == P(None, "fsdp")
  assert sharding._fsdp_spec((63, 7), fake, 16) == P()
  assert sharding._fsdp_spec((8, 3), fake, 1000) == P()  # small leaves stay replicated


WORKER = textwrap.dedent(r'''
  import json, sys
  import jax, numpy as np
  jax.config.update("jax_threefry_partitionable", True)
  jax.config.update("jax_default_matmul_precision", "highest")
  sys.path.insert(0, ROOT)
  from tipsito.data.synthetic import synthetic_batch
  from tipsito.train import sharding, step as step_lib
  from tipsito.config import defaults
  c = defaults.tiny_config("tipsito", batch_size=8)
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.model.text.depth = 1
  c.sharding.min_size = 1  # shard every divisible leaf, to exercise FSDP on tiny params
  host = synthetic_batch(c, seed=3)
  out = {}
  for name, devs, mesh_cfg in (("one", jax.devices()[:1], {"data": 1, "fsdp": 1, "model": 1}),
                               ("fsdp8", jax.devices(), {"data": 1, "fsdp": 8, "model": 1})):
    mesh = sharding.make_mesh(mesh_cfg, devs)
    setup = step_lib.build(c, mesh, vocab_size=100)
    state = setup.init_state()
    n_sharded = sum(1 for s in jax.tree.leaves(setup.state_shardings.params) if "fsdp" in str(s.spec))
    batch = sharding.global_batch(host, mesh)
    loss, metrics, centers, grads = step_lib.jit_loss_and_grads(setup)(state, batch, {})
    out[name] = dict(loss=float(loss), terms={k: float(v) for k, v in metrics.items()},
                     grads=[np.asarray(g).ravel().tolist() for g in jax.tree.leaves(jax.device_get(grads))],
                     params=[np.asarray(p).ravel()[:4].tolist() for p in jax.tree.leaves(jax.device_get(state.params))],
                     n_sharded=n_sharded, devices=len(devs))
  print("RESULT" + json.dumps(out))
''').replace("ROOT", repr(ROOT))


@pytest.fixture(scope="module")
def mesh_results():
  env = dict(os.environ)
  # 8 fake CPU devices; LLVM optimisation off (both meshes run in this one process with the same flags,
  # it only shortens the two compiles).
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT") :])


def test_same_init_loss_and_grads_on_1_and_8_devices(mesh_results):
  one, many = mesh_results["one"], mesh_results["fsdp8"]
  assert many["devices"] == 8 and many["n_sharded"] > 0 and one["n_sharded"] == 0
  for a, b in zip(one["params"], many["params"]):  # params born sharded, same values
    np.testing.assert_array_equal(a, b)
  assert one["loss"] == pytest.approx(many["loss"], abs=1e-5, rel=1e-5)
  for k in one["terms"]:
    assert one["terms"][k] == pytest.approx(many["terms"][k], abs=1e-5, rel=1e-5), k
  assert len(one["grads"]) == len(many["grads"])
  # Gradients agree to 1e-5 relative to each leaf's scale (fp32 reductions run in a different order
  # across 8 shards; single elements may differ by a few ulps of the leaf's largest entry).
  for a, b in zip(one["grads"], many["grads"]):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(1.0, float(np.abs(b).max()))
    assert float(np.abs(a - b).max()) <= 1e-5 * scale, (float(np.abs(a - b).max()), scale)
