"""One run of a sweep, the library: job files, and `run`, which trains a run directory's job.

The sweep (tipsito/studies/runner.py) writes `job.json` (study, arm, seed and the complete training config)
into the run directory (`write_job`); `run` trains it there with `tipsito.train.loop.train_and_evaluate`
(which resumes from the run directory's latest checkpoint), then writes `result.json`
(tipsito/studies/results.py: final eval metrics, the logged loss curves, the train-state size, wall time,
and tipsito/studies/provenance.py: the commit and the machine)
atomically. A run is finished exactly when `result.json` exists; the sweep never reruns it.
`python -m tipsito.studies.job --run_dir D` (tipsito/studies/job.py) is the same `run` as a program.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ml_collections as mlc

from tipsito.config import defaults
from tipsito.studies import provenance
from tipsito.studies import results
from tipsito.studies.results import write_json_atomic
from tipsito.train import workdir as workdir_lib

JOB_FILE = "job.json"
RESULT_FILE = "result.json"
LOG_FILE = "log.txt"
SWEEP_PID_ENV = "TIPSITO_SWEEP_PID"  # set by the sweep for its subprocess jobs


def config_to_json(config: mlc.ConfigDict) -> dict:
  """The config as JSON data (what job.json holds)."""
  return json.loads(config.to_json_best_effort())


def config_from_json(d: dict) -> mlc.ConfigDict:
  """Back from `config_to_json`: JSON lists become the tuples the config files use."""

  def tuples(x):
    if isinstance(x, dict):
      return {k: tuples(v) for k, v in x.items()}
    if isinstance(x, list):
      return tuple(tuples(v) for v in x)
    return x

  return defaults.typed_optionals(mlc.ConfigDict(tuples(d)))


def write_job(run_dir: str, *, study: str, arm: str, seed: int, config: mlc.ConfigDict) -> dict:
  """Writes `<run_dir>/job.json`; returns its content."""
  job = {"study": study, "arm": arm, "seed": int(seed), "config": config_to_json(config)}
  write_json_atomic(os.path.join(run_dir, JOB_FILE), job)
  return job


def read_json(path: str) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def is_finished(run_dir: str) -> bool:
  return os.path.isfile(os.path.join(run_dir, RESULT_FILE))


def run(run_dir: str) -> dict:
  """Trains and evaluates the job of `run_dir` (resuming from its checkpoints); writes and returns its
  result. Raises `tipsito.train.checkpointing.Preempted` after SIGTERM (checkpoint saved)."""
  # A --parallel / --dry_run sweep process imports this module and never trains.
  from tipsito.train import loop  # lazy: the trainer (JAX, TF)

  job = read_json(os.path.join(run_dir, JOB_FILE))
  config = config_from_json(job["config"])
  t0 = time.time()
  resumed_from = workdir_lib.latest_checkpoint_step(run_dir)
  metrics = loop.train_and_evaluate(config, run_dir)
  result = results.run_result(config, run_dir, metrics)
  result.update(
    study=job["study"],
    arm=job["arm"],
    seed=job["seed"],
    resumed_from_step=resumed_from,
    # The wall time of this attempt only: a resumed run's earlier attempts are not in it (a lower bound).
    seconds=round(time.time() - t0, 2),
    resumed=resumed_from is not None,
    provenance=provenance.describe(),
  )
  write_json_atomic(os.path.join(run_dir, RESULT_FILE), result)
  return result
