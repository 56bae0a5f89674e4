"""A run's saved `config.json`: its file name, the key of the accepted resume changes, and the readers.

Why in config/: validation checks `config.init_from` against the run it points at before anything is
written, and the config layer must not import the training code (tipsito/train/ sits above it); the
training workdir (tipsito/train/workdir.py) writes this file and reads it through these functions.
"""

from __future__ import annotations

import json
from typing import Optional

from tipsito import paths

CONFIG_FILE = "config.json"
# config.json key holding the accepted changes of earlier resumes (a list of {time, changes}).
HISTORY_KEY = "config_history"


def read_config_json(workdir: str) -> tuple[Optional[dict], list]:
  """(saved training config as a dict, accepted-change history) of a workdir; (None, []) if none."""
  f = paths.as_path(workdir) / CONFIG_FILE
  if not f.is_file():
    return None, []
  saved = json.loads(f.read_text())
  return saved, list(saved.pop(HISTORY_KEY, []) or [])


def init_run_config(path: Optional[str]) -> Optional[dict]:
  """The saved config.json of the run an `init_from` path points at (the workdir, its `checkpoints/`
  folder or a step folder in it), or None when there is none to read."""
  if not path:
    return None
  p = paths.as_path(path)
  for d in (p, p.parent, p.parent.parent):
    if (d / CONFIG_FILE).is_file():
      saved, _ = read_config_json(str(d))
      return saved
  return None
