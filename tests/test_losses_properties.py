"""Property tests (chex) for tipsito.losses: stop-gradient on the teacher, iBOT++ decomposition,
Sinkhorn marginals and stability, padding semantics, jit/non-jit agreement, input validation.

Why: the conformance vectors pin values on one small input; these tests pin the *structural* promises
the recipes rely on (TIPSv2 §3): the teacher never receives gradient, iBOT++ is iBOT
plus the visible tokens' term, the losses compile under jit and padded rows do not count.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito import losses

ST, TT = 0.1, 0.04


def _rand(seed, shape, scale=1.0):
  return (scale * np.random.default_rng(seed).normal(size=shape)).astype(np.float32)


def _np_log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_sinkhorn(logits, temp, n_iters):
  """dinov2 sinkhorn_knopp_teacher in float64 numpy (probability domain, as written by dinov2)."""
  q = np.exp(np.asarray(logits, np.float64) / temp).T  # K x n
  k, n = q.shape
  q /= q.sum()
  for _ in range(n_iters):
    q /= q.sum(1, keepdims=True)
    q /= k
    q /= q.sum(0, keepdims=True)
    q /= n
  return (q * n).T


# ------------------------------------------------------------------------------------------------
# No gradient reaches the teacher.


class TeacherStopGradientTest(chex.TestCase):
  """Gradients w.r.t. teacher logits, centres and teacher probabilities are exactly zero.

  Run under jit only (one compile per case keeps the suite fast); jit/eager agreement is covered by
  SelfDistillJitTest.
  """

  def setUp(self):
    super().setUp()
    self.s = _rand(0, (3, 4, 16))
    self.t = _rand(1, (2, 4, 16))
    self.c = _rand(2, (1, 16), 0.1)
    self.sp = _rand(3, (4, 9, 16))
    self.tp = _rand(4, (4, 9, 16))
    self.mask = np.random.default_rng(5).random((4, 9)) < 0.5

  @chex.variants(with_jit=True)
  def test_dino(self):
    for method in ("centering", "sinkhorn"):
      fn = self.variant(jax.grad(functools.partial(losses.dino_loss, method=method), argnums=(0, 1, 2)))
      gs, gt, gc = fn(self.s, self.t, self.c, ST, TT)
      np.testing.assert_array_equal(gt, 0.0)
      np.testing.assert_array_equal(gc, 0.0)
      self.assertGreater(float(jnp.abs(gs).max()), 1e-4)  # the student does get gradient

  @chex.variants(with_jit=True)
  def test_ibot(self):
    for method in ("centering", "sinkhorn"):
      for all_patches in (False, True):
        fn = self.variant(
          jax.grad(
            lambda s, t, c, ap=all_patches, me=method: losses.ibot_loss(
              s, t, self.mask, c, ST, TT, ap, method=me
            ),
            argnums=(0, 1, 2),
          )
        )
        gs, gt, gc = fn(self.sp, self.tp, self.c)
        np.testing.assert_array_equal(gt, 0.0)
        np.testing.assert_array_equal(gc, 0.0)
        self.assertGreater(float(jnp.abs(gs).max()), 1e-4)

  @chex.variants(with_jit=True)
  def test_from_probs(self):
    p = jax.nn.softmax(self.t / TT)
    g = self.variant(jax.grad(losses.dino_loss_from_probs, argnums=1))(self.s, p, ST)
    np.testing.assert_array_equal(g, 0.0)
    pp = jax.nn.softmax(self.tp / TT)
    g = self.variant(jax.grad(losses.ibot_loss_from_probs, argnums=1))(self.sp, pp, self.mask, ST, True)
    np.testing.assert_array_equal(g, 0.0)

  def test_naive_formula_would_leak_gradient(self):
    """Guard that the zero-gradient checks above are meaningful on this data."""

    def naive(t):
      p = jax.nn.softmax((t - self.c) / TT)
      return -jnp.mean(jnp.sum(p[None] * jax.nn.log_softmax(self.s / ST)[:, None], -1))

    self.assertGreater(float(jnp.abs(jax.grad(naive)(self.t)).max()), 1e-3)
    np.testing.assert_allclose(naive(self.t), losses.dino_loss(self.s, self.t, self.c, ST, TT), rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# iBOT++ minus iBOT equals the visible-token term.


def _visible_term(s, t, c, mask):
  """(1/(B N)) * sum over visible tokens of -sum_k p log q, computed independently in float64."""
  b, n, _ = s.shape
  p = np.exp(_np_log_softmax((np.asarray(t, np.float64) - np.asarray(c, np.float64).reshape(-1)) / TT))
  ce = -(p * _np_log_softmax(np.asarray(s, np.float64) / ST)).sum(-1)
  total = 0.0
  for i in range(b):
    for j in range(n):
      if not mask[i, j]:
        total += ce[i, j]
  return total / (b * n)


def test_ibotpp_minus_ibot_is_visible_term():
  b, n, k = 6, 16, 32
  s, t, c = _rand(10, (b, n, k)), _rand(11, (b, n, k), 0.3), _rand(12, (1, 1, k), 0.05)
  rng = np.random.default_rng(13)
  mask = rng.random((b, n)) < 0.6
  mask[2] = False  # an image with nothing masked, as dinov2 batches have
  pp = losses.ibot_loss(s, t, mask, c, ST, TT, True)
  ibot = losses.ibot_loss(s, t, mask, c, ST, TT, False, token_norm="patches")
  vis = _visible_term(s, t, c, mask)
  assert vis > 0.1
  np.testing.assert_allclose(float(pp) - float(ibot), vis, rtol=1e-5, atol=1e-6)


def test_ibotpp_minus_scaled_dinov2_ibot_is_visible_term():
  """With m masked tokens in every image, dinov2's iBOT is (N/m) x the 'patches'-normalised one."""
  b, n, k, m = 5, 16, 32, 12
  s, t, c = _rand(20, (b, n, k)), _rand(21, (b, n, k), 0.3), _rand(22, (k,), 0.05)
  rng = np.random.default_rng(23)
  mask = np.zeros((b, n), bool)
  for i in range(b):
    mask[i, rng.permutation(n)[:m]] = True
  pp = losses.ibot_loss(s, t, mask, c, ST, TT, True)
  ibot = losses.ibot_loss(s, t, mask, c, ST, TT, False)  # dinov2 normalisation
  np.testing.assert_allclose(
    float(pp) - (m / n) * float(ibot), _visible_term(s, t, c, mask), rtol=1e-5, atol=1e-6
  )


