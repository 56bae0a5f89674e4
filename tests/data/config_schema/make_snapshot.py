"""Snapshot of today's default configs (for tests/test_config_schema.py)."""

import importlib
import json
import sys
import ml_collections as mlc
from ml_collections import config_dict
from tipsito.config import defaults
from tipsito.config import recipes


def leaves(c, prefix=""):
  out = []
  for k in c.keys():
    path = prefix + k
    field = c._fields[k]
    v = c[k]
    if isinstance(v, mlc.ConfigDict) and not isinstance(field, config_dict.FieldReference):
      out.append([path, "<dict>", None])
      out.extend(leaves(v, path + "."))
    else:
      ft = field._field_type.__name__ if isinstance(field, config_dict.FieldReference) else None
      out.append([path, repr(v.to_dict() if isinstance(v, mlc.ConfigDict) else v), ft])
  return out


snap = {}
for r in recipes.RECIPES:
  snap[f"base_config/{r}/tiny/16"] = leaves(defaults.base_config(r, "tiny/16"))
  snap[f"base_config/{r}/B/16/90000/4096/L"] = leaves(
    defaults.base_config(r, "B/16", text_variant="L", total_steps=90000, batch_size=4096)
  )
  if r == "tipsv2":
    snap[f"base_config/{r}/g/14/50/64"] = leaves(
      defaults.base_config(r, "g/14", total_steps=50, batch_size=64)
    )
  snap[f"tiny_config/{r}"] = leaves(defaults.tiny_config(r))
for r in ("clip", "siglip", "ito", "tips", "tipsv2", "tipsito"):
  for extra in ("", ",optim=adafactor,pixels=tips"):
    arg = f"recipe={r}{extra},data=shapes"
    mod = importlib.import_module("configs.demo")
    snap[f"configs/demo.py:{arg}"] = leaves(mod.get_config(arg))
for name in (
  "clip_b16",
  "siglip_b16",
  "ito_b16",
  "ito_l16",
  "tipsito_b16",
  "tipsv2_g14",
  "tipsv2_distill",
  "eval_shapes",
):
  mod = importlib.import_module(f"configs.{name}")
  try:
    snap[f"configs/{name}.py"] = leaves(mod.get_config(None))
  except Exception as e:
    print("skip", name, type(e).__name__, e, file=sys.stderr)
json.dump(snap, open(sys.argv[1], "w"), separators=(",", ":"), sort_keys=True)
print(len(snap), "configs")
