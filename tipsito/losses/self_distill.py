"""Self-distillation losses: DINO (CLS), iBOT / iBOT++ (patches), teacher centering, Sinkhorn-Knopp, KoLeo.

Why this module exists: TIPSv2 and tipsito add DINOv2-style self-distillation to the contrastive loss
(TIPSv2 paper, §4): L = L_CLIP + 1.0 * L_DINO + 2.0 * L_iBOT++. The reference semantics are those of
dinov2/loss/{dino_clstoken_loss,ibot_patch_loss,koleo_loss}.py, reproduced to 1e-5 (gradients included)
against the vectors in tests/data/dino_losses/.

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
from typing import Optional, Union

import jax
import jax.numpy as jnp

from tipsito.choices import DINO_REDUCTIONS, TEACHER_METHODS  # noqa: F401 (re-exported)


Array = jax.Array

__all__ = [
  "teacher_probs_centered",
  "sinkhorn_knopp",
  "teacher_probs",
  "dino_loss",
  "dino_loss_from_probs",
  "update_center",
  "ibot_teacher_probs",
  "ibot_loss",
  "ibot_loss_from_probs",
  "ibot_token_cross_entropy",
  "ibot_masked_visible_cross_entropy",
  "update_patch_center",
  "koleo_loss",
  "koleo_neighbors",
]

_HIGHEST = jax.lax.Precision.HIGHEST


def _f32(x):
  """Promotes to at least float32 (keeps float64 when x64 is enabled)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _sg32(x):
  """Teacher-side input: float32 and no gradient."""
  return jax.lax.stop_gradient(_f32(x))


def _flat_center(center, k):
  """Returns the centre as (K,) whatever its stored shape ((K,), (1, K), (1, 1, K))."""
  center = _sg32(center)
  if center.size != k:
    raise ValueError(f"center has {center.size} entries ({center.shape}); expected {k} prototypes")
  return center.reshape(k)


def _check_method(method):
  """Rejects unknown teacher normalisations early (before any tracing)."""
  if method not in TEACHER_METHODS:
    raise ValueError(f"method must be one of {TEACHER_METHODS}, got {method!r}")


# ----------------------------------------------------------------------------------------------------
# Teacher probabilities.


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
  t = _sg32(teacher_logits)
  c = _flat_center(center, t.shape[-1])
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
  t = _sg32(teacher_logits)
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
  _check_method(method)
  if method == "centering":
    return teacher_probs_centered(teacher_logits, center, teacher_temp)
  return sinkhorn_knopp(teacher_logits, teacher_temp, n_iters, valid=valid)


# ----------------------------------------------------------------------------------------------------
# DINO (CLS token).


def _as_crops(x, name):
  """Accepts (crops, B, K) or a single crop (B, K)."""
  x = jnp.asarray(x)
  if x.ndim == 2:
    x = x[None]
  if x.ndim != 3:
    raise ValueError(f"{name} must be (crops, B, K) or (B, K); got {x.shape}")
  return x


def _batch_weights(valid, b, dtype):
  """Per-image validity weights as float (B,), all ones when `valid` is None."""
  if valid is None:
    return jnp.ones((b,), dtype)
  valid = jnp.asarray(valid)
  if valid.shape != (b,):
    raise ValueError(f"valid must have shape ({b},), got {valid.shape}")
  return valid.astype(dtype)


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
  s = _as_crops(_f32(student_logits), "student_logits")
  p = _as_crops(_sg32(teacher_probs), "teacher_probs")
  if s.shape[1:] != p.shape[1:]:
    raise ValueError(f"student {s.shape} and teacher {p.shape} must agree on (B, K)")
  n_s, b, _ = s.shape
  n_t = p.shape[0]
  lsm = jax.nn.log_softmax(s / student_temp, axis=-1)
  ce = -jnp.einsum("tbk,sbk->stb", p, lsm, precision=_HIGHEST)  # (S, T, B)
  w = _batch_weights(valid, b, ce.dtype)
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
  t = _sg32(teacher_logits)
  k = t.shape[-1]
  c = _flat_center(center, k)
  flat = t.reshape(-1, k)
  if valid is None:
    mean = jnp.mean(flat, axis=0)
  else:
    w = jnp.broadcast_to(jnp.asarray(valid), t.shape[:-1]).reshape(-1, 1).astype(flat.dtype)
    mean = jnp.sum(flat * w, axis=0) / jnp.maximum(jnp.sum(w), 1.0)
  new = momentum * c + (1.0 - momentum) * mean
  return new.reshape(jnp.shape(center)).astype(jnp.result_type(center))


