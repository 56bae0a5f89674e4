"""Distillation (TIPSv2 §3.1, Table 2): a frozen teacher replaces the teacher branch f_t; the randomly
initialised student image encoder learns through DINO and iBOT++ on every patch with no masking; the text
tower trains with the CLIP loss (random init, or the teacher's text tower: `config.distill.init_text`).

Why: TIPSv2's B/L/So400m models are distilled from g/14. When the teacher is a tipsito training workdir,
its own EMA DINO/iBOT heads are part of the frozen teacher and give the targets (no EMA in the student
run). An export or official TIPS weights hold encoders only: the teacher heads are then the EMA of the
student heads (head-only EMA, as in pretraining), applied to the frozen teacher features — our inference,
logged at start. The student features pass a training-only `distill_proj` to the teacher width.
"""
from tipsito.recipes.base import Recipe

RECIPE = Recipe(
    name="distill", doc="Distillation from a frozen exported/imported teacher, mask ratio 0.",
    parts=("image", "text", "logit_scale", "dino_head", "ibot_head", "distill_proj"),
    loss={"clip": 1.0, "dino": 1.0, "ibot": 2.0, "feature": 0.0, "koleo": 0.0}, views="multicrop",
    num_cls=2, ema_mode="head", mask_ratio=0.0, optimizer="adafactor", pixel="tips", teacher="frozen")
