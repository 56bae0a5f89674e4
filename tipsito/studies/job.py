"""One run of a sweep: `python -m tipsito.studies.job --run_dir W/<arm>/seed_<s>`.

The sweep (tipsito/studies/runner.py) writes `job.json` (study, arm, seed and the complete training config)
into the run directory; `run` trains it there with `tipsito.train.loop.train_and_evaluate` (which resumes
from the run directory's latest checkpoint), then writes `result.json` (tipsito/studies/results.py:
final eval metrics, the logged loss curves, the train-state size, wall time) atomically. A run is
finished exactly when `result.json` exists; the sweep never reruns it.

Why a module of its own: with `--parallel N` each run is this program in a subprocess (its log in the
run directory's `log.txt`); with one at a time the sweep calls `run` in its own process.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Sequence

import ml_collections as mlc
from absl import app
from absl import flags

from tipsito.studies import results
from tipsito.studies.results import write_json_atomic

JOB_FILE = "job.json"
RESULT_FILE = "result.json"
LOG_FILE = "log.txt"
SWEEP_PID_ENV = "TIPSITO_SWEEP_PID"  # set by the sweep for its subprocess jobs


def config_to_json(config: mlc.ConfigDict) -> dict:
  """The config as JSON data (what job.json holds)."""
  return json.loads(config.to_json_best_effort())


def config_from_json(d: dict) -> mlc.ConfigDict:
  """Back from `config_to_json`: JSON lists become the tuples the config files use."""
  from tipsito.config import defaults  # pylint: disable=import-outside-toplevel

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
  from tipsito.train import loop  # pylint: disable=import-outside-toplevel
  from tipsito.train import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  job = read_json(os.path.join(run_dir, JOB_FILE))
  config = config_from_json(job["config"])
  t0 = time.time()
  resumed_from = workdir_lib.latest_checkpoint_step(run_dir)
  metrics = loop.train_and_evaluate(config, run_dir)
  result = results.run_result(config, run_dir, metrics)
  result.update(study=job["study"], arm=job["arm"], seed=job["seed"], resumed_from_step=resumed_from,
                seconds=round(time.time() - t0, 2))
  write_json_atomic(os.path.join(run_dir, RESULT_FILE), result)
  return result


def _define_flags() -> None:
  if "run_dir" not in flags.FLAGS:
    flags.DEFINE_string("run_dir", None, "Run directory holding job.json (written by tipsito.sweep).")
    flags.mark_flag_as_required("run_dir")


def _stop_with_sweep() -> None:
  """Started by a sweep ($TIPSITO_SWEEP_PID): get SIGTERM when the sweep process ends, however it ends
  (Linux PR_SET_PDEATHSIG), so that the run checkpoints and stops instead of running on unwatched."""
  pid = os.environ.get(SWEEP_PID_ENV)
  if not pid or not sys.platform.startswith("linux"):
    return
  import ctypes  # pylint: disable=import-outside-toplevel
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
  if os.getppid() != int(pid):  # the sweep ended before the line above
    sys.exit(f"the sweep (pid {pid}) that started this run is gone")


def main(argv: Sequence[str]) -> None:
  """Runs the job; exits 75 after SIGTERM (checkpoint saved: rerun to resume)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  _stop_with_sweep()
  from tipsito import distributed  # pylint: disable=import-outside-toplevel
  distributed.configure_jax()
  run(flags.FLAGS.run_dir)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
