"""TIPSv2: L = L_CLIP + 1.0 L_DINO + 2.0 L_iBOT++ with head-only EMA, two CLS tokens (CLS1 <-> alt-text
'text', CLS2 <-> sampled synthetic caption 'text2'), Adafactor.

Why: the paper's recipe (METHOD §3). iBOT++ is iBOT with `loss_opts.ibot_all_patches=True`.
"""
from tipsito.recipes.base import Recipe

RECIPE = Recipe(
    name="tipsv2", doc="TIPSv2: 2-CLS CLIP + DINO + iBOT++ with head-only EMA, Adafactor.",
    parts=("image", "text", "logit_scale", "dino_head", "ibot_head"),
    loss={"clip": 1.0, "dino": 1.0, "ibot": 2.0, "koleo": 0.0}, views="multicrop", num_cls=2,
    ema_mode="head", mask_ratio=0.75, optimizer="adafactor", pixel="tips")
