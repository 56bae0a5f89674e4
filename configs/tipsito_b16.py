"""tipsito (ours) at B/16: TIPSv2 (2 CLS, DINO, iBOT++, head-only EMA, Adafactor) plus ITO's second view
contrasted with the alt-text and the fusion NT-Xent loss (lambda 2).

Crop sizes: 1 global crop of 224 px and 6 local crops of 96 px (14 x 14 and 6 x 6 patches of 16 px).
TIPSv2 §4 ("Implementation details") trains "1 global crop at resolution 224 and 6 local crops at
resolution 98": whole patches of its patch 14 (16 and 7). At patch 16, 98 px is 6.125 patches and the ViT
would centre zero-pad every local crop to 112 px, so about 23 % of each DINO student input would be a black
frame the teacher never sees (validation refuses it). 96 = 6 x 16 keeps TIPSv2's 224:98 global-to-local
ratio closest (224/96 = 2.33 against 2.29) and its local crop's pixel size; 112 = 7 x 16 would keep
TIPSv2's 7 x 7 local token grid but give 2.0 (the alternative: `--config.input.local_size=112`).

Views: view 1 is TIPSv2's global view, the whole image (`input.global_crop_scale=(1.0, 1.0)`; TIPSv2
§3.1: "the teacher network f_t processes the original image I, and the student network f_s processes a
crop or masked view"; §4: "We use only random resizes, crops and flips as augmentations"; the full
argument is in configs/tipsv2_g14.py; the DINOv2 range is `--config.input.global_crop_scale='(0.32,
1.0)'`). View 2 is ITO's view: ITO's photometric ops (`input.augment_view2='ito'`) and ITO's crop scale
(`input.view2_crop_scale=(0.5, 1.0)`; ITO, Method: "random resized crop with scale 0.5-1.0").

Args: data (webli | cc12m | ...), steps, batch.
"""

from tipsito.config import args
from tipsito.config import defaults
from tipsito.config import paper


def get_config(arg=None):
  """tipsito B/16."""
  a = args.parse_arg(arg, data="webli", steps=90000, batch=4096)
  c = defaults.base_config("tipsito", "B/16", total_steps=a.steps, batch_size=a.batch)
  c.model.image.update(dict(dtype="bfloat16", remat=True))
  c.model.text.update(dict(dtype="bfloat16"))
  c.model.fusion.chunks = paper.FUSION_CHUNKS  # 9.93 -> 9.85 GiB per chip at 64 (docs/performance.md)
  c.data = defaults.data_config(a.data)
  c.input.update(
    dict(
      views="multicrop_two_views",
      global_size=224,
      local_size=96,
      num_local=6,
      mask_ratio=0.75,
      augment="tips",
      global_crop_scale=paper.TIPSV2_GLOBAL_CROP_SCALE,
      augment_view2="ito",
      view2_crop_scale=paper.ITO_CROP_SCALE,
      num_workers=32,
    )
  )
  c.optim.update(dict(lr=1e-3, warmup_steps=10000, momentum_dtype="bfloat16"))
  return c
