"""Conformance tests for tipsito.losses (dino.py, ibot.py, teacher_targets.py, koleo.py) against dinov2's DINO / iBOT / KoLeo losses.

Why: TIPSv2's self-distillation terms must reproduce dinov2 (README section 2 of the conformance
vectors) to rtol 1e-5 / atol 1e-5 for losses and atol 1e-6 / rtol 1e-5 for probabilities, centres and
gradients, gradients taken with jax.grad. Crop-major (C*B, K) reference rows are reshaped to (C, B, K).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito import losses
from tipsito.losses import dino, ibot, koleo, teacher_targets

from conftest import DATA_DIR

LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
PROB_TOL = dict(rtol=1e-5, atol=1e-6)  # probabilities, centres, gradients
B, K, N = 4, 32, 16
ST, TT = 0.1, 0.04


@pytest.fixture(scope="module")
def ref():
  return dict(np.load(DATA_DIR / "dino_losses" / "dino_losses.npz"))


def _crops(x):
  """(C*B, K) crop-major rows -> (C, B, K)."""
  return jnp.asarray(x).reshape(-1, B, x.shape[-1])


# ------------------------------------------------------------------------------------------------
# DINO teacher targets and centre.


def test_dino_teacher_probs_centering(ref):
  p = losses.teacher_probs_centered(_crops(ref["teacher_cls_logits"]), ref["dino_center_init"], TT)
  assert p.shape == (2, B, K)
  np.testing.assert_allclose(p.reshape(8, K), ref["dino_teacher_probs_softmax_centered"], **PROB_TOL)
  p2 = losses.teacher_probs(ref["teacher_cls_logits"], ref["dino_center_init"], TT)
  np.testing.assert_allclose(p2, ref["dino_teacher_probs_softmax_centered"], **PROB_TOL)


def test_dino_center_update(ref):
  new = losses.update_center(ref["dino_center_init"], _crops(ref["teacher_cls_logits"]), 0.9)
  assert new.shape == (1, K)
  np.testing.assert_allclose(new, ref["dino_center_after_update"], **PROB_TOL)
  # Same from the flat crop-major rows and with a (K,) centre.
  new_flat = losses.update_center(ref["dino_center_init"][0], ref["teacher_cls_logits"], 0.9)
  assert new_flat.shape == (K,)
  np.testing.assert_allclose(new_flat, ref["dino_center_after_update"][0], **PROB_TOL)


def test_dino_teacher_probs_sinkhorn(ref):
  p = losses.sinkhorn_knopp(_crops(ref["teacher_cls_logits"]), TT, n_iters=3)
  np.testing.assert_allclose(p.reshape(8, K), ref["dino_teacher_probs_sinkhorn"], **PROB_TOL)
  p2 = losses.teacher_probs(ref["teacher_cls_logits"], None, TT, method="sinkhorn")
  np.testing.assert_allclose(p2, ref["dino_teacher_probs_sinkhorn"], **PROB_TOL)
  # Sinkhorn ignores the centre, centering does not: the two targets differ on this data.
  assert np.abs(np.asarray(p2) - ref["dino_teacher_probs_softmax_centered"]).max() > 1e-2


# ------------------------------------------------------------------------------------------------
# DINO losses.


def _swap(t):
  """ssl_meta_arch swap of the teacher's two global crops."""
  return jnp.concatenate([t[4:], t[:4]], 0)


def test_dino_loss_global_swapped(ref):
  s = _crops(ref["student_global_cls_logits"])
  t = _crops(ref["teacher_cls_logits"])
  c = ref["dino_center_init"]

  def fn(s_):
    return losses.dino_loss(s_, t, c, ST, TT, skip_same_view=True, reduction="mean")

  loss, g = jax.value_and_grad(fn)(s)
  np.testing.assert_allclose(loss, ref["dino_loss_global_swapped"], **LOSS_TOL)
  np.testing.assert_allclose(g.reshape(8, K), ref["dino_loss_global_swapped_grad_student"], **PROB_TOL)
  # The literal dinov2 call: one (8, K) "crop" against the swapped teacher rows.
  t_sw = _swap(jnp.asarray(ref["dino_teacher_probs_softmax_centered"]))
  literal = losses.dino_loss_from_probs(ref["student_global_cls_logits"], t_sw, ST, "sum")
  np.testing.assert_allclose(literal, ref["dino_loss_global_swapped"], **LOSS_TOL)
  # Without skipping same views the loss includes the (i, i) pairs and differs.
  all_pairs = losses.dino_loss(s, t, c, ST, TT)
  assert abs(float(all_pairs) - float(ref["dino_loss_global_swapped"])) > 1e-2


