"""Distillation (TIPSv2 §3.1): a frozen teacher (a tipsito export or imported official TIPS weights)
supervises a randomly initialised student image encoder through DINO and iBOT++ on every patch with no
masking; the text tower trains with the CLIP loss (random init, or the teacher's text tower when widths
match: `config.distill.init_text`).

Why: TIPSv2's B/L/So400m models are distilled from g/14. The teacher's heads are not part of an export, so
the teacher heads are the EMA of the student heads (head-only EMA, as in pretraining) applied to the frozen
teacher features, and the student features pass a training-only `distill_proj` to the teacher width.
"""
from tipsito.recipes.base import Recipe

RECIPE = Recipe(
    name="distill", doc="Distillation from a frozen exported/imported teacher, mask ratio 0.",
    parts=("image", "text", "logit_scale", "dino_head", "ibot_head", "distill_proj"),
    loss={"clip": 1.0, "dino": 1.0, "ibot": 2.0, "feature": 0.0, "koleo": 0.0}, views="multicrop",
    num_cls=2, ema_mode="head", mask_ratio=0.0, optimizer="adafactor", pixel="tips", teacher="frozen")
