"""What the objective needs from the config, resolved once: `LossContext`, and the iBOT mask decision.

Why separate from the terms: `tipsito.train.step` builds the context once per run (weights with zero
terms dropped, `config.loss_opts`), the feature pass and every term read it, and the defaults of the
options live only in the default config, so no field here has a default of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from tipsito.objective.model import TrainModel


def masks_student_view(config) -> bool:
  """Whether the student sees view 1 with iBOT's patch mask: the pipeline draws a mask
  (`input.mask_ratio` > 0) and the image tower has the mask token to put in the masked places
  (`model.image.use_mask_token`).

  Why one function: the model gets its mask token from this answer (`step.build_model`) and the loss
  context carries it to the feature pass, which applies the batch's mask only when it is true and the
  `ibot` term is on; nothing else re-derives it.
  """
  return bool(config.model.image.use_mask_token) and float(config.input.mask_ratio) > 0


@dataclasses.dataclass(frozen=True)
class LossContext:
  """Everything static the loss needs: model, weights and options (built once from the config and the
  recipe; the terms read these fields, never the Recipe itself).

  Attributes:
    model: the run's TrainModel.
    frozen_teacher: the recipe's teacher is a frozen distillation teacher (`Recipe.teacher == 'frozen'`):
      the teacher features and heads come from `frozen`, and `dino_global_crop` applies.
    weights: term -> float, zero weights removed (the active terms).
    masks_student_view: see `masks_student_view`; when true the `ibot` term requires the batch's MASK.
    has_local_crops: the batch carries multi-crop's LOCAL_CROPS (`BatchLayout.num_local` > 0 in
      tipsito/data/batch.py); when true the `dino` term requires them.
    student_temp ... fusion_cls, dino_reduction, view_weighting: `config.loss_opts` of the same names
      (ibot_token_norm, ibot_visible_weight: see `ibot_loss_from_probs` in tipsito/losses/ibot.py;
      dino_reduction: 'mean' | 'sum' of the DINO cross-entropies over the student crops, see `dino_term`
      in tipsito/objective/terms.py; view_weighting: 'mean' | 'sum' of the alt-text InfoNCE over ITO's
      two views, see `contrastive_pair_weights` there).
    dino_global_crop: `config.distill.dino_global_crop`: distillation also uses the student's global crop
      as a DINO student view (off by default: TIPSv2 §3.1 names only two changes for distillation).
    logit_scale_max: clamp of the log contrastive scale (`config.model.logit_scale_max`), None = none.
    ema_keys: top-level params with an EMA copy (`state.ema`).
    teacher_model: distillation only, the frozen teacher's VisionTransformer.
  """

  model: TrainModel
  frozen_teacher: bool
  weights: dict
  masks_student_view: bool
  has_local_crops: bool
  student_temp: float
  teacher_temp: float
  warmup_teacher_temp: float
  teacher_temp_warmup_steps: int
  center_momentum: float
  ibot_all_patches: bool
  ibot_token_norm: str
  ibot_visible_weight: float
  teacher_method: str
  contrastive_view: str
  logit_scale_max: Optional[float]
  fusion_cls: int
  dino_reduction: str
  view_weighting: str
  dino_global_crop: bool
  ema_keys: tuple[str, ...]
  teacher_model: Any


def teacher_temperature(ctx: LossContext, step) -> jax.Array:
  """Linear warmup of the teacher temperature (0.04 -> 0.07 over `teacher_temp_warmup_steps`)."""
  if ctx.teacher_temp_warmup_steps <= 0:
    return jnp.asarray(ctx.teacher_temp, jnp.float32)
  frac = jnp.clip(jnp.asarray(step, jnp.float32) / ctx.teacher_temp_warmup_steps, 0.0, 1.0)
  return ctx.warmup_teacher_temp + frac * (ctx.teacher_temp - ctx.warmup_teacher_temp)
