"""Config mapping -> flax module kwargs, the one conversion every builder of a tower uses; and the one
completion of a tower config with the tower module's defaults.

Why one function: configs hold dtypes as names and sequences as lists (JSON, ml_collections), while flax
module fields need dtype objects and hashable values. The training model (tipsito/train/step.py), the
distillation teacher (tipsito/train/teacher.py), the planner (tipsito/planning/pod.py) and inference
(tipsito/inference.py, from an export's config.json) must build the same module from the same config.

Why the completion is here: a tower config (an export's config.json `image`/`text`, or one built in memory
from official TIPS weights or a Hugging Face folder) may leave out structure keys that then mean the
module's default (an export written before the key existed). `complete_tower_config` fills them once,
from the module dataclasses themselves (tipsito/models/vit.py, tipsito/models/text.py), for the export
writer and reader (tipsito/export_format.py) and the in-memory producers, so that every reader (the
interop writers, the evaluators, the distillation teacher) reads the keys directly: a tower's defaults
live in its module alone (tests/test_config_reads.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax.numpy as jnp

from tipsito.models.text import TextEncoder
from tipsito.models.vit import VisionTransformer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_DTYPE_KEYS = ("dtype", "param_dtype")


def module_kwargs(cfg: Mapping[str, Any], module_cls: Optional[type] = None) -> dict:
  """`cfg` with dtype names resolved and lists as tuples.

  With `module_cls`, keys that are not fields of that flax module are dropped (an export's config.json
  may carry bookkeeping keys a newer or older module does not have).
  """
  fields = None if module_cls is None else set(module_cls.__dataclass_fields__) - {"parent", "name"}
  out = {}
  for k, v in dict(cfg).items():
    if fields is not None and k not in fields:
      continue
    if k in _DTYPE_KEYS and isinstance(v, str):
      v = _DTYPES[v] if v in _DTYPES else jnp.dtype(v)
    elif isinstance(v, list):
      v = tuple(v)
    out[k] = v
  return out


# The module each tower config builds.
TOWER_MODULES = {"image": VisionTransformer, "text": TextEncoder}
# Keys that fix the shapes of a tower's parameters. Every tower config tipsito has written (an export's
# config.json since its FORMAT_VERSION 1) states them, so one that is missing is refused, never filled:
# the module's default would build a tower the saved parameters do not fit.
SHAPE_KEYS = {
  "image": ("patch_size", "width", "depth", "num_heads", "mlp_dim"),
  "text": ("vocab_size", "width", "depth", "num_heads", "mlp_dim"),
}
# The keys of a tower config that fix its parameter tree or shapes: a run started from another model's
# towers (`config.init_from`) must agree with the source on each, checked before anything is written
# (tipsito/train/assembly.py `check_init_from`). `max_len` is not one: the TIPS text tower's positions are
# not parameters, so a run may shorten its captions (the load's per-leaf check covers the CLIP tower's).
PARAM_KEYS = {
  "image": (
    "patch_size",
    "width",
    "depth",
    "num_heads",
    "mlp_dim",
    "ffn",
    "num_cls_tokens",
    "posemb_grid",
    "patch_bias",
    "cls_posemb",
    "pre_norm",
  ),
  "text": ("flavour", "vocab_size", "width", "depth", "num_heads", "mlp_dim", "out_dim"),
}
# A tower's architecture: PARAM_KEYS and the keys that change what the same parameters compute (pixel
# statistics, activation, LayerNorm epsilon, caption length). configs/finetune.py copies these from the
# model it continues, so that the run computes what the source computed.
ARCHITECTURE_KEYS = {
  "image": PARAM_KEYS["image"] + ("pixel_mean", "pixel_std", "activation", "ln_eps"),
  "text": PARAM_KEYS["text"] + ("max_len", "activation", "ln_eps"),
}
# Module fields a tower config need not state and that are not filled: `remat` and `attention_recompute`
# are training-time memory settings with no effect on the outputs (the export leaves `remat` out of the
# image tower: tipsito/export_format.py write_export); the module's default applies when a tower is built.
UNSTATED_FIELDS = ("remat", "attention_recompute")


class TowerConfigError(ValueError):
  """A tower config lacks a key that cannot be filled with a default (says which config and key)."""


def _json_default(v: Any) -> Any:
  """A module field's default as a config holds it: dtypes by name, sequences as lists."""
  if isinstance(v, (tuple, list)):
    return [_json_default(x) for x in v]
  if isinstance(v, (str, bool, int, float)) or v is None:
    return v
  return jnp.dtype(v).name


def tower_defaults(tower: str) -> dict:
  """{field: default} of the `tower` ('image' | 'text') module, as a config holds them (JSON values)."""
  fields = TOWER_MODULES[tower].__dataclass_fields__
  return {
    k: _json_default(f.default)
    for k, f in fields.items()
    if k not in ("parent", "name") and k not in UNSTATED_FIELDS
  }


def complete_tower_config(cfg: Mapping[str, Any], tower: str, source: str) -> tuple[dict, list[str]]:
  """(`cfg` with every structure key of the `tower` module, the keys filled with the module's default).

  A key in SHAPE_KEYS that is missing raises TowerConfigError naming `source` (the file or producer the
  config comes from) and the key. Keys `cfg` states are kept as they are (also ones the module does not
  have: bookkeeping of a newer or older tipsito, which `module_kwargs` drops).
  """
  missing = [k for k in SHAPE_KEYS[tower] if k not in cfg]
  if missing:
    raise TowerConfigError(
      f"{source}: the {tower} tower config has no {', '.join(repr(f'{tower}.{k}') for k in missing)}; "
      "these fix the parameter shapes and have no default: add them to the config (the values the "
      "tower was trained with), or export the model again with this tipsito"
    )
  out = dict(cfg)
  filled = []
  for k, v in tower_defaults(tower).items():
    if k not in out:
      out[k] = v
      filled.append(k)
  return out, filled
