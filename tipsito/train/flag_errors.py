"""Flag parsing that turns a mistyped `--config.<key>` into one line naming the key and the fix.

Why: ml_collections raises an AttributeError from inside its flag parser for an unknown key, which absl
prints as a 57-line traceback ending in `AttributeError: '\\'ibott\\'\\nDid you mean "ibot" ...'`. Here the
config file is loaded again, the override path is walked key by key, and the first unknown key is
reported with its closest match and the valid keys at that level.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from typing import Optional, Sequence

from absl import app


def _config_arg(argv: Sequence[str], name: str = "config") -> Optional[str]:
  for i, a in enumerate(argv):
    if a == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
    if a.startswith(f"--{name}="):
      return a.split("=", 1)[1]
  return None


def _load(spec: str):
  path, _, arg = spec.partition(":")
  mod_spec = importlib.util.spec_from_file_location("tipsito_flag_errors_config", os.path.expanduser(path))
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  return mod.get_config(arg or None)


def explain_unknown_override(argv: Sequence[str], name: str = "config") -> Optional[str]:
  """The message for the first `--config.a.b=v` whose key does not exist in the config file, or None."""
  spec = _config_arg(argv, name)
  if spec is None:
    return None
  try:
    config = _load(spec)
  except Exception:  # pylint: disable=broad-except  # the config file itself fails: not our case
    return None
  prefix = f"--{name}."
  for a in argv:
    if not a.startswith(prefix):
      continue
    key = a[len(prefix) :].split("=", 1)[0]
    if key.startswith("no") and "." not in key:  # --config.nofoo (boolean negation) is absl syntax
      continue
    node, done = config, []
    for part in key.split("."):
      keys = list(node.keys()) if hasattr(node, "keys") else []
      if part not in keys:
        where = ".".join([name] + done)
        close = difflib.get_close_matches(part, keys, n=1)
        hint = f"; did you mean --{where}.{close[0]}?" if close else ""
        if not keys:
          return f"--{name}.{key}: {where} is a value, not a group of keys; set it with --{where}=VALUE"
        return (
          f"--{name}.{key}: unknown config key {part!r} under {where}{hint} Valid keys under "
          f"{where}: {sorted(keys)}"
        )
      node, done = node[part], done + [part]
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """absl `flags_parser` for app.run: the usual parsing, with unknown config keys reported in one line."""
  try:
    return app.parse_flags_with_usage(argv)
  except Exception:  # pylint: disable=broad-except
    msg = explain_unknown_override(argv)
    if msg is None:
      raise
    sys.stderr.write(f"FATAL Flags parsing error: {msg}\n")
    sys.exit(1)
