"""The towers' attention cores (tipsito/models/layers.py ATTENTIONS, tipsito/models/splash.py).

'splash' is the Pallas TPU kernel; here it runs in Pallas interpret mode ('splash_interpret') on CPU and
must equal 'xla' in the forward pass and in the gradients, with the masks the towers use: the text
tower's key padding (with and without the causal mask of the 'clip' flavour) and the fusion module's
text padding. Lengths that are not multiples of 128 exercise the padding to the kernel's blocks.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito.config import defaults
from tipsito.config import validation
from tipsito.config.validation import ConfigError
from tipsito.models import fusion
from tipsito.models import layers
from tipsito.models import splash
from tipsito.models import text

TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(b=2, t=70, h=2, d=64, seed=0):
  r = np.random.RandomState(seed)
  return [jnp.asarray(r.randn(b, t, h, d), jnp.float32) for _ in range(3)]


def _key_mask(b, t):
  """Rows with 50 and 10 valid keys, then padding: (B,1,1,T)."""
  valid = np.ones((b, t), bool)
  valid[0, 50:] = False
  valid[1, 10:] = False
  return jnp.asarray(valid)[:, None, None, :]


@pytest.mark.parametrize('is_causal', [False, True])
@pytest.mark.parametrize('masked', [False, True])
def test_splash_core_equals_xla_forward_and_gradients(is_causal, masked):
  q, k, v = _qkv()
  mask = _key_mask(2, 70) if masked else None

  def loss(impl):
    return lambda q, k, v: jnp.sum(jnp.sin(layers.attention_core(q, k, v, mask, is_causal, impl)))

  want = layers.attention_core(q, k, v, mask, is_causal, 'xla')
  got = layers.attention_core(q, k, v, mask, is_causal, 'splash_interpret')
  np.testing.assert_allclose(got, want, **TOL)
  g_want = jax.grad(loss('xla'), argnums=(0, 1, 2))(q, k, v)
  g_got = jax.grad(loss('splash_interpret'), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, **TOL)


def test_splash_pads_to_the_kernel_blocks():
  assert [-(-t // splash.LANES) * splash.LANES for t in (64, 197, 1025)] == [128, 256, 1152]
  assert [splash.block_size(n) for n in (128, 256, 1152, 1024)] == [128, 256, 128, 512]


def _ids():
  """Two captions of 5 and 2 tokens in a length-9 row (pad id 0 after them)."""
  ids = np.zeros((2, 9), np.int32)
  ids[0, :5] = [5, 7, 9, 11, 30]
  ids[1, :2] = [4, 30]
  return jnp.asarray(ids)


@pytest.mark.parametrize('flavour', ['tips', 'clip'])
def test_text_tower_splash_equals_xla(flavour):
  """The text tower's padding mask ('tips': keys only; 'clip': causal and keys) reaches the kernel."""
  kw = dict(flavour=flavour, vocab_size=32, max_len=16, width=64, depth=1, num_heads=1, mlp_dim=64, out_dim=8)
  ids = _ids()
  params = text.TextEncoder(**kw).init(jax.random.PRNGKey(0), ids)

  def run(impl):
    def f(p):
      out = text.TextEncoder(attention=impl, **kw).apply(p, ids)
      return jnp.sum(out['pooled'] ** 2), out['pooled']

    return jax.value_and_grad(f, has_aux=True)(params)

  (_, want), g_want = run('xla')
  (_, got), g_got = run('splash_interpret')
  np.testing.assert_allclose(got, want, **TOL)
  # Gradients at 5e-5 relative: the exact GELU's custom VJP (tipsito/models/layers.py) sums its backward in
  # a different order under each attention core (one element of 2048 differed by 3e-5 relative).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=5e-5, atol=1e-5), g_got, g_want)


