"""Image encoder: the pre-LN ViT of the official TIPS release, or OpenCLIP's ViT.

Why one module for both: released TIPS/TIPSv2 weights must load and reproduce official outputs
(tests/test_models_conformance.py), and CLIP/SigLIP/ITO towers must map one-to-one onto OpenCLIP's
ViT (and Hugging Face `CLIPVisionModel`) so that exported weights run there
(tests/test_models_openclip.py). The two differ only in a few switches; the blocks are shared.

TIPS semantics (the field defaults; conformance matters):
  * inputs not a multiple of the patch size are centre zero-padded;
  * patch embedding with bias; learned posemb on a fixed grid (32x32), resized with
    `jax.image.resize(..., 'bilinear')` (antialiased) to the actual grid, and added to the patch
    tokens *before* the CLS tokens are prepended (CLS tokens get no position);
  * no LayerNorm before the blocks; tanh GELU; LayerNorm eps 1e-6;
  * token order [cls_0 .. cls_{n-1}, patches row-major];
  * the MaskCLIP value trick reuses the last block's parameters.
OpenCLIP semantics (`patch_bias=False, cls_posemb=True, pre_norm=True, activation='gelu_exact',
ln_eps=1e-5`, set by tipsito/config/defaults.py for the CLIP-style recipes), as OpenCLIP's
`VisionTransformer.forward`: conv1 without bias; class embedding prepended; one position table with
a row per CLS token followed by the grid rows (`positional_embedding`, (1 + G*G, D)) added to every
token; `ln_pre`; the blocks; `ln_post` (here `norm`) on every token, the CLS token being the pooled
output that `image_proj` projects.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from tipsito.models import layers

Dtype = Any


def center_pad(x: jax.Array, patch_size: int) -> jax.Array:
  """Zero-pads (B,H,W,C) so H and W are multiples of the patch, centred.

  Same split as the official `maybe_center_pad`: top = pad // 2, bottom = the
  rest (likewise left/right), so 200x300 at patch 14 -> 210x308 (5/5, 4/4).
  """
  h, w = x.shape[1:3]
  ph = (-h) % patch_size
  pw = (-w) % patch_size
  if ph == 0 and pw == 0:
    return x
  return jnp.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))


def resize_posemb(posemb: jax.Array, grid: tuple[int, int]) -> jax.Array:
  """Bilinear (antialiased, jax.image.resize default) resize of (1,gh,gw,D).

  Antialiasing matters when downsampling 32x32 -> 16x16 (0.117 max abs
  difference on the conformance model without it), so this is the exact
  official call.
  """
  if posemb.shape[1:3] == tuple(grid):
    return posemb
  return jax.image.resize(posemb, (1, grid[0], grid[1], posemb.shape[-1]), method='bilinear')


class VisionTransformer(nn.Module):
  """Pre-LN ViT returning CLS tokens, patch tokens and (optionally) values.

  Param tree: patch_embed/{kernel[,bias]}, posemb (1,G,G,D) or, with `cls_posemb`,
  (n + G*G, D) (rows: the n CLS tokens, then the grid row-major), cls (1,n,D),
  [mask_token (D,)], [norm_pre], block_{i}/{norm1,attn/{query,key,value,out},norm2,mlp},
  norm. `mask_token` only exists when `use_mask_token` (training only).
  With `scan=True` the blocks are one `nn.scan` and their params live under
  `blocks/...` with a leading depth axis (tipsito.models.layer_stack converts;
  exports and the TIPS import stay per-layer).
  """

  patch_size: int = 14
  width: int = 768
  depth: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  ffn: str = 'mlp'  # 'mlp' | 'swiglu'
  activation: str = 'gelu'  # of the 'mlp' FFN: layers.ACTIVATIONS ('gelu' = tanh, TIPS)
  ln_eps: float = layers.LN_EPS  # every LayerNorm (1e-6 TIPS, 1e-5 OpenCLIP)
  patch_bias: bool = True  # patch embedding bias (TIPS); OpenCLIP's conv1 has none
  cls_posemb: bool = False  # position rows for the CLS tokens too (OpenCLIP), one (n+G*G, D) table
  pre_norm: bool = False  # LayerNorm `norm_pre` before the blocks (OpenCLIP ln_pre)
  num_cls_tokens: int = 1
  posemb_grid: Union[int, Sequence[int]] = 32
  use_mask_token: bool = False
  dropout: float = 0.0
  stochastic_depth: float = 0.0
  remat: bool = False
  remat_policy: str = 'nothing_saveable'  # layers.REMAT_POLICIES
  scan: bool = False  # blocks as one nn.scan, params stacked under 'blocks'
  attention: str = 'xla'  # attention core: layers.ATTENTIONS
  attention_recompute: bool = True  # the 'xla' core recomputes its probabilities (layers.attention_core)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  pixel_mean: Sequence[float] = (0.0, 0.0, 0.0)
  pixel_std: Sequence[float] = (1.0, 1.0, 1.0)

  def _grid(self) -> tuple[int, int]:
    """The stored posemb grid as (gh, gw)."""
    g = self.posemb_grid
    return (g, g) if isinstance(g, int) else (int(g[0]), int(g[1]))

  def preprocess(self, images: jax.Array) -> jax.Array:
    """uint8 -> /255, then (x - mean)/std, then centre zero-pad; float32.

    Normalisation lives in the model so that the data pipeline can ship cheap
    uint8 batches and exported encoders carry their own pixel statistics.
    Padding is applied after normalisation, i.e. in model-input space, which
    is what the official release does (it pads its [0,1] model inputs).
    """
    x = images
    if x.dtype == jnp.uint8:
      x = x.astype(jnp.float32) / 255.0
    else:
      x = x.astype(jnp.float32)
    mean = tuple(float(m) for m in self.pixel_mean)
    std = tuple(float(s) for s in self.pixel_std)
    if mean != (0.0, 0.0, 0.0) or std != (1.0, 1.0, 1.0):
      x = (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)
    return center_pad(x, self.patch_size)

  # Longer than ~60 lines on purpose: one @nn.compact forward in the official tower's order (patchify,
  # CLS/register tokens, mask token, position embedding, blocks, norm); splitting it would split the
  # parameter scope the TIPS importer and the conformance tests address by name.
  @nn.compact
  def __call__(
    self,
    images: jax.Array,
    *,
    mask: Optional[jax.Array] = None,
    train: bool = False,
    return_values: bool = False,
    return_blocks: Sequence[int] = (),
    cls_only: bool = False,
  ) -> dict[str, jax.Array]:
    """Encodes (B,H,W,3) images.

    Args:
      images: uint8 in [0,255] or float in [0,1], any H, W.
      mask: optional bool (B,gh,gw); True patches are replaced by the mask
        token before the posemb is added (iBOT student view).
      train: enables dropout / stochastic depth ('dropout' rng stream).
      return_values: also return the MaskCLIP value-trick patch embeddings.
      return_blocks: also return the token sequences after these blocks, counted as Hugging Face's
        backbones count stages (0 = the embeddings before the first block, k = after block k, so
        `depth` is the last), each after the final LayerNorm (transformers' `apply_layernorm`): the
        inputs of a DPT decoder (tipsito/models/dpt.py). The other outputs are unchanged.
      cls_only: return only 'cls', and let the last block compute only the CLS rows (their queries
        attend to every token; `layers.Block.query_rows`). Why: a step whose loss terms read only the
        CLS tokens (CLIP, SigLIP, DINO's local crops) otherwise pays the last block's patch rows, about
        a twelfth of a ViT-B's FLOPs, for outputs nobody reads; the CLS values are the same up to float
        rounding (tests/test_models_modules.py). With `scan` the blocks are one scanned body and every
        row is computed; with dropout the CLS rows draw other (equally distributed) dropout masks.
    Returns:
      {'cls': (B,n_cls,D), 'patches': (B,gh,gw,D)[, 'values': (B,gh,gw,D)]
      [, 'blocks': tuple of {'cls', 'patches'} in the order of `return_blocks`]} ({'cls'} alone with
      `cls_only`), all after the final LayerNorm, in `dtype`.
    """
    blocks = tuple(int(k) for k in return_blocks)
    if cls_only and (blocks or return_values):
      raise ValueError('cls_only returns the CLS tokens alone: it excludes return_blocks and return_values')
    if blocks and (self.scan or min(blocks) < 0 or max(blocks) > self.depth):
      raise ValueError(
        f'return_blocks {list(blocks)}: needs per-layer blocks (scan=False) and stages in 0..{self.depth}'
      )
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    x = self.preprocess(images).astype(self.dtype)
    x = nn.Conv(
      self.width,
      (self.patch_size, self.patch_size),
      strides=(self.patch_size, self.patch_size),
      padding='VALID',
      use_bias=self.patch_bias,
      kernel_init=nn.initializers.lecun_normal(),
      name='patch_embed',
      **kw,
    )(x)
    b, gh, gw, d = x.shape
    n = self.num_cls_tokens

    if self.use_mask_token:
      mask_token = self.param('mask_token', nn.initializers.zeros, (d,), self.param_dtype)
    if mask is not None:
      if not self.use_mask_token:
        raise ValueError('mask given but use_mask_token=False')
      if mask.shape != (b, gh, gw):
        raise ValueError(f'mask shape {mask.shape} != patch grid {(b, gh, gw)}')
      x = jnp.where(mask[..., None], mask_token.astype(x.dtype), x)

    # OpenCLIP initialises the class and position embeddings N(0, width**-0.5); TIPS zeros / 0.02.
    scale = d**-0.5
    if self.cls_posemb:
      gs = self._grid()
      posemb = self.param('posemb', nn.initializers.normal(scale), (n + gs[0] * gs[1], d), self.param_dtype)
      cls_pos = posemb[:n].astype(x.dtype)
      grid_pos = posemb[n:].reshape(1, gs[0], gs[1], d)
    else:
      grid_pos = self.param('posemb', nn.initializers.normal(0.02), (1, *self._grid(), d), self.param_dtype)
    x = x + resize_posemb(grid_pos, (gh, gw)).astype(x.dtype)
    x = x.reshape(b, gh * gw, d)

    cls = self.param(
      'cls',
      nn.initializers.normal(scale) if self.cls_posemb else nn.initializers.zeros,
      (1, n, d),
      self.param_dtype,
    )
    cls = cls.astype(x.dtype)
    if self.cls_posemb:
      cls = cls + cls_pos[None]
    x = jnp.concatenate([jnp.broadcast_to(cls, (b, n, d)), x], 1)
    if self.pre_norm:
      x = layers.layer_norm('norm_pre', eps=self.ln_eps, **kw)(x)
    x = nn.Dropout(self.dropout)(x, deterministic=not train)

    block_kw = dict(
      num_heads=self.num_heads,
      mlp_dim=self.mlp_dim,
      ffn=self.ffn,
      activation=self.activation,
      ln_eps=self.ln_eps,
      dropout=self.dropout,
      attention=self.attention,
      attention_recompute=layers.recomputes_attention(
        self.attention_recompute, self.remat, self.remat_policy
      ),
      **kw,
    )
    rates = [self.stochastic_depth * i / max(self.depth - 1, 1) for i in range(self.depth)]
    values = None
    kept = {0: x} if 0 in blocks else {}
    if self.scan:
      stack = layers.scan_blocks(
        layers.make_block_cls(self.remat, self.remat_policy, scan=True),
        self.depth,
        drop_path=self.stochastic_depth,
        name='blocks',
        **block_kw,
      )
      x, all_values = stack(x, jnp.asarray(rates, jnp.float32), None, None, train, return_values)
      if return_values:
        values = all_values[-1]
    else:
      block_cls = layers.make_block_cls(self.remat, self.remat_policy)
      for i in range(self.depth):
        rows = n if cls_only and i == self.depth - 1 else 0
        blk = block_cls(drop_path=rates[i], query_rows=rows, name=f'block_{i}', **block_kw)
        if return_values and i == self.depth - 1:
          values = blk(x, None, None, train, True)
        x = blk(x, None, None, train, False)
        if i + 1 in blocks:
          kept[i + 1] = x

    norm = layers.layer_norm('norm', eps=self.ln_eps, **kw)
    if cls_only:
      return {'cls': norm(x[:, :n])}
    split = lambda t: {'cls': t[:, :n], 'patches': t[:, n:].reshape(b, gh, gw, d)}
    out = split(norm(x))
    if blocks:
      out['blocks'] = tuple(split(norm(kept[k])) for k in blocks)
    if return_values:
      out['values'] = norm(values)[:, n:].reshape(b, gh, gw, d)
    return out
