"""Transformer building blocks shared by the image, text and fusion towers.

Why one module: the ViT, the TIPS/CLIP text towers and the ITO fusion module
are all pre-LN transformers that differ only in the FFN (GELU MLP, masked ReLU
MLP, SwiGLU) and in the attention mask. Keeping one Block keeps the parameter
naming uniform, which the TIPS importer relies on (tipsito/tips_import.py).

Conventions: LayerNorm eps 1e-6 (the official TIPS release; the OpenCLIP-style CLIP/ITO towers pass
1e-5, PyTorch's LayerNorm default that OpenCLIP and Hugging Face CLIP use); attention uses separate query/key/value
DenseGeneral projections with bias (kernel (D,H,D/H)) and an output projection
(kernel (H,D/H,D)), like flax MultiHeadDotProductAttention. The attention core is chosen by the
towers' `attention` field (ATTENTIONS): 'xla' is `jax.nn.dot_product_attention` without an
implementation, which in JAX 0.10 is the plain einsum-softmax-einsum on every backend (no fused kernel);
'cudnn' is the same call with implementation='cudnn' (cuDNN flash attention, GPU, bf16/fp16); 'splash'
is the Pallas TPU splash-attention kernel (tipsito/models/splash.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from tipsito.models.activation_sharding import constrain_batch
from tipsito.choices import ATTENTIONS
from tipsito.config import presets
from tipsito.models import splash

Dtype = Any
LN_EPS = presets.TIPS_LN_EPS
OPENCLIP_LN_EPS = presets.OPENCLIP_LN_EPS


def layer_norm(name: str, dtype: Dtype, param_dtype: Dtype, eps: float = LN_EPS) -> nn.LayerNorm:
  """The LayerNorm used everywhere (eps 1e-6 as in the official release unless `eps` is given)."""
  return nn.LayerNorm(epsilon=eps, dtype=dtype, param_dtype=param_dtype, name=name)


def quick_gelu(x: jax.Array) -> jax.Array:
  """x * sigmoid(1.702 x): the GELU approximation of OpenAI's CLIP weights (OpenCLIP `QuickGELU`)."""
  return x * jax.nn.sigmoid(jnp.asarray(1.702, x.dtype) * x)


_SQRT_HALF = 0.5**0.5
_INV_SQRT_2PI = (2.0 * math.pi) ** -0.5


@jax.custom_vjp
def gelu_exact(x: jax.Array) -> jax.Array:
  """The exact erf GELU x * Phi(x) (torch nn.GELU: OpenCLIP ViT-B-16), lean in memory.

  The forward is `jax.nn.gelu(x, approximate=False)` itself (0.5 x erfc(-x / sqrt 2)), so the values
  are bitwise today's. Why a custom VJP: autodiff through XLA's erfc expansion keeps its intermediates
  (erfc, exp and the product, each the size of the MLP's hidden layer) from the forward to the backward
  pass; the analytic derivative Phi(x) + x phi(x) needs only x, which the MLP's first matmul has
  produced anyway (docs/performance.md has the memory). The backward works on 2-D (rows, features)
  views, the layout of the matmul it follows, so that XLA fuses it into one loop with the incoming
  gradient instead of materialising Phi and phi (measured on XLA:CPU). Phi in the backward is
  0.5 (1 + erf(x / sqrt 2)), the form torch's GELU backward evaluates, not the forward's erfc: XLA's f32
  erf is one rational polynomial where erfc evaluates two branches and an exp, and on XLA:CPU the
  derivative costs a third of the erfc form's time (B/16's MLP hidden layers: 26 -> 10 ms over reading
  the gradient). The two forms of Phi differ by at most 2.4e-7 absolutely (where Phi is tiny, erfc's
  relative precision buys nothing a gradient of scale 1 can hold). Gradients differ from autodiff through
  erfc by rounding only (tests/test_models_gelu.py).
  """
  return jax.nn.gelu(x, approximate=False)


def _gelu_exact_fwd(x):
  return gelu_exact(x), x


