"""tipsito losses: contrastive (CLIP, SigLIP, ITO NT-Xent) and self-distillation (DINO, iBOT(++),
their teacher targets, KoLeo), one concept per module.

Why a package of plain functions: the loss terms in tipsito/objective compose these terms freely under one
jitted train step on globally sharded arrays; no loss keeps state (centres are explicit inputs/outputs).
"""

from tipsito.losses.contrastive import clip_logits
from tipsito.losses.contrastive import clip_loss
from tipsito.losses.contrastive import ntxent_logits
from tipsito.losses.contrastive import ntxent_loss
from tipsito.losses.contrastive import siglip_loss
from tipsito.losses.dino import dino_loss
from tipsito.losses.dino import dino_loss_from_probs
from tipsito.losses.ibot import ibot_loss
from tipsito.losses.ibot import ibot_loss_from_probs
from tipsito.losses.ibot import ibot_masked_visible_cross_entropy
from tipsito.losses.ibot import ibot_teacher_probs
from tipsito.losses.ibot import ibot_token_cross_entropy
from tipsito.losses.koleo import koleo_loss
from tipsito.losses.koleo import koleo_neighbors
from tipsito.losses.teacher_targets import sinkhorn_knopp
from tipsito.losses.teacher_targets import teacher_probs
from tipsito.losses.teacher_targets import teacher_probs_centered
from tipsito.losses.dino import update_center
from tipsito.losses.ibot import update_patch_center

__all__ = [
  "clip_logits",
  "clip_loss",
  "siglip_loss",
  "ntxent_logits",
  "ntxent_loss",
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
