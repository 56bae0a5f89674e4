"""TIPS (v1): two CLS tokens with CLIP losses, DINO on local crops and iBOT on masked tokens only,
with a full EMA teacher (image encoder + heads).

Why: the baseline TIPSv2 improves on; also the full-EMA ablation of the paper.
"""
from tipsito.recipes.base import Recipe

RECIPE = Recipe(
    name="tips", doc="TIPS: 2-CLS CLIP + DINO + iBOT (masked tokens), full EMA teacher, Adafactor.",
    parts=("image", "text", "logit_scale", "dino_head", "ibot_head"),
    loss={"clip": 1.0, "dino": 1.0, "ibot": 2.0, "koleo": 0.0}, views="multicrop", num_cls=2,
    ema_mode="full", mask_ratio=0.75, optimizer="adafactor", pixel="tips")
