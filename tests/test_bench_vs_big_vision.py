"""tipsito/bench/vs_big_vision.py: the side-by-side step against big_vision's two-tower CLIP.

Why: the parity numbers in docs/performance.md come from this tool; these tests keep it runnable and keep
its big_vision side honest (big_vision's own loss and towers at tipsito's shapes). big_vision is not a
dependency: the tests that run it need a local checkout named by TIPSITO_BIG_VISION (the directory holding
the `big_vision` package) and skip otherwise. The error for a missing checkout is tested always.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import app
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tipsito.bench import vs_big_vision as bench
from tipsito.losses import contrastive

BIG_VISION = os.environ.get("TIPSITO_BIG_VISION")
needs_big_vision = pytest.mark.skipif(
  not BIG_VISION,
  reason="no big_vision checkout: set TIPSITO_BIG_VISION to the directory holding the big_vision package",
)


def test_missing_or_wrong_checkout_is_a_clear_error(tmp_path):
  with pytest.raises(app.UsageError, match="--big_vision is required"):
    bench.big_vision_root(None)
  with pytest.raises(app.UsageError, match=f"--big_vision={tmp_path}: no big_vision/models"):
    bench.big_vision_root(str(tmp_path))


def test_unknown_recipe_or_toggle_is_a_clear_error():
  with pytest.raises(app.UsageError, match="--recipes: 'siglip'"):
    bench.run_side_by_side("/nonexistent", ["siglip"])
  with pytest.raises(app.UsageError, match="--toggles: 'fast'"):
    bench.run_side_by_side("/nonexistent", ["clip"], toggles=["fast"])


@needs_big_vision
def test_big_vision_softmax_loss_is_tipsito_clip_loss():
  """The loss big_vision's rows run (read from its CLIP trainer) is tipsito's clip_loss (known answer)."""
  bv = bench.import_big_vision(bench.big_vision_root(BIG_VISION))
  rs = np.random.RandomState(0)
  zimg, ztxt = (rs.normal(size=(6, 8)).astype(np.float32) for _ in range(2))
  zimg, ztxt = (z / np.linalg.norm(z, axis=-1, keepdims=True) for z in (zimg, ztxt))
  t = jnp.float32(7.0)
  mesh = Mesh(np.asarray(jax.devices()[:1]), ("batch",))
  bv_loss = jax.jit(
    jax.shard_map(lambda a, b: bv.softmax_loss(a, b, t)[0], mesh=mesh, in_specs=P("batch"), out_specs=P())
  )(zimg, ztxt)
  np.testing.assert_allclose(bv_loss, contrastive.clip_loss(zimg, ztxt, t), rtol=1e-6)


@needs_big_vision
def test_tiny_side_by_side_rows():
  """Tiny shapes (about a minute): both sides compile and run at the same shapes, the ratios are to
  big_vision's row, and big_vision's exact-GELU row really changes its towers."""
  rows = bench.run_side_by_side(
    BIG_VISION, ["clip"], variant="tiny/16", batch=4, steps=1, toggles=["bv_exact_gelu"], log=lambda s: None
  )
  by = {r["row"]: r for r in rows}
  assert list(by) == ["clip", "big_vision clip", "big_vision clip +exact_gelu"]
  ours, bv, bv_exact = by["clip"], by["big_vision clip"], by["big_vision clip +exact_gelu"]
  for r in rows:
    assert r["step_s"] > 0 and r["temp_MiB"] > 0 and r["flops"] > 0
  assert bv["gflop_vs_bv"] == bv["temp_MiB_vs_bv"] == bv["step_s_vs_bv"] == 1.0
  # Same towers, batch and loss: the FLOPs agree to a few percent (what differs: ln_pre, biases, masks).
  assert 0.95 < ours["flops"] / bv["flops"] < 1.1
  # erf's polynomial costs more than tanh's: the toggle reached big_vision's MLP blocks.
  assert bv_exact["flops"] > bv["flops"]


def test_remat_toggles_set_both_towers_policy():
  """`--toggles remat_P` rows: both towers' blocks rematerialised with policy P, nothing else changed."""
  base = bench.tipsito_config("clip", "tiny/16", 8)
  for policy in ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
    c = bench.tipsito_config("clip", "tiny/16", 8, toggles=[f"remat_{policy}"])
    for tower in ("image", "text"):
      assert (c.model[tower].remat, c.model[tower].remat_policy) == (True, policy)
      c.model[tower].update(dict(remat=base.model[tower].remat, remat_policy=base.model[tower].remat_policy))
    assert c.to_dict() == base.to_dict()
