"""iBOT (masked patch tokens) and iBOT++ (every patch token, TIPSv2 §3.3 Eq. 3) patch distillation.

Why: TIPSv2's dense-feature term. The teacher targets come from tipsito/losses/teacher_targets.py; this
module holds the per-token cross-entropy, the token sets and their normalisations (dinov2's, and the
`separate` study option with its formula), the masked / visible mechanism metric of TIPSv2 Fig. 2 and
the patch centre's EMA. Conventions: teacher_targets.py's docstring (masked tokens are selected with
weights, never boolean indexing, so one compiled step serves every mask).
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

from tipsito.losses.teacher_targets import (
  as_f32,
  batch_weights,
  check_method,
  flat_center,
  sinkhorn_knopp,
  teacher_probs_centered,
  teacher_side,
)

Array = jax.Array


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
  check_method(method)
  if method == "centering":
    return teacher_probs_centered(t, center, teacher_temp)
  tok = _token_weights(mask, all_patches, t.shape[:2], valid)
  return sinkhorn_knopp(t, teacher_temp, n_iters, valid=tok)


def ibot_token_cross_entropy(student_patch_logits: Array, teacher_patch_probs: Array, student_temp) -> Array:
  """(B, N) per-token cross-entropy ``ce[b, n] = -sum_k p[b, n, k] log_softmax(s[b, n] / tau_s)[k]``.

  Why: the one quantity every iBOT variant averages (`ibot_loss_from_probs`) and the masked / visible
  mechanism metrics report (`ibot_masked_visible_cross_entropy`)."""
  s = as_f32(student_patch_logits)
  p = teacher_side(teacher_patch_probs)
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
  w = batch_weights(valid, b, ce.dtype)
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
    jax.lax.stop_gradient((as_f32(student_patch_logits), as_f32(teacher_patch_probs)))
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
  t = teacher_side(teacher_patch_logits)
  k = t.shape[-1]
  c = flat_center(center, k)
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
