"""Behaviour of the model modules at tiny sizes (shapes, dtypes, options).

Why: these are the properties the training recipes rely on and that the
conformance vectors do not cover: bf16 compute with fp32 params, non-square
posemb resizing, mask-token placement, remat equivalence, padding invariance
of the text towers, and gradient flow through the ITO fusion module.
"""

import os
import subprocess
import sys
import textwrap

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito.models import (
  DINOHead,
  FusionTransformer,
  TextEncoder,
  VisionTransformer,
  text_config,
  vit_config,
)
from tipsito.models import vit as vit_lib
from tipsito.config import presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KEY = jax.random.PRNGKey(0)


def init(m, *args, **kw):
  """Random params of the right tree/shapes/dtypes, without compiling init.

  (XLA compiles flax init's many RNG calls slowly on CPU; the tests only need
  some non-trivial values.) LayerNorm scales ~1, everything else ~N(0, 0.1).
  """
  shapes = jax.eval_shape(lambda k, *a: m.init(k, *a, **kw), KEY, *args)
  rng = np.random.default_rng(0)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    v = rng.normal(0.0, 0.1, s.shape)
    if "'scale'" in name:
      v = v + 1.0
    return jnp.asarray(v, s.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)['params']


_JITTED = {}


def apply(m, params, *args, rngs=None, **kw):
  """Jitted apply, cached per (module, static options) so repeats reuse it.

  Python scalars in `kw` are static; arrays (e.g. `mask`) are traced.
  """
  static = {k: v for k, v in kw.items() if isinstance(v, (bool, int, float, str, type(None)))}
  dyn = {k: v for k, v in kw.items() if k not in static}
  key = (repr(m), tuple(sorted(static.items())), tuple(sorted(dyn)), rngs is None)
  if key not in _JITTED:
    _JITTED[key] = jax.jit(lambda p, a, d, r: m.apply({'params': p}, *a, rngs=r, **d, **static))
  return _JITTED[key](params, args, dyn, rngs)


def _images(b, h, w, seed=0):
  # numpy, not jax.random: compiling threefry for each shape costs seconds.
  return jnp.asarray(np.random.default_rng(seed).uniform(size=(b, h, w, 3)), jnp.float32)


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize('variant,n_cls,dtype', [('tiny/14', 2, jnp.float32), ('tiny/16', 1, jnp.bfloat16)])
def test_vit_shapes_dtypes(variant, n_cls, dtype):
  cfg = vit_config(variant, num_cls_tokens=n_cls, dtype=dtype, posemb_grid=8)
  m = VisionTransformer(**cfg)
  p = cfg['patch_size']
  x = _images(2, 3 * p, 4 * p)
  params = init(m, x)
  chex.assert_trees_all_equal_dtypes(params, jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params))
  out = apply(m, params, x, return_values=True)
  chex.assert_shape(out['cls'], (2, n_cls, 64))
  chex.assert_shape(out['patches'], (2, 3, 4, 64))
  chex.assert_shape(out['values'], (2, 3, 4, 64))
  for v in out.values():
    chex.assert_type(v, dtype)
  if dtype == jnp.float32:
    # Odd size: centre padded to the next patch multiple.
    out = apply(m, params, _images(1, 3 * p - 5, 2 * p + 1))
    chex.assert_shape(out['patches'], (1, 3, 3, 64))


def test_uint8_and_pixel_stats():
  cfg = vit_config('tiny/16', depth=0, posemb_grid=4)
  m = VisionTransformer(**cfg)
  img8 = np.random.default_rng(0).integers(0, 256, (1, 32, 32, 3), np.uint8)
  params = init(m, img8)
  a = apply(m, params, img8)
  b = apply(m, params, jnp.asarray(img8, jnp.float32) / 255.0)
  np.testing.assert_allclose(a['patches'], b['patches'], atol=1e-6)
  mean, std = presets.CLIP_PIXEL_MEAN, presets.CLIP_PIXEL_STD
  mc = VisionTransformer(**dict(cfg, pixel_mean=mean, pixel_std=std))
  c = apply(mc, params, img8)
  manual = (jnp.asarray(img8, jnp.float32) / 255.0 - jnp.asarray(mean)) / (jnp.asarray(std))
  d = apply(m, params, manual)
  np.testing.assert_allclose(c['patches'], d['patches'], atol=1e-5)


