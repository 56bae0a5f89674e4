"""SigLIP baseline ViT-B/16: sigmoid loss, learned scale (init 10) and bias (init -10), AdamW.

Args: data, steps, batch.
"""

from tipsito.config import args
from tipsito.config import defaults


def get_config(arg=None):
  """SigLIP B/16 baseline."""
  a = args.parse_arg(arg, data="cc12m", steps=48000, batch=8192)
  c = defaults.base_config("siglip", "B/16", total_steps=a.steps, batch_size=a.batch)
  c.model.embed_dim = 768
  c.model.text.update(dict(out_dim=768, vocab_size=32000, max_len=64, dtype="bfloat16"))
  c.model.image.dtype = "bfloat16"
  c.model.logit_bias_init = -10.0
  c.data = defaults.data_config(a.data)
  c.input.update(dict(augment="ito", num_workers=32))
  c.optim.update(dict(lr=1e-3, warmup_steps=2000, weight_decay=1e-4))
  return c
