"""tipsito model zoo: image/text encoders (kept at inference) and training-only
heads and fusion module. Re-exported here so configs and recipes import one
namespace."""

from tipsito.models.fusion import FusionTransformer
from tipsito.models.heads import DINOHead
from tipsito.config.presets import TEXT_PRESETS, VIT_PRESETS, text_config, vit_config
from tipsito.models.text import TextEncoder
from tipsito.models.vit import VisionTransformer

__all__ = [
  'VisionTransformer',
  'TextEncoder',
  'DINOHead',
  'FusionTransformer',
  'VIT_PRESETS',
  'TEXT_PRESETS',
  'vit_config',
  'text_config',
]
