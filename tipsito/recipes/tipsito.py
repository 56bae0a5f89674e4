"""tipsito (ours): TIPSv2 plus ITO's second augmented view ('image2', contrasted with 'text') and the
fusion NT-Xent loss between (view 1 + caption) and (view 2 + caption).

Why: tests whether ITO's cheap second view and fusion module add to TIPSv2; every term is switchable.
"""
from tipsito.recipes.base import Recipe

RECIPE = Recipe(
    name="tipsito", doc="tipsito: TIPSv2 + ITO second view + fusion loss.",
    parts=("image", "text", "logit_scale", "dino_head", "ibot_head", "fusion"),
    loss={"clip": 1.0, "clip_view2": 0.5, "fusion": 2.0, "dino": 1.0, "ibot": 2.0, "koleo": 0.0},
    views="multicrop_two_views", num_cls=2, ema_mode="head", mask_ratio=0.75, optimizer="adafactor",
    pixel="tips")
