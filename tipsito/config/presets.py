"""Architecture presets for the image and text towers.

Why a table: every recipe (TIPSv2, ITO, CLIP, distillation) names its towers by
variant ('B/14', 'g/14', ...) and the sizes must be exactly those of the
official TIPS release / TIPSv2 Table 16 so that parameter counts and released
checkpoints line up. Recipe-level choices (number of CLS tokens,
pixel statistics, dtype, mask token, tower structure) are *not* part of a
preset: they are given as overrides by the config that uses the preset.
"""

from __future__ import annotations

import copy
from typing import Any

# Pixel statistics. TIPS feeds [0,1] pixels unnormalised; CLIP/ITO use the
# OpenAI CLIP statistics.
TIPS_PIXEL_MEAN = (0.0, 0.0, 0.0)
TIPS_PIXEL_STD = (1.0, 1.0, 1.0)
CLIP_PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)

# LayerNorm epsilon: the official TIPS release (flax default 1e-6) and torch.nn.LayerNorm's default,
# which OpenCLIP and Hugging Face CLIP (`layer_norm_eps`) use.
TIPS_LN_EPS = 1e-6
OPENCLIP_LN_EPS = 1e-5

# Tower structure by family, given as overrides next to a size preset (tipsito/config/defaults.py).
# 'tips': the official TIPS towers (the module defaults). 'openclip': OpenCLIP's ViT and text
# transformer (ViT-B-16: nn.GELU, i.e. exact erf GELU; LayerNorm 1e-5; conv1 without bias; a position
# row for the class token; ln_pre), so that CLIP/SigLIP/ITO weights map one-to-one onto OpenCLIP and
# Hugging Face CLIPModel (tests/test_models_openclip.py holds the name mapping).
IMAGE_STRUCTURE: dict[str, dict[str, Any]] = {
  'tips': dict(activation='gelu', ln_eps=TIPS_LN_EPS, patch_bias=True, cls_posemb=False, pre_norm=False),
  'openclip': dict(
    activation='gelu_exact', ln_eps=OPENCLIP_LN_EPS, patch_bias=False, cls_posemb=True, pre_norm=True
  ),
}
TEXT_STRUCTURE: dict[str, dict[str, Any]] = {
  'tips': dict(flavour='tips', activation='relu', ln_eps=TIPS_LN_EPS),
  'openclip': dict(flavour='clip', activation='gelu_exact', ln_eps=OPENCLIP_LN_EPS),
}


def _vit(
  width: int, depth: int, num_heads: int, mlp_dim: int, patch_size: int, ffn: str = 'mlp'
) -> dict[str, Any]:
  """Builds one preset row; a helper so the table below stays one line per row."""
  return dict(width=width, depth=depth, num_heads=num_heads, mlp_dim=mlp_dim, ffn=ffn, patch_size=patch_size)


# Image tower presets (the TIPS release's sizes; ITO's B/16, L/16; small test sizes).
VIT_PRESETS: dict[str, dict[str, Any]] = {
  'tiny/14': _vit(64, 2, 4, 128, 14),
  'tiny/16': _vit(64, 2, 4, 128, 16),
  'Ti/16': _vit(192, 12, 3, 768, 16),
  'Ti/14': _vit(192, 12, 3, 768, 14),
  'S/14': _vit(384, 12, 6, 1536, 14),
  'S/16': _vit(384, 12, 6, 1536, 16),
  'B/14': _vit(768, 12, 12, 3072, 14),
  'B/16': _vit(768, 12, 12, 3072, 16),
  'L/14': _vit(1024, 24, 16, 4096, 14),
  'L/16': _vit(1024, 24, 16, 4096, 16),
  'So400m/14': _vit(1152, 27, 16, 4304, 14),
  'g/14': _vit(1536, 40, 24, 6144, 14, ffn='swiglu'),
}


def _text(width: int, depth: int, num_heads: int, mlp_dim: int) -> dict[str, Any]:
  """Builds one text preset row."""
  return dict(width=width, depth=depth, num_heads=num_heads, mlp_dim=mlp_dim)


# Text tower presets, keyed by the size prefix of the image variant. TIPS text
# width = image width; 12 layers except So400m (27 layers, TIPSv2 Table 16:
# 448.3M). g keeps a plain ReLU MLP of 6144 (the official text tower has no
# SwiGLU).
TEXT_PRESETS: dict[str, dict[str, Any]] = {
  'tiny': _text(64, 2, 4, 128),
  'Ti': _text(192, 12, 3, 768),
  'S': _text(384, 12, 6, 1536),
  'B': _text(768, 12, 12, 3072),
  'L': _text(1024, 12, 16, 4096),
  'So400m': _text(1152, 27, 16, 4304),
  'g': _text(1536, 12, 24, 6144),
}


def vit_config(variant: str, **overrides: Any) -> dict[str, Any]:
  """Returns VisionTransformer kwargs for `variant` with `overrides` applied.

  A plain dict (not a ConfigDict) so that it can be stored in ml_collections
  configs, json export configs and passed as `VisionTransformer(**cfg)`.
  """
  return _preset(VIT_PRESETS, variant, variant, 'image', overrides)


def text_config(variant: str, **overrides: Any) -> dict[str, Any]:
  """Returns TextEncoder kwargs for `variant` (e.g. 'B' or 'B/14') + overrides.

  Accepts the full image variant name too, since configs usually select one
  variant for both towers.
  """
  return _preset(TEXT_PRESETS, variant.split('/')[0], variant, 'text', overrides)


def _preset(table: dict, key: str, variant: str, tower: str, overrides: dict) -> dict[str, Any]:
  """A copy of `table[key]` with `overrides` applied; unknown keys name the tower and the known ones."""
  if key not in table:
    raise ValueError(f'Unknown {tower} variant {variant!r}; known: {sorted(table)}')
  cfg = copy.deepcopy(table[key])
  cfg.update(overrides)
  return cfg


def swiglu_hidden_dim(mlp_dim: int) -> int:
  """SwiGLU hidden size of the official release: (int(mlp*2/3)+7)//8*8.

  Keeps the parameter count of a SwiGLU FFN close to a 2-matrix MLP of size
  `mlp_dim` (three matrices of 2/3 the size), rounded to a multiple of 8.
  """
  return (int(mlp_dim * 2 / 3) + 7) // 8 * 8