# ----------------------------------------------------------------------------------------------------
# iBOT / iBOT++ (patch tokens).


def _token_weights(mask, all_patches, shape_bn, valid):
  """(B, N) bool: the tokens that carry loss (masked ones, or all for iBOT++) of valid images."""
  if mask is None:
    tok = jnp.zeros(shape_bn, bool)
  else:
    tok = jnp.asarray(mask).astype(bool)
    if tok.shape != shape_bn:
      tok = tok.reshape(shape_bn)  # accepts (B, gh, gw) masks
  tok = jnp.logical_or(tok, jnp.asarray(all_patches, bool))
  if valid is not None:
    tok = jnp.logical_and(tok, jnp.asarray(valid, bool)[:, None])
  return tok


def ibot_teacher_probs(
  teacher_patch_logits: Array,
  mask: Optional[Array],
  center: Optional[Array],
  teacher_temp,
  all_patches: Union[bool, Array],
  *,
  method: str = "centering",
  n_iters: int = 3,
  valid: Optional[Array] = None,
) -> Array:
  """Dense (B, N, K) iBOT teacher targets.

  Why: 'centering' is per token: ``softmax((t - c) / tau_t)``. 'sinkhorn' normalises over the tokens
  that enter the loss: the masked tokens of valid images (iBOT, dinov2 `sinkhorn_knopp_teacher` with
  n = number of masked tokens) or every token (iBOT++). Those are selected with weights, so the result
  for masked tokens equals dinov2's Sinkhorn on the gathered (n_masked, K) rows, and other tokens get 0.

  Args:
    teacher_patch_logits: (B, N, K) (no gradient).
    mask: (B, N) (or (B, gh, gw)) bool, True = masked for the student; may be None with all_patches.
    center: centre with K entries (unused by 'sinkhorn').
    teacher_temp: tau_t.
    all_patches: False = iBOT, True = iBOT++ (Python or traced bool).
  """
  t = jnp.asarray(teacher_patch_logits)
  if t.ndim != 3:
    raise ValueError(f"teacher_patch_logits must be (B, N, K); got {t.shape}")
  _check_method(method)
  if method == "centering":
    return teacher_probs_centered(t, center, teacher_temp)
  tok = _token_weights(mask, all_patches, t.shape[:2], valid)
  return sinkhorn_knopp(t, teacher_temp, n_iters, valid=tok)


def ibot_token_cross_entropy(student_patch_logits: Array, teacher_patch_probs: Array, student_temp) -> Array:
  """(B, N) per-token cross-entropy ``ce[b, n] = -sum_k p[b, n, k] log_softmax(s[b, n] / tau_s)[k]``.

  Why: the one quantity every iBOT variant averages (`ibot_loss_from_probs`) and the masked / visible
  mechanism metrics report (`ibot_masked_visible_cross_entropy`)."""
  s = _f32(student_patch_logits)
  p = _sg32(teacher_patch_probs)
  if s.ndim != 3 or s.shape != p.shape:
    raise ValueError(f"student {s.shape} and teacher {p.shape} must both be (B, N, K)")
  return -jnp.sum(p * jax.nn.log_softmax(s / student_temp, axis=-1), axis=-1)


