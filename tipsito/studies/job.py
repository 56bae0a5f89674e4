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

import os
import signal
import sys
from typing import Sequence

from absl import app
from absl import flags

from tipsito import distributed
from tipsito.studies.jobs import (  # noqa: F401  (the library, also re-exported for callers of this module)
  JOB_FILE,
  LOG_FILE,
  RESULT_FILE,
  SWEEP_PID_ENV,
  config_from_json,
  config_to_json,
  is_finished,
  read_json,
  run,
  write_job,
)


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
  distributed.configure_jax()
  run(flags.FLAGS.run_dir)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
