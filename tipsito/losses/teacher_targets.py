"""Teacher targets shared by DINO and iBOT: softmax centering and Sinkhorn-Knopp, and the numeric
conventions every self-distillation loss follows.

Why a module of its own: DINO (tipsito/losses/dino.py) and iBOT / iBOT++ (tipsito/losses/ibot.py) turn
teacher head outputs into targets the same two ways (`config.loss_opts.teacher_method`), and a frozen
distillation teacher supplies targets made the same way; the reference semantics are those of
dinov2/loss/{dino_clstoken_loss,ibot_patch_loss}.py, reproduced to 1e-5 (gradients included) against
the vectors in tests/data/dino_losses/.

Design choices, and where they differ in *form* (not in value) from dinov2:
- Plain functions of arrays instead of stateful torch modules: the centre is an explicit input and
  `update_center` / `update_patch_center` return the new centre, so the caller keeps it in its train state.
  As in dinov2 the probabilities of step t use the centre from step t-1 ("lazy" update).
- Global batch, no collectives: the caller runs these under `jax.jit` on arrays sharded over the batch;
  sums over the batch (Sinkhorn normalisations, centre means) therefore already are global, which is what
  dinov2 gets with its `all_reduce` calls.
- Static shapes only: masked tokens are selected with weights, never with boolean indexing, so the same
  compiled step serves every mask. In particular Sinkhorn over iBOT's masked tokens runs on the dense
  (B, N, K) logits with the mask as sample weights; it equals dinov2's Sinkhorn on the gathered tokens.
- Crop layout: DINO logits are (crops, B, K), crop axis first. dinov2's crop-major (C*B, K) rows reshape
  to this with ``x.reshape(C, B, K)``.
- The teacher side never receives gradient: teacher logits, centres and teacher probabilities are wrapped
  in `jax.lax.stop_gradient` inside every function.
- Everything is computed in at least float32 whatever the input dtype.
- `valid` (optional bool, per image) marks real examples in a padded batch; invalid images are removed
  from every sum and every denominator, so the result equals the one on the un-padded batch.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from tipsito.choices import TEACHER_METHODS

Array = jax.Array


def as_f32(x):
  """Promotes to at least float32 (keeps float64 when x64 is enabled)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def teacher_side(x):
  """Teacher-side input: float32 and no gradient."""
  return jax.lax.stop_gradient(as_f32(x))


def flat_center(center, k):
  """Returns the centre as (K,) whatever its stored shape ((K,), (1, K), (1, 1, K))."""
  center = teacher_side(center)
  if center.size != k:
    raise ValueError(f"center has {center.size} entries ({center.shape}); expected {k} prototypes")
  return center.reshape(k)


def check_method(method):
  """Rejects unknown teacher normalisations early (before any tracing)."""
  if method not in TEACHER_METHODS:
    raise ValueError(f"method must be one of {TEACHER_METHODS}, got {method!r}")


def batch_weights(valid, b, dtype):
  """Per-image validity weights as float (B,), all ones when `valid` is None."""
  if valid is None:
    return jnp.ones((b,), dtype)
  valid = jnp.asarray(valid)
  if valid.shape != (b,):
    raise ValueError(f"valid must have shape ({b},), got {valid.shape}")
  return valid.astype(dtype)


def teacher_probs_centered(teacher_logits: Array, center: Array, teacher_temp) -> Array:
  """DINO softmax-centering teacher: ``p = softmax((t - c) / tau_t)`` over the prototype axis.

  Why: centering (subtracting a running mean of the teacher logits) and sharpening (a low teacher
  temperature, 0.04 -> 0.07) together prevent the collapse of self-distillation (DINO).

  Args:
    teacher_logits: (..., K) teacher head outputs; no gradient flows into them.
    center: the running centre, any shape with K entries ((K,), (1, K) or (1, 1, K)).
    teacher_temp: tau_t (scalar; may be traced, e.g. a warm-up schedule).
  Returns:
    (..., K) probabilities, rows sum to 1.
  """
  t = teacher_side(teacher_logits)
  c = flat_center(center, t.shape[-1])
  return jax.nn.softmax((t - c) / teacher_temp, axis=-1)


