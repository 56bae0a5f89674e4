"""Image-text and view-view contrastive losses (CLIP, SigLIP, ITO's NT-Xent fusion loss).

Why this module exists: every tipsito recipe ('clip', 'siglip', 'ito', 'tips', 'tipsv2', 'tipsito',
'distill') scores paired embeddings against the other members of the *global* batch. These are plain JAX
functions with no collectives: the training step calls them under `jax.jit` on arrays sharded over the
batch axis, and XLA inserts whatever all-gathers the matmuls need. That keeps one code path for one CPU
and for a TPU pod, and makes the losses directly comparable with the single-process reference vectors
(big_vision / open_clip / the ITO authors' spec, see tests/data/).

Conventions shared by all functions here:
- Embeddings arrive already L2-normalised and are *not* re-normalised inside, so gradients with respect
  to the embeddings are those of the loss alone (this is how the reference gradients were taken).
- `logit_scale` is the multiplier s itself (logits = s * cosine), not its logarithm. TIPS' learned
  temperature T is passed as s = 1/T.
- Computation is done in at least float32 whatever the input dtype (bf16 activations on TPU), because
  log-softmax over a large batch is precision-sensitive.
- `valid` (optional bool (B,)) marks real examples in a padded batch. Invalid examples are removed
  completely: they are neither anchors nor negatives, and averages divide by the number of valid
  examples, so the loss equals the loss of the un-padded batch. If no example is valid the loss is 0.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["clip_logits", "clip_loss", "siglip_loss", "ntxent_logits", "ntxent_loss"]

# The ITO spec excludes self-similarities with this additive value (not -inf), kept for exactness.
_SELF_MASK_VALUE = -1e9
# Logit given to padded (invalid) columns: exp() of it underflows to exactly 0 in float32.
_INVALID_VALUE = -1e30


def _f32(x):
  """Promotes to at least float32 (keeps float64 when x64 is enabled) so softmaxes are stable."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _check_pair(a, b, name_a, name_b):
  """Fails early with a readable message instead of an opaque matmul shape error."""
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"{name_a} and {name_b} must be (B, D); got {a.shape} and {b.shape}")
  if a.shape != b.shape:
    raise ValueError(f"{name_a} {a.shape} and {name_b} {b.shape} must have the same shape")


def _valid_f(valid, batch, dtype):
  """Returns the validity weights as a float (B,) vector (all ones when `valid` is None)."""
  if valid is None:
    return jnp.ones((batch,), dtype)
  valid = jnp.asarray(valid)
  if valid.shape != (batch,):
    raise ValueError(f"valid must have shape ({batch},), got {valid.shape}")
  return valid.astype(dtype)


def _reduce(per_example, w, reduction):
  """Applies `reduction` to per-example losses; 'mean' divides by the number of valid examples."""
  per_example = per_example * w
  if reduction == "none":
    return per_example
  if reduction == "sum":
    return jnp.sum(per_example)
  if reduction == "mean":
    return jnp.sum(per_example) / jnp.maximum(jnp.sum(w), 1.0)
  raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _masked_log_softmax(logits, col_valid):
  """log_softmax over the last axis with invalid columns removed (they get probability 0)."""
  # A large finite value (not -inf) keeps fully-invalid rows and their gradients NaN-free; those rows
  # are zero-weighted by the caller anyway.
  logits = jnp.where(col_valid[None, :] > 0, logits, _INVALID_VALUE)
  return jax.nn.log_softmax(logits, axis=-1)


def clip_logits(image_emb: Array, text_emb: Array, logit_scale) -> Array:
  """CLIP similarity logits, rows are images: ``logits[i, j] = s * <image_emb[i], text_emb[j]>``.

  Exposed separately so training code can log retrieval accuracy from the same matrix the loss uses.
  """
  image_emb, text_emb = _f32(image_emb), _f32(text_emb)
  _check_pair(image_emb, text_emb, "image_emb", "text_emb")
  return _f32(logit_scale) * image_emb @ text_emb.T


def clip_loss(
  image_emb: Array, text_emb: Array, logit_scale, *, reduction: str = "mean", valid: Optional[Array] = None
) -> Array:
  """Bidirectional InfoNCE (CLIP softmax loss) over the batch.

  Why: the image-text alignment term of CLIP, ITO (L_align) and TIPS/TIPSv2 (L_CLIP, once per CLS token).
  With ``z_ij = s * <x_i, y_j>`` for images x and texts y (B, D), both L2-normalised by the caller:

      l_i2t(i) = -log softmax_j(z_ij)[j=i]          (image i retrieves its text among all texts)
      l_t2i(i) = -log softmax_j(z_ji)[j=i]          (text i retrieves its image among all images)
      l(i)     = (l_i2t(i) + l_t2i(i)) / 2
      loss     = mean_i l(i)

  This equals big_vision ``bidirectional_contrastive_loss`` and open_clip ``ClipLoss``. Exactly one
  positive per row (no multi-positive variant): inputs must be (B, D).

  Args:
    image_emb: (B, D) L2-normalised image embeddings (not re-normalised here).
    text_emb: (B, D) L2-normalised text embeddings, row i pairs with image i.
    logit_scale: scalar multiplier s (not log s); TIPS passes 1/T.
    reduction: 'mean' (scalar), 'sum' (scalar) or 'none' (per-example l(i), shape (B,)).
    valid: optional bool (B,); invalid rows are dropped as anchors *and* negatives and 'mean' divides by
      the number of valid rows (per-example values of invalid rows are 0).
  Returns:
    The loss (scalar, or (B,) for reduction='none').
  """
  logits = clip_logits(image_emb, text_emb, logit_scale)
  b = logits.shape[0]
  w = _valid_f(valid, b, logits.dtype)
  diag = jnp.arange(b)
  if valid is None:
    l_i2t = -jnp.diagonal(jax.nn.log_softmax(logits, axis=1))
    l_t2i = -jnp.diagonal(jax.nn.log_softmax(logits, axis=0))
  else:
    l_i2t = -_masked_log_softmax(logits, w)[diag, diag]
    l_t2i = -_masked_log_softmax(logits.T, w)[diag, diag]
  return _reduce(0.5 * (l_i2t + l_t2i), w, reduction)