def _gelu_exact_bwd(x, ct):
  shape = x.shape
  x2 = x.reshape(-1, shape[-1]) if x.ndim > 2 else x
  g2 = ct.reshape(x2.shape)
  c = lambda v: jnp.asarray(v, x.dtype)  # noqa: E731
  cdf = c(0.5) + c(0.5) * jax.lax.erf(x2 * c(_SQRT_HALF))
  pdf = c(_INV_SQRT_2PI) * jnp.exp(c(-0.5) * x2 * x2)
  return ((g2 * (cdf + x2 * pdf)).reshape(shape),)


gelu_exact.defvjp(_gelu_exact_fwd, _gelu_exact_bwd)


_TANH_K = math.sqrt(2.0 / math.pi)
_TANH_A = 0.044715


@jax.custom_vjp
def gelu_tanh(x: jax.Array) -> jax.Array:
  """The tanh GELU 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (flax `nn.gelu`: the official TIPS
  vision tower, the ITO fusion module), lean in memory like `gelu_exact`.

  The forward is `jax.nn.gelu(x, approximate=True)` itself, so the values are bitwise flax's. Why a custom
  VJP: autodiff keeps tanh's output, the cube and the products from the forward to the backward pass, each
  the size of the MLP's hidden layer; the analytic derivative s + 2 x s (1 - s) sqrt(2/pi)
  (1 + 3 * 0.044715 x^2), s = sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) = 0.5 (1 + tanh(...)), needs only x,
  which the MLP's first matmul has produced anyway (docs/performance.md has the memory). Gradients differ
  from autodiff's by float32 rounding (at most 1.2e-6 against a derivative of scale 1, both as far from
  float64; tests/test_models_gelu.py).
  """
  return jax.nn.gelu(x, approximate=True)


def _gelu_tanh_fwd(x):
  return gelu_tanh(x), x


def _gelu_tanh_bwd(x, ct):
  shape = x.shape
  x2 = x.reshape(-1, shape[-1]) if x.ndim > 2 else x
  g2 = ct.reshape(x2.shape)
  c = lambda v: jnp.asarray(v, x.dtype)  # noqa: E731
  x_sq = x2 * x2
  # 0.5 (1 + tanh(u)) = sigmoid(2u) and 0.5 (1 - tanh(u)^2) = 2 s (1 - s): one transcendental, no t^2.
  s = jax.nn.sigmoid(c(2.0 * _TANH_K) * (x2 + c(_TANH_A) * x_sq * x2))
  du = c(2.0 * _TANH_K) * (c(1.0) + c(3.0 * _TANH_A) * x_sq)
  return ((g2 * (s + x2 * s * (c(1.0) - s) * du)).reshape(shape),)


gelu_tanh.defvjp(_gelu_tanh_fwd, _gelu_tanh_bwd)


# FFN activations by config name (`model.image.activation`, `model.text.activation`):
# 'gelu' is flax's tanh approximation (the official TIPS vision tower), 'gelu_exact' the erf GELU
# (torch nn.GELU: OpenCLIP ViT-B-16), 'quick_gelu' OpenAI CLIP's, 'relu' the TIPS text tower's.
ACTIVATIONS = {
  'gelu': gelu_tanh,
  'gelu_exact': gelu_exact,
  'quick_gelu': quick_gelu,
  'relu': nn.relu,
}


def activation_fn(name: str) -> Callable[[jax.Array], jax.Array]:
  """The activation called `name` (ACTIVATIONS); the error lists the valid names."""
  if name not in ACTIVATIONS:
    raise ValueError(f'activation {name!r} unknown; valid values: {sorted(ACTIVATIONS)}')
  return ACTIVATIONS[name]


def drop_path(x: jax.Array, rate: float, rng: jax.Array) -> jax.Array:
  """Stochastic depth: zeroes a residual branch per example, rescales the rest.

  Used instead of dropout on whole blocks because it regularises deep ViTs
  without changing the expected activation (scaled by 1/keep).
  """
  keep = 1.0 - rate
  shape = (x.shape[0],) + (1,) * (x.ndim - 1)
  mask = jax.random.bernoulli(rng, keep, shape)
  return jnp.where(mask, x / keep, jnp.zeros_like(x))


