"""Distillation as TIPSv2 §3.1 describes it: the default config (feature loss off) trains, and a tipsito
training workdir as teacher brings its own frozen EMA DINO/iBOT heads (no EMA in the student run).

Why: with only encoder weights (export, official .npz) the teacher heads have to be invented (EMA of the
student heads); with a workdir the paper's frozen teacher, heads included, is available and must be used.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito import objective
from conftest import run_synthetic_steps
from tipsito.config import defaults
from tipsito.config import validation as config_validation
from tipsito.data.synthetic import synthetic_batch
from tipsito.train import assembly
from tipsito.train import checkpointing
from tipsito.train import sharding
from tipsito.train import step as step_lib
from tipsito.train import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIPS = pathlib.Path(__file__).parent / "data" / "tips_model"


def paper_distill_config():
  spec = importlib.util.spec_from_file_location("cfg_distill", ROOT / "configs" / "tipsv2_distill.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config("student=B")


def tiny_student(teacher=None, npz=False):
  """The paper distillation config's losses, views, EMA and optimizer on tiny depth-1 towers."""
  paper = paper_distill_config()
  c = defaults.tiny_config("distill", image_size=28)
  for key in ("loss", "loss_opts", "ema"):
    c[key] = paper[key]
  c.optim.update({k: v for k, v in paper.optim.items() if k not in ("lr", "warmup_steps", "momentum_dtype")})
  c.input.mask_ratio = paper.input.mask_ratio
  c.model.image.update(dict(patch_size=14, depth=1, posemb_grid=4))
  c.model.text.depth = 1
  if npz:
    c.distill.teacher_image_npz = str(TIPS / "tiny_vit_mlp_vision.npz")
  c.distill.teacher = teacher
  return c


def run(c, steps):
  return run_synthetic_steps(c, steps)


def test_default_distill_config_trains_with_feature_loss_off():
  c = tiny_student(npz=True)
  assert c.loss.feature == 0.0 and c.input.mask_ratio == 0.0 and c.optim.name == "adafactor"
  config_validation.validate(c, num_devices=1)
  setup, state, _, hist = run(c, 4)
  assert "loss/feature" not in hist[0] and {"loss/dino", "loss/ibot", "loss/clip"} <= set(hist[0])
  assert all(np.isfinite(v) for h in hist for v in h.values())
  assert hist[-1]["loss/total"] < hist[0]["loss/total"]
  assert setup.teacher.heads is None and set(state.ema) == {"dino_head", "ibot_head"}  # EMA fallback


@pytest.fixture(scope="module")
def teacher_workdir(tmp_path_factory):
  """A tiny tipsv2 pretraining workdir (config.json + one checkpoint) whose EMA heads differ from its
  student heads, so the test can tell which ones the distillation uses."""
  wd = tmp_path_factory.mktemp("teacher")
  c = defaults.tiny_config("tipsv2", image_size=28)
  c.model.image.update(dict(patch_size=14, depth=1, posemb_grid=4))
  c.model.text.update(dict(depth=1, vocab_size=100))
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  setup = step_lib.build(c, mesh)
  state = setup.init_state()
  state = state.replace(ema=jax.tree.map(lambda x: x * 1.5 + 0.01, state.ema))
  workdir_lib.save_config(c, str(wd))
  ckpt = checkpointing.Checkpointer(str(wd / "checkpoints"), every_steps=1, keep=1, async_save=False)
  ckpt.save(1, state, force=True)
  ckpt.close()
  return wd, jax.device_get(state)


def test_distill_from_training_workdir_uses_the_teachers_own_heads(teacher_workdir):
  wd, t_state = teacher_workdir
  c = tiny_student(teacher=str(wd))
  setup, state, frozen, hist = run(c, 3)
  assert setup.teacher.heads is not None and state.ema == {}
  for k in ("dino_head", "ibot_head"):  # the teacher's EMA heads, not its student heads
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(frozen[k]), t_state.ema[k])
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(frozen["image"]),
    {k: v for k, v in t_state.params["image"].items() if k != "mask_token"},
  )
  assert all(np.isfinite(v) for h in hist for v in h.values())
  # The targets come from the frozen heads: other head values change the DINO and iBOT losses.
  batch = jax.tree.map(jnp.asarray, synthetic_batch(c, seed=1))
  other = dict(
    frozen,
    dino_head=jax.tree.map(lambda x: -x, frozen["dino_head"]),
    ibot_head=jax.tree.map(lambda x: -x, frozen["ibot_head"]),
  )
  f = jax.jit(
    lambda fr: objective.compute_losses(
      setup.ctx, state.params, state.ema, state.centers, fr, batch, state.step, jax.random.PRNGKey(0)
    )[1][0]
  )
  a, b = f(frozen), f(other)
  assert abs(float(a["loss/dino"]) - float(b["loss/dino"])) > 1e-4
  assert abs(float(a["loss/ibot"]) - float(b["loss/ibot"])) > 1e-4


def test_teacher_heads_must_match_student_heads(teacher_workdir):
  wd, _ = teacher_workdir
  c = tiny_student(teacher=str(wd))
  c.model.heads.num_prototypes = 32
  with pytest.raises(ValueError, match=r"config\.model\.heads .*num_prototypes.*32.*teacher's heads"):
    assembly.build(c, sharding.make_mesh(c.mesh, jax.devices()[:1]), vocab_size=100)
