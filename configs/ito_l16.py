"""ITO ViT-L/16: as ito_b16 with the L/16 image tower (768-d text tower, 768-d embedding).

Args: data (as ito_b16), steps, batch.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("tipsito_configs_common",
                                               os.path.join(os.path.dirname(__file__), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  """ITO L/16 config."""
  a = common.parse_arg(arg, data="datacomp1b", steps=0, batch=8192)
  spec = importlib.util.spec_from_file_location("ito_b16", os.path.join(os.path.dirname(__file__), "ito_b16.py"))
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  c = base.get_config(f"data={a.data},variant=L/16,steps={a.steps},batch={a.batch}")
  c.model.embed_dim = 768
  c.model.text.update(dict(out_dim=768, width=768, num_heads=12, mlp_dim=3072))
  c.model.image.remat = True
  return c
