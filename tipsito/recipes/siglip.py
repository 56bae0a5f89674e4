"""SigLIP baseline: pairwise sigmoid loss with learned scale (init 10) and bias (init -10).

Why: the second standard baseline; needs no batch-wide softmax.
"""
from tipsito.recipes.base import Recipe

RECIPE = Recipe(
    name="siglip", doc="SigLIP: sigmoid image-text loss with learned scale and bias.",
    parts=("image", "text", "image_proj", "logit_scale", "logit_bias"),
    loss={"siglip": 1.0}, views="single", num_cls=1, ema_mode="none", mask_ratio=0.0,
    optimizer="adamw", pixel="clip")
