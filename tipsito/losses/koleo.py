"""KoLeo: the Kozachenko-Leonenko entropy regulariser of dinov2 (dinov2/loss/koleo_loss.py), off by default.

Why its own module: it is not self-distillation (no teacher), only a spread of the batch's CLS features
on the sphere that DINOv2 adds beside it; the `koleo` term of tipsito/objective/terms.py uses it.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from tipsito.losses.teacher_targets import as_f32, batch_weights

Array = jax.Array

_HIGHEST = jax.lax.Precision.HIGHEST


def koleo_loss(x: Array, *, eps: float = 1e-8, valid: Optional[Array] = None) -> Array:
  """Kozachenko-Leonenko entropy regulariser (DINOv2 KoLeoLoss), optional term, off by default.

  Why: spreads the backbone CLS features of a batch uniformly on the sphere. For rows x_i (B, D):

      u_i  = x_i / max(||x_i||, eps)                   (torch F.normalize)
      nn_i = argmax_{j != i} <u_i, u_j>                 (self excluded by setting the diagonal to -1)
      d_i  = || u_i - u_{nn_i} + eps ||                  (torch PairwiseDistance adds eps elementwise)
      L    = -mean_i log(d_i + eps)

  The neighbour index is not differentiated; the gradient flows through both u_i and u_{nn_i}.
  Difference in scope from dinov2: dinov2 applies it per GPU chunk of the batch; here the neighbours
  are searched among the rows given (the global batch under jit). dinov2's meta-arch sums the loss
  over the global-crop chunks: call this once per crop and add.

  Args:
    x: (B, D) features (not normalised).
    eps: 1e-8 as dinov2.
    valid: optional bool (B,); invalid rows are neither anchors nor candidate neighbours.
  """
  u, idx = _koleo_normalise_and_match(x, eps, valid)
  diff = u - u[idx] + eps
  dist = jnp.sqrt(jnp.sum(diff * diff, axis=-1))
  per_row = -jnp.log(dist + eps)
  w = batch_weights(valid, u.shape[0], u.dtype)
  return jnp.sum(per_row * w) / jnp.maximum(jnp.sum(w), 1.0)


def koleo_neighbors(x: Array, *, eps: float = 1e-8, valid: Optional[Array] = None) -> Array:
  """int32 (B,) nearest-neighbour index used by `koleo_loss` (max cosine, self excluded).

  Why: lets callers/tests inspect which row each feature is pushed away from.
  """
  return _koleo_normalise_and_match(x, eps, valid)[1]


def _koleo_normalise_and_match(x, eps, valid):
  """Returns (u, idx): rows normalised as torch F.normalize and their nearest-neighbour indices."""
  x = as_f32(x)
  if x.ndim != 2:
    raise ValueError(f"koleo_loss expects (B, D); got {x.shape}")
  b = x.shape[0]
  sq = jnp.sum(x * x, axis=-1, keepdims=True)
  big = sq > eps * eps
  norm = jnp.where(big, jnp.sqrt(jnp.where(big, sq, 1.0)), eps)  # NaN-free gradient at x = 0
  u = x / norm
  dots = jax.lax.stop_gradient(jnp.matmul(u, u.T, precision=_HIGHEST))
  dots = jnp.where(jnp.eye(b, dtype=bool), -1.0, dots)
  if valid is not None:
    w = batch_weights(valid, b, x.dtype)
    dots = jnp.where(w[None, :] > 0, dots, -3.0)  # below any cosine and below the self value
  idx = jnp.argmax(dots, axis=1).astype(jnp.int32)
  return u, idx