@pytest.mark.parametrize("key,n_teacher", [("dino_loss_local", 2), ("dino_loss_local_1global", 1)])
def test_dino_loss_local(ref, key, n_teacher):
  s = _crops(ref["student_local_cls_logits"])
  assert s.shape == (3, B, K)
  t = _crops(ref["teacher_cls_logits"])[:n_teacher]
  c = ref["dino_center_init"]

  def fn(s_, reduction):
    return losses.dino_loss(s_, t, c, ST, TT, reduction=reduction)

  loss, g = jax.value_and_grad(fn)(s, "sum")
  np.testing.assert_allclose(loss, ref[key], **LOSS_TOL)
  np.testing.assert_allclose(g.reshape(12, K), ref[f"{key}_grad_student"], **PROB_TOL)
  # 'mean' = 'sum' / number of pairs; its gradient scales the same way.
  mean, gm = jax.value_and_grad(fn)(s, "mean")
  np.testing.assert_allclose(mean, ref[key] / (3 * n_teacher), **LOSS_TOL)
  np.testing.assert_allclose(gm.reshape(12, K), ref[f"{key}_grad_student"] / (3 * n_teacher), **PROB_TOL)
  # From precomputed probabilities (the teacher list of the dinov2 call).
  probs = _swap(jnp.asarray(ref["dino_teacher_probs_softmax_centered"])).reshape(2, B, K)
  probs = probs if n_teacher == 2 else jnp.asarray(ref["dino_teacher_probs_softmax_centered"])[:4]
  np.testing.assert_allclose(losses.dino_loss_from_probs(s, probs, ST, "sum"), ref[key], **LOSS_TOL)


def test_metaarch_dino_terms(ref):
  """dinov2 ssl_meta_arch scaling, from the documented formulas (n_terms = (2-1)*2 + 3*2 = 8)."""
  t = _crops(ref["teacher_cls_logits"])
  c = ref["dino_center_init"]
  n_terms = (2 - 1) * 2 + 3 * 2
  local = losses.dino_loss(_crops(ref["student_local_cls_logits"]), t, c, ST, TT, reduction="sum") / n_terms
  np.testing.assert_allclose(local, ref["metaarch_dino_local_crops_loss"], **LOSS_TOL)
  glob = (
    losses.dino_loss(_crops(ref["student_global_cls_logits"]), t, c, ST, TT, skip_same_view=True)
    * 2
    / n_terms
  )
  np.testing.assert_allclose(glob, ref["metaarch_dino_global_crops_loss"], **LOSS_TOL)
  # Equivalently, 'sum' with skip_same_view sums the 2 swapped pairs.
  glob_sum = (
    losses.dino_loss(
      _crops(ref["student_global_cls_logits"]), t, c, ST, TT, skip_same_view=True, reduction="sum"
    )
    / n_terms
  )
  np.testing.assert_allclose(glob_sum, ref["metaarch_dino_global_crops_loss"], **LOSS_TOL)


def test_dino_loss_sinkhorn_matches_formula(ref):
  """method='sinkhorn' uses the Sinkhorn targets over all T*B teacher rows, then the same CE."""
  s = ref["student_local_cls_logits"].reshape(3, B, K).astype(np.float64) / ST
  p = ref["dino_teacher_probs_sinkhorn"].reshape(2, B, K).astype(np.float64)
  lsm = s - s.max(-1, keepdims=True)
  lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
  expect = np.mean([-(p[t] * lsm[i]).sum(-1).mean() for i in range(3) for t in range(2)])
  got = losses.dino_loss(
    _crops(ref["student_local_cls_logits"]),
    _crops(ref["teacher_cls_logits"]),
    None,
    ST,
    TT,
    method="sinkhorn",
  )
  np.testing.assert_allclose(got, expect, **LOSS_TOL)


# ------------------------------------------------------------------------------------------------
# iBOT teacher targets and centre.


def test_ibot_teacher_probs_centering(ref):
  t, m, c = ref["teacher_patch_logits"], ref["masks"], ref["ibot_center_init"]
  for all_patches in (False, True):
    p = losses.ibot_teacher_probs(t, m, c, TT, all_patches)
    assert p.shape == (8, N, K)
    np.testing.assert_allclose(p, ref["ibot_teacher_probs_dense_softmax_centered"], **PROB_TOL)
    np.testing.assert_allclose(
      np.asarray(p).reshape(-1, K)[ref["mask_indices"]],
      ref["ibot_teacher_probs_masked_softmax_centered"],
      **PROB_TOL,
    )


