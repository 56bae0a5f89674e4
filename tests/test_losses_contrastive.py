"""Conformance and behaviour tests for tipsito.losses.contrastive (CLIP, SigLIP, ITO NT-Xent).

Why: the contrastive terms must match big_vision / open_clip and the ITO authors' spec to the README
tolerances (values *and* gradients), and padded batches must not change the loss.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tipsito import losses
from tipsito.losses import contrastive

from conftest import DATA_DIR

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)  # README sections 3 and 4
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def clip_ref():
  return dict(np.load(DATA_DIR / "clip_losses" / "clip_losses.npz"))


@pytest.fixture(scope="module")
def ito_ref():
  return dict(np.load(DATA_DIR / "ito_fusion_loss" / "ito_fusion_loss.npz"))


# ------------------------------------------------------------------------------------------------
# CLIP softmax loss (README section 3).


def test_clip_logits(clip_ref):
  got = losses.clip_logits(clip_ref["zimg"], clip_ref["ztxt"], clip_ref["clip_logit_scale"])
  np.testing.assert_allclose(got, clip_ref["clip_logits"], rtol=1e-5, atol=1e-5)


def test_clip_loss_value_and_per_example(clip_ref):
  args = (clip_ref["zimg"], clip_ref["ztxt"], clip_ref["clip_logit_scale"])
  loss = losses.clip_loss(*args)
  assert loss.shape == () and loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, clip_ref["clip_loss"], **LOSS_TOL)
  per = losses.clip_loss(*args, reduction="none")
  assert per.shape == (8,)
  np.testing.assert_allclose(per, clip_ref["clip_loss_per_example"], **LOSS_TOL)
  np.testing.assert_allclose(
    losses.clip_loss(*args, reduction="sum"), clip_ref["clip_loss_per_example"].sum(), **LOSS_TOL
  )


def test_clip_loss_gradients(clip_ref):
  gi, gt, gs = jax.grad(losses.clip_loss, argnums=(0, 1, 2))(
    jnp.asarray(clip_ref["zimg"]), jnp.asarray(clip_ref["ztxt"]), jnp.asarray(clip_ref["clip_logit_scale"])
  )
  np.testing.assert_allclose(gi, clip_ref["clip_loss_grad_zimg"], **GRAD_TOL)
  np.testing.assert_allclose(gt, clip_ref["clip_loss_grad_ztxt"], **GRAD_TOL)
  np.testing.assert_allclose(gs, clip_ref["clip_loss_grad_scale"], **GRAD_TOL)


def test_clip_loss_is_not_symmetric_in_a_trivial_way(clip_ref):
  """Both directions matter: the i2t-only loss differs from the bidirectional one on this data."""
  logits = clip_ref["clip_logits"]
  i2t = optax.softmax_cross_entropy_with_integer_labels(logits, np.arange(8))
  t2i = optax.softmax_cross_entropy_with_integer_labels(logits.T, np.arange(8))
  assert abs(float(i2t.mean() - t2i.mean())) > 1e-3
  np.testing.assert_allclose(
    losses.clip_loss(clip_ref["zimg"], clip_ref["ztxt"], clip_ref["clip_logit_scale"]),
    0.5 * (i2t.mean() + t2i.mean()),
    **LOSS_TOL,
  )


def test_clip_loss_rejects_bad_shapes(clip_ref):
  with pytest.raises(ValueError, match="must have the same shape"):
    losses.clip_loss(clip_ref["zimg"], clip_ref["ztxt"][:4], 1.0)
  with pytest.raises(ValueError, match=r"\(B, D\)"):
    losses.clip_loss(clip_ref["zimg"][None], clip_ref["ztxt"][None], 1.0)
  with pytest.raises(ValueError, match="reduction"):
    losses.clip_loss(clip_ref["zimg"], clip_ref["ztxt"], 1.0, reduction="avg")


def test_clip_loss_bf16_inputs_computed_in_float32(clip_ref):
  zi = jnp.asarray(clip_ref["zimg"], jnp.bfloat16)
  zt = jnp.asarray(clip_ref["ztxt"], jnp.bfloat16)
  loss = losses.clip_loss(zi, zt, clip_ref["clip_logit_scale"])
  assert loss.dtype == jnp.float32
  ref = losses.clip_loss(zi.astype(jnp.float32), zt.astype(jnp.float32), clip_ref["clip_logit_scale"])
  np.testing.assert_allclose(loss, ref, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# SigLIP (README section 3).


@pytest.mark.parametrize(
  "suffix,t_key,b_key", [("", "siglip_t", "siglip_b"), ("_t3_bm2", "siglip_t2", "siglip_b2")]
)
def test_siglip_loss_value_and_gradients(clip_ref, suffix, t_key, b_key):
  args = tuple(jnp.asarray(clip_ref[k]) for k in ("zimg", "ztxt", t_key, b_key))
  loss, grads = jax.value_and_grad(losses.siglip_loss, argnums=(0, 1, 2, 3))(*args)
  np.testing.assert_allclose(loss, clip_ref[f"siglip_loss{suffix}"], **LOSS_TOL)
  for g, name in zip(grads, ("zimg", "ztxt", "t", "b")):
    np.testing.assert_allclose(g, clip_ref[f"siglip_loss{suffix}_grad_{name}"], **GRAD_TOL)


def test_siglip_reductions(clip_ref):
  args = (clip_ref["zimg"], clip_ref["ztxt"], clip_ref["siglip_t"], clip_ref["siglip_b"])
  per = losses.siglip_loss(*args, reduction="none")
  z = 10.0 * clip_ref["zimg"].astype(np.float64) @ clip_ref["ztxt"].T.astype(np.float64) - 10.0
  y = 2 * np.eye(8) - 1
  expect = np.log1p(np.exp(-y * z)).sum(1)  # -log sigmoid(y z), rows are images
  np.testing.assert_allclose(per, expect, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(losses.siglip_loss(*args, reduction="sum"), expect.sum(), rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# ITO fusion NT-Xent (README section 4).


def test_ntxent_logits(ito_ref):
  l1, l2 = losses.ntxent_logits(ito_ref["S1"], ito_ref["S2"], ito_ref["scale"])
  np.testing.assert_allclose(l1, ito_ref["logits1"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(l2, ito_ref["logits2"], rtol=1e-5, atol=1e-5)


def test_ntxent_loss_value_halves_and_float64(ito_ref):
  loss = losses.ntxent_loss(ito_ref["S1"], ito_ref["S2"], ito_ref["scale"])
  np.testing.assert_allclose(loss, ito_ref["loss"], **LOSS_TOL)
  np.testing.assert_allclose(loss, ito_ref["loss_float64_reference"], **LOSS_TOL)
  # The two halves, with an independent CE (optax) on our logits.
  l1, l2 = losses.ntxent_logits(ito_ref["S1"], ito_ref["S2"], ito_ref["scale"])
  labels = np.arange(8)
  np.testing.assert_allclose(
    optax.softmax_cross_entropy_with_integer_labels(l1, labels).mean(), ito_ref["loss1"], **LOSS_TOL
  )
  np.testing.assert_allclose(
    optax.softmax_cross_entropy_with_integer_labels(l2, labels).mean(), ito_ref["loss2"], **LOSS_TOL
  )
  # Same code in float64 against the float64 loop reference, much tighter.
  with jax.enable_x64(True):
    loss64 = losses.ntxent_loss(
      ito_ref["S1"].astype(np.float64), ito_ref["S2"].astype(np.float64), np.float64(ito_ref["scale"])
    )
    assert loss64.dtype == jnp.float64
    np.testing.assert_allclose(loss64, ito_ref["loss_float64_reference"], rtol=1e-6)


def test_ntxent_gradients(ito_ref):
  g1, g2 = jax.grad(losses.ntxent_loss, argnums=(0, 1))(
    jnp.asarray(ito_ref["S1"]), jnp.asarray(ito_ref["S2"]), jnp.asarray(ito_ref["scale"])
  )
  np.testing.assert_allclose(g1, ito_ref["grad_S1"], **GRAD_TOL)
  np.testing.assert_allclose(g2, ito_ref["grad_S2"], **GRAD_TOL)


def test_ntxent_excludes_self_similarity(ito_ref):
  """Self-pairs must carry no probability mass: making z1_i.z1_i huge changes nothing."""
  s1, s2 = ito_ref["S1"], ito_ref["S2"]
  l1, _ = losses.ntxent_logits(s1, s2, ito_ref["scale"])
  np.testing.assert_array_equal(np.diagonal(np.asarray(l1)[:, 8:]), np.full(8, -1e9, np.float32))
  # Without the exclusion the loss would be larger (self-similarity 1 is the largest logit).
  naive1 = np.concatenate([s1 @ s2.T, s1 @ s1.T], 1) * ito_ref["scale"]
  naive = optax.softmax_cross_entropy_with_integer_labels(naive1, np.arange(8)).mean()
  assert float(naive) > float(ito_ref["loss1"]) + 0.1


# ------------------------------------------------------------------------------------------------
# Padding (`valid`) semantics: a padded batch gives the loss of the un-padded batch.


def _padded(rng, x, n_pad):
  pad = rng.normal(size=(n_pad, x.shape[1])).astype(np.float32)
  pad /= np.linalg.norm(pad, axis=1, keepdims=True)
  return np.concatenate([x, pad], 0)


@pytest.mark.parametrize("name", ["clip", "siglip", "ntxent"])
def test_valid_mask_equals_unpadded_batch(clip_ref, name):
  rng = np.random.default_rng(0)
  zi, zt = clip_ref["zimg"][:6], clip_ref["ztxt"][:6]
  fns = {
    "clip": lambda a, b, **kw: losses.clip_loss(a, b, 14.0, **kw),
    "siglip": lambda a, b, **kw: losses.siglip_loss(a, b, 10.0, -10.0, **kw),
    "ntxent": lambda a, b, **kw: losses.ntxent_loss(a, b, 14.0, **kw),
  }
  fn = fns[name]
  # Interleave padding rows so that the mask (not a slice) does the work.
  order = np.array([0, 6, 1, 2, 7, 3, 4, 5])
  pzi, pzt = _padded(rng, zi, 2)[order], _padded(rng, zt, 2)[order]
  valid = order < 6
  ref, (rgi, _) = jax.value_and_grad(fn, argnums=(0, 1))(zi, zt)
  got, (ggi, _) = jax.value_and_grad(functools.partial(fn, valid=valid), argnums=(0, 1))(pzi, pzt)
  np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(ggi)[valid], rgi, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(ggi)[~valid], 0.0)
  # Without the mask the padding does change the loss (the test above can fail).
  assert abs(float(fn(pzi, pzt)) - float(ref)) > 1e-3
  per = fn(pzi, pzt, valid=valid, reduction="none")
  np.testing.assert_array_equal(np.asarray(per)[~valid], 0.0)
  np.testing.assert_allclose(np.asarray(per)[valid], fn(zi, zt, reduction="none"), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# jit and non-jit give the same result.


class ContrastiveJitTest(chex.TestCase):
  """Every contrastive loss is jit-friendly and gives the same value with and without jit."""

  def setUp(self):
    super().setUp()
    self.c = dict(np.load(DATA_DIR / "clip_losses" / "clip_losses.npz"))
    self.i = dict(np.load(DATA_DIR / "ito_fusion_loss" / "ito_fusion_loss.npz"))
    self.valid = np.array([True] * 7 + [False])

  @chex.variants(with_jit=True, without_jit=True)
  def test_clip(self):
    fn = self.variant(functools.partial(losses.clip_loss, reduction="none"))
    out = fn(self.c["zimg"], self.c["ztxt"], self.c["clip_logit_scale"])
    np.testing.assert_allclose(out, self.c["clip_loss_per_example"], **LOSS_TOL)
    fnv = self.variant(losses.clip_loss)
    ref = losses.clip_loss(self.c["zimg"][:7], self.c["ztxt"][:7], self.c["clip_logit_scale"])
    np.testing.assert_allclose(
      fnv(self.c["zimg"], self.c["ztxt"], self.c["clip_logit_scale"], valid=self.valid), ref, rtol=1e-6
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_siglip(self):
    fn = self.variant(losses.siglip_loss)
    out = fn(self.c["zimg"], self.c["ztxt"], self.c["siglip_t2"], self.c["siglip_b2"])
    np.testing.assert_allclose(out, self.c["siglip_loss_t3_bm2"], **LOSS_TOL)

  @chex.variants(with_jit=True, without_jit=True)
  def test_ntxent(self):
    fn = self.variant(losses.ntxent_loss)
    out = fn(self.i["S1"], self.i["S2"], self.i["scale"])
    np.testing.assert_allclose(out, self.i["loss"], **LOSS_TOL)
    g = self.variant(jax.grad(losses.ntxent_loss))(self.i["S1"], self.i["S2"], self.i["scale"])
    np.testing.assert_allclose(g, self.i["grad_S1"], **GRAD_TOL)


def test_module_exports():
  for name in contrastive.__all__:
    assert getattr(losses, name) is getattr(contrastive, name)
    assert getattr(contrastive, name).__doc__