def test_posemb_resize_non_square():
  """Resize is jax.image.resize bilinear (antialiased) to any (h, w) grid."""
  cfg = vit_config('tiny/14', depth=1, num_cls_tokens=2)
  m = VisionTransformer(**cfg)
  x = _images(1, 14 * 5, 14 * 9)
  params = init(m, x)
  pos = params['posemb']
  resized = vit_lib.resize_posemb(pos, (5, 9))
  chex.assert_shape(resized, (1, 5, 9, 64))
  np.testing.assert_allclose(
    resized, jax.image.resize(pos, (1, 5, 9, 64), 'bilinear', antialias=True), atol=1e-6
  )
  assert not np.allclose(
    resized, jax.image.resize(pos, (1, 5, 9, 64), 'bilinear', antialias=False), atol=1e-4
  )
  # The model with the 32x32 table equals a model whose table is already the
  # resized (5, 9) grid (no resize inside): the resize is what the model does.
  m2 = VisionTransformer(**dict(cfg, posemb_grid=(5, 9)))
  p2 = dict(params, posemb=resized)
  a = apply(m, params, x)
  b = apply(m2, p2, x)
  np.testing.assert_allclose(a['patches'], b['patches'], atol=1e-5)
  np.testing.assert_allclose(a['cls'], b['cls'], atol=1e-5)


def test_mask_token_applied_where_true():
  """depth=0: each output token is LN(own embedding), so placement is visible."""
  cfg = vit_config('tiny/14', depth=0, num_cls_tokens=1, use_mask_token=True, posemb_grid=4)
  m = VisionTransformer(**cfg)
  x = _images(2, 56, 56)
  mask = jnp.asarray(np.random.default_rng(3).uniform(size=(2, 4, 4)) < 0.5)
  params = init(m, x, mask=mask)
  params = dict(params, mask_token=jnp.arange(64, dtype=jnp.float32) / 10.0)
  plain = apply(m, params, x)['patches']
  masked = apply(m, params, x, mask=mask)['patches']
  ln = nn.LayerNorm(epsilon=1e-6)
  expect = ln.apply({'params': params['norm']}, params['mask_token'] + params['posemb'][0])
  mk = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(masked)[~mk], np.asarray(plain)[~mk], atol=1e-6)
  np.testing.assert_allclose(np.asarray(masked)[mk], np.broadcast_to(expect, (2, 4, 4, 64))[mk], atol=1e-5)
  assert not np.allclose(np.asarray(masked)[mk], np.asarray(plain)[mk])
  # No mask token parameter unless asked for; a mask without it is an error.
  m0 = VisionTransformer(**dict(cfg, use_mask_token=False))
  p0 = init(m0, x)
  assert 'mask_token' not in p0
  with pytest.raises(ValueError):
    apply(m0, p0, x, mask=mask)


def test_remat_identical():
  cfg = vit_config('tiny/14', num_cls_tokens=2, posemb_grid=4, depth=1)
  x = _images(2, 28, 42)
  m, mr = VisionTransformer(**cfg), VisionTransformer(**dict(cfg, remat=True))
  params = init(m, x)
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(init(mr, x))

  def loss(p, mod):
    o = mod.apply({'params': p}, x, return_values=True)
    return jnp.sum(o['cls'] ** 2) + jnp.sum(o['values'] * o['patches'])

  vg = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  l1, g1 = vg(params, m)
  l2, g2 = vg(params, mr)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  chex.assert_trees_all_close(g1, g2, rtol=1e-5, atol=1e-5)