def ibot_loss_from_probs(
  student_patch_logits: Array,
  teacher_patch_probs: Array,
  mask: Optional[Array],
  student_temp,
  all_patches: Union[bool, Array],
  *,
  token_norm: str = "masked",
  visible_weight: float = 1.0,
  valid: Optional[Array] = None,
) -> Array:
  """iBOT (masked tokens) / iBOT++ (all tokens) cross-entropy from given teacher probabilities.

  Why: the patch-level distillation term; separated from the targets so a frozen distillation teacher
  can supply them. Per token ``ce[b, n]`` of `ibot_token_cross_entropy`, token set W_b = masked tokens
  of image b (all_patches=False) or all N tokens (all_patches=True); M_b / V_b = the masked / visible
  tokens of image b (V_b = all N when `mask` is None):

      token_norm='masked' (dinov2): L = (1/B) sum_b (1 / max(|W_b|, 1)) sum_{n in W_b} ce[b, n]
      token_norm='patches':         L = (1/B) sum_b (1 / N)             sum_{n in W_b} ce[b, n]
      token_norm='separate' (ours, iBOT++ only):
          L = (1/B) sum_b [ (1/max(|M_b|, 1)) sum_{n in M_b} ce[b, n]
                            + w_v (1/max(|V_b|, 1)) sum_{n in V_b} ce[b, n] ]     (w_v = visible_weight)

  B counts every (valid) image, including images without any masked token (dinov2 forward_masked).
  With all_patches=True 'masked' and 'patches' both give iBOT++ = mean_b mean_n ce[b, n], in which the
  visible tokens weigh |V_b| / |M_b| (1/3 at mask ratio 0.75) of the masked ones. 'separate' is not in
  TIPSv2: it is our option for the `ibot` study (issue 33), where the masked and the visible means carry
  1 and w_v whatever the mask ratio; at w_v = 1 it is iBOT's loss plus the same loss on the visible
  tokens. With token_norm='patches' the masked and visible parts add up: iBOT++ = iBOT + (1/(B N))
  sum_{visible} ce.

  Args:
    student_patch_logits: (B, N, K).
    teacher_patch_probs: (B, N, K) targets (stop_gradient applied).
    mask: (B, N) bool, True = masked; may be None when all_patches is True.
    student_temp: tau_s.
    all_patches: False = iBOT, True = iBOT++ (Python or traced bool; must be True for 'separate').
    token_norm: 'masked', 'patches' or 'separate' (static), see above.
    visible_weight: w_v of token_norm='separate' (ignored otherwise).
    valid: optional bool (B,) for padded batches.
  """
  ce = ibot_token_cross_entropy(student_patch_logits, teacher_patch_probs, student_temp)  # (B, N)
  b, n = ce.shape
  w = _batch_weights(valid, b, ce.dtype)
  if token_norm == "separate":
    if isinstance(all_patches, jax.core.Tracer) or not bool(all_patches):
      raise ValueError("token_norm='separate' is an iBOT++ option: all_patches must be True")
    masked = _token_weights(mask, False, (b, n), valid).astype(ce.dtype)
    visible = _token_weights(None, True, (b, n), valid).astype(ce.dtype) - masked
    per_image = jnp.sum(ce * masked, axis=-1) / jnp.maximum(jnp.sum(masked, axis=-1), 1.0)
    per_image += visible_weight * jnp.sum(ce * visible, axis=-1) / jnp.maximum(jnp.sum(visible, axis=-1), 1.0)
    return jnp.sum(per_image * w) / jnp.maximum(jnp.sum(w), 1.0)
  tok = _token_weights(mask, all_patches, (b, n), valid).astype(ce.dtype)
  if token_norm == "masked":
    denom = jnp.maximum(jnp.sum(tok, axis=-1), 1.0)
  elif token_norm == "patches":
    denom = float(n)
  else:
    raise ValueError(f"token_norm must be 'masked', 'patches' or 'separate', got {token_norm!r}")
  per_image = jnp.sum(ce * tok, axis=-1) / denom
  return jnp.sum(per_image * w) / jnp.maximum(jnp.sum(w), 1.0)