def sinkhorn_knopp(
  teacher_logits: Array, teacher_temp, n_iters: int = 3, valid: Optional[Array] = None
) -> Array:
  """Sinkhorn-Knopp teacher (DINOv2 / SwAV), over every sample of the (global) batch.

  Why: an alternative to centering that spreads the batch equally over the K prototypes, used by
  DINOv2 (`train.centering = sinkhorn_knopp`). All leading axes of `teacher_logits` are samples: with
  DINO's (T, B, K) crops and images are normalised together, as dinov2 does with its (T*B, K) rows.

  With Q = exp(t / tau_t)^T (K x n, n = number of valid samples), dinov2 computes

      Q <- Q / sum(Q)
      repeat n_iters times:
        Q <- Q / (K * row_sums(Q))       # each prototype gets mass 1/K
        Q <- Q / (n * col_sums(Q))       # each sample gets mass 1/n
      P = n * Q^T                        # rows of P (samples) sum to 1

  This implementation runs the same recursion in the log domain (every step is an exact rescaling, so
  exp(t / tau_t) can no longer overflow for logits above ~3.5 at tau_t = 0.04) and with sample weights
  instead of boolean indexing: samples with valid = False get no mass, do not count in n, and come back
  with probability 0. That is how iBOT's "Sinkhorn over the masked tokens only" stays static-shape
  (pass the mask as `valid`).

  Args:
    teacher_logits: (..., K) teacher head outputs (no gradient flows into them).
    teacher_temp: tau_t.
    n_iters: number of Sinkhorn iterations (static; dinov2 uses 3).
    valid: optional bool, broadcastable to teacher_logits.shape[:-1]; False = not a sample.
  Returns:
    (..., K) probabilities; valid rows sum to 1, invalid rows are 0.
  """
  t = teacher_side(teacher_logits)
  shape = t.shape
  if valid is None:
    w = jnp.ones(shape[:-1], bool)
  else:
    w = jnp.broadcast_to(jnp.asarray(valid), shape[:-1]).astype(bool)
  probs = _sinkhorn_log_domain(t.reshape(-1, shape[-1]), w.reshape(-1), teacher_temp, n_iters)
  return probs.reshape(shape)


@functools.partial(jax.jit, static_argnames=("n_iters",))
def _sinkhorn_log_domain(t, w, teacher_temp, n_iters):
  """Sinkhorn-Knopp on (n, K) logits with (n,) bool sample weights, in the log domain.

  Jitted on its own because it is a long chain of small ops (slow op-by-op when called eagerly); under
  an outer jit it is simply inlined.
  """
  k = t.shape[-1]
  logq = t / teacher_temp
  wcol = w[:, None]
  n = jnp.sum(w).astype(logq.dtype)
  log_n = jnp.log(jnp.maximum(n, 1.0))
  log_k = jnp.log(jnp.asarray(k, logq.dtype))
  logq = jnp.where(wcol, logq, -jnp.inf)
  logq = logq - jax.nn.logsumexp(logq)  # total mass 1

  def one_iteration(_, logq):
    """One row (prototype) then column (sample) normalisation."""
    logq = logq - jax.nn.logsumexp(logq, axis=0, keepdims=True) - log_k  # prototypes: mass 1/K
    per_sample = jax.nn.logsumexp(logq, axis=1, keepdims=True)
    per_sample = jnp.where(wcol, per_sample, 0.0)
    return jnp.where(wcol, logq - per_sample - log_n, -jnp.inf)  # samples: mass 1/n

  # A loop (not unrolled) keeps compile time independent of n_iters.
  logq = jax.lax.fori_loop(0, n_iters, one_iteration, logq)
  return jnp.where(wcol, jnp.exp(logq + log_n), 0.0)


def teacher_probs(
  teacher_logits: Array,
  center: Optional[Array],
  teacher_temp,
  *,
  method: str = "centering",
  n_iters: int = 3,
  valid: Optional[Array] = None,
) -> Array:
  """Dispatches to `teacher_probs_centered` ('centering') or `sinkhorn_knopp` ('sinkhorn').

  Why: recipes switch the teacher normalisation with one config string. `center` is ignored (may be
  None) for 'sinkhorn'; `valid` only affects 'sinkhorn' (centering is per row).
  """
  check_method(method)
  if method == "centering":
    return teacher_probs_centered(teacher_logits, center, teacher_temp)
  return sinkhorn_knopp(teacher_logits, teacher_temp, n_iters, valid=valid)
