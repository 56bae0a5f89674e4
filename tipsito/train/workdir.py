"""A training workdir on disk: its `config.json` (the resolved config plus the accepted resume changes) and
what it holds (`checkpoints/`).

Why its own module: the loop writes `config.json`; export, evaluate, the resume guard and workdir teachers
(tipsito/train/teacher.py) read it back. One reader and one writer keep the file's layout in one place,
and none of those readers needs the loop. Restoring a workdir's state (`restore_latest`) and starting a
run from another one (`init_from_run`; validation checks it against `init_run_config` here) are
tipsito/train/assembly.py: this module reads files only, it builds nothing.
"""

from __future__ import annotations

import json
from typing import Optional

import jax
import ml_collections as mlc

from tipsito import paths

# The file's name and readers live in tipsito/config/run_file.py (validation reads them below train/);
# they are this module's names too, for its callers.
from tipsito.config.run_file import CONFIG_FILE, HISTORY_KEY, init_run_config, read_config_json  # noqa: F401


def is_training_workdir(path: Optional[str]) -> bool:
  """A tipsito training workdir: config.json + checkpoints/ (an export has config.json + params/)."""
  if not path:
    return False
  p = paths.as_path(path)  # local or gs://
  return (p / CONFIG_FILE).is_file() and (p / "checkpoints").is_dir()


def save_config(config: mlc.ConfigDict, workdir: str, history: list | None = None) -> None:
  """Writes `<workdir>/config.json` (export, evaluate and humans read it), with the history of accepted
  resume changes under `HISTORY_KEY`. Process 0 only."""
  if jax.process_index() == 0:
    d = paths.as_path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    out = json.loads(config.to_json_best_effort())
    if history:
      out[HISTORY_KEY] = history
    (d / CONFIG_FILE).write_text(json.dumps(out, indent=2, sort_keys=True))


def load_config(workdir: str) -> mlc.ConfigDict:
  """Reads back `<workdir>/config.json` (tuples come back as lists; the code accepts both)."""
  saved, _ = read_config_json(workdir)
  w = paths.resolve(workdir)
  if saved is None:
    raise FileNotFoundError(
      f"{w} is not a training workdir (no config.json): pass the --workdir of a "
      "training run (it holds config.json and checkpoints/)"
    )
  if "format_version" in saved:
    raise ValueError(
      f"{w} is an export, not a training workdir: it is already exported. Load it with "
      f"tipsito.load({w!r}) or evaluate it with `python -m tipsito.evaluate --checkpoint {w}`; "
      "`export --workdir` needs a training workdir (config.json + checkpoints/)"
    )
  return mlc.ConfigDict(saved)


def latest_checkpoint_step(workdir: str) -> Optional[int]:
  """Highest finalized Orbax step under `<workdir>/checkpoints` (None when there is none: nothing to
  resume). Read without opening a CheckpointManager, so nothing is created in the workdir."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  d = paths.as_path(workdir) / "checkpoints"
  steps = ocp.utils.checkpoint_steps(d) if d.is_dir() else []
  return max(steps) if steps else None