def ibot_masked_visible_cross_entropy(
  student_patch_logits: Array, teacher_patch_probs: Array, mask: Optional[Array], student_temp
) -> dict[str, tuple[Array, Array]]:
  """The mechanism of TIPSv2 Fig. 2: the patch cross-entropy on masked and on visible tokens, apart.

  Why: TIPSv2 §3.3 explains iBOT++ by the visible tokens, which iBOT leaves unsupervised ("the
  representations of visible patches remain poor in iBOT but improve in iBOT++", Fig. 2). Logging both
  means for every patch loss, whatever tokens the loss itself uses, lets a run check that claim. With
  ``ce[b, n]`` of `ibot_token_cross_entropy` against the targets the loss uses (the teacher's centred
  and sharpened, or Sinkhorn, probabilities on the unmasked image) and M / V the masked / visible tokens
  of the whole batch (V = every token when `mask` is None):

      ce_masked  = sum_{(b,n) in M} ce[b, n] / |M|        (0 when |M| = 0)
      ce_visible = sum_{(b,n) in V} ce[b, n] / |V|        (0 when |V| = 0)

  Token means, not image means, so that a batch split into micro-batches combines exactly (each mean
  weighted by its count; tipsito/objective/accumulate.py). When every image masks the same number of
  tokens (the input pipeline's masks) ce_masked equals the iBOT loss (token_norm 'masked'). No gradient.

  Returns:
    {'masked': (ce_masked, |M|), 'visible': (ce_visible, |V|)}; 'masked' only when `mask` is not None.
  """
  # The barrier keeps XLA from sharing this cross-entropy with the loss's: shared, it changed how the
  # loss's sum was fused and its last bit (tests/fingerprint_recipes.py, plain iBOT).
  s, p = jax.lax.optimization_barrier(
    jax.lax.stop_gradient((_f32(student_patch_logits), _f32(teacher_patch_probs)))
  )
  ce = ibot_token_cross_entropy(s, p, student_temp)
  b, n = ce.shape
  masked = _token_weights(mask, False, (b, n), None).astype(ce.dtype)
  sets = {"visible": 1.0 - masked} if mask is None else {"masked": masked, "visible": 1.0 - masked}
  out = {}
  for name, tok in sets.items():
    count = jnp.sum(tok)
    out[name] = (jnp.sum(ce * tok) / jnp.maximum(count, 1.0), count)
  return out


