"""Recipes: `config.recipe` -> `Recipe` (which model parts exist, which loss terms with which weights).

Why plain data in one table: the train loop, `info`, `bench`, the default config and its validation all
look recipes up by name, and a recipe never forks the loop; it only names parts, terms (keys of
`tipsito.objective.terms.TERMS`) and defaults. A new recipe is one `Recipe(...)` entry here.
"""

from __future__ import annotations

import dataclasses
import math

from tipsito.choices import CLIP, CLIP_VIEW2, DINO, FEATURE, FUSION, IBOT, KOLEO, SIGLIP

EMA_MODES = ("head", "full", "none")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Declarative description of a training recipe.

  Attributes:
    name: registry key (config.recipe).
    doc: one line shown by `info` and in errors.
    parts: top-level TrainModel parts (see tipsito.objective.model).
    loss: default weights; the keys are the terms this recipe allows in `config.loss`.
    views: default `config.input.views`.
    num_cls: default number of CLS tokens of the image encoder.
    ema_mode: default `config.ema.mode` (one of EMA_MODES).
    mask_ratio: default iBOT mask ratio.
    optimizer: default `config.optim.name`.
    pixel: 'tips' (mean 0 / std 1) or 'clip' (CLIP statistics).
    teacher: 'ema' (self-distillation) or 'frozen' (distillation from an exported/imported model).
    view_weighting: default `config.loss_opts.view_weighting`, how the alt-text InfoNCE of ITO's two views
      combine ('mean' | 'sum', see `tipsito.objective.terms.contrastive_pair_weights`); only matters
      when both `clip` and `clip_view2` are on.
    ibot_all_patches: default `config.loss_opts.ibot_all_patches` (iBOT++ on every patch; False: iBOT on
      the masked tokens only, TIPS v1).
    logit_scale_init: default `config.model.logit_scale_init`, the log of the initial contrastive logit
      scale (CLIP's 1/0.07; SigLIP's 10).
  """

  name: str
  doc: str
  parts: tuple[str, ...]
  loss: dict
  views: str = "single"
  num_cls: int = 1
  ema_mode: str = "none"
  mask_ratio: float = 0.0
  optimizer: str = "adamw"
  pixel: str = "clip"
  teacher: str = "ema"
  view_weighting: str = "sum"
  ibot_all_patches: bool = True
  logit_scale_init: float = math.log(1 / 0.07)

  @property
  def terms(self) -> tuple[str, ...]:
    """Loss terms this recipe may use (the valid keys of `config.loss`)."""
    return tuple(self.loss)


_TIPS_PARTS = ("image", "text", "logit_scale", "dino_head", "ibot_head")

# The reference point every vision-language paper compares to (ITO's and TIPSv2's tables).
CLIP_RECIPE = Recipe(
  name="clip",
  doc="CLIP: InfoNCE between image CLS and caption (AdamW).",
  parts=("image", "text", "image_proj", "logit_scale"),
  loss={CLIP: 1.0},
  views="single",
  num_cls=1,
  ema_mode="none",
  mask_ratio=0.0,
  optimizer="adamw",
  pixel="clip",
)

# The second standard baseline: pairwise sigmoid loss with learned scale (init 10) and bias (init -10);
# needs no batch-wide softmax.
SIGLIP_RECIPE = Recipe(
  name="siglip",
  doc="SigLIP: sigmoid image-text loss with learned scale and bias.",
  parts=("image", "text", "image_proj", "logit_scale", "logit_bias"),
  loss={SIGLIP: 1.0},
  views="single",
  num_cls=1,
  ema_mode="none",
  mask_ratio=0.0,
  optimizer="adamw",
  pixel="clip",
  logit_scale_init=math.log(10.0),
)

# ITO: L = L_align + lambda * L_fusion with L_align the mean over the two views, i.e. weights
# clip = clip_view2 = 0.5 and fusion = lambda = 2. The weights already write L_align's mean, so the view
# weighting is 'sum' (each InfoNCE at its weight): CLS x caption 0.5 for view 1 and 0.5 for view 2.
# The fusion Transformer is training-only.
ITO_RECIPE = Recipe(
  name="ito",
  doc="ITO: two views x caption InfoNCE + fusion NT-Xent (lambda=2), AdamW.",
  parts=("image", "text", "image_proj", "logit_scale", "fusion"),
  loss={CLIP: 0.5, CLIP_VIEW2: 0.5, FUSION: 2.0},
  views="two_views",
  num_cls=1,
  ema_mode="none",
  mask_ratio=0.0,
  optimizer="adamw",
  pixel="clip",
)

# TIPS (v1): two CLS tokens with CLIP losses, DINO on local crops and iBOT on masked tokens only, with a
# full EMA teacher (image encoder + heads): the baseline TIPSv2 improves on, and its full-EMA ablation.
TIPS_RECIPE = Recipe(
  name="tips",
  doc="TIPS: 2-CLS CLIP + DINO + iBOT (masked tokens), full EMA teacher, Adafactor.",
  parts=_TIPS_PARTS,
  loss={CLIP: 1.0, DINO: 1.0, IBOT: 2.0, KOLEO: 0.0},
  views="multicrop",
  num_cls=2,
  ema_mode="full",
  mask_ratio=0.75,
  optimizer="adafactor",
  pixel="tips",
  ibot_all_patches=False,
)

# TIPSv2: L = L_CLIP + 1.0 L_DINO + 2.0 L_iBOT++ with head-only EMA, two CLS tokens (CLS1 <-> alt-text
# 'text', CLS2 <-> sampled synthetic caption 'text2'). iBOT++ is iBOT with `loss_opts.ibot_all_patches`.
TIPSV2_RECIPE = Recipe(
  name="tipsv2",
  doc="TIPSv2: 2-CLS CLIP + DINO + iBOT++ with head-only EMA, Adafactor.",
  parts=_TIPS_PARTS,
  loss={CLIP: 1.0, DINO: 1.0, IBOT: 2.0, KOLEO: 0.0},
  views="multicrop",
  num_cls=2,
  ema_mode="head",
  mask_ratio=0.75,
  optimizer="adafactor",
  pixel="tips",
)

# tipsito (ours): TIPSv2 plus ITO's second augmented view ('image2', contrasted with 'text') and the
# fusion NT-Xent loss between (view 1 + caption) and (view 2 + caption); tests whether ITO's cheap second
# view and fusion module add to TIPSv2. Every term is switchable.
# Contrastive weights: TIPSv2's L_CLIP is the mean over its two captions (TIPSv2 A.9), and ITO's L_align,
# which is what the second view adds, is the mean over the two views of the one caption (ITO). tipsito
# uses L_CLIP = 1/2 L_align(CLS1, alt-text) + 1/2 InfoNCE(CLS2, synthetic), i.e. with view_weighting
# 'mean' (tipsito/objective/terms.py: contrastive_pair_weights; clip_view2 is the same InfoNCE as clip's
# CLS1 x alt-text, on view 2, hence the same weight 1) the effective weights are
#   CLS1 x alt-text, view 1: 1/4;  CLS1 x alt-text, view 2: 1/4;  CLS2 x synthetic, view 1: 1/2
# (total 1, TIPSv2's; `python -m tipsito.info` prints them); with one CLS token 1/2 + 1/2 (ITO's L_align).
# view_weighting='sum' gives 1/2 + 1/2 for CLS1 x alt-text and 1/2 for CLS2 (total 1.5), tipsito's
# behaviour before. Fusion: `loss.fusion` = 2 is ITO's lambda relative to the alt-text alignment
# (terms.py: fusion_term), i.e. weight 2 x (1/4 + 1/4) = 1 with 'mean' and two CLS, fusion : alignment = 2
# as in ITO (the weight 2 before was a ratio of 4; `loss.fusion=4` gives it back).
TIPSITO_RECIPE = Recipe(
  name="tipsito",
  doc="tipsito: TIPSv2 + ITO second view + fusion loss.",
  parts=_TIPS_PARTS + ("fusion",),
  loss={CLIP: 1.0, CLIP_VIEW2: 1.0, FUSION: 2.0, DINO: 1.0, IBOT: 2.0, KOLEO: 0.0},
  views="multicrop_two_views",
  num_cls=2,
  ema_mode="head",
  mask_ratio=0.75,
  optimizer="adafactor",
  pixel="tips",
  view_weighting="mean",
)

# Distillation (TIPSv2's B/L/So400m models are distilled from g/14): a frozen teacher replaces the
# teacher branch; the randomly initialised student image encoder learns through DINO (on the local crops,
# as in pretraining: TIPSv2 §3.1 names only the frozen teacher and no mask as changes; the global crop as
# a DINO student view is `config.distill.dino_global_crop`) and iBOT++ on every patch with no masking;
# the text tower trains with the CLIP loss (random init, or the teacher's text tower:
# `config.distill.init_text`). When the teacher is a tipsito training workdir, its own EMA DINO/iBOT
# heads are part of the frozen teacher and give the targets (no EMA in the student run). An
# export or official TIPS weights hold encoders only: the teacher heads are then the EMA of the student
# heads, applied to the frozen teacher features (our inference, logged at start). The student features
# pass a training-only `distill_proj` to the teacher width.
DISTILL_RECIPE = Recipe(
  name="distill",
  doc="Distillation from a frozen exported/imported teacher, mask ratio 0.",
  parts=_TIPS_PARTS + ("distill_proj",),
  loss={CLIP: 1.0, DINO: 1.0, IBOT: 2.0, FEATURE: 0.0, KOLEO: 0.0},
  views="multicrop",
  num_cls=2,
  ema_mode="head",
  mask_ratio=0.0,
  optimizer="adafactor",
  pixel="tips",
  teacher="frozen",
)

RECIPES: dict[str, Recipe] = {
  r.name: r
  for r in (
    CLIP_RECIPE,
    SIGLIP_RECIPE,
    ITO_RECIPE,
    TIPS_RECIPE,
    TIPSV2_RECIPE,
    TIPSITO_RECIPE,
    DISTILL_RECIPE,
  )
}


def get_recipe(name: str) -> Recipe:
  """Looks a recipe up by name; the error lists the valid names."""
  if name not in RECIPES:
    raise ValueError(f"config.recipe={name!r} is not a recipe; valid values: {sorted(RECIPES)}")
  return RECIPES[name]