# ------------------------------------------------------------------------------------------------
# Sinkhorn-Knopp.


@pytest.mark.parametrize("n_iters", [1, 3, 10])
def test_sinkhorn_rows_sum_to_one_and_match_float64(n_iters):
  t = _rand(30, (3, 5, 24), 0.3)
  p = losses.sinkhorn_knopp(t, TT, n_iters)
  assert p.shape == t.shape and p.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(
    np.asarray(p).reshape(-1, 24), _np_sinkhorn(t.reshape(-1, 24), TT, n_iters), rtol=1e-5, atol=1e-6
  )


def test_sinkhorn_balances_prototypes():
  """After many iterations each prototype gets n/K of the mass (the point of Sinkhorn)."""
  t = _rand(31, (64, 16), 0.05)
  p = np.asarray(losses.sinkhorn_knopp(t, TT, 200))
  np.testing.assert_allclose(p.sum(0), 64 / 16, rtol=1e-3)
  np.testing.assert_allclose(p.sum(1), 1.0, rtol=1e-5)
  # Centering does not balance: the same logits give clearly unequal prototype masses.
  pc = np.asarray(losses.teacher_probs_centered(t, np.zeros(16), TT))
  assert np.abs(pc.sum(0) - 4.0).max() > 0.5


def test_sinkhorn_large_logits_do_not_overflow():
  """exp(t / 0.04) overflows float32 for t > 3.5; the log-domain recursion must stay exact."""
  t = _rand(32, (40, 16), 4.0)
  assert np.abs(t).max() / TT > 88.7  # naive float32 exp would overflow
  p = np.asarray(losses.sinkhorn_knopp(t, TT, 3))
  assert np.all(np.isfinite(p))
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(p, _np_sinkhorn(t, TT, 3), rtol=1e-4, atol=1e-6)


