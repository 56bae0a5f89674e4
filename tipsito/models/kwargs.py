"""Config mapping -> flax module kwargs, the one conversion every builder of a tower uses.

Why one function: configs hold dtypes as names and sequences as lists (JSON, ml_collections), while flax
module fields need dtype objects and hashable values. The training model (tipsito/train/step.py), the
distillation teacher (tipsito/train/teacher.py), the planner (tipsito/plan.py) and inference
(tipsito/inference.py, from an export's config.json) must build the same module from the same config.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax.numpy as jnp

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
