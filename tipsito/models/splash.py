"""The Pallas TPU splash-attention kernel behind the towers' `attention: 'splash'` (tipsito/models/layers.py).

Why a module of its own: the kernel (jax.experimental.pallas.ops.tpu.splash_attention) wants a layout and
mask vocabulary different from `jax.nn.dot_product_attention`: heads-first (H,T,d) per example, sequence
lengths that are multiples of its 128-wide blocks, a static mask (full or causal) and per-token segment
ids instead of a boolean array. This module translates the towers' (B,T,H,d) q/k/v and boolean key mask
into that vocabulary and back, so that the result equals the 'xla' core (tests/test_models_attention.py,
in Pallas interpret mode on CPU).

Padding: T is padded up to a multiple of 128 (197 -> 256, 1,025 -> 1,152, 64 -> 128); padded keys get
segment id 0, real keys 1 where valid and 0 where masked, every query 1, so a query sees exactly the
valid keys. Padded query rows are cut off. Splash never materialises the (T,T) logits, which is what it
saves over 'xla' (python -m tipsito.plan --attention xla splash reports the difference per config).

One difference from 'xla': a row whose keys are all masked (an all-padding caption, which the 'clip'
tokenizer never writes: it always has SOT and EOT) would be an undefined softmax in the kernel; it attends
to all its real keys here, where 'xla' averages the values uniformly.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tipsito.models.activation_sharding import BATCH_AXES

LANES = 128  # the kernel's block sizes must be multiples of this (splash_attention_kernel.NUM_LANES)
_BLOCKS = (512, 256, 128)  # the largest that divides the padded length is used


def key_valid_from_mask(mask: Optional[jax.Array], batch_and_len: tuple) -> Optional[jax.Array]:
  """(B,T) key validity from the towers' (B,1,1,T) boolean key mask (None: no mask)."""
  if mask is None:
    return None
  b, t = batch_and_len
  if mask.ndim != 4 or mask.shape[1:3] != (1, 1) or mask.shape[-1] != t:
    raise ValueError(
      f"attention 'splash' takes a key mask of shape (B,1,1,{t}), got {mask.shape}; use attention 'xla' "
      'for other masks'
    )
  return jnp.broadcast_to(mask[:, 0, 0, :], (b, t)).astype(bool)


def block_size(padded_len: int) -> int:
  """The largest of 512/256/128 that divides `padded_len` (a multiple of 128)."""
  return next(s for s in _BLOCKS if padded_len % s == 0)


def splash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  key_valid: Optional[jax.Array],
  is_causal: bool,
  scale: float,
  *,
  interpret: bool = False,
) -> jax.Array:
  """softmax(scale q k^T, masked) v with the splash kernel; (B,T,H,d) in and out, like the 'xla' core.

  `key_valid` (B,T) bool or None; `is_causal` adds the causal mask (the 'clip' text tower). `interpret`
  runs the kernel in Pallas interpret mode (any backend, slow: for tests).
  """
  b, t, _, _ = q.shape
  valid = jnp.ones((b, t), bool) if key_valid is None else key_valid
  # A row with no valid key attends to all its real keys (see the module docstring).
  valid = jnp.where(jnp.any(valid, axis=1, keepdims=True), valid, True)
  q = q * jnp.asarray(scale, q.dtype)
  local = functools.partial(_local_splash, is_causal=is_causal, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(q, k, v, valid)
  # Inside a sharded train step the kernel runs per device (a Mosaic kernel is not partitioned by GSPMD):
  # the batch split over the batch axes, the heads over 'model', as the einsum core would be.
  split = [a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1]
  batch = tuple(split) if split and b % math.prod(mesh.shape[a] for a in split) == 0 else None
  model = mesh.shape.get('model', 1)
  heads = 'model' if model > 1 and q.shape[2] % model == 0 else None
  spec = P(batch, None, heads, None)
  return jax.shard_map(
    local, mesh=mesh, in_specs=(spec, spec, spec, P(batch, None)), out_specs=spec, check_vma=False
  )(q, k, v, valid)


def _local_splash(q, k, v, valid, *, is_causal: bool, interpret: bool):
  """The kernel on (B,T,H,d) q (already scaled), k, v and (B,T) key validity on one device."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

  b, t, h, _ = q.shape
  padded = -(-t // LANES) * LANES
  pad = padded - t
  segment_kv = jnp.pad(valid, ((0, 0), (0, pad))).astype(jnp.int32)
  segments = kernel_lib.SegmentIds(q=jnp.ones((b, padded), jnp.int32), kv=segment_kv)

  def heads_first(x):
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

  static_mask = (mask_lib.CausalMask if is_causal else mask_lib.FullMask)((padded, padded))
  blk = block_size(padded)
  sizes = kernel_lib.BlockSizes(
    block_q=blk,
    block_kv=blk,
    block_kv_compute=blk,
    block_q_dkv=blk,
    block_kv_dkv=blk,
    block_kv_dkv_compute=blk,
    use_fused_bwd_kernel=True,
  )
  kernel = kernel_lib.make_splash_mha(
    mask_lib.MultiHeadMask([static_mask] * h),
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )
  y = jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v), segment_ids=segments)
  return y.transpose(0, 2, 1, 3)[:, :t]