def test_dropout_and_stochastic_depth_train_only():
  cfg = vit_config('tiny/14', dropout=0.1, stochastic_depth=0.5, posemb_grid=2)
  m = VisionTransformer(**cfg)
  x = _images(4, 28, 28)
  params = init(m, x)
  e1 = apply(m, params, x)['cls']
  e2 = apply(m, params, x)['cls']
  np.testing.assert_array_equal(e1, e2)
  t1 = apply(m, params, x, train=True, rngs={'dropout': jax.random.PRNGKey(1)})['cls']
  assert not np.allclose(t1, e1)


@pytest.mark.parametrize(
  'flavour,out_dim,dtype',
  [('tips', None, jnp.float32), ('clip', None, jnp.float32), ('clip', 32, jnp.bfloat16)],
)
def test_text_shapes_dtypes(flavour, out_dim, dtype):
  cfg = text_config('tiny', flavour=flavour, vocab_size=100, max_len=8, out_dim=out_dim, dtype=dtype)
  m = TextEncoder(**cfg)
  ids = jnp.array([[5, 6, 7, 0, 0, 0, 0, 0], [9, 9, 9, 9, 9, 9, 9, 9], [4, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
  params = init(m, ids)
  chex.assert_trees_all_equal_dtypes(params, jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params))
  out = apply(m, params, ids)
  chex.assert_shape(out['pooled'], (3, out_dim or 64))
  chex.assert_shape(out['tokens'], (3, 8, 64))
  chex.assert_type([out['pooled'], out['tokens']], dtype)
  np.testing.assert_array_equal(out['valid'], np.asarray(ids) != 0)
  if dtype == jnp.float32:
    # Padding invariance: the pooled vector ignores how much padding follows.
    short = apply(m, params, ids[:1, :4])['pooled']
    np.testing.assert_allclose(short, out['pooled'][:1], atol=1e-5)
  if flavour == 'clip' and out_dim is None:
    # EOT pooling = last valid token (after the final LN).
    np.testing.assert_allclose(out['pooled'][0], out['tokens'][0, 2], atol=1e-6)
    np.testing.assert_allclose(out['pooled'][1], out['tokens'][1, 7], atol=1e-6)
    # Causal: changing a later token does not change earlier tokens.
    ids2 = ids.at[1, 7].set(3)
    out2 = apply(m, params, ids2)
    np.testing.assert_allclose(out2['tokens'][1, :7], out['tokens'][1, :7], atol=1e-6)


def test_dino_head():
  h = DINOHead(num_prototypes=16, hidden_dim=32, bottleneck_dim=8)
  x = _normal(4, (3, 5, 24))
  params = init(h, x)
  logits = apply(h, params, x)
  chex.assert_shape(logits, (3, 5, 16))
  chex.assert_type(logits, jnp.float32)
  # Weight norm with fixed gain: prototypes are unit directions, so logits
  # are cosines and rescaling a prototype's raw weights changes nothing.
  assert np.all(np.abs(logits) <= 1.0 + 1e-5)
  scaled = dict(params, last_layer=params['last_layer'] * jnp.linspace(0.5, 3.0, 16)[None, :])
  np.testing.assert_allclose(apply(h, scaled, x), logits, atol=1e-5)
  assert sorted(params) == ['Dense_0', 'Dense_1', 'Dense_2', 'last_layer']
  assert params['Dense_2']['kernel'].shape == (32, 8)


def test_fusion_grads_and_norm():
  f = FusionTransformer(width=32, depth=2, num_heads=4, max_text_len=6)
  b, h, w, di, length, dt = 3, 2, 3, 16, 6, 24
  cls = _normal(1, (b, di))
  patches = _normal(2, (b, h, w, di))
  text = _normal(3, (b, length, dt))
  valid = jnp.array([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0]], bool)
  params = init(f, cls, patches, text, valid)
  out = apply(f, params, cls, patches, text, valid)
  chex.assert_shape(out, (b, 32))
  np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), 1.0, atol=1e-5)

  def loss(c, p, t):
    z = f.apply({'params': params}, c, p, t, valid)
    return jnp.sum(z * jnp.arange(32.0))

  gc, gp, gt = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(cls, patches, text)
  for g in (gc, gp, gt):
    assert float(jnp.abs(g).sum()) > 0
  assert float(jnp.abs(gt[0, :3]).sum()) > 0
  # Padded text tokens are masked as keys: no gradient, no effect.
  np.testing.assert_array_equal(gt[0, 3:], 0.0)
  out2 = apply(f, params, cls, patches, text.at[0, 4].set(100.0), valid)
  np.testing.assert_allclose(out2, out, atol=1e-6)


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_fusion_remat_gradients_bitwise_and_memory_lower(policy):
  """`model.fusion.remat` / `remat_policy`: the fusion module's blocks rematerialised give the same output
  and the same parameter and input gradients bit for bit, the same parameter tree, and (the point) less
  compiled memory for the backward with nothing_saveable."""
  b, h, w, di, length, dt = 4, 3, 3, 16, 6, 24
  args = (_normal(1, (b, di)), _normal(2, (b, h, w, di)), _normal(3, (b, length, dt)))
  valid = jnp.array([[1] * 3 + [0] * 3, [1] * 6, [1] + [0] * 5, [1] * 4 + [0] * 2], bool)
  plain = FusionTransformer(width=32, depth=2, num_heads=4, max_text_len=6)
  remat = FusionTransformer(width=32, depth=2, num_heads=4, max_text_len=6, remat=True, remat_policy=policy)
  params = init(plain, *args, valid)
  shapes = jax.eval_shape(lambda: remat.init(KEY, *args, valid))["params"]
  assert jax.tree.structure(shapes) == jax.tree.structure(params)

  def compiled(module):
    loss = lambda p, *a: jnp.sum(jnp.sin(module.apply({"params": p}, *a, valid)))  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(params, *args).compile()

  ours, theirs = compiled(remat), compiled(plain)
  jax.tree.map(np.testing.assert_array_equal, ours(params, *args), theirs(params, *args))
  if policy == "nothing_saveable":
    mem = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert mem(ours) < mem(theirs), (mem(ours), mem(theirs))


