"""The complete default config, built from the schema; data presets; typed optional keys.

Why: every experiment file (configs/demo.py, configs/tipsv2_g14.py, ...) is a short `get_config(arg)` that
starts from `base_config(recipe, variant)` and overrides what the paper says. The keys, their defaults,
types and ranges are declared once in tipsito/config/schema.py; this module only assembles them for a
recipe and variant (and holds the data presets and the small `tiny_config` of the tests).
"""

from __future__ import annotations

from typing import Any

import ml_collections as mlc
from ml_collections import config_dict

from tipsito.config import args
from tipsito.config import schema
from tipsito.config import recipes


# Keys whose value may be None, with the type a command-line value is parsed as (declared in
# tipsito/config/schema.py, `optional=True`). Why: ml_collections can override a key from the command line
# (`--config.data.data_dir=/x`) only when it knows the key's type, and a bare None has none ("Type NoneType
# ... is not supported for overriding"). Each of these keys is a typed field reference instead, so it
# stays overridable after a config file sets it to None. `object` takes a Python literal
# (`--config.data.build_options="{'image_size': 32}"`); '*' matches any user-named entry.
OPTIONAL_KEYS = schema.optional_keys()

# Top-level keys of a training config that a standalone eval config (configs/eval_*.py, read by
# `python -m tipsito.evaluate --config`) may leave out beside `evals`: `eval_config_values` gives them the
# schema's defaults, so the evaluator reads no key with a default of its own.
EVAL_CONFIG_KEYS = ("tokenizer",)


def eval_config_values(config: Any) -> dict[str, Any]:
  """{key: value} of EVAL_CONFIG_KEYS in a training or standalone eval `config`: the config's own value,
  else the schema's default (tipsito/config/schema.py)."""
  declared = {k.path: k.default for k in schema.KEYS}
  return {k: config[k] if k in config else declared[k] for k in EVAL_CONFIG_KEYS}


def typed_optionals(c: mlc.ConfigDict, prefix: str = "") -> mlc.ConfigDict:
  """Makes every OPTIONAL_KEYS entry under `c` (whose path is `prefix`) a typed field reference, in place.

  Called by base_config / data_config / eval configs; returns `c` for chaining.
  """
  for path, typ in OPTIONAL_KEYS.items():
    parts = path.split(".")
    if prefix:
      pre = prefix.split(".")
      if parts[: len(pre)] != pre:
        continue
      parts = parts[len(pre) :]
    _type_leaves(c, parts, typ)
  return c


def _type_leaves(node: mlc.ConfigDict, parts: list[str], typ: type) -> None:
  head, rest = parts[0], parts[1:]
  keys = list(node.keys()) if head == "*" else [head] if head in node else []
  for k in keys:
    if rest:
      if isinstance(node[k], mlc.ConfigDict):
        _type_leaves(node[k], rest, typ)
      continue
    if isinstance(node._fields.get(k), config_dict.FieldReference):  # pylint: disable=protected-access
      continue
    value = node[k]
    if isinstance(value, mlc.ConfigDict):
      value = value.to_dict()
    if typ is tuple and isinstance(value, list):
      value = tuple(value)
    node[k] = config_dict.FieldReference(value, field_type=typ)


# Paper data mixtures: TFDS names/data dirs are placeholders the user points at their prepared copies
# (converted with `python -m tipsito.data.convert`); field names follow the shared record schema.
DATA_PRESETS = {
  "shapes": dict(name="shapes", caption_keys=("caption_detailed",)),
  "scenes": dict(name="scenes", caption_keys=("caption", "caption_detailed")),
  "openclipart": dict(name="openclipart", caption_keys=("caption_short", "caption_detailed")),
  "webli": dict(name="webli", caption_keys=("caption_paligemma", "caption_gemini")),
  "cc3m": dict(name="cc3m", caption_keys=()),
  "cc12m": dict(name="cc12m", caption_keys=()),
  "yfcc15m": dict(name="yfcc15m", caption_keys=()),
  "laion100m": dict(name="laion100m", caption_keys=()),
  "datacomp1b": dict(name="datacomp1b", caption_keys=()),
}


def data_config(preset: str, **overrides: Any) -> mlc.ConfigDict:
  """`config.data` for a named preset (see DATA_PRESETS): the schema's `data.*` defaults, the preset, then
  `overrides`."""
  args.check_choice("data", preset, DATA_PRESETS)
  d = {k.path.split(".", 1)[1]: k.default for k in schema.KEYS if k.path.startswith("data.")}
  d.update(DATA_PRESETS[preset])
  d.update(overrides)
  return typed_optionals(mlc.ConfigDict(d), "data")


def base_config(
  recipe_name: str,
  variant: str,
  *,
  text_variant: str | None = None,
  total_steps: int = 1000,
  batch_size: int = 1024,
) -> mlc.ConfigDict:
  """The complete default config for `recipe_name` with image tower `variant` (e.g. 'B/14').

  Every key and its default is declared in tipsito/config/schema.py; the recipe-dependent defaults (loss
  weights, views, CLS count, EMA mode, mask ratio, optimizer, pixel statistics) come from the recipe
  table (tipsito/config/recipes.py), the tower sizes from the variant presets. Everything is
  overridable afterwards.
  """
  ctx = schema.Ctx(
    recipe=recipes.get_recipe(recipe_name),
    variant=variant,
    text_variant=text_variant or variant,
    total_steps=total_steps,
    batch_size=batch_size,
  )
  c = mlc.ConfigDict(schema.defaults_for(ctx))
  c.data = data_config("shapes")
  return typed_optionals(c)


def tiny_config(
  recipe_name: str, *, batch_size: int = 8, total_steps: int = 10, image_size: int = 32, num_local: int = 2
) -> mlc.ConfigDict:
  """A CPU-sized config of any recipe (tests, `bench` smoke runs): tiny/16 towers, small heads."""
  c = base_config(recipe_name, "tiny/16", total_steps=total_steps, batch_size=batch_size)
  c.model.text.vocab_size = None  # the demo tokenizer's size (tests that never tokenize pass their own)
  c.max_len = 8
  c.model.text.max_len = 8
  c.model.heads.update(dict(num_prototypes=64, hidden_dim=32, bottleneck_dim=16))
  c.model.fusion.update(dict(width=32, depth=1, num_heads=2))
  c.input.update(dict(global_size=image_size, local_size=image_size // 2))
  if c.input.num_local:
    c.input.num_local = num_local
  c.optim.warmup_steps = 0
  c.optim.lr = 1e-3
  c.optim.min_dim_size_to_factor = 32
  c.ckpt.update(dict(every_steps=5, keep=2, async_save=False))
  c.log_every_steps = 1
  return c
