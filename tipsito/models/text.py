"""Text encoders: the official TIPS tower and OpenCLIP's text tower (CLIP/SigLIP/ITO).

Why two flavours in one module: TIPS recipes must reproduce the released
TIPS text tower bit-for-bit in semantics (sqrt(D)-scaled embedding, fixed
sinusoidal positions, key-padding mask, ReLU MLP multiplied by the valid mask,
final LN eps 1e-6, masked mean), while CLIP/SigLIP/ITO use OpenCLIP's
`TextTransformer` so that their weights map one-to-one onto OpenCLIP and
Hugging Face `CLIPTextModel` (tests/test_models_openclip.py): token embedding +
learned positions, causal mask, exact-erf GELU, LayerNorm eps 1e-5, `ln_final`
(here `norm`), pooled at the end-of-text token, `text_projection` (here `proj`)
without bias. Both share the pre-LN Block of layers.py.

Input convention (contract): int32 ids (B,L), pad id 0, valid = ids != 0. For
the 'clip' flavour the tokenizer (tipsito/data/tokenizer.py, flavour 'clip')
writes [SOT, pieces..., EOT] and keeps EOT under truncation, so the last valid
token is the EOT; EOT is also the largest id, so this is the position OpenCLIP
pools (`text.argmax(-1)`) and Hugging Face pools (first `eos_token_id`).
Padding keys are masked too; that changes nothing at the valid positions,
which see only earlier (valid) tokens through the causal mask.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tipsito.choices import FLAVOURS
from tipsito.models import layers


Dtype = Any


def sinusoidal_posemb(length: int, dim: int) -> np.ndarray:
  """Fixed [sin | cos] position embedding of the official TIPS text tower.

  Timescales from 1 to 1e4 with log increment ln(1e4)/max(dim/2 - 1, 1);
  odd widths get one zero column. Computed in numpy (static at trace time).
  """
  n = dim // 2
  inc = math.log(1e4) / max(n - 1, 1)
  inv = np.exp(np.arange(n, dtype=np.float32) * -np.float32(inc))
  t = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
  sig = np.concatenate([np.sin(t), np.cos(t)], axis=1)
  if dim % 2:
    sig = np.pad(sig, ((0, 0), (0, 1)))
  return sig.astype(np.float32)


def last_valid(valid: jax.Array) -> jax.Array:
  """(B,) the position of each example's last valid token (right padding), 0 for an empty one: the EOT
  of the 'clip' tokenizer, where OpenCLIP pools."""
  return jnp.maximum(jnp.sum(valid, axis=1, dtype=jnp.int32) - 1, 0)


class TextEncoder(nn.Module):
  """Transformer text tower ('tips' or 'clip' flavour).

  Param tree: token_emb/embedding (V,D), [posemb (max_len,D) for 'clip'],
  block_{i}/..., norm, [proj/kernel (D,out_dim) when out_dim]. With `scan=True`
  the blocks' params live under `blocks/...` with a leading depth axis.
  `activation` / `ln_eps` None mean the flavour's own: 'relu' / 1e-6 (TIPS),
  'gelu_exact' / 1e-5 (OpenCLIP's nn.GELU and PyTorch LayerNorm).
  """

  flavour: str = 'tips'  # 'tips' | 'clip'
  activation: Optional[str] = None  # MLP activation (layers.ACTIVATIONS); None = the flavour's
  ln_eps: Optional[float] = None  # every LayerNorm; None = the flavour's
  vocab_size: int = 32000
  max_len: int = 64
  width: int = 768
  depth: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  out_dim: Optional[int] = None
  dropout: float = 0.0
  remat: bool = False
  remat_policy: str = 'nothing_saveable'  # layers.REMAT_POLICIES
  scan: bool = False  # blocks as one nn.scan, params stacked under 'blocks'
  attention: str = 'xla'  # attention core: layers.ATTENTIONS
  attention_recompute: bool = True  # the 'xla' core recomputes its probabilities (layers.attention_core)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  # ~60 lines on purpose: one @nn.compact forward in the official text tower's order, so the parameter
  # names stay those the TIPS importer and the conformance tests address.
  @nn.compact
  def __call__(
    self, ids: jax.Array, *, train: bool = False, pooled_only: bool = False
  ) -> dict[str, jax.Array]:
    """Encodes (B,L) token ids.

    Returns {'pooled': (B,D_out), 'tokens': (B,L,width) after final LN,
    'valid': (B,L) bool}. 'pooled' is the masked mean (tips) or the last
    valid token, the EOT of the 'clip' tokenizer (clip), then the optional
    projection. `pooled_only`: no 'tokens', and for 'clip' the last block computes only the EOT row
    (`layers.Block` with `query_index`): a step whose loss terms read only the pooled caption (every
    recipe but ITO's fusion) otherwise pays the last block's other rows, about a twelfth of the tower's
    FLOPs, for outputs nobody reads. The pooled values are the same up to float rounding
    (tests/test_models_modules.py). With `scan`, or for 'tips' (its masked mean reads every row), every
    row is computed.
    """
    if self.flavour not in FLAVOURS:
      raise ValueError(f'Unknown text flavour {self.flavour!r}')
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    ids = jnp.asarray(ids).astype(jnp.int32)
    b, length = ids.shape
    valid = ids != 0
    emb = nn.Embed(
      self.vocab_size,
      self.width,
      embedding_init=nn.initializers.normal(1.0 if self.flavour == 'tips' else 0.02),
      name='token_emb',
      **kw,
    )
    x = emb(ids)
    if self.flavour == 'tips':
      x = x * jnp.asarray(math.sqrt(self.width), x.dtype)
      x = x + jnp.asarray(sinusoidal_posemb(length, self.width), x.dtype)
      is_causal, activation, mask_ffn, eps = False, 'relu', True, layers.LN_EPS
    else:
      if length > self.max_len:
        raise ValueError(f'sequence length {length} > max_len {self.max_len}')
      pos = self.param('posemb', nn.initializers.normal(0.01), (self.max_len, self.width), self.param_dtype)
      x = x + pos[:length].astype(x.dtype)
      is_causal, activation, mask_ffn, eps = True, 'gelu_exact', False, layers.OPENCLIP_LN_EPS
    activation = self.activation if self.activation is not None else activation
    eps = float(self.ln_eps) if self.ln_eps is not None else eps
    x = nn.Dropout(self.dropout)(x, deterministic=not train)

    eot_only = pooled_only and is_causal and not self.scan
    attn_mask = layers.key_padding(valid, self.attention)  # keys only: (B,1,1,L) or lengths (B,)
    block_kw = dict(
      num_heads=self.num_heads,
      mlp_dim=self.mlp_dim,
      ffn='mlp',
      activation=activation,
      ln_eps=eps,
      mask_ffn=mask_ffn,
      is_causal=is_causal,
      dropout=self.dropout,
      attention=self.attention,
      attention_recompute=layers.recomputes_attention(
        self.attention_recompute, self.remat, self.remat_policy
      ),
      **kw,
    )
    if self.scan:
      stack = layers.scan_blocks(
        layers.make_block_cls(self.remat, self.remat_policy, scan=True), self.depth, name='blocks', **block_kw
      )
      x, _ = stack(x, jnp.zeros((self.depth,), jnp.float32), attn_mask, valid, train, False)
    else:
      block_cls = layers.make_block_cls(self.remat, self.remat_policy)
      for i in range(self.depth):
        # The EOT row alone in the last block (`pooled_only`): its causal keys are the valid ones.
        eot = last_valid(valid) if eot_only and i == self.depth - 1 else None
        x = block_cls(name=f'block_{i}', **block_kw)(x, attn_mask, valid, train, False, eot)
    x = layers.layer_norm('norm', eps=eps, **kw)(x)

    if self.flavour == 'tips':
      v = valid[..., None].astype(jnp.float32)
      pooled = (jnp.sum(x.astype(jnp.float32) * v, axis=1) / (jnp.sum(v, axis=1) + 1e-8)).astype(x.dtype)
    elif eot_only:  # the last block computed the EOT row alone
      pooled = x[:, 0]
    else:
      pooled = layers.take_rows(x, last_valid(valid))[:, 0]
    if self.out_dim is not None:
      pooled = nn.Dense(
        self.out_dim, use_bias=False, name='proj', kernel_init=nn.initializers.normal(self.width**-0.5), **kw
      )(pooled)
    if pooled_only:
      return {'pooled': pooled, 'valid': valid}
    return {'pooled': pooled, 'tokens': x, 'valid': valid}