def _close(ours, ref):
  """Equal to float32 rounding, leaf by leaf: within 1e-5 of the tree's largest magnitude (a one-row matmul
  may round in another order than the full one; a key bias's gradient is zero up to that rounding)."""
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref))
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=0, atol=1e-5 * scale), ours, ref)


@pytest.mark.parametrize("core", ["xla_mask", "xla_lengths"])
def test_block_query_rows_is_the_full_block_sliced(core):
  """`Block(query_rows=n)` is the full block's first n output rows (their queries attend to every token),
  in value and in every gradient, within float tolerance (a one-row matmul may round differently); the
  fusion module's last block reads only its CLS row this way. Break check: taking keys/values from the
  sliced rows too makes the values differ."""
  from tipsito.models import layers  # pylint: disable=import-outside-toplevel

  b, t, d = 3, 7, 16
  x = _normal(1, (b, t, d))
  valid = jnp.array([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5], bool)
  mask = layers.key_padding(valid, "cudnn" if core == "xla_lengths" else "xla")
  full = layers.Block(num_heads=4, mlp_dim=32)
  params = full.init(KEY, x, mask)["params"]
  for n in (1, 3):
    part = layers.Block(num_heads=4, mlp_dim=32, query_rows=n)
    assert jax.tree.structure(part.init(KEY, x, mask)["params"]) == jax.tree.structure(params)

    def loss(module, p, x, n=n):
      y = module.apply({"params": p}, x, mask)[:, :n]
      return jnp.sum(jnp.sin(y) * jnp.cos(jnp.arange(y.size)).reshape(y.shape))

    y = part.apply({"params": params}, x, mask)
    chex.assert_shape(y, (b, n, d))
    np.testing.assert_allclose(y, full.apply({"params": params}, x, mask)[:, :n], rtol=1e-6, atol=1e-6)
    g_part = jax.grad(lambda p, x, m=part: loss(m, p, x), argnums=(0, 1))(params, x)
    g_full = jax.grad(lambda p, x: loss(full, p, x), argnums=(0, 1))(params, x)
    _close(g_part, g_full)