def test_fusion_module_splash_equals_xla():
  """The fusion module masks the caption's padding as keys of the [image; text] sequence."""
  kw = dict(width=64, depth=1, num_heads=1, mlp_ratio=1, max_text_len=9)
  r = np.random.RandomState(1)
  cls, patches = jnp.asarray(r.randn(2, 16), jnp.float32), jnp.asarray(r.randn(2, 3, 3, 16), jnp.float32)
  tokens = jnp.asarray(r.randn(2, 9, 16), jnp.float32)
  valid = _ids() != 0
  params = fusion.FusionTransformer(**kw).init(jax.random.PRNGKey(0), cls, patches, tokens, valid)

  def run(impl):
    def f(p, tokens):
      out = fusion.FusionTransformer(attention=impl, **kw).apply(p, cls, patches, tokens, valid)
      return jnp.sum(out[:, :4]), out

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, tokens)

  (_, want), g_want = run('xla')
  (_, got), g_got = run('splash_interpret')
  np.testing.assert_allclose(got, want, **TOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), g_got, g_want)
  # The padded caption tokens get no gradient: they are masked as keys.
  assert not np.any(np.asarray(g_got[1])[1, 2:])


def test_cudnn_off_gpu_is_a_clear_error_at_trace_time():
  q, k, v = _qkv(t=8)
  with pytest.raises(ValueError, match="'cudnn' needs an NVIDIA GPU.*'xla'"):
    jax.eval_shape(lambda q, k, v: layers.attention_core(q, k, v, None, False, 'cudnn'), q, k, v)
  with pytest.raises(ValueError, match='unknown; valid values'):
    layers.attention_core(q, k, v, None, False, 'flash')


def test_config_rejects_cudnn_in_float32_and_names_the_key():
  cfg = defaults.tiny_config('clip')
  cfg.model.text.attention = 'cudnn'
  with pytest.raises(ConfigError, match=r"model\.text\.attention='cudnn' needs model\.text\.dtype"):
    validation.validate(cfg)
  cfg.model.text.dtype = 'bfloat16'
  validation.validate(cfg)
  cfg.model.fusion.attention = 'flash'
  with pytest.raises(ConfigError, match='model.fusion.attention'):
    validation.validate(cfg)


# Key sequence lengths instead of a mask (layers.key_padding: what the towers pass on LENGTH_CORES, i.e.
# cuDNN). On CPU the 'xla' core takes lengths too, so the two forms are compared there, bit for bit.


@pytest.mark.parametrize('is_causal', [False, True])
def test_xla_core_with_key_lengths_equals_the_mask(is_causal):
  q, k, v = _qkv()
  mask = _key_mask(2, 70)
  lengths = layers.key_padding(mask[:, 0, 0, :], 'cudnn')
  np.testing.assert_array_equal(lengths, [50, 10])

  def loss(m):
    return lambda q, k, v: jnp.sum(jnp.sin(layers.attention_core(q, k, v, m, is_causal, 'xla')))

  np.testing.assert_array_equal(
    layers.attention_core(q, k, v, lengths, is_causal, 'xla'),
    layers.attention_core(q, k, v, mask, is_causal, 'xla'),
  )
  for a, b in zip(jax.grad(loss(lengths), (0, 1, 2))(q, k, v), jax.grad(loss(mask), (0, 1, 2))(q, k, v)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match='integer key lengths'):
    layers.attention_core(q, k, v, jnp.ones((2,), bool), is_causal, 'xla')


def _with_length_cores(monkeypatch, cores):
  monkeypatch.setattr(layers, 'LENGTH_CORES', cores)


@pytest.mark.parametrize('flavour', ['tips', 'clip'])
def test_text_tower_with_key_lengths_equals_the_mask(flavour, monkeypatch):
  """The towers' wiring: the text tower given lengths (here on 'xla') computes what it computes with the
  mask, every output and gradient bitwise."""
  kw = dict(flavour=flavour, vocab_size=32, max_len=16, width=64, depth=2, num_heads=2, mlp_dim=64, out_dim=8)
  ids = _ids()
  params = text.TextEncoder(**kw).init(jax.random.PRNGKey(0), ids)

  def run(cores):
    _with_length_cores(monkeypatch, cores)

    def f(p):
      out = text.TextEncoder(**kw).apply(p, ids)
      return jnp.sum(out['pooled'] ** 2) + jnp.sum(jnp.sin(out['tokens'])), out

    return jax.value_and_grad(f, has_aux=True)(params)

  (_, want), g_want = run(())
  (_, got), g_got = run(('xla',))
  jax.tree.map(np.testing.assert_array_equal, (got, g_got), (want, g_want))