# Attention cores by config name (`model.image.attention`, `model.text.attention`,
# `model.fusion.attention`). 'splash_interpret' runs the splash kernel in Pallas interpret mode: the CPU
# check of the kernel in tests/test_models_attention.py, far too slow to train with, so not a config value.
_HALF_DTYPES = (jnp.bfloat16, jnp.float16)


# The cores the towers give right padding as key sequence lengths instead of a boolean mask
# (`key_padding`). cuDNN's fused attention takes lengths natively (its padding mask type, no (B,1,1,T) mask
# tensor to read), the form upstream JAX reports it fast and robust with. `step_bench --attention
# cudnn_mask` empties this for a row, to measure the explicit-mask path next to it.
LENGTH_CORES = ('cudnn',)


def key_padding(key_valid: jax.Array, implementation: str) -> jax.Array:
  """What the towers pass as `mask` for keys valid up to a per-example length ((B,T) bool, right padding:
  the text tower's pad id 0 after EOT, the fusion module's [image; text]): int32 lengths (B,) on
  LENGTH_CORES, the boolean key mask (B,1,1,T) otherwise. Both mean the same (tests/test_models_attention.py);
  lengths are only right when no valid key follows a padded one, which the tokenizer guarantees."""
  if implementation in LENGTH_CORES:
    return jnp.sum(key_valid, axis=1, dtype=jnp.int32)
  return key_valid[:, None, None, :]


def _xla_core(q, k, v, mask, lengths, is_causal: bool, scale: float) -> jax.Array:
  """The 'xla' core: softmax(q k^T * scale, masked) v, einsum-softmax-einsum on (B,T,H,d) as they come.

  The computation of `jax.nn.dot_product_attention(implementation='xla')`, step for step: the logits in
  float32 (bfloat16 inputs multiplied at BF16_BF16_F32), scaled after the product, masked keys (boolean
  `mask`, key `lengths`, causal) set to -0.7 x float32's maximum, the softmax in float32, the probabilities
  cast to v's dtype; equal to that function to float32 rounding, bitwise at the towers' head dimension 64
  (tests/test_models_attention.py). Why not call it: jax.nn runs its core under a `vmap` over the query
  groups of grouped-query attention, which with one group per key head still leaves 5-D dot products
  whose layouts cost XLA:CPU 1.28x the time of these 4-D ones for the forward and backward of a ViT-B/16
  block's attention (docs/performance.md).
  """
  precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
  logits = jnp.einsum('BTNH,BSNH->BNTS', q, k, precision=precision, preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(scale)
  t, s = logits.shape[2], logits.shape[3]
  keep = None if mask is None else mask.astype(bool)
  if lengths is not None:
    keys = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    keep = keys if keep is None else keep & keys
  if is_causal:
    causal = jnp.tril(jnp.ones((t, s), bool))
    keep = causal if keep is None else keep & causal
  if keep is not None:
    logits = jnp.where(keep, logits, jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max)))
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum('BNTS,BSNH->BTNH', probs, v)


def recomputed_core(core: Callable) -> Callable:
  """`core` (the signature of `_xla_core`) keeping only its inputs for the backward pass, which computes
  the probabilities again (`attention_core(..., recompute=True)`)."""
  return jax.checkpoint(core, policy=jax.checkpoint_policies.nothing_saveable, static_argnums=(5, 6))


_xla_core_recomputed = recomputed_core(_xla_core)