def _value_grad_flops(fn, *args):
  """(value, gradients w.r.t. every argument, compiled FLOPs) of sum(sin(fn(*args)) * a fixed pattern)."""

  def loss(*a):
    y = fn(*a)
    return jnp.sum(jnp.sin(y) * jnp.cos(jnp.arange(y.size)).reshape(y.shape))

  vg = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
  return vg(*args), vg.lower(*args).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("num_cls", [1, 2])
def test_image_tower_cls_only_is_the_full_towers_cls(num_cls):
  """`VisionTransformer(..., cls_only=True)` (what a CLIP / SigLIP step encodes with, and DINO's local
  crops): only 'cls', equal to the full tower's in value and in every parameter and pixel gradient
  (float tolerance: the last block's one-row matmuls may round differently), at fewer FLOPs because the
  last block computes only the CLS rows; incompatible outputs are refused. Break check: computing every
  row in the last block (query_rows 0) fails the FLOP assertion."""
  vit = VisionTransformer(
    patch_size=4,
    width=32,
    depth=2,
    num_heads=4,
    mlp_dim=64,
    posemb_grid=4,
    num_cls_tokens=num_cls,
    activation="gelu_exact",
    patch_bias=False,
    cls_posemb=True,
    pre_norm=True,
  )
  x = _images(3, 16, 16)
  params = init(vit, x)
  out = vit.apply({"params": params}, x, cls_only=True)
  assert sorted(out) == ["cls"]
  chex.assert_shape(out["cls"], (3, num_cls, 32))
  ours, flops_ours = _value_grad_flops(
    lambda p, x: vit.apply({"params": p}, x, cls_only=True)["cls"], params, x
  )
  full, flops_full = _value_grad_flops(lambda p, x: vit.apply({"params": p}, x)["cls"], params, x)
  _close(ours, full)
  assert flops_ours < 0.9 * flops_full, (flops_ours, flops_full)
  with pytest.raises(ValueError, match="cls_only"):
    vit.apply({"params": params}, x, cls_only=True, return_values=True)


@pytest.mark.parametrize("remat", [False, True])
def test_text_tower_pooled_only_is_the_full_towers_eot_row(remat):
  """`TextEncoder(..., pooled_only=True)` ('clip' flavour: what every recipe but ITO's fusion encodes
  captions with): no 'tokens', and 'pooled' equal to the full tower's in value and in every gradient
  (float tolerance) for captions of every length (full, one token, empty), at fewer FLOPs: the last
  block computes only each caption's EOT row, which under the causal mask sees exactly its valid keys.
  Break checks: the row before the EOT, or keeping the causal mask for the lone EOT query (it would sit
  at position 0 and see one key), make the values differ."""
  t = TextEncoder(
    flavour="clip",
    vocab_size=50,
    max_len=8,
    width=32,
    depth=2,
    num_heads=4,
    mlp_dim=64,
    out_dim=16,
    remat=remat,
    remat_policy="dots_saveable",
  )
  ids = jnp.array(
    [[1, 5, 7, 49, 0, 0, 0, 0], [1, 49, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 49], [49] + [0] * 7, [0] * 8]
  )
  params = init(t, ids)
  out = t.apply({"params": params}, ids, pooled_only=True)
  assert sorted(out) == ["pooled", "valid"]
  ours, flops_ours = _value_grad_flops(
    lambda p: t.apply({"params": p}, ids, pooled_only=True)["pooled"], params
  )
  full, flops_full = _value_grad_flops(lambda p: t.apply({"params": p}, ids)["pooled"], params)
  _close(ours, full)
  assert flops_ours < 0.9 * flops_full, (flops_ours, flops_full)