def test_ibot_masked_sinkhorn_static_shape_equals_gathered(ref):
  """Sinkhorn on dense (B, N, K) logits with the mask as weights == dinov2 on the 82 gathered rows."""
  t, m, idx = ref["teacher_patch_logits"], ref["masks"], ref["mask_indices"]
  p = losses.ibot_teacher_probs(t, m, None, TT, False, method="sinkhorn")
  flat = np.asarray(p).reshape(-1, K)
  np.testing.assert_allclose(flat[idx], ref["ibot_teacher_probs_masked_sinkhorn"], **PROB_TOL)
  unmasked = np.ones(8 * N, bool)
  unmasked[idx] = False
  np.testing.assert_array_equal(flat[unmasked], 0.0)
  # The same through sinkhorn_knopp's `valid`, and directly on the gathered rows (B = 82).
  p2 = losses.sinkhorn_knopp(t, TT, 3, valid=m)
  np.testing.assert_array_equal(p2, p)
  gathered = losses.sinkhorn_knopp(t.reshape(-1, K)[idx], TT, 3)
  np.testing.assert_allclose(gathered, ref["ibot_teacher_probs_masked_sinkhorn"], **PROB_TOL)
  # Sinkhorn over *all* tokens (iBOT++) is a different normalisation.
  p_all = losses.ibot_teacher_probs(t, m, None, TT, True, method="sinkhorn")
  assert (
    np.abs(np.asarray(p_all).reshape(-1, K)[idx] - ref["ibot_teacher_probs_masked_sinkhorn"]).max() > 1e-3
  )


def test_ibot_center_updates(ref):
  c, t, m = ref["ibot_center_init"], ref["teacher_patch_logits"], ref["masks"]
  masked = losses.update_patch_center(c, t, m, momentum=0.9)
  assert masked.shape == (1, 1, K)
  np.testing.assert_allclose(masked, ref["ibot_center_after_masked_update"], **PROB_TOL)
  dense = losses.update_patch_center(c, t, momentum=0.9)
  np.testing.assert_allclose(dense, ref["ibot_center_after_dense_update"], **PROB_TOL)
  # No masked token at all: the centre does not move.
  same = losses.update_patch_center(c, t, np.zeros_like(m), momentum=0.9)
  np.testing.assert_array_equal(same, c)


# ------------------------------------------------------------------------------------------------
# iBOT / iBOT++ losses.


def test_ibot_loss_masked_and_gradient(ref):
  s, t, m, c, idx = (
    ref["student_patch_logits"],
    ref["teacher_patch_logits"],
    ref["masks"],
    ref["ibot_center_init"],
    ref["mask_indices"],
  )

  def fn(s_):
    return losses.ibot_loss(s_, t, m, c, ST, TT, False)

  loss, g = jax.value_and_grad(fn)(jnp.asarray(s))
  np.testing.assert_allclose(loss, ref["ibot_loss_masked"], **LOSS_TOL)
  np.testing.assert_allclose(loss, ref["ibot_loss_dense_forward_with_mask"], **LOSS_TOL)
  flat = np.asarray(g).reshape(-1, K)
  np.testing.assert_allclose(flat[idx], ref["ibot_loss_masked_grad_student_masked"], **PROB_TOL)
  visible = np.ones(8 * N, bool)
  visible[idx] = False
  np.testing.assert_array_equal(flat[visible], 0.0)  # iBOT: no gradient on visible tokens
  # From the dense teacher probabilities.
  from_probs = losses.ibot_loss_from_probs(s, ref["ibot_teacher_probs_dense_softmax_centered"], m, ST, False)
  np.testing.assert_allclose(from_probs, ref["ibot_loss_dense_forward_with_mask"], **LOSS_TOL)


def test_ibot_masks_weight(ref):
  """Per-token weights 1/max(n_i, 1), read off the gradient at s = 0 with one-hot teacher targets.

  With s = 0 and p = e_0: dL/ds[b, n, 0] = (1/B) w[b, n] (1/K - 1) / tau_s.
  """
  m = ref["masks"]
  p = np.zeros((8, N, K), np.float32)
  p[..., 0] = 1.0
  g = jax.grad(lambda s_: losses.ibot_loss_from_probs(s_, p, m, ST, False))(jnp.zeros((8, N, K)))
  w = np.asarray(g)[..., 0] * 8 * ST / (1.0 / K - 1.0)
  np.testing.assert_allclose(w.reshape(-1)[ref["mask_indices"]], ref["ibot_masks_weight"], **PROB_TOL)
  np.testing.assert_allclose(w.reshape(-1)[~m.reshape(-1)], 0.0, atol=1e-7)


