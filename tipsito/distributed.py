"""JAX set-up shared by every program: global settings (`configure_jax`) and joining a multi-process job.

Why one place: every program (train, evaluate, export, info, bench, plan) must draw the same random
numbers for the same config on any mesh, and every host of a pod runs one JAX process that must join the
same job the same way. `--distributed` calls `jax.distributed.initialize`; coordinator address, process
count and process id come from the flags when given, else from the environment JAX detects (Cloud TPU,
SLURM, Open MPI, ...). Outside those (a CPU or GPU machine, `launch/local_multiprocess.sh`) pass all three.
CPU processes talk through gloo collectives, switched on here before the backend starts.
"""
from __future__ import annotations

from typing import Optional

from absl import flags

FLAGS = flags.FLAGS
FLAG_NAMES = ("distributed", "coordinator_address", "num_processes", "process_id")


def configure_jax() -> None:
  """Global JAX settings every program needs before it builds anything.

  Partitionable threefry: random bits do not depend on how an array is sharded, so the same seed gives
  the same initialisation and dropout/mask draws on 1 device, 8 fake devices or a pod (resume onto a
  different device count relies on it). Idempotent.
  """
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_threefry_partitionable", True)


def define_flags() -> None:
  """--distributed, --coordinator_address, --num_processes, --process_id (idempotent).

  Call from the program's own flag definitions so they appear in its --help.
  """
  if "distributed" in FLAGS:
    return
  flags.DEFINE_bool("distributed", False,
                    "Join a multi-process JAX job (jax.distributed.initialize): one process per host.")
  flags.DEFINE_string("coordinator_address", None,
                      "With --distributed: HOST:PORT of process 0's coordination service (default: "
                      "detected on Cloud TPU / SLURM / MPI).")
  flags.DEFINE_integer("num_processes", None, "With --distributed: total number of processes.")
  flags.DEFINE_integer("process_id", None, "With --distributed: this process's id in [0, num_processes).")
  import sys  # pylint: disable=import-outside-toplevel
  for name in FLAG_NAMES:  # --help lists the key flags of the program being run (sys.argv[0])
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None) -> None:
  """jax.distributed.initialize with gloo CPU collectives; None arguments are auto-detected by JAX."""
  import jax  # pylint: disable=import-outside-toplevel
  given = [coordinator_address is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given) and not coordinator_address:
    # JAX can detect the rest only on clusters it knows; a partial set is almost always a typo.
    raise ValueError("--num_processes/--process_id given without --coordinator_address=HOST:PORT; "
                     "pass all three (or none on Cloud TPU / SLURM)")
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id={process_id} must be in [0, --num_processes={num_processes})")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id)


def initialize_from_flags() -> None:
  """Initializes when --distributed is set; the other three flags without it are an error."""
  extra = [n for n in FLAG_NAMES[1:] if FLAGS[n].value is not None]
  if not FLAGS.distributed:
    if extra:
      raise ValueError(f"--{extra[0]} needs --distributed")
    return
  initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
