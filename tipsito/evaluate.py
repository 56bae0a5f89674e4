"""`python -m tipsito.evaluate --config F --checkpoint DIR [--output JSON]`: run all configured evals.

Why a standalone entry point: the numbers users compare (zero-shot, retrieval, zero-shot segmentation,
kNN, the linear probes of tipsito/evals/probes.py) must be computable on any encoder, not only during training: a tipsito export (`tipsito.load`,
including imported official TIPS weights) or a training workdir/checkpoint (restored with the training
code's own model builder and Orbax checkpointer). The evaluators are exactly the ones the
training loop runs (`tipsito.evals`), so numbers agree between the two.

Prints a table (eval | metric | value), writes JSON ({'checkpoint', 'kind', 'metrics', 'pictures'}) to
--output, and pictures (PCA maps, segmentation overlays) as PNG to --pictures_dir (default: a
'pictures' folder next to --output).

Flags: --config (ml_collections config file, 'file.py:args' allowed; uses config.evals and
config.tokenizer), --checkpoint, --output, --pictures_dir, --only (comma-separated eval names),
--max_examples (override for every eval; quick checks), and the multi-host flags of
tipsito.distributed (--distributed [--coordinator_address --num_processes --process_id]): every process
encodes its share of each batch; process 0 prints and writes the results.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping, Sequence

from absl import app
from absl import flags
from absl import logging

from tipsito import command
from tipsito import distributed
from tipsito.evals import registry as eval_registry
from tipsito.evals import runner as eval_runner
from tipsito import paths
from tipsito.config import defaults
from tipsito.evals import pictures as pictures_lib

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Defines the CLI flags (idempotent; only when run as a program)."""
  if "checkpoint" in FLAGS:
    return
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  config_flags.DEFINE_config_file(
    "config", None, "Config file with `evals` (and `tokenizer`).", lock_config=False
  )
  flags.DEFINE_string(
    "checkpoint",
    None,
    "Export directory, training workdir, its checkpoints/ folder or a step folder checkpoints/N.",
  )
  flags.DEFINE_string("output", None, "JSON file for the results (optional).")
  flags.DEFINE_string("pictures_dir", None, "Folder for PNG pictures (default: <output dir>/pictures).")
  flags.DEFINE_list("only", None, "Run only these evals (names in config.evals).")
  flags.DEFINE_integer("max_examples", None, "Cap on examples per eval split (quick checks).")
  distributed.define_flags()  # --distributed: every host runs this; batches are split over processes


def is_export(path: str) -> bool:
  """An export has config.json + params/ (tipsito.export_format.write_export); local or gs://."""
  p = paths.as_path(path)
  return (p / "config.json").is_file() and (p / "params").is_dir()


def load_encoder(config, checkpoint: str):
  """Returns (encoder, kind): 'export' via tipsito.load, 'train' via the training code."""
  if is_export(checkpoint):
    from tipsito import inference  # optional: an export needs inference only

    return inference.load(checkpoint), "export"
  try:
    from tipsito.train import step  # optional: training code, for workdirs only
  except ImportError as e:
    raise ValueError(
      f"{checkpoint!r} is not an export (no config.json + params/) and the training code needed for "
      f"training checkpoints cannot be imported ({e}); export it first with "
      "`python -m tipsito.export --workdir DIR --output EXPORT`"
    ) from e
  del step  # imported above only to fail early with a clear message
  return _encoder_from_workdir(config, checkpoint), "train"


def _encoder_from_workdir(config, checkpoint: str):
  """Latest checkpoint of a training workdir -> in-memory Encoder (no export needed).

  The same read as `export_from_workdir` (tipsito/train/exporting.py `encoder_from_workdir`): the
  workdir's saved config.json defines the towers and only the export's part of the checkpoint is read,
  so a distilled student evaluates without its teacher; `checkpoint` may be the workdir or its
  `checkpoints/` folder.
  """
  del config  # the workdir's own training config defines the model
  from tipsito.train import exporting  # optional: training code, for workdirs only

  workdir, step = workdir_and_step(checkpoint)
  if not ((workdir / "config.json").is_file() and (workdir / "checkpoints").is_dir()):
    raise ValueError(
      f"{checkpoint!r} is neither an export (config.json + params/) nor a training "
      "workdir (config.json + checkpoints/) or one of its step folders (checkpoints/N)"
    )
  return exporting.encoder_from_workdir(workdir, step, what=f"--checkpoint {checkpoint}")


def workdir_and_step(checkpoint: str):
  """(workdir path, step or None) of `--checkpoint`: a workdir, its `checkpoints/` folder (latest step)
  or a step folder `checkpoints/N` (that step)."""
  path = paths.as_path(checkpoint)  # local or gs://
  if path.name.isdigit() and path.parent.name == "checkpoints":
    return path.parent.parent, int(path.name)
  return (path.parent if path.name == "checkpoints" else path), None