def test_ibotpp_all_patches_and_gradient(ref):
  s, t, m, c = (
    ref["student_patch_logits"],
    ref["teacher_patch_logits"],
    ref["masks"],
    ref["ibot_center_init"],
  )

  def fn(s_, mask):
    return losses.ibot_loss(s_, t, mask, c, ST, TT, True)

  loss, g = jax.value_and_grad(fn)(jnp.asarray(s), m)
  np.testing.assert_allclose(loss, ref["ibotpp_loss_all_patches"], **LOSS_TOL)
  np.testing.assert_allclose(g, ref["ibotpp_loss_all_patches_grad_student"], **PROB_TOL)
  # iBOT++ ignores the mask (None or all-True give the same), and equals iBOT with an all-True mask.
  np.testing.assert_allclose(fn(s, None), ref["ibotpp_loss_all_patches"], **LOSS_TOL)
  np.testing.assert_allclose(
    losses.ibot_loss(s, t, np.ones_like(m), c, ST, TT, False), ref["ibotpp_loss_all_patches"], **LOSS_TOL
  )
  # all_patches as a traced bool (e.g. a config-driven jnp value inside jit).
  jfn = jax.jit(lambda s_, ap: losses.ibot_loss(s_, t, m, c, ST, TT, ap))
  np.testing.assert_allclose(jfn(s, jnp.array(True)), ref["ibotpp_loss_all_patches"], **LOSS_TOL)
  np.testing.assert_allclose(jfn(s, jnp.array(False)), ref["ibot_loss_masked"], **LOSS_TOL)


def test_ibot_accepts_grid_masks(ref):
  """Pipeline masks are (B, gh, gw); they are flattened row-major like the patch tokens."""
  s, t, m, c = (
    ref["student_patch_logits"],
    ref["teacher_patch_logits"],
    ref["masks"],
    ref["ibot_center_init"],
  )
  got = losses.ibot_loss(s, t, m.reshape(8, 4, 4), c, ST, TT, False)
  np.testing.assert_allclose(got, ref["ibot_loss_masked"], **LOSS_TOL)


# ------------------------------------------------------------------------------------------------
# KoLeo.


def test_koleo_values_and_neighbors(ref):
  x = ref["koleo_input"]
  np.testing.assert_allclose(losses.koleo_loss(x[:4]), ref["koleo_loss_chunk0"], **LOSS_TOL)
  np.testing.assert_allclose(losses.koleo_loss(x[4:]), ref["koleo_loss_chunk1"], **LOSS_TOL)
  np.testing.assert_allclose(losses.koleo_loss(x), ref["koleo_loss_all8"], **LOSS_TOL)
  np.testing.assert_array_equal(losses.koleo_neighbors(x[:4]), ref["koleo_nn_index_chunk0"])


def test_koleo_sum_of_chunks_and_gradient(ref):
  def fn(x):
    return losses.koleo_loss(x[:4]) + losses.koleo_loss(x[4:])

  loss, g = jax.value_and_grad(fn)(jnp.asarray(ref["koleo_input"]))
  np.testing.assert_allclose(loss, ref["koleo_loss_sum_chunks"], **LOSS_TOL)
  np.testing.assert_allclose(g, ref["koleo_loss_sum_chunks_grad_input"], **PROB_TOL)


def test_koleo_duplicate_and_zero_rows_are_finite():
  """torch's eps handling keeps duplicates finite; a zero row must not give NaN gradients."""
  x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
  x[1] = x[0]
  x[4] = 0.0
  loss, g = jax.value_and_grad(losses.koleo_loss)(jnp.asarray(x))
  assert np.isfinite(loss) and np.all(np.isfinite(g))
  # Duplicate pair: distance = ||eps * 1|| = sqrt(D) * eps exactly as torch PairwiseDistance.
  assert int(losses.koleo_neighbors(x)[0]) == 1
  expected0 = -np.log(np.sqrt(8) * 1e-8 + 1e-8)
  per_row0 = float(losses.koleo_loss(x[:2]))  # rows 0 and 1 are each other's neighbour
  np.testing.assert_allclose(per_row0, expected0, rtol=1e-5)