def test_fusion_module_with_key_lengths_equals_the_mask(monkeypatch):
  """[image; text] with the caption's padding on the right: lengths 1 + h*w + caption length."""
  kw = dict(width=64, depth=1, num_heads=1, mlp_ratio=1, max_text_len=9)
  r = np.random.RandomState(1)
  cls, patches = jnp.asarray(r.randn(2, 16), jnp.float32), jnp.asarray(r.randn(2, 3, 3, 16), jnp.float32)
  tokens = jnp.asarray(r.randn(2, 9, 16), jnp.float32)
  valid = _ids() != 0
  params = fusion.FusionTransformer(**kw).init(jax.random.PRNGKey(0), cls, patches, tokens, valid)

  def run(cores):
    _with_length_cores(monkeypatch, cores)

    def f(p, tokens):
      out = fusion.FusionTransformer(**kw).apply(p, cls, patches, tokens, valid)
      return jnp.sum(out[:, :4]), out

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, tokens)

  (_, want), g_want = run(())
  (_, got), g_got = run(('xla',))
  jax.tree.map(np.testing.assert_array_equal, (got, g_got), (want, g_want))
  assert not np.any(np.asarray(g_got[1])[1, 2:])  # padded caption tokens: masked as keys


def _dot_ranks(f, *args) -> set:
  """The ranks of the results of every dot_general in the lowered forward and backward of `f`."""
  text = jax.jit(jax.grad(f, argnums=tuple(range(len(args))))).lower(*args).as_text()
  return {r.count('x') for r in re.findall(r'stablehlo\.dot_general.*-> tensor<((?:\d+x)+)', text)}


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize(
  'masking, is_causal',
  [
    ('none', False),
    ('none', True),
    ('mask', False),
    ('mask', True),
    ('lengths', False),
    ('lengths', True),
    ('one_query', False),
  ],  # one query row (Block.query_rows) against every key: never causal
)
def test_xla_core_is_jax_nn_attention_without_the_group_vmap(dtype, masking, is_causal):
  """The 'xla' core (`layers._xla_core`) computes `jax.nn.dot_product_attention(implementation='xla')`:
  the forward bitwise at head dimension 64 (the towers'), to float32 rounding at 16, gradients to
  rounding; with 4-D dot products only, where jax.nn's vmap over query groups lowers 5-D ones (the reason
  the core is ours: docs/performance.md). Break check: `_xla_core` calling jax.nn fails the rank check."""
  q, k, v = (x.astype(dtype) for x in _qkv())
  if masking == 'one_query':
    q = q[:, :1]
  mask = _key_mask(2, 70) if masking in ('mask', 'one_query') else None
  lengths = jnp.asarray([50, 10], jnp.int32) if masking == 'lengths' else None
  scale = 1.0 / 8.0

  def ours(q, k, v):
    return layers._xla_core(q, k, v, mask, lengths, is_causal, scale)

  def theirs(q, k, v):
    return jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=is_causal, scale=scale, key_value_seq_lengths=lengths
    )

  def loss(f):
    return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)))

  np.testing.assert_array_equal(ours(q, k, v), theirs(q, k, v))
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == 'float32' else dict(rtol=2e-2, atol=2e-2)
  for a, b in zip(jax.grad(loss(ours), (0, 1, 2))(q, k, v), jax.grad(loss(theirs), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
  assert _dot_ranks(loss(ours), q, k, v) == {4}
  assert 5 in _dot_ranks(loss(theirs), q, k, v)
  if dtype == 'float32':  # another head dimension: equal to rounding
    q16, k16, v16 = (x[..., :16] for x in (q, k, v))
    np.testing.assert_allclose(ours(q16, k16, v16), theirs(q16, k16, v16), rtol=1e-6, atol=1e-6)


def _probabilities(f, *args, shape):
  """The residuals of `f(*args)`'s backward pass the size of attention probabilities `shape` (B, heads, T,
  S), in whatever layout (jax's 'xla' core keeps (1, B, heads, T, S) arrays: its exp and its quotient)."""
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel

  return [a for a, _ in saved_residuals(f, *args) if a.size == np.prod(shape) and len(a.shape) >= 4]


@pytest.mark.parametrize('is_causal', [False, True])
@pytest.mark.parametrize('masking', ['none', 'mask', 'lengths'])
def test_xla_core_recompute_keeps_no_probabilities(is_causal, masking):
  """`attention_core(..., recompute=True)`: the backward pass keeps q, k, v and computes the probabilities
  again, so no (B, heads, T, T) residual is saved, where the plain core saves at least one; values and
  gradients bitwise those of the plain core (the same function, computed again). Break check: `recompute`
  ignored saves the probabilities."""
  q, k, v = _qkv()
  mask = {'none': None, 'mask': _key_mask(2, 70)}.get(masking)
  if masking == 'lengths':
    mask = layers.key_padding(_key_mask(2, 70)[:, 0, 0, :], 'cudnn')

  def loss(recompute):
    return lambda q, k, v: jnp.sum(jnp.sin(layers.attention_core(q, k, v, mask, is_causal, 'xla', recompute)))

  assert len(_probabilities(loss(False), q, k, v, shape=(2, 2, 70, 70))) >= 1
  assert _probabilities(loss(True), q, k, v, shape=(2, 2, 70, 70)) == []
  for a, b in zip(jax.grad(loss(True), (0, 1, 2))(q, k, v), jax.grad(loss(False), (0, 1, 2))(q, k, v)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(
    layers.attention_core(q, k, v, mask, is_causal, 'xla', True),
    layers.attention_core(q, k, v, mask, is_causal, 'xla'),
  )


@pytest.mark.parametrize('tower', ['image', 'text', 'fusion'])
def test_towers_recompute_attention_probabilities_by_default(tower):
  """Each tower's default (`attention_recompute`, config `model.<tower>.attention_recompute`): its blocks
  keep no attention probabilities for the backward pass, and every gradient equals the tower's with them
  kept (`attention_recompute=False`), which keeps one per block. With `remat` the block's policy decides
  (`layers.recomputes_attention`), so no recompute is nested in a recomputed block."""
  from tipsito.models.vit import VisionTransformer  # pylint: disable=import-outside-toplevel

  r = np.random.RandomState(2)
  if tower == 'image':
    module = lambda **kw: VisionTransformer(
      patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, posemb_grid=2, **kw
    )  # noqa: E731
    args = (jnp.asarray(r.randint(0, 256, (2, 8, 8, 3)), jnp.uint8),)
    out, shape = lambda o: jnp.sum(jnp.sin(o['cls'])) + jnp.sum(o['patches'] ** 2), (2, 2, 5, 5)  # noqa: E731
  elif tower == 'text':
    module = lambda **kw: text.TextEncoder(
      flavour='clip', vocab_size=32, max_len=16, width=32, depth=2, num_heads=2, mlp_dim=64, out_dim=8, **kw
    )  # noqa: E731
    args = (_ids(),)
    out, shape = lambda o: jnp.sum(jnp.sin(o['tokens'])) + jnp.sum(o['pooled'] ** 2), (2, 2, 9, 9)  # noqa: E731
  else:
    module = lambda **kw: fusion.FusionTransformer(
      width=32, depth=2, num_heads=2, mlp_ratio=1, max_text_len=9, **kw
    )  # noqa: E731
    args = tuple(jnp.asarray(r.randn(*s), jnp.float32) for s in [(2, 16), (2, 3, 3, 16), (2, 9, 16)]) + (
      _ids() != 0,
    )
    out, shape = lambda o: jnp.sum(jnp.sin(o)), (2, 2, 19, 19)  # noqa: E731
  params = module().init(jax.random.PRNGKey(0), *args)

  def f(**kw):
    return lambda p: out(module(**kw).apply(p, *args))

  assert len(_probabilities(f(attention_recompute=False), params, shape=shape)) >= 2  # >= 1 per block
  assert _probabilities(f(), params, shape=shape) == []
  g = jax.grad(f())(params)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
    g,
    jax.grad(f(attention_recompute=False))(params),
  )
  assert not layers.recomputes_attention(True, True, 'nothing_saveable')
  assert layers.recomputes_attention(True, True, 'none') and layers.recomputes_attention(
    True, False, 'nothing_saveable'
  )
