"""DINO: self-distillation of the CLS token (DINO; dinov2/loss/dino_clstoken_loss.py; TIPSv2 §3 Eq. 1).

Why: the image-level self-distillation term of TIPSv2 / tipsito. The teacher targets come from
tipsito/losses/teacher_targets.py (centering or Sinkhorn-Knopp); this module holds the cross-entropy
over (student crop, teacher crop) pairs and the centre's EMA. Conventions (float32, stop-gradient on the
teacher side, `valid` for padded batches, crop axis first): teacher_targets.py's docstring.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from tipsito.losses.teacher_targets import as_f32, batch_weights, flat_center, teacher_probs, teacher_side

Array = jax.Array

_HIGHEST = jax.lax.Precision.HIGHEST


def _as_crops(x, name):
  """Accepts (crops, B, K) or a single crop (B, K)."""
  x = jnp.asarray(x)
  if x.ndim == 2:
    x = x[None]
  if x.ndim != 3:
    raise ValueError(f"{name} must be (crops, B, K) or (B, K); got {x.shape}")
  return x


def dino_loss_from_probs(
  student_logits: Array,
  teacher_probs: Array,
  student_temp,
  reduction: str = "mean",
  *,
  skip_same_view: bool = False,
  valid: Optional[Array] = None,
) -> Array:
  """DINO cross-entropy between given teacher probabilities and student logits.

  Why: separates the loss from how the teacher targets were made (centering, Sinkhorn, or a frozen
  distillation teacher). With student logits s (S, B, K) and teacher probabilities p (T, B, K):

      CE(s, t) = -(1/B) * sum_b sum_k p[t, b, k] * log_softmax(s[s, b] / tau_s)[k]
      'sum'  : L = sum_{(s, t) in P} CE(s, t)                 (dinov2 DINOLoss.forward; TIPSv2 Eq. 1)
      'mean' : L = (1/|P|) * sum_{(s, t) in P} CE(s, t)       (dinov2 ssl_meta_arch; our default)

  With one teacher crop and M student crops, 'sum' = M * 'mean'. TIPSv2 Eq. 1 writes the loss as a sum
  over the M local crops; dinov2's meta-arch divides that sum by the number of loss terms (M with one
  global crop), i.e. takes the mean. `config.loss_opts.dino_reduction` chooses (default 'mean'; why:
  `dino_term` in tipsito/objective/terms.py).

  P is every (student crop, teacher crop) pair, or, with skip_same_view, every pair except
  (i, i) for i < min(S, T): the student's first T crops are then the teacher's views in the same order
  and a crop is never its own target (original DINO with global crops on both sides). With S = T = 2
  and skip_same_view, 'mean' equals dinov2's "global crops swapped" loss.

  Args:
    student_logits: (S, B, K) student head outputs, or (B, K) for a single crop.
    teacher_probs: (T, B, K) targets (or (B, K)); wrapped in stop_gradient.
    student_temp: tau_s (0.1).
    reduction: 'mean' or 'sum' over pairs (the batch is always averaged).
    skip_same_view: exclude the pairs (i, i).
    valid: optional bool (B,); the batch average runs over valid images only.
  """
  s = _as_crops(as_f32(student_logits), "student_logits")
  p = _as_crops(teacher_side(teacher_probs), "teacher_probs")
  if s.shape[1:] != p.shape[1:]:
    raise ValueError(f"student {s.shape} and teacher {p.shape} must agree on (B, K)")
  n_s, b, _ = s.shape
  n_t = p.shape[0]
  lsm = jax.nn.log_softmax(s / student_temp, axis=-1)
  ce = -jnp.einsum("tbk,sbk->stb", p, lsm, precision=_HIGHEST)  # (S, T, B)
  w = batch_weights(valid, b, ce.dtype)
  per_pair = jnp.sum(ce * w, axis=-1) / jnp.maximum(jnp.sum(w), 1.0)  # (S, T)
  pair_w = jnp.ones((n_s, n_t), ce.dtype)
  if skip_same_view:
    m = min(n_s, n_t)
    pair_w = pair_w.at[jnp.arange(m), jnp.arange(m)].set(0.0)
  n_pairs = n_s * n_t - (min(n_s, n_t) if skip_same_view else 0)
  if n_pairs == 0:
    raise ValueError("no (student, teacher) pair left: S = T = 1 with skip_same_view")
  total = jnp.sum(per_pair * pair_w)
  if reduction == "sum":
    return total
  if reduction == "mean":
    return total / n_pairs
  raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def dino_loss(
  student_logits: Array,
  teacher_logits: Array,
  center: Optional[Array],
  student_temp,
  teacher_temp,
  *,
  method: str = "centering",
  reduction: str = "mean",
  skip_same_view: bool = False,
  n_iters: int = 3,
  valid: Optional[Array] = None,
) -> Array:
  """DINO loss on CLS-token head outputs (DINO paper; TIPSv2 §3).

  Why: the image-level self-distillation term of TIPSv2/tipsito. Teacher targets

      p = softmax((t - c) / tau_t)                         method='centering'
      p = sinkhorn_knopp(t, tau_t, n_iters)                method='sinkhorn' (c unused)

  and then the cross-entropy of `dino_loss_from_probs`:

      CE(s, t) = -(1/B) sum_b sum_k p[t, b, k] log_softmax(s[s, b] / tau_s)[k]
      'mean': average of CE over (student crop, teacher crop) pairs; 'sum': their sum (dinov2).

  dinov2's meta-arch terms in this notation (S_l local crops, 2 global crops, n = 2 + 2 S_l terms):
  local = dino_loss(local, teacher, reduction='sum') / n;
  global = 2 * dino_loss(global, teacher, skip_same_view=True) / n.

  Args:
    student_logits: (S, B, K) student head outputs (crop axis first) or (B, K).
    teacher_logits: (T, B, K) teacher head outputs or (B, K); receives no gradient.
    center: running centre with K entries (ignored for 'sinkhorn'); receives no gradient.
    student_temp, teacher_temp: tau_s and tau_t.
    method: 'centering' or 'sinkhorn' (static).
    reduction: 'mean' or 'sum' over crop pairs (static).
    skip_same_view: see `dino_loss_from_probs`.
    n_iters: Sinkhorn iterations.
    valid: optional bool (B,) for padded batches (also excluded from the Sinkhorn normalisation).
  """
  probs = teacher_probs(teacher_logits, center, teacher_temp, method=method, n_iters=n_iters, valid=valid)
  return dino_loss_from_probs(
    student_logits, probs, student_temp, reduction, skip_same_view=skip_same_view, valid=valid
  )


def update_center(center: Array, teacher_logits: Array, momentum, *, valid: Optional[Array] = None) -> Array:
  """EMA of the teacher *logits*: ``c <- m * c + (1 - m) * mean(t)`` (mean over all leading axes).

  Why: the DINO centre tracks the batch mean of the teacher head outputs (not of the probabilities),
  over the global batch and every teacher crop. Returns the new centre with the shape of `center`.

  Args:
    center: current centre with K entries ((K,), (1, K), ...).
    teacher_logits: (..., K), e.g. (T, B, K).
    momentum: m (0.9).
    valid: optional bool broadcastable to teacher_logits.shape[:-1] (e.g. (B,)); only valid rows count.
  """
  t = teacher_side(teacher_logits)
  k = t.shape[-1]
  c = flat_center(center, k)
  flat = t.reshape(-1, k)
  if valid is None:
    mean = jnp.mean(flat, axis=0)
  else:
    w = jnp.broadcast_to(jnp.asarray(valid), t.shape[:-1]).reshape(-1, 1).astype(flat.dtype)
    mean = jnp.sum(flat * w, axis=0) / jnp.maximum(jnp.sum(w), 1.0)
  new = momentum * c + (1.0 - momentum) * mean
  return new.reshape(jnp.shape(center)).astype(jnp.result_type(center))
