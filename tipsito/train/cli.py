"""Command line of `python -m tipsito.train --config configs/F.py[:k=v,...] --workdir DIR [--config.key=value ...]`.

Why a thin absl entry point: flags and config parsing only; all logic lives in
`tipsito.train.loop.train_and_evaluate` so tests and notebooks call the same function.

Multi-host: every host runs the same command with `--distributed` (one JAX process per host). On Cloud
TPU (and SLURM / MPI clusters) JAX finds the coordinator itself; elsewhere add
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (see launch/local_multiprocess.sh,
which starts N processes on one machine). CPU processes use gloo collectives (tipsito.distributed).

Exit status: 0 when the run finished (or reached --config.total_steps earlier); 75
(`checkpointing.PREEMPTED_EXIT_CODE`, EX_TEMPFAIL) when SIGTERM on any host stopped every host after the
same step and that step was checkpointed: relaunch the same command to resume.
"""

from __future__ import annotations

import os
from typing import Sequence

from absl import flags
from absl import logging

from tipsito import command
from tipsito import distributed
from tipsito.train import flag_errors

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Defines --config / --workdir / the distributed flags (idempotent: importing defines nothing)."""
  if "workdir" in FLAGS:
    return
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py[:args]).", lock_config=True
  )
  flags.DEFINE_string("workdir", None, "Output directory (resumed automatically if it has checkpoints).")
  distributed.define_flags()
  flags.mark_flags_as_required(["config", "workdir"])
  command.key_flags_in_help(["config", "workdir"])  # the program is __main__.py, not this module


def main(argv: Sequence[str]) -> None:
  """Parses flags, sets up JAX, runs the loop."""
  command.no_arguments(argv)
  command.initialize_distributed()
  distributed.configure_jax()
  import jax  # pylint: disable=import-outside-toplevel

  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from tipsito.train import loop  # heavy (JAX, TF): after the platform, TF log level

  logging.info(
    "JAX %s: process %d of %d, %d devices (%s)",
    jax.__version__,
    jax.process_index(),
    jax.process_count(),
    jax.device_count(),
    jax.devices()[0].platform,
  )
  loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)  # raises Preempted (exit 75) after SIGTERM


run = command.entry_point(_define_flags, main, flags_parser=flag_errors.parse_flags)  # tipsito-train


if __name__ == "__main__":
  run()