def siglip_loss(
  image_emb: Array,
  text_emb: Array,
  logit_scale,
  logit_bias,
  *,
  reduction: str = "mean",
  valid: Optional[Array] = None,
) -> Array:
  """SigLIP pairwise sigmoid loss, as big_vision computes it.

  Why: the SigLIP baseline recipe; it needs no softmax over the batch, only independent binary terms.
  With ``z_ij = t * <x_i, y_j> + b`` and labels ``y_ij = +1 if i == j else -1``:

      l(i) = -sum_j log sigmoid(y_ij * z_ij)
      loss = (1/B) * sum_i l(i)          (= sum over all B^2 pairs / B)

  Args:
    image_emb, text_emb: (B, D) L2-normalised embeddings, row i of each is a positive pair.
    logit_scale: scalar t (not log t); SigLIP initialises it at 10.
    logit_bias: scalar b; SigLIP initialises it at -10.
    reduction: 'mean' (the formula above), 'sum' (sum over pairs) or 'none' ((B,) image-anchored l(i)).
    valid: optional bool (B,); pairs with an invalid image or text are dropped and 'mean' divides by
      the number of valid images.
  """
  z = clip_logits(image_emb, text_emb, logit_scale) + _f32(logit_bias)
  b = z.shape[0]
  w = _valid_f(valid, b, z.dtype)
  labels = 2.0 * jnp.eye(b, dtype=z.dtype) - 1.0
  pair_nll = -jax.nn.log_sigmoid(labels * z)
  if valid is not None:
    pair_nll = pair_nll * w[None, :]
  return _reduce(jnp.sum(pair_nll, axis=1), w, reduction)


def ntxent_logits(z1: Array, z2: Array, logit_scale) -> tuple[Array, Array]:
  """The two (B, 2B) logit matrices of ITO's fusion NT-Xent loss (see `ntxent_loss`).

  ``logits1[i] = [s*<z1_i, z2_j> for all j] ++ [s*<z1_i, z1_j> for all j, j == i set to -1e9]`` and
  symmetrically ``logits2`` with the roles of z1 and z2 exchanged. The target of row i is column i.
  """
  z1, z2 = _f32(z1), _f32(z2)
  _check_pair(z1, z2, "z1", "z2")
  s = _f32(logit_scale)
  b = z1.shape[0]
  self_mask = jnp.eye(b, dtype=bool)
  cross = s * z1 @ z2.T
  same1 = jnp.where(self_mask, _SELF_MASK_VALUE, s * z1 @ z1.T)
  same2 = jnp.where(self_mask, _SELF_MASK_VALUE, s * z2 @ z2.T)
  logits1 = jnp.concatenate([cross, same1], axis=1)
  logits2 = jnp.concatenate([cross.T, same2], axis=1)
  return logits1, logits2


def ntxent_loss(
  z1: Array, z2: Array, logit_scale, *, reduction: str = "mean", valid: Optional[Array] = None
) -> Array:
  """ITO fusion loss: symmetric NT-Xent between two views' fused embeddings (ITO paper, L_fusion).

  Why: ITO's L_fusion makes the fused (image view + caption) embedding of view 1 identify the one of
  view 2 among every other fused embedding of the global batch, both views' negatives included.
  With z1, z2 (B, D) L2-normalised (row i of each is a positive pair) and s the CLIP scale:

      logits1_i = [s z1_i.z2_j]_{j=1..B} ++ [s z1_i.z1_j]_{j=1..B}, with j = i set to -1e9
      logits2_i = [s z2_i.z1_j]_{j=1..B} ++ [s z2_i.z2_j]_{j=1..B}, with j = i set to -1e9
      l1(i) = -log softmax(logits1_i)[i],   l2(i) = -log softmax(logits2_i)[i]
      loss  = (mean_i l1(i) + mean_i l2(i)) / 2

  (the lambda weight of ITO is applied by the caller).

  Args:
    z1, z2: (B, D) L2-normalised fused embeddings (not re-normalised here).
    logit_scale: scalar multiplier s (shared with the CLIP term in ITO).
    reduction: 'mean', 'sum' or 'none' (per-example (l1(i) + l2(i)) / 2, shape (B,)).
    valid: optional bool (B,); invalid rows are dropped as anchors and from both negative blocks.
  """
  logits1, logits2 = ntxent_logits(z1, z2, logit_scale)
  b = logits1.shape[0]
  w = _valid_f(valid, b, logits1.dtype)
  diag = jnp.arange(b)
  if valid is None:
    lsm1 = jax.nn.log_softmax(logits1, axis=1)
    lsm2 = jax.nn.log_softmax(logits2, axis=1)
  else:
    cols = jnp.concatenate([w, w])
    lsm1 = _masked_log_softmax(logits1, cols)
    lsm2 = _masked_log_softmax(logits2, cols)
  per_example = -0.5 * (lsm1[diag, diag] + lsm2[diag, diag])
  return _reduce(per_example, w, reduction)
