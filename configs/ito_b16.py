"""ITO ViT-B/16 (ITO paper): two augmented views, both contrasted with the caption, fusion NT-Xent with
lambda = 2, AdamW (0.9, 0.98, eps 1e-6, wd 0.1), 224px, batch 8192. Both views are random resized crops
of area 0.5-1.0 (`input.global_crop_scale`, `input.view2_crop_scale`; ITO, Method: "random resized crop
with scale 0.5-1.0").

Schedule (steps=0): `paper.ITO_STEPS` (tipsito/config/paper.py), ITO's "30 epochs unless noted" at batch
8192 for every set but DataComp-1B, which ITO trains "1 epoch" (its 10-epoch B/16 row is
`data=datacomp1b,steps=1600000`, 10 x that budget).

Args: data (cc3m | cc12m | yfcc15m | laion100m | datacomp1b), steps, batch.
"""

from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """ITO config for `data=...` (steps=0: the data set's budget, `paper.ITO_STEPS`)."""
  a = args.parse_arg(arg, data="cc12m", variant="B/16", steps=0, batch=8192)
  return paper.ito(a.data, a.variant, total_steps=a.steps, batch_size=a.batch)