def test_module_exports():
  """Every public loss of the one-concept modules is exported by the package and documented."""
  for module in (dino, ibot, koleo, teacher_targets):
    public = [
      n for n, v in vars(module).items() if callable(v) and getattr(v, "__module__", "") == module.__name__
    ]
    public = [n for n in public if not n.startswith("_") and n not in ("as_f32", "teacher_side")]
    public = [n for n in public if n not in ("flat_center", "check_method", "batch_weights")]
    assert public, module.__name__
    for name in public:
      assert getattr(losses, name) is getattr(module, name), name
      assert getattr(module, name).__doc__, name


# --- masked / visible cross-entropy (TIPSv2 Fig. 2) and the 'separate' iBOT++ norm (ours) -----------


def _patch_case(seed=0, b=3, n=8, k=5):
  """Random (student logits, teacher probs, mask) with unequal masked counts per image (one image with
  nothing masked), and the per-token cross-entropy written out in numpy."""
  rs = np.random.RandomState(seed)
  s = rs.normal(size=(b, n, k)).astype(np.float32)
  t = rs.normal(size=(b, n, k)).astype(np.float32)
  p = np.exp(t) / np.exp(t).sum(-1, keepdims=True)
  mask = rs.rand(b, n) < 0.6
  mask[0] = False
  mask[1, :2] = True
  z = s / 0.1
  lsm = z - z.max(-1, keepdims=True)
  lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
  ce = -(p * lsm).sum(-1)
  return s, p, mask, ce


def test_masked_visible_cross_entropy_is_the_token_mean_of_each_set():
  s, p, mask, ce = _patch_case()
  out = ibot.ibot_masked_visible_cross_entropy(s, p, mask, 0.1)
  np.testing.assert_allclose(out["masked"][0], ce[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(out["visible"][0], ce[~mask].mean(), rtol=1e-5)
  assert float(out["masked"][1]) == mask.sum() and float(out["visible"][1]) == (~mask).sum()
  # No mask: every token is visible and there is no masked entry.
  out = ibot.ibot_masked_visible_cross_entropy(s, p, None, 0.1)
  assert set(out) == {"visible"}
  np.testing.assert_allclose(out["visible"][0], ce.mean(), rtol=1e-5)
  # The metric carries no gradient.
  g = jax.grad(lambda x: ibot.ibot_masked_visible_cross_entropy(x, p, mask, 0.1)["visible"][0])(s)
  assert not np.any(np.asarray(g))


def test_masked_cross_entropy_equals_ibot_when_every_image_masks_as_many_tokens():
  s, p, _, _ = _patch_case()
  mask = np.zeros(s.shape[:2], bool)
  mask[:, ::2] = True
  out = ibot.ibot_masked_visible_cross_entropy(s, p, mask, 0.1)
  plain = ibot.ibot_loss_from_probs(s, p, mask, 0.1, False)
  np.testing.assert_allclose(out["masked"][0], plain, rtol=1e-6)


@pytest.mark.parametrize("w_v", [1.0, 0.25, 0.0])
def test_separate_norm_is_the_masked_mean_plus_weighted_visible_mean(w_v):
  s, p, mask, ce = _patch_case(seed=1)
  got = ibot.ibot_loss_from_probs(s, p, mask, 0.1, True, token_norm="separate", visible_weight=w_v)
  per_image = [
    (ce[i][mask[i]].mean() if mask[i].any() else 0.0)
    + w_v * (ce[i][~mask[i]].mean() if (~mask[i]).any() else 0.0)
    for i in range(len(ce))
  ]
  np.testing.assert_allclose(got, np.mean(per_image), rtol=1e-5)
  if w_v == 0.0:  # only the masked tokens: iBOT (images with nothing masked count 0)
    np.testing.assert_allclose(got, ibot.ibot_loss_from_probs(s, p, mask, 0.1, False), rtol=1e-6)
  # Its gradient flows through every token it weighs.
  g = jax.grad(
    lambda x: ibot.ibot_loss_from_probs(x, p, mask, 0.1, True, token_norm="separate", visible_weight=w_v)
  )(jnp.asarray(s))
  visible_grad = np.abs(np.asarray(g)).sum(-1)[~mask]
  assert np.all(visible_grad > 0) if w_v else not np.any(visible_grad)


def test_separate_norm_is_an_ibotpp_option():
  s, p, mask, _ = _patch_case()
  with pytest.raises(ValueError, match="'separate' is an iBOT\\+\\+ option"):
    ibot.ibot_loss_from_probs(s, p, mask, 0.1, False, token_norm="separate")
