"""The composite training model: every trainable part a recipe may use, in one flax module.

Why one module with named methods instead of one module per recipe: the parameter tree is then identical
across recipes for the parts they share ('image', 'text', 'image_proj', 'logit_scale', 'dino_head', ...),
so sharding rules, EMA subsets, the exporter and `info` all address parts by the same top-level names.
Which parts exist is decided by the recipe (`Recipe.parts`); the loss terms decide which methods are called.
Top-level param names (shared with `tipsito.export_format.write_export`):
  image (VisionTransformer), text (TextEncoder), image_proj (bias-free Dense, CLIP/ITO only),
  logit_scale (log of the contrastive scale s; TIPS' temperature is T = 1/s), logit_bias (SigLIP),
  dino_head / ibot_head (student DINO/iBOT heads), fusion (ITO fusion Transformer),
  distill_proj (distillation: student width -> teacher width, training only).
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from tipsito import models


class TrainModel(nn.Module):
  """Image/text encoders plus the training-only parts listed in `parts`.

  Attributes:
    image_cfg: VisionTransformer kwargs.
    text_cfg: TextEncoder kwargs.
    parts: names of the top-level parts to build (see module docstring).
    embed_dim: output dim of `image_proj` (CLIP/ITO); unused when 'image_proj' not in parts.
    heads_cfg: DINOHead kwargs (shared by the DINO and iBOT heads).
    fusion_cfg: FusionTransformer kwargs.
    logit_scale_init: initial log of the contrastive scale (ln(1/0.07) for CLIP/TIPS, ln(10) SigLIP).
    logit_bias_init: initial SigLIP bias.
    distill_dim: teacher width for `distill_proj`.
  """

  image_cfg: Any
  text_cfg: Any
  parts: tuple[str, ...]
  embed_dim: Optional[int] = None
  heads_cfg: Any = None
  fusion_cfg: Any = None
  logit_scale_init: float = 2.6592600369262695  # ln(1/0.07)
  logit_bias_init: float = -10.0
  distill_dim: Optional[int] = None

  def setup(self):
    self.image = models.VisionTransformer(**dict(self.image_cfg))
    if "text" in self.parts:
      self.text = models.TextEncoder(**dict(self.text_cfg))
    if "image_proj" in self.parts:
      self.image_proj = nn.Dense(
        self.embed_dim,
        use_bias=False,
        name="image_proj",
        param_dtype=self.image_cfg["param_dtype"],
      )
    if "logit_scale" in self.parts:
      self.logit_scale = self.param("logit_scale", nn.initializers.constant(self.logit_scale_init), ())
    if "logit_bias" in self.parts:
      self.logit_bias = self.param("logit_bias", nn.initializers.constant(self.logit_bias_init), ())
    if "dino_head" in self.parts:
      self.dino_head = models.DINOHead(**dict(self.heads_cfg))
    if "ibot_head" in self.parts:
      self.ibot_head = models.DINOHead(**dict(self.heads_cfg))
    if "fusion" in self.parts:
      self.fusion = models.FusionTransformer(**dict(self.fusion_cfg))
    if "distill_proj" in self.parts:
      self.distill_proj = nn.Dense(self.distill_dim, name="distill_proj")

  # --- methods called by the losses -------------------------------------------------------------
  def encode_image(self, images, mask=None, train=False, cls_only=False):
    """Image tower: {'cls': (B,n,D), 'patches': (B,h,w,D)}; {'cls'} alone with `cls_only` (its last
    block then computes the CLS rows only: `VisionTransformer`)."""
    return self.image(images, mask=mask, train=train, cls_only=cls_only)

  def encode_text(self, ids, train=False, pooled_only=False):
    """Text tower: {'pooled', 'tokens', 'valid'}; no 'tokens' with `pooled_only` (`TextEncoder`)."""
    return self.text(ids, train=train, pooled_only=pooled_only)

  def project(self, x):
    """Image embedding for the contrastive loss: `image_proj` when present, identity (TIPS) otherwise."""
    return self.image_proj(x) if "image_proj" in self.parts else x

  def scales(self):
    """(logit_scale (log s), logit_bias or 0)."""
    bias = self.logit_bias if "logit_bias" in self.parts else jnp.zeros(())
    return self.logit_scale, bias

  def dino(self, x):
    """DINO head logits (fp32)."""
    return self.dino_head(x)

  def ibot(self, x):
    """iBOT head logits (fp32)."""
    return self.ibot_head(x)

  def fuse(self, image_cls, image_patches, text_tokens, text_valid):
    """ITO fusion embedding (B, fusion width), unit norm."""
    return self.fusion(image_cls, image_patches, text_tokens, text_valid)

  def to_teacher_width(self, x):
    """Distillation: maps student features into the teacher's width before the shared-shape heads."""
    return self.distill_proj(x)

  def init_all(self, images, ids):
    """Touches every part once so `init` creates all parameters (used only for initialisation)."""
    mask = None
    if self.image_cfg.get("use_mask_token"):
      b = images.shape[0]
      p = self.image_cfg["patch_size"]
      mask = jnp.zeros((b, -(-images.shape[1] // p), -(-images.shape[2] // p)), bool)
    img = self.encode_image(images, mask=mask)
    cls = img["cls"][:, 0]
    out = {"emb": self.project(cls)}
    if "text" in self.parts:
      txt = self.encode_text(ids)
      out["text"] = txt["pooled"]
    if "logit_scale" in self.parts:
      out["scales"] = self.scales()
    feats, patches = cls, img["patches"]
    if "distill_proj" in self.parts:
      feats, patches = self.to_teacher_width(feats), self.to_teacher_width(patches)
    if "dino_head" in self.parts:
      out["dino"] = self.dino(feats)
    if "ibot_head" in self.parts:
      out["ibot"] = self.ibot(patches)
    if "fusion" in self.parts:
      out["fusion"] = self.fuse(cls, img["patches"], txt["tokens"], txt["valid"])
    return out
