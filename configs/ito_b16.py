"""ITO ViT-B/16 (ITO paper): two augmented views, both contrasted with the caption, fusion NT-Xent with
lambda = 2, AdamW (0.9, 0.98, eps 1e-6, wd 0.1), 224px, batch 8192.

Args: data (cc3m | cc12m | yfcc15m | laion100m | datacomp1b), steps, batch.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("tipsito_configs_common",
                                               os.path.join(os.path.dirname(__file__), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


# Steps per data set: ~32 epochs for CC3M/CC12M/YFCC, one pass-equivalent budget for the large sets.
STEPS = dict(cc3m=12000, cc12m=48000, yfcc15m=60000, laion100m=120000, datacomp1b=160000)


def get_config(arg=None):
  """ITO config for `data=...`."""
  a = common.parse_arg(arg, data="cc12m", variant="B/16", steps=0, batch=8192)
  common.check_choice("data", a.data, tuple(STEPS))
  common.check_choice("variant", a.variant, ("B/16", "L/16"))
  c = common.base_config("ito", a.variant, total_steps=a.steps or STEPS[a.data], batch_size=a.batch)
  c.model.embed_dim = 512
  c.model.text.update(dict(out_dim=512, width=512, depth=12, num_heads=8, mlp_dim=2048, vocab_size=49408,
                           max_len=77, dtype="bfloat16"))
  c.max_len = 77
  c.model.fusion.max_text_len = 77
  c.model.image.update(dict(dtype="bfloat16"))
  c.data = common.data_config(a.data)
  c.input.update(dict(views="two_views", augment="ito", num_local=0, num_workers=32))
  c.optim.update(dict(name="adamw", lr=1e-3, warmup_steps=2000, b1=0.9, b2=0.98, eps=1e-6,
                      weight_decay=0.1))
  c.evals.zeroshot = dict(type="zeroshot", dataset="imagenet2012", split="validation", every_steps=5000,
                          batch_size=1024, image_size=224)
  return c
