"""ITO ViT-L/16: as ito_b16 with the L/16 image tower (768-d text tower, 768-d embedding).

Args: data (as ito_b16), steps, batch.
"""

from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """ITO L/16 config."""
  a = args.parse_arg(arg, data="datacomp1b", steps=0, batch=8192)
  c = paper.ito(a.data, "L/16", total_steps=a.steps, batch_size=a.batch)
  c.model.embed_dim = 768
  c.model.text.update(dict(out_dim=768, width=768, num_heads=12, mlp_dim=3072))
  c.model.image.remat = True
  return c