def attention_core(q, k, v, mask, is_causal: bool, implementation: str, recompute: bool = False) -> jax.Array:
  """softmax(q k^T / sqrt(d) + mask) v for (B,T,H,d) q/k/v with the `implementation` asked for.

  `mask` is None, a boolean key mask (B,1,1,T) (the text tower's padding, the fusion module's text
  padding) or int32 key lengths (B,) (keys at positions >= length are masked; `key_padding`); 'xla' also
  takes any boolean mask broadcastable to (B,H,T,T). Errors are raised at trace time, so a wrong choice
  fails before anything is compiled.

  `recompute` (the 'xla' core only): the backward pass keeps q, k and v alone and computes the
  probabilities again from q and k, instead of keeping them from the forward pass. Why: after the MLP's
  hidden layer they are the largest activation a block keeps at short sequences (B x heads x T x T: at
  ViT-B/16, 197 tokens and 12 heads, 1.8 MiB per image and block in float32, 0.77x the hidden layer;
  above it from 4 x width / heads tokens on), and the flash kernels
  ('cudnn', 'splash') never keep them either. The values and gradients are the same function; the
  price is one more q k^T and softmax per block in the backward pass (at 197 tokens, 0.7 % of a ViT-B
  block's FLOPs).
  """
  scale = 1.0 / (q.shape[-1] ** 0.5)
  lengths = None
  if mask is not None and mask.ndim == 1:
    if not jnp.issubdtype(mask.dtype, jnp.integer):
      raise ValueError(f'attention: a 1-D mask must be integer key lengths (B,), got {mask.dtype}')
    lengths, mask = mask.astype(jnp.int32), None
  if implementation == 'xla':
    return (_xla_core_recomputed if recompute else _xla_core)(q, k, v, mask, lengths, is_causal, scale)
  if implementation == 'cudnn':
    if jax.default_backend() != 'gpu':
      raise ValueError(
        f"attention 'cudnn' needs an NVIDIA GPU, this process runs on {jax.default_backend()!r}; "
        "set model.image.attention / model.text.attention / model.fusion.attention to 'xla'"
      )
    if q.dtype not in _HALF_DTYPES:
      raise ValueError(
        f"attention 'cudnn' needs bfloat16 or float16 activations, got {q.dtype}; "
        "set the tower's dtype to 'bfloat16' or its attention to 'xla'"
      )
    return jax.nn.dot_product_attention(
      q,
      k,
      v,
      mask=mask,
      is_causal=is_causal,
      scale=scale,
      key_value_seq_lengths=lengths,
      implementation='cudnn',
    )
  if implementation in ('splash', 'splash_interpret'):
    if lengths is not None:
      key_valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
    else:
      key_valid = splash.key_valid_from_mask(mask, q.shape[:2])
    return splash.splash_attention(
      q,
      k,
      v,
      key_valid,
      is_causal,
      scale,
      interpret=implementation == 'splash_interpret',
    )
  raise ValueError(f'attention {implementation!r} unknown; valid values: {list(ATTENTIONS)}')


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """Row `index[b]` of each example b of (B,T,...) as (B,1,...): a gather of one row per example."""
  return jnp.take_along_axis(x, index.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)


class Attention(nn.Module):
  """Multi-head self-attention with q/k/v/out projections (all with bias).

  `values_only=True` returns `out(value(x))` without any token mixing: the
  MaskCLIP "value trick" used for zero-shot segmentation (TIPS paper).
  `attention` picks the core (ATTENTIONS); the parameters are the same for all.
  """

  num_heads: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  kernel_init: Callable = nn.initializers.xavier_uniform()
  attention: str = 'xla'
  recompute: bool = False  # the 'xla' core's probabilities recomputed in the backward (`attention_core`)

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    mask: Optional[jax.Array] = None,
    is_causal: bool = False,
    values_only: bool = False,
    query_rows: int = 0,
    query_index: Optional[jax.Array] = None,
  ) -> jax.Array:
    """(B,T,D) -> (B,T,D), or (B,query_rows,D) when `query_rows` > 0: only the first `query_rows` tokens
    ask (keys and values are every token's), for a last layer whose other outputs nobody reads; or
    (B,1,D) when `query_index` (B,) int is given: only token `query_index[b]` of example b asks. That
    token must be its example's last valid key (`mask` masks every key after it, right padding), so a
    causal mask would allow it exactly the keys `mask` allows and `is_causal` is dropped for it: the
    OpenCLIP text tower's end-of-text row (tipsito/models/text.py)."""
    d = x.shape[-1]
    if d % self.num_heads:
      raise ValueError(f'width {d} not divisible by num_heads {self.num_heads}')
    hd = d // self.num_heads

    def proj(name):
      return nn.DenseGeneral(
        features=(self.num_heads, hd),
        axis=-1,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=self.kernel_init,
        name=name,
      )

    out = nn.DenseGeneral(
      features=d,
      axis=(-2, -1),
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=self.kernel_init,
      name='out',
    )
    if query_index is not None and query_rows:
      raise ValueError('attention: give query_rows or query_index, not both')
    pick = (lambda t: take_rows(t, query_index)) if query_index is not None else (lambda t: t[:, :query_rows])
    v = proj('value')(x)
    if values_only:
      return out(pick(v) if query_rows or query_index is not None else v)
    k = proj('key')(x)
    if (query_rows or query_index is not None) and self.attention in ('splash', 'splash_interpret'):
      q = proj('query')(x)  # its kernels tile full queries: every row, then the asked ones
      return out(pick(attention_core(q, k, v, mask, is_causal, self.attention, self.recompute)))
    if query_index is not None:
      q = proj('query')(pick(x))
      return out(attention_core(q, k, v, mask, False, self.attention, self.recompute))
    if query_rows and is_causal:
      raise ValueError('attention: query_rows with is_causal would mask against the wrong positions')
    q = proj('query')(x[:, :query_rows] if query_rows else x)
    return out(attention_core(q, k, v, mask, is_causal, self.attention, self.recompute))


