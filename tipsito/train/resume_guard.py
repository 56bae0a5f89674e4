"""Resume guard: a workdir with checkpoints only resumes with a config its checkpoints are consistent with.

Why: resuming reads the config from the command line, not from `<workdir>/config.json`. A changed
batch size, step count, recipe or model would silently change the run (schedule, data order) or fail
deep inside Orbax with a tree mismatch, after `config.json` was already overwritten, which then breaks
`export` and `evaluate` on that workdir too. So before anything is written the new config is compared
with the saved one, key by key:

* safe changes (evals, logging and checkpoint cadence, export, input prefetch, skip thresholds, the data
  location, mesh and sharding, which Orbax reshards on restore) are allowed, logged, and appended to the
  history kept in `config.json` under `HISTORY_KEY`;
* every other change (state tree, shapes, recipe, losses, optimizer and schedule, data and its order,
  seed, tokenizer, teacher) stops the run with the list of changed keys and how to proceed.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Iterable

from tipsito.config import schema
from tipsito.config.run_file import HISTORY_KEY  # the accepted changes of earlier resumes in config.json

# Keys (or key prefixes, ending in '.') whose change cannot make a checkpoint inconsistent: the keys
# declared `safe=True` in the config schema (tipsito/config/schema.py).
SAFE_KEYS = schema.safe_keys()

# Why a safe change is safe, where it is not obvious (logged with the change on resume).
SAFE_NOTES = {
  "input.microbatches": "the objective is the same: micro-batches accumulate the gradient of "
  "the whole global batch exactly (tipsito/objective/accumulate.py)"
}


class ResumeConfigError(ValueError):
  """The config differs from the workdir's in keys that would make its checkpoints inconsistent."""


def flatten(config: Any) -> dict[str, Any]:
  """{'a.b.c': value} of a ConfigDict / dict, with JSON-normalised values (tuples become lists)."""
  if hasattr(config, "to_json_best_effort"):
    tree = json.loads(config.to_json_best_effort())
  else:
    tree = json.loads(json.dumps(config, default=str))
  out: dict[str, Any] = {}

  def walk(node, prefix):
    if isinstance(node, dict):  # an empty dict has no keys (adding entries later shows them as added)
      for k, v in node.items():
        walk(v, f"{prefix}{k}.")
    else:
      out[prefix[:-1]] = node

  walk(tree, "")
  return out


def is_safe(key: str, safe: Iterable[str] = SAFE_KEYS) -> bool:
  """Whether changing `key` leaves the checkpointed run consistent."""
  return any(key == s or (s.endswith(".") and key.startswith(s)) for s in safe)


_MISSING = "<absent>"


def diff(saved: dict, new: dict) -> dict[str, tuple[Any, Any]]:
  """{key: (saved value, new value)} for every flattened key that differs (absent on one side too)."""
  a, b = flatten(saved), flatten(new)
  a.pop(HISTORY_KEY, None)
  b.pop(HISTORY_KEY, None)
  return {
    k: (a.get(k, _MISSING), b.get(k, _MISSING))
    for k in sorted(set(a) | set(b))
    if a.get(k, _MISSING) != b.get(k, _MISSING)
  }


def check(saved: Any, new: Any, workdir: str) -> dict[str, tuple[Any, Any]]:
  """Returns the safe changes of `new` relative to `saved`; raises ResumeConfigError on any other.

  The message lists each refused key with both values and the two ways on: the saved config, or a
  new workdir (optionally starting from this run's params with `--config.init_from`).
  """
  changes = diff(saved, new)
  refused = {k: v for k, v in changes.items() if not is_safe(k)}
  if refused:
    rows = "\n".join(f"  config.{k}: {old!r} -> {cur!r}" for k, (old, cur) in refused.items())
    raise ResumeConfigError(
      f"{workdir} has checkpoints of a run with a different config; these changes would make them "
      f"inconsistent (state tree, shapes, recipe, optimizer or data order):\n{rows}\n"
      f"To continue that run, use the config it was started with (saved in {workdir}/config.json). "
      f"To train with the new settings, use a new --workdir, with --config.init_from={workdir} to "
      f"start from its latest params. Nothing was written."
    )
  return changes


def history_entry(changes: dict[str, tuple[Any, Any]], step: int | None) -> dict:
  """One accepted-changes record for config.json."""
  return {
    "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "resumed_at_step": step,
    "changes": {k: [old, new] for k, (old, new) in changes.items()},
  }
