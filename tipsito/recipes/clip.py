"""CLIP baseline: image/text towers, bias-free image projection, InfoNCE with a learned clamped scale.

Why: the reference point every vision-language paper compares to (ITO's and TIPSv2's tables).
"""
from tipsito.recipes.base import Recipe

RECIPE = Recipe(
    name="clip", doc="CLIP: InfoNCE between image CLS and caption (AdamW).",
    parts=("image", "text", "image_proj", "logit_scale"),
    loss={"clip": 1.0}, views="single", num_cls=1, ema_mode="none", mask_ratio=0.0,
    optimizer="adamw", pixel="clip")
