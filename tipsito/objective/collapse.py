"""Collapse signals of self-distillation, logged with the losses (`collapse/*`).

Why: DINO/iBOT fail silently. The two classic collapses are a teacher that outputs the uniform
distribution (entropy -> ln K; the loss then sits at ln K) and one that puts every image on one prototype
(entropy -> 0); a third is a student whose CLS features span few directions. The metrics here make each
visible in TensorBoard long before the evals do:

* `collapse/{dino,ibot}_teacher_entropy`: mean entropy (nats) of the teacher's target distributions, as
  the loss uses them (centering or Sinkhorn); compare with ln K (`collapse/log_prototypes`);
* `collapse/{dino,ibot}_center_norm`: L2 norm of the teacher-logit centre;
* `collapse/cls_effective_rank`: effective rank (exp of the entropy of the normalised singular values,
  Roy & Vetterli 2007) of the L2-normalised CLS features of up to `RANK_ROWS` batch rows; 1 = every
  image has the same feature, min(rows, width) = features spread evenly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

RANK_ROWS = 256  # rows of the batch the effective rank is computed on (a (n, n) eigen-decomposition)


def entropy(probs: jax.Array, weights: jax.Array | None = None) -> jax.Array:
  """Mean over rows of -sum_k p log p (nats); `weights` (same leading shape) weight the rows."""
  p = jnp.asarray(probs, jnp.float32)
  h = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  if weights is None:
    return jnp.mean(h)
  w = jnp.asarray(weights, jnp.float32)
  return jnp.sum(h * w) / jnp.maximum(jnp.sum(w), 1.0)


def effective_rank(features: jax.Array, max_rows: int = RANK_ROWS) -> jax.Array:
  """Effective rank of the rows of (B, D) `features` after L2 normalisation (first `max_rows` rows)."""
  x = jnp.asarray(features, jnp.float32)[:max_rows]
  x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
  eig = jnp.clip(jnp.linalg.eigvalsh(x @ x.T), 0.0, None)  # squared singular values
  s = jnp.sqrt(eig)
  p = s / jnp.maximum(jnp.sum(s), 1e-12)
  return jnp.exp(-jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)))


def teacher_signals(name: str, teacher_probs: jax.Array, center, weights=None) -> dict:
  """`collapse/<name>_teacher_entropy`, `_center_norm` and `log_prototypes` for one head."""
  out = {
    f"collapse/{name}_teacher_entropy": entropy(jax.lax.stop_gradient(teacher_probs), weights),
    "collapse/log_prototypes": jnp.float32(math.log(teacher_probs.shape[-1])),
  }
  if center is not None:
    out[f"collapse/{name}_center_norm"] = jnp.linalg.norm(jnp.asarray(center, jnp.float32))
  return out