def test_fusion_last_block_computes_the_cls_row_only():
  """The fusion module equals the same two blocks computed on every row and read at CLS (output and
  gradients, float tolerance), at fewer FLOPs: the last block's other rows are never computed."""
  from tipsito.models import layers  # pylint: disable=import-outside-toplevel

  b, h, w, di, length, dt = 4, 3, 3, 16, 6, 24
  args = (_normal(1, (b, di)), _normal(2, (b, h, w, di)), _normal(3, (b, length, dt)))
  valid = jnp.array([[1] * 3 + [0] * 3, [1] * 6, [1] + [0] * 5, [1] * 4 + [0] * 2], bool)
  f = FusionTransformer(width=32, depth=2, num_heads=4, max_text_len=6)
  params = init(f, *args, valid)

  class AllRows(layers.Block):  # the block as it was: every row computed, the fusion reads row 0
    query_rows: int = 0

    def __post_init__(self):
      object.__setattr__(self, "query_rows", 0)
      super().__post_init__()

  def run(block_cls):
    orig = layers.Block
    layers.Block = block_cls
    try:
      loss = lambda p, *a: jnp.sum(jnp.sin(f.apply({"params": p}, *a, valid)) * jnp.arange(32.0))  # noqa: E731
      fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
      return fn(params, *args), fn.lower(params, *args).compile().cost_analysis()["flops"]
    finally:
      layers.Block = orig

  (ours, flops_ours), (ref, flops_ref) = run(layers.Block), run(AllRows)
  _close(ours, ref)
  assert flops_ours < 0.8 * flops_ref, (flops_ours, flops_ref)


def test_fusion_chunks_are_the_same_function_in_less_memory():
  """`model.fusion.chunks`: the module run over groups of examples in turn (each rematerialised) has the
  parameters of `chunks=1` (same init), the same output and gradients within float tolerance, with each
  row where it was (group g holds rows g, g + chunks, ...; break check: un-grouping in the other order
  permutes the rows and fails), and less compiled memory for the backward; a count that does not divide
  the batch is refused naming the key."""
  b, h, w, di, length, dt = 8, 4, 4, 16, 6, 24
  args = (_normal(1, (b, di)), _normal(2, (b, h, w, di)), _normal(3, (b, length, dt)))
  valid = jnp.arange(length)[None, :] < jnp.array([3, 6, 1, 4, 2, 5, 6, 1])[:, None]
  plain = FusionTransformer(width=32, depth=2, num_heads=4, max_text_len=6)
  params = init(plain, *args, valid)

  def compiled(module):
    loss = lambda p, *a: jnp.sum(jnp.sin(module.apply({"params": p}, *a, valid)) * jnp.arange(32.0))  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(params, *args).compile()

  ref = compiled(plain)
  out = apply(plain, params, *args, valid)
  for k in (2, 4):
    chunked = plain.clone(chunks=k)
    jax.tree.map(np.testing.assert_array_equal, init(chunked, *args, valid), params)
    _close(apply(chunked, params, *args, valid), out)
    ours = compiled(chunked)
    _close(ours(params, *args), ref(params, *args))
    mem = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert mem(ours) < mem(ref), (k, mem(ours), mem(ref))
  with pytest.raises(ValueError, match=r"model\.fusion\.chunks=3 must divide the 8 examples"):
    apply(plain.clone(chunks=3), params, *args, valid)


def test_fusion_chunks_move_no_rows_between_devices():
  """On a batch sharded over 4 devices, the grouped fusion module (chunks=2: each device's rows split
  between both groups) compiles without moving activations between devices (no all-to-all, permute or
  gather of rows); only the parameters' gradients are summed. Break check: groups of contiguous rows
  (rows 0..B/2 first) put each group on two devices and fail it."""
  code = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tipsito.models.fusion import FusionTransformer
    b = 16
    args = [jnp.ones(s) for s in ((b, 16), (b, 4, 4, 16), (b, 6, 24))]
    valid = jnp.ones((b, 6), bool)
    f = FusionTransformer(width=32, depth=2, num_heads=4, max_text_len=6, chunks=2)
    params = f.init(jax.random.PRNGKey(0), *args, valid)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    loss = lambda p, *a: jnp.sum(f.apply(p, *a) ** 2)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    hlo = step.lower(params, *map(rows, args), rows(valid)).compile().as_text()
    print("RESULT", sum(hlo.count(op) for op in ("all-to-all", "collective-permute", "all-gather")))
    """
  )
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  moves = int([line for line in proc.stdout.splitlines() if line.startswith("RESULT")][-1].split()[1])
  assert moves == 0, moves