def _evals_config(
  config, only: Sequence[str] | None, max_examples: int | None, default_data_dir: str | None = None
) -> dict:
  """config.evals as plain dicts, filtered by --only, with config-level tokenizer and overrides.

  default_data_dir: data_dir for evals that set none (a training workdir's own `data/` folder, where
  the training run built its built-in dataset, so that standalone and training-time numbers agree).
  """
  evals = config.evals.to_dict() if hasattr(config.evals, "to_dict") else dict(config.evals)
  if only:
    missing = [n for n in only if n not in evals]
    if missing:
      raise ValueError(f"--only names {missing} not in config.evals ({sorted(evals)})")
    evals = {k: v for k, v in evals.items() if k in only}
  tokenizer = defaults.eval_config_values(config)["tokenizer"]
  for cfg in evals.values():
    if default_data_dir and not cfg.get("data_dir"):
      cfg["data_dir"] = default_data_dir
    if tokenizer and not cfg.get("tokenizer"):
      cfg["tokenizer"] = tokenizer
    if max_examples is not None:
      cfg["max_examples"] = int(max_examples)
      if cfg.get("type") == "knn":
        cfg["max_train_examples"] = int(max_examples)
  return evals


def format_table(results: Mapping[str, float]) -> str:
  """Fixed-width table: eval | metric | value (sorted by eval then metric); a metric's bootstrap
  interval ('_ci_lo', '_ci_hi') is folded into its value as 'v [lo, hi]' (tipsito/evals/runner.py)."""
  rows = []
  for key, text in eval_runner.with_intervals_folded({k: results[k] for k in sorted(results)}):
    name, _, metric = key.partition("/")
    rows.append((name, metric, text))
  if not rows:
    return "(no results)"
  w0 = max(len("eval"), *(len(r[0]) for r in rows))
  w1 = max(len("metric"), *(len(r[1]) for r in rows))
  w2 = max(len("value"), *(len(r[2]) for r in rows))
  lines = [f"{'eval':<{w0}}  {'metric':<{w1}}  {'value':>{w2}}", f"{'-' * w0}  {'-' * w1}  {'-' * w2}"]
  lines += [f"{a:<{w0}}  {b:<{w1}}  {c:>{w2}}" for a, b, c in rows]
  return "\n".join(lines)


def _json_safe(x: Any):
  """NaN/inf -> None (JSON has no NaN; a missing number must not break readers)."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def evaluate(
  config,
  checkpoint: str,
  *,
  output: str | None = None,
  pictures_dir: str | None = None,
  only: Sequence[str] | None = None,
  max_examples: int | None = None,
  print_fn=print,
) -> dict:
  """Library form of the CLI: loads the encoder, runs the evals, prints/writes results; returns them."""

  start = time.time()
  encoder, kind = load_encoder(config, checkpoint)
  data_dir = None
  if kind == "train":
    wd, _ = workdir_and_step(checkpoint)
    data_dir = os.fspath(wd / "data") if (wd / "data").is_dir() else None
  evaluators = eval_registry.make_evaluators(_evals_config(config, only, max_examples, data_dir))
  if not evaluators:
    raise ValueError("config.evals is empty: nothing to evaluate")
  results, pics = eval_runner.run_all(evaluators, encoder, log=logging.info)
  if pictures_dir is None and output:
    pictures_dir = os.path.join(os.path.dirname(os.path.abspath(output)), "pictures")
  import jax  # pylint: disable=g-import-not-at-top

  primary = jax.process_index() == 0  # every process has the same numbers; one writes them
  picture_paths = (
    pictures_lib.write_pictures(pics, step=0, directory=pictures_dir) if pictures_dir and primary else []
  )
  summary = {
    "checkpoint": os.path.abspath(checkpoint),
    "kind": kind,
    "metrics": {k: _json_safe(float(v)) for k, v in sorted(results.items())},
    "pictures": picture_paths,
    "seconds": round(time.time() - start, 2),
  }
  if not primary:
    return summary
  print_fn(format_table(results))
  if output:
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=2)
    print_fn(f"wrote {output}")
  return summary


def main(argv: Sequence[str]) -> None:
  """CLI body."""
  command.no_arguments(argv)
  if FLAGS.config is None:
    raise app.UsageError("--config is required")
  if not FLAGS.checkpoint:
    raise app.UsageError("--checkpoint is required")
  command.initialize_distributed()
  with command.exit_on((ValueError, FileNotFoundError, KeyError)):
    evaluate(
      FLAGS.config,
      FLAGS.checkpoint,
      output=FLAGS.output,
      pictures_dir=FLAGS.pictures_dir,
      only=FLAGS.only,
      max_examples=FLAGS.max_examples,
    )


run = command.entry_point(_define_flags, main)  # tipsito-evaluate


if __name__ == "__main__":
  run()
