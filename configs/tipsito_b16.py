"""tipsito (ours) at B/16: TIPSv2 (2 CLS, DINO, iBOT++, head-only EMA, Adafactor) plus ITO's second view
contrasted with the alt-text and the fusion NT-Xent loss (lambda 2).

Args: data (webli | cc12m | ...), steps, batch.
"""
from tipsito.config import args
from tipsito.config import defaults


def get_config(arg=None):
  """tipsito B/16."""
  a = args.parse_arg(arg, data="webli", steps=90000, batch=4096)
  c = defaults.base_config("tipsito", "B/16", total_steps=a.steps, batch_size=a.batch)
  c.model.image.update(dict(dtype="bfloat16", remat=True))
  c.model.text.update(dict(dtype="bfloat16"))
  c.data = defaults.data_config(a.data)
  c.input.update(dict(views="multicrop_two_views", num_local=6, mask_ratio=0.75, augment="tips",
                      num_workers=32))
  c.optim.update(dict(lr=1e-3, warmup_steps=10000, momentum_dtype="bfloat16"))
  return c