class ActivationDense(nn.Dense):
  """`Dense(act(h))`: the activation and the matmul that reads it, as one module with `nn.Dense`'s
  parameters (`Mlp` wraps it in `nn.remat` under the name Dense_1; see there)."""

  activation: str = 'gelu_exact'

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    return super().__call__(activation_fn(self.activation)(inputs))


# The activations whose output `Mlp` recomputes from its input in the backward pass instead of keeping it.
RECOMPUTED_ACTIVATIONS = ('gelu_exact',)


class Mlp(nn.Module):
  """Two-layer FFN (Dense_0 -> act -> Dense_1), optionally masked.

  `activation`: a name of ACTIVATIONS ('gelu' is flax's tanh approximation,
  as the official vision tower; 'relu' the official TIPS text tower; 'gelu_exact'
  OpenCLIP's nn.GELU). When `valid` is
  given, the hidden and output activations are multiplied by it, exactly as
  the official TIPS text MLP does (keeps padded positions at zero FFN output).

  With 'gelu_exact' (RECOMPUTED_ACTIVATIONS), unmasked and without dropout, the activation and Dense_1 run
  as one rematerialised `ActivationDense` (same parameters, bitwise the same values): the backward pass
  then keeps only the hidden layer's input, which the GELU's own backward needs (`gelu_exact`), and
  recomputes the activation for Dense_1's weight gradient. Why: otherwise autodiff keeps the activation's
  output too, a second hidden-layer-sized tensor per block. On the TPU compiler (float32 B/16 CLIP, 64
  images per chip, unscanned) that kept our step's peak 5 % above big_vision's, whose tanh GELU the
  compiler recomputes on its own; recomputed, 6.4 % below (docs/performance.md). The cost is one more
  forward of the activation, 0.5 % of the step's FLOPs.
  """

  mlp_dim: int
  activation: str = 'gelu'
  dropout: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, valid: Optional[jax.Array] = None, train: bool = False) -> jax.Array:
    d = x.shape[-1]
    kw = dict(
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(1e-6),
    )
    h = nn.Dense(self.mlp_dim, name='Dense_0', **kw)(x)
    if self.activation in RECOMPUTED_ACTIVATIONS and valid is None and not (train and self.dropout > 0.0):
      return nn.remat(ActivationDense)(d, activation=self.activation, name='Dense_1', **kw)(h)
    h = activation_fn(self.activation)(h)
    if valid is not None:
      h = h * valid[..., None].astype(h.dtype)
    h = nn.Dropout(self.dropout)(h, deterministic=not train)
    y = nn.Dense(d, name='Dense_1', **kw)(h)
    if valid is not None:
      y = y * valid[..., None].astype(y.dtype)
    return y


class SwiGlu(nn.Module):
  """SwiGLU FFN of ViT-g: Dense_2(silu(Dense_0 x) * Dense_1 x), all with bias.

  Hidden size (int(mlp_dim*2/3)+7)//8*8, as the official release.
  """

  mlp_dim: int
  dropout: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, valid: Optional[jax.Array] = None, train: bool = False) -> jax.Array:
    del valid
    d = x.shape[-1]
    hidden = presets.swiglu_hidden_dim(self.mlp_dim)
    dense = lambda n, name: nn.Dense(  # noqa: E731
      n,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=nn.initializers.xavier_uniform(),
      name=name,
    )
    h = nn.silu(dense(hidden, 'Dense_0')(x)) * dense(hidden, 'Dense_1')(x)
    h = nn.Dropout(self.dropout)(h, deterministic=not train)
    return dense(d, 'Dense_2')(h)


