"""ITO fusion module (ITO paper). TRAINING-ONLY: never exported.

Why it exists: ITO's fusion loss contrasts two views fused with the same
caption, which forces the image tokens to carry caption-relevant detail. The
module is thrown away after training; `tipsito.export_format.write_export`
refuses any parameter tree that contains it (allowed top-level keys are only
image/text/image_proj, and leaves under a 'fusion' path are rejected).

Computation: image tokens [CLS; patches] (after the encoder's final norm) and
text tokens are projected to `width`; image tokens get a fixed 2D sin-cos
posemb (zero at CLS), text tokens a learned 1D posemb; the sequence
[image; text] runs through a pre-LN transformer (`depth` layers, `num_heads`,
MLP `mlp_ratio`x GELU) with text padding masked as keys; final LN; the output
at position 0 (image CLS) is L2-normalised. No stop-gradient anywhere.

Only that one output is read, so the last block computes the CLS row alone
(its query attends to every token's keys and values; `Block.query_rows`): the
same function, with the other rows' queries, residuals and MLP never computed
(at B/16, 2 layers: about 40% of the module's FLOPs and one layer's
activations fewer).

`chunks` > 1 runs the module over that many groups of examples one after the other (a `scan`), each
group rematerialised (`remat_policy`): the backward pass then holds one group's activations and
attention probabilities at a time instead of the whole batch's, at the cost of one more forward of the
module. Why: the module runs once the towers have saved every activation of their forward, so its
backward transient (at B/16, the first block's attention probabilities and MLP hidden layer) sits on top
of the step's peak; a group's is 1/chunks of that. Each example's fusion is its own (the module never
mixes examples), so the function is the same; group g holds rows g, g + chunks, g + 2 chunks, ..., so
that a batch sharded in contiguous blocks over devices gives every device its share of every group (no
rows move). Parameters are those of `chunks=1` (broadcast into the scan).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tipsito.models import layers

Dtype = Any


def sincos_2d(h: int, w: int, dim: int) -> np.ndarray:
  """Fixed 2D sin-cos posemb (h*w, dim): half the channels per axis (MAE).

  Each half is [sin | cos] of the coordinate times 1/10000^(k/(dim/4)).
  Static numpy so it costs nothing at run time.
  """
  if dim % 4:
    raise ValueError(f'fusion width {dim} must be a multiple of 4')
  q = dim // 4
  omega = 1.0 / (10000.0 ** (np.arange(q, dtype=np.float64) / q))
  ys, xs = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing='ij')

  def one(c):
    t = c.reshape(-1)[:, None] * omega[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1)

  return np.concatenate([one(ys), one(xs)], axis=1).astype(np.float32)


class FusionTransformer(nn.Module):
  """Fuses image tokens with a caption into one unit vector (ITO).

  TRAINING-ONLY module: it must never appear in an exported checkpoint.
  """

  width: int = 512
  depth: int = 2
  num_heads: int = 8
  mlp_ratio: int = 4
  max_text_len: int = 64
  attention: str = 'xla'  # attention core: layers.ATTENTIONS
  attention_recompute: bool = True  # the 'xla' core recomputes its probabilities (layers.attention_core)
  remat: bool = False  # rematerialise each block with remat_policy (gradients bitwise unchanged)
  remat_policy: str = 'nothing_saveable'  # layers.REMAT_POLICIES
  chunks: int = 1  # groups of examples run one after the other, each rematerialised (module docstring)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(
    self, image_cls: jax.Array, image_patches: jax.Array, text_tokens: jax.Array, text_valid: jax.Array
  ) -> jax.Array:
    """(B,D_i), (B,h,w,D_i), (B,L,D_t), (B,L) bool -> (B,width) unit norm."""
    inputs = (image_cls, image_patches, text_tokens, text_valid)
    k, b = self.chunks, image_cls.shape[0]
    if k == 1 or self.is_initializing():  # the same parameters either way; init may see a 1-example batch
      return self.fuse(*inputs)
    if k < 1 or b % k:
      raise ValueError(
        f'model.fusion.chunks={k} must divide the {b} examples the fusion module reads per step '
        '(per microbatch, every view it fuses); pick a divisor or chunks=1'
      )
    policy = layers.REMAT_POLICIES[self.remat_policy]
    groups = [x.reshape(b // k, k, *x.shape[1:]).swapaxes(0, 1) for x in inputs]  # group g: rows g::k

    def one_group(module, carry, group):
      return carry, module.fuse(*group)

    body = one_group if policy is None else nn.remat(one_group, policy=policy, prevent_cse=False)  # 'none'
    scan = nn.scan(
      body,
      variable_broadcast='params',
      split_rngs={'params': False},
      length=k,
    )
    _, out = scan(self, None, groups)  # (k, B/k, width)
    return out.swapaxes(0, 1).reshape(b, out.shape[-1])

  def fuse(
    self, image_cls: jax.Array, image_patches: jax.Array, text_tokens: jax.Array, text_valid: jax.Array
  ) -> jax.Array:
    """The module on one group of examples (all of them when `chunks` is 1)."""
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    b, h, w, di = image_patches.shape
    length = text_tokens.shape[1]
    if length > self.max_text_len:
      raise ValueError(f'text length {length} > max_text_len {self.max_text_len}')
    img = jnp.concatenate(
      [image_cls[:, None, :].astype(self.dtype), image_patches.reshape(b, h * w, di).astype(self.dtype)],
      axis=1,
    )
    img = nn.Dense(self.width, name='image_proj', **kw)(img)
    pos = np.concatenate([np.zeros((1, self.width), np.float32), sincos_2d(h, w, self.width)], axis=0)
    img = img + jnp.asarray(pos, img.dtype)[None]

    txt = nn.Dense(self.width, name='text_proj', **kw)(text_tokens.astype(self.dtype))
    tpos = self.param(
      'text_posemb', nn.initializers.normal(0.02), (self.max_text_len, self.width), self.param_dtype
    )
    txt = txt + tpos[:length].astype(txt.dtype)

    x = jnp.concatenate([img, txt], axis=1)
    key_valid = jnp.concatenate([jnp.ones((b, 1 + h * w), bool), text_valid.astype(bool)], axis=1)
    mask = layers.key_padding(key_valid, self.attention)  # [image; text]: right padding
    block_cls = layers.make_block_cls(self.remat, self.remat_policy)
    # Groups (`chunks` > 1) are rematerialised as a whole, as blocks are with `remat`.
    recompute = layers.recomputes_attention(
      self.attention_recompute, self.remat or self.chunks > 1, self.remat_policy
    )
    for i in range(self.depth):
      x = block_cls(
        num_heads=self.num_heads,
        mlp_dim=self.mlp_ratio * self.width,
        ffn='mlp',
        activation='gelu',
        attention=self.attention,
        attention_recompute=recompute,
        query_rows=1 if i == self.depth - 1 else 0,  # only the CLS output is read
        name=f'block_{i}',
        **kw,
      )(x, mask, None, False, False)  # positional: nn.remat marks train and values_only static
    x = layers.layer_norm('norm', **kw)(x)
    return layers.l2_normalize(x[:, 0].astype(jnp.float32))
