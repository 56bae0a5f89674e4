"""Command line of `python -m tipsito.train --config configs/F.py[:k=v,...] --workdir DIR [--config.key=value ...]`.

Why a thin absl entry point: flags and config parsing only; all logic lives in
`tipsito.train.loop.train_and_evaluate` so tests and notebooks call the same function. Multi-host TPU
runs call `jax.distributed.initialize()` first (automatic on Cloud TPU VMs).
"""
from __future__ import annotations

import os
from typing import Sequence

from absl import app
from absl import flags
from absl import logging

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Defines --config / --workdir (idempotent: importing this module defines nothing)."""
  if "workdir" in FLAGS:
    return
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py[:args]).",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Output directory (resumed automatically if it has checkpoints).")
  flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (multi-host pods).")
  flags.mark_flags_as_required(["config", "workdir"])


def main(argv: Sequence[str]) -> None:
  """Parses flags, sets up JAX, runs the loop."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  import jax  # pylint: disable=import-outside-toplevel
  if FLAGS.distributed:
    jax.distributed.initialize()
  jax.config.update("jax_threefry_partitionable", True)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from tipsito.train import loop  # pylint: disable=import-outside-toplevel
  logging.info("JAX %s: %d processes, %d devices (%s)", jax.__version__, jax.process_count(),
               jax.device_count(), jax.devices()[0].platform)
  loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)


def run() -> None:
  """Console-script entry point (tipsito-train)."""
  _define_flags()
  from tipsito.train import flag_errors  # pylint: disable=import-outside-toplevel
  app.run(main, flags_parser=flag_errors.parse_flags)


if __name__ == "__main__":
  run()