class Block(nn.Module):
  """Pre-LN transformer block: x += Attn(LN x); x += FFN(LN x).

  Positional args only (x, mask, valid, train, values_only[, query_index]) so that the block
  can be wrapped by `nn.remat` with `train`/`values_only` static.
  `mask` is a boolean attention mask broadcastable to (B, heads, T, T);
  `valid` (B,T) multiplies the FFN activations (TIPS text tower only).
  `ln_eps` is the epsilon of both LayerNorms (1e-6 TIPS, 1e-5 OpenCLIP).
  `query_rows` > 0 returns only the first `query_rows` tokens (B,query_rows,D): their queries attend to
  every token, and the other rows' queries, residuals and FFN are never computed. Why: the ITO fusion
  module reads only its CLS output, so its last block computes one row of 261 (tipsito/models/fusion.py),
  and so does the image tower's when only its CLS tokens are read (`VisionTransformer(..., cls_only=True)`).
  `query_index` (B,) int, a call argument, does the same for one row per example at its own position,
  the example's last valid token (`Attention`): the OpenCLIP text tower's end-of-text row when only the
  pooled output is read (`TextEncoder(..., pooled_only=True)`).
  """

  num_heads: int
  mlp_dim: int
  ffn: str = 'mlp'  # 'mlp' | 'swiglu'
  activation: str = 'gelu'
  ln_eps: float = LN_EPS
  mask_ffn: bool = False
  is_causal: bool = False
  dropout: float = 0.0
  drop_path: float = 0.0
  attention: str = 'xla'  # ATTENTIONS
  attention_recompute: bool = False  # `Attention.recompute` (`attention_core`)
  query_rows: int = 0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None, valid=None, train=False, values_only=False, query_index=None):
    return self._forward(self._sublayers(), x, mask, valid, train, values_only, self.drop_path, query_index)

  def _sublayers(self):
    """The block's submodules, named as in the param tree (built once per call)."""
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    if self.ffn == 'mlp':
      ffn = Mlp(self.mlp_dim, self.activation, self.dropout, name='mlp', **kw)
    elif self.ffn == 'swiglu':
      ffn = SwiGlu(self.mlp_dim, self.dropout, name='mlp', **kw)
    else:
      raise ValueError(f'Unknown ffn {self.ffn!r}')
    eps = self.ln_eps
    return (
      layer_norm('norm1', eps=eps, **kw),
      Attention(
        self.num_heads, attention=self.attention, recompute=self.attention_recompute, name='attn', **kw
      ),
      layer_norm('norm2', eps=eps, **kw),
      ffn,
    )

  def _forward(self, sublayers, x, mask, valid, train, values_only, rate, query_index=None):
    """x += Attn(LN x); x += FFN(LN x), stochastic depth `rate` on both branches; with `query_index` (B,)
    only that row of each example (its last valid token: `Attention`), (B,1,D)."""
    norm1, attn, norm2, ffn = sublayers
    x = constrain_batch(x)
    n = self.query_rows
    y = attn(norm1(x), mask, self.is_causal, values_only, n, query_index)
    if n:
      x, valid = x[:, :n], (valid[:, :n] if valid is not None else None)
    elif query_index is not None:
      x, valid = take_rows(x, query_index), (take_rows(valid, query_index) if valid is not None else None)
    x = constrain_batch(x + self._residual(y, train, rate))
    y = ffn(norm2(x), valid if self.mask_ffn else None, train)
    return constrain_batch(x + self._residual(y, train, rate))

  def _residual(self, y, train, rate):
    """Dropout and stochastic depth on a residual branch (train only).

    `rate` is a float (unrolled towers) or a traced per-layer scalar (ScanBlock);
    whether stochastic depth runs at all is decided by the static `drop_path`.
    """
    y = nn.Dropout(self.dropout)(y, deterministic=not train)
    if train and self.drop_path > 0.0:
      y = drop_path(y, rate, self.make_rng('dropout'))
    return y


