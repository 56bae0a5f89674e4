"""The exact GELU of the OpenCLIP-style towers (tipsito/models/layers.py `gelu_exact`).

Its forward must be today's `jax.nn.gelu(x, approximate=False)` bit for bit (exported towers run in
OpenCLIP, whose nn.GELU is 0.5 x (1 + erf(x / sqrt 2))), its gradient the analytic Phi(x) + x phi(x) within
float rounding of autodiff's, and the point of the custom VJP, less compiled memory than autodiff through
erfc, is measured on XLA:CPU (deterministic for a fixed build).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tipsito.models import layers

# Every float32 regime: the left tail (where 1 + erf cancels), zero, the centre and the right tail.
X = np.concatenate([np.linspace(-12, 12, 4001), [-40.0, -1e-30, 0.0, 1e-30, 40.0]]).astype(np.float32)


def _autodiff_gelu(x):
  return jax.nn.gelu(x, approximate=False)


def _reference64(x):
  """GELU and its derivative in float64 (math.erfc: no cancellation in the left tail)."""
  x = np.asarray(x, np.float64)
  cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x])
  pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
  return x * cdf, cdf + x * pdf


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_is_todays_gelu_bitwise(dtype):
  x = jnp.asarray(X, dtype).reshape(2, -1, 1)
  ours = np.asarray(jax.jit(layers.gelu_exact)(x).astype(jnp.float32))
  today = np.asarray(jax.jit(_autodiff_gelu)(x).astype(jnp.float32))
  np.testing.assert_array_equal(ours, today)
  assert layers.ACTIVATIONS["gelu_exact"] is layers.gelu_exact


def test_forward_matches_openclip_formula():
  """OpenCLIP's nn.GELU (torch, 0.5 x (1 + erf(x / sqrt 2))) in float32: equal to rounding; in the left tail,
  where 1 + erf cancels, ours keeps float32's relative precision against float64 and OpenCLIP's does not."""
  ours = np.asarray(layers.gelu_exact(jnp.asarray(X)), np.float64)
  openclip = torch.nn.functional.gelu(torch.from_numpy(X)).numpy().astype(np.float64)
  np.testing.assert_allclose(ours, openclip, rtol=2e-6, atol=2e-6)
  ref, _ = _reference64(X)
  np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=1e-37)
  tail = (X < -4) & (X > -12)  # relative error where 1 + erf cancels (not below float32's range)
  rel = lambda v: np.max(np.abs(v[tail] - ref[tail]) / np.abs(ref[tail]))  # noqa: E731
  assert rel(ours) < 1e-4 < rel(openclip), (rel(ours), rel(openclip))


def test_gradient_is_analytic_and_matches_autodiff():
  x = jnp.asarray(X)
  ct = jnp.cos(x)  # a non-trivial cotangent

  def vjp(f):
    return np.asarray(jax.jit(lambda v, g: jax.vjp(f, v)[1](g)[0])(x, ct), np.float64)

  ours, today = vjp(layers.gelu_exact), vjp(_autodiff_gelu)
  np.testing.assert_allclose(ours, today, rtol=2e-6, atol=1e-7)
  _, dref = _reference64(X)
  np.testing.assert_allclose(ours, dref * np.asarray(ct, np.float64), rtol=2e-6, atol=1e-7)
  # torch's autograd of OpenCLIP's nn.GELU, the exported towers' backward. Both evaluate Phi as
  # 0.5 (1 + erf(x / sqrt 2)) in float32 with their own erf, which differ by about an ulp of 1: 2 ulps.
  t = torch.from_numpy(X).requires_grad_()
  torch.nn.functional.gelu(t).backward(torch.from_numpy(np.asarray(ct)))
  np.testing.assert_allclose(ours, t.grad.numpy(), rtol=2e-6, atol=2 * np.finfo(np.float32).eps)


def test_mlp_gradient_unchanged_and_memory_lower():
  """Two GELU MLP layers: the parameter gradients equal autodiff's to rounding, and the compiled backward
  keeps less (the erfc intermediates are not carried from the forward to the backward pass)."""
  r = np.random.RandomState(0)
  b, t, d, h = 4, 33, 32, 128
  params = [
    (jnp.asarray(r.randn(d, h) * 0.2, jnp.float32), jnp.asarray(r.randn(h, d) * 0.2, jnp.float32))
  ] * 2
  x = jnp.asarray(r.randn(b, t, d), jnp.float32)

  def loss(p, x, act):
    for w0, w1 in p:
      x = x + act(x @ w0) @ w1
    return jnp.sum(x**2)

  def compiled(act):
    return jax.jit(jax.grad(lambda p, x: loss(p, x, act))).lower(params, x).compile()

  ours, today = compiled(layers.gelu_exact), compiled(_autodiff_gelu)
  for a, b_ in zip(jax.tree.leaves(ours(params, x)), jax.tree.leaves(today(params, x))):
    a, b_ = np.asarray(a), np.asarray(b_)  # sums of ~4000 products: rounding relative to the largest
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6 * np.abs(b_).max())
  mem = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
  assert mem(ours) < mem(today), (mem(ours), mem(today))


@pytest.mark.parametrize("train_dropout", [False, True])
def test_mlp_keeps_only_the_hidden_input_for_the_backward(train_dropout, monkeypatch):
  """`layers.Mlp` with 'gelu_exact': the activation and Dense_1 run as one rematerialised `ActivationDense`
  (same parameters), so the backward keeps one hidden-layer-sized tensor, the GELU's input, where plain
  autodiff keeps the activation's output too (what held the TPU peak above big_vision's,
  docs/performance.md); values and gradients bitwise those of the plain path. With dropout in training the
  plain path runs (the dropout mask sits between the two). Break check: an empty RECOMPUTED_ACTIVATIONS
  gives two hidden-sized residuals."""
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel

  mlp = layers.Mlp(64, "gelu_exact", dropout=0.5 if train_dropout else 0.0)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 5, 16), jnp.float32)
  params = mlp.init(jax.random.PRNGKey(0), x)
  rngs = {"dropout": jax.random.PRNGKey(1)}
  f = lambda p, x: mlp.apply(p, x, train=train_dropout, rngs=rngs)  # noqa: E731
  hidden = lambda: [a for a, _ in saved_residuals(f, params, x) if a.shape == (2, 5, 64)]  # noqa: E731
  lean = hidden()
  value_grad = jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(f(p, x))), argnums=(0, 1))
  ours = value_grad(params, x)
  monkeypatch.setattr(layers, "RECOMPUTED_ACTIVATIONS", ())
  plain = layers.Mlp(64, "gelu_exact", dropout=mlp.dropout)
  assert jax.tree.structure(plain.init(jax.random.PRNGKey(0), x)) == jax.tree.structure(params)
  f = lambda p, x: plain.apply(p, x, train=train_dropout, rngs=rngs)  # noqa: E731
  n_lean, n_plain = len(lean), len(hidden())
  assert n_lean == n_plain if train_dropout else (n_lean, n_plain) == (1, 2), (n_lean, n_plain)
  jax.tree.map(np.testing.assert_array_equal, ours, value_grad(params, x))


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_openclip_tower_gradient_unchanged_under_remat_policies(policy):
  """The custom VJP inside rematerialised blocks (`model.image.remat_policy`): the OpenCLIP-style tower's
  gradients equal those without remat (the backward recomputes the same forward)."""
  from tipsito.models.vit import VisionTransformer

  kw = dict(
    patch_size=8, width=32, depth=2, num_heads=2, mlp_dim=64, activation="gelu_exact", pre_norm=True,
    cls_posemb=True, patch_bias=False, ln_eps=1e-5, posemb_grid=2,
  )  # fmt: skip
  x = jax.random.randint(jax.random.PRNGKey(1), (2, 16, 16, 3), 0, 256).astype(jnp.uint8)
  params = VisionTransformer(**kw).init(jax.random.PRNGKey(0), x)

  def grad(**extra):
    f = lambda p: jnp.sum(jnp.sin(VisionTransformer(**kw, **extra).apply(p, x)["patches"]))  # noqa: E731
    return jax.jit(jax.grad(f))(params)

  jax.tree.map(np.testing.assert_array_equal, grad(remat=True, remat_policy=policy), grad())


# The tanh GELU (flax nn.gelu: the TIPS vision tower, the ITO fusion module), lean the same way.


def _autodiff_gelu_tanh(x):
  return jax.nn.gelu(x, approximate=True)


def _reference64_tanh(x):
  """The tanh GELU and its derivative in float64."""
  x = np.asarray(x, np.float64)
  k, a = math.sqrt(2.0 / math.pi), 0.044715
  t = np.tanh(k * (x + a * x**3))
  return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * a * x * x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tanh_forward_is_flax_gelu_bitwise(dtype):
  import flax.linen as nn

  x = jnp.asarray(X, dtype).reshape(2, -1, 1)
  ours = np.asarray(jax.jit(layers.gelu_tanh)(x).astype(jnp.float32))
  np.testing.assert_array_equal(ours, np.asarray(jax.jit(nn.gelu)(x).astype(jnp.float32)))
  assert layers.ACTIVATIONS["gelu"] is layers.gelu_tanh


def test_tanh_gradient_is_analytic_and_matches_autodiff_and_torch():
  x = jnp.asarray(X[np.abs(X) < 30])  # beyond, x^3 overflows float32's range in both (inf * 0)
  ct = jnp.cos(x)

  def vjp(f):
    return np.asarray(jax.jit(lambda v, g: jax.vjp(f, v)[1](g)[0])(x, ct), np.float64)

  ours, today = vjp(layers.gelu_tanh), vjp(_autodiff_gelu_tanh)
  # Where tanh -> -1 (x < -3) both formulas lose float32's relative precision: rounding of order 1e-6
  # absolute against a derivative of scale 1, and ours is no further from float64 than autodiff is.
  np.testing.assert_allclose(ours, today, rtol=2e-6, atol=2.5e-6)
  _, dref = _reference64_tanh(np.asarray(x))
  exact = dref * np.asarray(ct, np.float64)
  np.testing.assert_allclose(ours, exact, rtol=2e-6, atol=2e-6)
  assert np.max(np.abs(ours - exact)) <= 1.5 * np.max(np.abs(today - exact))
  # torch's autograd of nn.GELU(approximate='tanh'), the exported TIPS tower's activation (gelu_pytorch_tanh).
  t = torch.from_numpy(np.asarray(x)).requires_grad_()
  torch.nn.functional.gelu(t, approximate="tanh").backward(torch.from_numpy(np.asarray(ct)))
  np.testing.assert_allclose(ours, t.grad.numpy(), rtol=2e-6, atol=2.5e-6)


@pytest.mark.parametrize(
  "lean,autodiff",
  [(layers.gelu_tanh, _autodiff_gelu_tanh), (layers.gelu_exact, _autodiff_gelu)],
  ids=["tanh", "erf"],
)
def test_fusion_module_gradient_unchanged_and_memory_lower(lean, autodiff, monkeypatch):
  """The ITO fusion module (tanh GELU MLPs over [image; text]): parameter and input gradients equal
  autodiff's to rounding, and its compiled backward keeps less. Break check: with ACTIVATIONS['gelu'] set
  back to autodiff's GELU, the memory assertion fails."""
  from tipsito.models.fusion import FusionTransformer

  r = np.random.RandomState(0)
  args = (
    jnp.asarray(r.randn(4, 32), jnp.float32),
    jnp.asarray(r.randn(4, 3, 3, 32), jnp.float32),
    jnp.asarray(r.randn(4, 6, 16), jnp.float32),
    jnp.asarray(np.arange(6)[None] < np.array([[6], [3], [1], [4]])),
  )
  module = FusionTransformer(width=32, depth=2, num_heads=2, max_text_len=8)
  params = module.init(jax.random.PRNGKey(0), *args)

  def compiled(act):
    monkeypatch.setitem(layers.ACTIVATIONS, "gelu", act)
    f = lambda p, a, b, c: jnp.sum(jnp.sin(module.apply(p, a, b, c, args[3])))  # noqa: E731
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3))).lower(params, *args[:3]).compile()

  ours, today = compiled(lean), compiled(autodiff)
  got, want = jax.tree.leaves(ours(params, *args[:3])), jax.tree.leaves(today(params, *args[:3]))
  scale = max(float(np.abs(b_).max()) for b_ in want)  # leaves whose exact gradient is 0 (attention key
  for a, b_ in zip(got, want):  # biases) hold rounding noise: compare them at the gradients' scale
    np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-6 * scale)
  mem = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
  assert mem(ours) < mem(today), (mem(ours), mem(today))


def test_dino_head_gradient_unchanged():
  """The DINO/iBOT heads' MLP GELU (exact erf, dinov2's) goes through `gelu_exact`: the same forward bit for
  bit and the same gradients to rounding as autodiff through erfc."""
  from tipsito.models import heads

  x = jnp.asarray(np.random.RandomState(1).randn(6, 32), jnp.float32)
  head = heads.DINOHead(num_prototypes=16, hidden_dim=48, bottleneck_dim=8, num_layers=3)
  params = head.init(jax.random.PRNGKey(0), x)

  def run(act):
    orig = layers.gelu_exact
    heads.layers.gelu_exact = act
    try:
      out = jax.jit(lambda p: head.apply(p, x))(params)  # fresh functions: no trace cached across `act`
      g = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(head.apply(p, x)))))(params)
    finally:
      heads.layers.gelu_exact = orig
    return out, g

  (out, g), (out_ref, g_ref) = run(layers.gelu_exact), run(_autodiff_gelu)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out_ref))
  scale = max(float(np.abs(b_).max()) for b_ in jax.tree.leaves(g_ref))
  for a, b_ in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-6 * scale)