def ibot_loss(
  student_patch_logits: Array,
  teacher_patch_logits: Array,
  mask: Optional[Array],
  center: Optional[Array],
  student_temp,
  teacher_temp,
  all_patches: Union[bool, Array],
  *,
  method: str = "centering",
  n_iters: int = 3,
  token_norm: str = "masked",
  visible_weight: float = 1.0,
  valid: Optional[Array] = None,
) -> Array:
  """iBOT (all_patches=False) or iBOT++ (all_patches=True, TIPSv2 eq. 3) patch distillation loss.

  Why: TIPSv2's dense-feature term. The student saw the masked image, the teacher the full image; the
  student must predict the teacher's prototype distribution at each patch position:

      p[b, n] = softmax((t[b, n] - c) / tau_t)    or Sinkhorn over the loss tokens (method='sinkhorn')
      ce[b, n] = -sum_k p[b, n, k] log_softmax(s[b, n] / tau_s)[k]
      iBOT   : L = (1/B) sum_b (1/max(m_b, 1)) sum_{n masked in b} ce[b, n]   (m_b = #masked in b)
      iBOT++ : L = (1/B) sum_b (1/N) sum_n ce[b, n]

  iBOT matches dinov2 iBOTPatchLoss.forward_masked (B includes images with nothing masked); iBOT++
  matches iBOTPatchLoss.forward with an all-True mask. See `ibot_loss_from_probs` for token_norm.

  Args:
    student_patch_logits: (B, N, K) student head outputs on the masked image's patch tokens.
    teacher_patch_logits: (B, N, K) teacher head outputs on the unmasked image (no gradient).
    mask: (B, N) bool, True = masked for the student (may be None with all_patches=True).
    center: patch centre with K entries (ignored for 'sinkhorn'), no gradient.
    student_temp, teacher_temp: tau_s and tau_t.
    all_patches: iBOT++ switch (Python or traced bool).
    method: 'centering' or 'sinkhorn'; n_iters: Sinkhorn iterations.
    token_norm: 'masked' (dinov2), 'patches' or 'separate' (ours; static).
    visible_weight: the visible tokens' weight of token_norm='separate'.
    valid: optional bool (B,) for padded batches.
  """
  probs = ibot_teacher_probs(
    teacher_patch_logits, mask, center, teacher_temp, all_patches, method=method, n_iters=n_iters, valid=valid
  )
  return ibot_loss_from_probs(
    student_patch_logits,
    probs,
    mask,
    student_temp,
    all_patches,
    token_norm=token_norm,
    visible_weight=visible_weight,
    valid=valid,
  )


def update_patch_center(
  center: Array, teacher_patch_logits: Array, mask: Optional[Array] = None, momentum=0.9
) -> Array:
  """EMA of the iBOT teacher patch logits: ``c <- m * c + (1 - m) * mean(t over selected tokens)``.

  Why: the iBOT centre (separate from the DINO one). mask=None averages every token of every image
  (dinov2 `update_center` on dense tokens, right for iBOT++); with a (B, N) bool mask only the True
  tokens count (dinov2 ssl_meta_arch, which feeds the masked teacher tokens). If no token is selected
  the centre is returned unchanged. The result has the shape of `center`.
  """
  t = _sg32(teacher_patch_logits)
  k = t.shape[-1]
  c = _flat_center(center, k)
  flat = t.reshape(-1, k)
  if mask is None:
    new = momentum * c + (1.0 - momentum) * jnp.mean(flat, axis=0)
  else:
    w = jnp.asarray(mask).reshape(-1, 1).astype(flat.dtype)
    if w.shape[0] != flat.shape[0]:
      raise ValueError(f"mask {jnp.shape(mask)} does not match the tokens of {t.shape}")
    count = jnp.sum(w)
    mean = jnp.sum(flat * w, axis=0) / jnp.maximum(count, 1.0)
    new = jnp.where(count > 0, momentum * c + (1.0 - momentum) * mean, c)
  return new.reshape(jnp.shape(center)).astype(jnp.result_type(center))


# ----------------------------------------------------------------------------------------------------
# KoLeo.


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
  w = _batch_weights(valid, u.shape[0], u.dtype)
  return jnp.sum(per_row * w) / jnp.maximum(jnp.sum(w), 1.0)


def koleo_neighbors(x: Array, *, eps: float = 1e-8, valid: Optional[Array] = None) -> Array:
  """int32 (B,) nearest-neighbour index used by `koleo_loss` (max cosine, self excluded).

  Why: lets callers/tests inspect which row each feature is pushed away from.
  """
  return _koleo_normalise_and_match(x, eps, valid)[1]


def _koleo_normalise_and_match(x, eps, valid):
  """Returns (u, idx): rows normalised as torch F.normalize and their nearest-neighbour indices."""
  x = _f32(x)
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
    w = _batch_weights(valid, b, x.dtype)
    dots = jnp.where(w[None, :] > 0, dots, -3.0)  # below any cosine and below the self value
  idx = jnp.argmax(dots, axis=1).astype(jnp.int32)
  return u, idx
