"""CLIP baseline ViT-B/16 (AdamW, batch 8192, 224px, single view).

Args: data (cc3m | cc12m | yfcc15m | laion100m | datacomp1b), steps, batch.
"""

from tipsito.config import args
from tipsito.config import defaults


def get_config(arg=None):
  """CLIP B/16 baseline."""
  a = args.parse_arg(arg, data="cc12m", steps=48000, batch=8192)
  c = defaults.base_config("clip", "B/16", total_steps=a.steps, batch_size=a.batch)
  c.model.embed_dim = 512
  c.model.text.update(
    dict(
      out_dim=512,
      width=512,
      depth=12,
      num_heads=8,
      mlp_dim=2048,
      vocab_size=49408,
      max_len=77,
      dtype="bfloat16",
    )
  )
  c.max_len = 77
  c.model.image.dtype = "bfloat16"
  c.data = defaults.data_config(a.data)
  c.input.update(dict(augment="ito", num_workers=32))
  c.optim.update(dict(lr=1e-3, warmup_steps=2000))
  return c