def test_sinkhorn_weights_equal_gathering():
  t = _rand(33, (4, 10, 16), 0.3)
  valid = np.random.default_rng(34).random((4, 10)) < 0.4
  p = np.asarray(losses.sinkhorn_knopp(t, TT, 3, valid=valid))
  np.testing.assert_allclose(p[valid], _np_sinkhorn(t[valid], TT, 3), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(p[~valid], 0.0)
  np.testing.assert_allclose(p[valid].sum(-1), 1.0, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Padding (`valid`) semantics.


def test_dino_valid_equals_unpadded():
  s, t, c = _rand(40, (3, 6, 16)), _rand(41, (2, 6, 16), 0.3), _rand(42, (16,), 0.05)
  valid = np.array([True, False, True, True, False, True])
  for method in ("centering", "sinkhorn"):
    for red in ("mean", "sum"):
      got = losses.dino_loss(s, t, c, ST, TT, method=method, reduction=red, valid=valid)
      ref = losses.dino_loss(s[:, valid], t[:, valid], c, ST, TT, method=method, reduction=red)
      np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
      unmasked = losses.dino_loss(s, t, c, ST, TT, method=method, reduction=red)
      assert abs(float(unmasked) - float(ref)) > 1e-3
  new = losses.update_center(c, t, 0.9, valid=valid)
  np.testing.assert_allclose(new, losses.update_center(c, t[:, valid], 0.9), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("all_patches", [False, True])
@pytest.mark.parametrize("method", ["centering", "sinkhorn"])
def test_ibot_valid_equals_unpadded(all_patches, method):
  s, t, c = _rand(50, (5, 9, 16)), _rand(51, (5, 9, 16), 0.3), _rand(52, (16,), 0.05)
  mask = np.random.default_rng(53).random((5, 9)) < 0.5
  valid = np.array([True, True, False, True, False])
  got = losses.ibot_loss(s, t, mask, c, ST, TT, all_patches, method=method, valid=valid)
  ref = losses.ibot_loss(s[valid], t[valid], mask[valid], c, ST, TT, all_patches, method=method)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  unmasked = losses.ibot_loss(s, t, mask, c, ST, TT, all_patches, method=method)
  assert abs(float(unmasked) - float(ref)) > 1e-3


def test_koleo_valid_equals_unpadded():
  x = _rand(60, (7, 8))
  valid = np.array([True, False, True, True, True, False, True])
  got = losses.koleo_loss(x, valid=valid)
  np.testing.assert_allclose(got, losses.koleo_loss(x[valid]), rtol=1e-5)
  assert abs(float(losses.koleo_loss(x)) - float(got)) > 1e-3
  idx = np.asarray(losses.koleo_neighbors(x, valid=valid))
  assert np.all(valid[idx[valid]])


# ------------------------------------------------------------------------------------------------
# jit and non-jit agree; dtypes.


def _np_softmax(x):
  return np.exp(_np_log_softmax(x))


def _np_dino(s, t, c, method, reduction, skip_same_view):
  """DINO loss from its formula, float64 numpy (independent of the implementation)."""
  k = t.shape[-1]
  if method == "centering":
    p = _np_softmax((np.asarray(t, np.float64) - np.asarray(c, np.float64).reshape(k)) / TT)
  else:
    p = _np_sinkhorn(t.reshape(-1, k), TT, 3).reshape(t.shape)
  lsm = _np_log_softmax(np.asarray(s, np.float64) / ST)
  terms = [
    -(p[j] * lsm[i]).sum(-1).mean()
    for i in range(s.shape[0])
    for j in range(t.shape[0])
    if not (skip_same_view and i == j)
  ]
  return np.sum(terms) if reduction == "sum" else np.mean(terms)


def _np_ibot(s, t, mask, c, method, all_patches):
  """iBOT / iBOT++ from the dinov2 formulas, float64 numpy, gathering tokens with boolean indexing."""
  k = t.shape[-1]
  tok = np.ones_like(mask) if all_patches else mask
  if method == "centering":
    p = _np_softmax((np.asarray(t, np.float64) - np.asarray(c, np.float64).reshape(k)) / TT)
  else:
    p = np.zeros(t.shape)
    p[tok] = _np_sinkhorn(t[tok], TT, 3)
  ce = -(p * _np_log_softmax(np.asarray(s, np.float64) / ST)).sum(-1)
  per_image = [ce[i][tok[i]].sum() / max(tok[i].sum(), 1) for i in range(s.shape[0])]
  return np.sum(per_image) / s.shape[0]


def _np_koleo(x, eps=1e-8):
  x = np.asarray(x, np.float64)
  u = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), eps)
  dots = u @ u.T
  np.fill_diagonal(dots, -1)
  nn = dots.argmax(1)
  return -np.log(np.linalg.norm(u - u[nn] + eps, axis=1) + eps).mean()


class SelfDistillJitTest(chex.TestCase):
  """Jitted and eager calls both reproduce an independent float64 reference (hence each other)."""

  def setUp(self):
    super().setUp()
    self.s = _rand(70, (3, 4, 16))
    self.t = _rand(71, (2, 4, 16), 0.3)
    self.c = _rand(72, (1, 16), 0.05)
    self.sp = _rand(73, (4, 9, 16))
    self.tp = _rand(74, (4, 9, 16), 0.3)
    self.mask = np.random.default_rng(75).random((4, 9)) < 0.5
    self.x = _rand(76, (6, 8))

  def _check(self, fn, expected, *args, rtol=1e-5, atol=1e-6):
    got = self.variant(fn)(*args)
    chex.assert_tree_all_finite(got)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol), got, expected)
    return got

  @chex.variants(with_jit=True, without_jit=True)
  def test_dino(self):
    for method in ("centering", "sinkhorn"):
      for red in ("mean", "sum"):
        for skip in (False, True):
          out = self._check(
            functools.partial(losses.dino_loss, method=method, reduction=red, skip_same_view=skip),
            _np_dino(self.s, self.t, self.c, method, red, skip),
            self.s,
            self.t,
            self.c,
            ST,
            TT,
          )
          chex.assert_shape(out, ())
          chex.assert_type(out, jnp.float32)

  @chex.variants(with_jit=True, without_jit=True)
  def test_ibot(self):
    for method in ("centering", "sinkhorn"):
      for ap in (False, True):
        self._check(
          functools.partial(losses.ibot_loss, method=method, all_patches=ap),
          _np_ibot(self.sp, self.tp, self.mask, self.c, method, ap),
          self.sp,
          self.tp,
          self.mask,
          self.c,
          ST,
          TT,
        )

  @chex.variants(with_jit=True, without_jit=True)
  def test_teacher_side(self):
    out = self._check(
      functools.partial(losses.sinkhorn_knopp, n_iters=3),
      _np_sinkhorn(self.t.reshape(-1, 16), TT, 3).reshape(self.t.shape),
      self.t,
      TT,
    )
    chex.assert_shape(out, self.t.shape)
    self._check(losses.teacher_probs_centered, _np_softmax((self.t - self.c) / TT), self.t, self.c, TT)
    out = self._check(
      losses.update_center, 0.9 * self.c + 0.1 * self.t.reshape(-1, 16).mean(0), self.c, self.t, 0.9
    )
    chex.assert_shape(out, (1, 16))
    self._check(
      losses.update_patch_center,
      0.9 * self.c + 0.1 * self.tp[self.mask].mean(0),
      self.c,
      self.tp,
      self.mask,
      0.9,
    )
    self._check(
      losses.update_patch_center, 0.9 * self.c + 0.1 * self.tp.reshape(-1, 16).mean(0), self.c, self.tp
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_koleo(self):
    self._check(losses.koleo_loss, _np_koleo(self.x), self.x)
    # Gradient against central finite differences of the float64 reference (neighbours are stable).
    g = self.variant(jax.grad(losses.koleo_loss))(self.x)
    h = 1e-4
    num = np.zeros(self.x.shape)
    for i in range(self.x.shape[0]):
      for j in range(self.x.shape[1]):
        xp, xm = self.x.astype(np.float64), self.x.astype(np.float64)
        xp[i, j] += h
        xm[i, j] -= h
        num[i, j] = (_np_koleo(xp) - _np_koleo(xm)) / (2 * h)
    np.testing.assert_allclose(g, num, rtol=1e-3, atol=1e-4)

  def test_bf16_inputs_give_float32_losses(self):
    s16, t16 = jnp.asarray(self.s, jnp.bfloat16), jnp.asarray(self.t, jnp.bfloat16)
    out = losses.dino_loss(s16, t16, self.c, ST, TT)
    chex.assert_type(out, jnp.float32)
    ref = losses.dino_loss(s16.astype(jnp.float32), t16.astype(jnp.float32), self.c, ST, TT)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    chex.assert_type(
      losses.ibot_loss(jnp.asarray(self.sp, jnp.bfloat16), self.tp, self.mask, self.c, ST, TT, True),
      jnp.float32,
    )


# ------------------------------------------------------------------------------------------------
# Input validation.


def test_bad_inputs_raise():
  s, t, c = _rand(80, (3, 4, 16)), _rand(81, (2, 4, 16)), np.zeros(16, np.float32)
  with pytest.raises(ValueError, match="agree on"):
    losses.dino_loss(s, t[:, :3], c, ST, TT)
  with pytest.raises(ValueError, match="method"):
    losses.dino_loss(s, t, c, ST, TT, method="sk")
  with pytest.raises(ValueError, match="reduction"):
    losses.dino_loss(s, t, c, ST, TT, reduction="none")
  with pytest.raises(ValueError, match="prototypes"):
    losses.dino_loss(s, t, np.zeros(15), ST, TT)
  with pytest.raises(ValueError, match="no .* pair"):
    losses.dino_loss(s[:1], t[:1], c, ST, TT, skip_same_view=True)
  with pytest.raises(ValueError, match="token_norm"):
    losses.ibot_loss(s, s, None, c, ST, TT, True, token_norm="x")
  with pytest.raises(ValueError, match=r"\(B, D\)"):
    losses.koleo_loss(s)
