"""The argument of a config file (`--config configs/X.py:k=v,k2=v2`), big_vision style.

Why: ml_collections hands everything after the ':' to `get_config(arg)` as one string; each experiment
file declares its arguments with their defaults, and a wrong key or value fails naming what is allowed.
"""

from __future__ import annotations

from typing import Any

import ml_collections as mlc


def parse_arg(arg: str | None, **defaults: Any) -> mlc.ConfigDict:
  """big_vision-style 'k=v,k2=v2' config argument; values are cast to the type of the default.

  Unknown keys fail naming the key and the known ones (the same rule as every other config key).
  """
  out = dict(defaults)
  for kv in (arg or "").split(","):
    if not kv.strip():
      continue
    if "=" not in kv:
      raise ValueError(f"config arg {kv!r}: expected k=v; known keys: {sorted(defaults)}")
    k, v = (s.strip() for s in kv.split("=", 1))
    if k not in defaults:
      raise ValueError(f"config arg key {k!r} unknown; known keys: {sorted(defaults)}")
    d = defaults[k]
    if isinstance(d, bool):
      v = v.lower() in ("1", "true", "yes")
    elif isinstance(d, int):
      v = int(v)
    elif isinstance(d, float):
      v = float(v)
    out[k] = v
  return mlc.ConfigDict(out)


def check_choice(name: str, value: Any, allowed) -> Any:
  """Config-arg enumerations fail with the allowed values (e.g. `student=B|L|So400m`)."""
  if value not in allowed:
    raise ValueError(f"config arg {name}={value!r} not allowed; valid values: {list(allowed)}")
  return value