class ScanBlock(Block):
  """One step of a `nn.scan` over identical blocks: (x, rate, ...) -> (x', values).

  Why a subclass: `nn.scan` needs a (carry, per-layer input) -> (carry, output)
  signature, while the params must stay exactly those of `Block` (same names,
  stacked on a leading layer axis) so that `tipsito.models.layer_stack`
  converts checkpoints both ways. `rate` is this layer's stochastic-depth rate
  (scanned over); `drop_path` must hold the largest rate so the static switch
  is on. With `with_values`, the MaskCLIP value path of this layer's input is
  returned too (the tower keeps the last one); otherwise the output is None.
  """

  @nn.compact
  def __call__(
    self,
    x,
    rate,
    mask=None,
    valid=None,
    train=False,  # pytype: disable=signature-mismatch
    with_values=False,
  ):
    sub = self._sublayers()
    values = self._forward(sub, x, mask, valid, train, True, rate) if with_values else None
    return self._forward(sub, x, mask, valid, train, False, rate), values


# Rematerialisation policies by config name (`model.image.remat_policy`,
# `model.text.remat_policy`); 'none' keeps every activation (no remat even if
# `remat=True`). See jax.checkpoint_policies for what each one saves.
REMAT_POLICIES = {
  'none': None,
  'nothing_saveable': jax.checkpoint_policies.nothing_saveable,
  'dots_saveable': jax.checkpoint_policies.dots_saveable,
  'dots_with_no_batch_dims_saveable': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  'everything_saveable': jax.checkpoint_policies.everything_saveable,
}


def recomputes_attention(asked: bool, remat: bool, policy: str) -> bool:
  """Whether a tower's blocks recompute their 'xla' attention probabilities (`attention_core`): when the
  tower asks (`attention_recompute`), unless its blocks are rematerialised, whose policy then decides what
  they keep (a recompute inside a recomputed block would compute the probabilities a third time)."""
  return bool(asked) and not (remat and REMAT_POLICIES.get(policy) is not None)


def make_block_cls(remat: bool, policy: str = 'nothing_saveable', scan: bool = False):
  """Block (or ScanBlock) class, wrapped in nn.remat with `policy` if asked.

  Rematerialisation trades compute for memory on big towers; outputs are
  bit-identical (tested). `train` and the values flag are static arguments.
  """
  if policy not in REMAT_POLICIES:
    raise ValueError(f'remat_policy {policy!r} unknown; valid values: {sorted(REMAT_POLICIES)}')
  cls = ScanBlock if scan else Block
  if not remat or policy == 'none':
    return cls
  # Argument indices count `self` as 0. Block: x=1, mask=2, valid=3, train=4,
  # values_only=5. ScanBlock: x=1, rate=2, mask=3, valid=4, train=5, values=6.
  static = (5, 6) if scan else (4, 5)
  return nn.remat(cls, static_argnums=static, prevent_cse=not scan, policy=REMAT_POLICIES[policy])


def scan_blocks(block_cls, depth: int, **block_kwargs):
  """`depth` copies of `block_cls` (a ScanBlock class) as one `nn.scan`.

  Params are stacked on a leading axis of size `depth` under one name, so XLA
  compiles the block body once instead of `depth` times (the point of scanning:
  ViT-g/14 compiles in minutes instead of tens of minutes). Each layer gets its
  own 'params' and 'dropout' RNG. Call the result as
  `(x, rates (depth,), mask, valid, train, with_values)`.
  """
  return nn.scan(
    block_cls,
    variable_axes={'params': 0},
    split_rngs={'params': True, 'dropout': True},
    in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
    length=depth,
  )(**block_kwargs)


def l2_normalize(x: jax.Array, axis: int = -1, eps: float = 1e-12) -> jax.Array:
  """x / max(||x||, sqrt(eps)): safe L2 normalisation in fp32."""
  x32 = x.astype(jnp.float32)
  n = jnp.sum(x32 * x32, axis=axis, keepdims=True)
  return (x32 * jax.lax.rsqrt(jnp.maximum(n, eps))).astype(x.dtype)
