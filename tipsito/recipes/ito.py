"""ITO: two augmented views, both contrasted with the caption, plus the fusion NT-Xent loss.

Why: ITO (METHOD §3): L = L_align + lambda * L_fusion with L_align the mean over the two views, i.e.
weights clip = clip_view2 = 0.5 and fusion = lambda = 2. The fusion Transformer is training-only.
"""
from tipsito.recipes.base import Recipe

RECIPE = Recipe(
    name="ito", doc="ITO: two views x caption InfoNCE + fusion NT-Xent (lambda=2), AdamW.",
    parts=("image", "text", "image_proj", "logit_scale", "fusion"),
    loss={"clip": 0.5, "clip_view2": 0.5, "fusion": 2.0}, views="two_views", num_cls=1,
    ema_mode="none", mask_ratio=0.0, optimizer="adamw", pixel="clip")
