"""JAX set-up shared by every program: global settings (`configure_jax`) and joining a multi-process job.

Why one place: every program (train, evaluate, export, info, bench, plan) must draw the same random
numbers for the same config on any mesh, and every host of a pod runs one JAX process that must join the
same job the same way. `--distributed` calls `jax.distributed.initialize`; coordinator address, process
count and process id come from the flags when given, else from the environment JAX detects (Cloud TPU,
SLURM, Open MPI, ...). Outside those (a CPU or GPU machine, `launch/local_multiprocess.sh`) pass all three.
CPU processes talk through gloo collectives, switched on here before the backend starts.

Platform: on a machine without a TPU, JAX would still initialise libtpu when the `[tpu-plan]` extra is
installed (its backend is tried first), which prints libtpu's host-bounds and worker-hostname errors and,
with two processes starting at once, fails on libtpu's one-process lock file. `configure_jax` therefore
selects JAX's platforms before any backend starts (`jax_platforms`, JAX's own switch): `cpu` when nothing
on the machine is an accelerator (no TPU PCI device, no /dev/accel*, no /dev/vfio/<group>, no TPU
environment variable, no GPU device node); otherwise JAX chooses as usual. An explicit `JAX_PLATFORMS`
(or an earlier `jax.config.update("jax_platforms", ...)`) always wins. Only `tipsito.plan` uses libtpu on
such a machine (compile-only topologies, tipsito/planning/pod.py).

Peer loss: with several processes, `initialize` starts the watch of tipsito/distributed/peer_loss.py, so
that a process that disappears is named by the others, which exit with status 76. Why a subpackage: the
watch is part of joining a multi-process job and nothing else; the training loop only registers its
clean-ups with it.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

from absl import flags

from tipsito.distributed import peer_loss

FLAGS = flags.FLAGS
FLAG_NAMES = ("distributed", "coordinator_address", "num_processes", "process_id")
# Environment variables that only a TPU host (Cloud TPU VM, GKE TPU node) or a TPU job sets.
TPU_ENV_VARS = (
  "TPU_ACCELERATOR_TYPE",
  "TPU_WORKER_HOSTNAMES",
  "TPU_WORKER_ID",
  "TPU_VISIBLE_CHIPS",
  "TPU_VISIBLE_DEVICES",
  "TPU_PROCESS_BOUNDS",
  "TPU_CHIPS_PER_PROCESS_BOUNDS",
  "TPU_HOST_BOUNDS",
  "TPU_TOPOLOGY",
)
# Device nodes of accelerators: TPU v4/v5p (/dev/accel*), TPU v5e/v6e (/dev/vfio/<group>), NVIDIA
# (also under WSL2: /dev/dxg), AMD (/dev/kfd).
ACCELERATOR_DEVICE_GLOBS = (
  "/dev/accel*",
  "/dev/vfio/[0-9]*",
  "/dev/nvidia[0-9]*",
  "/dev/nvidiactl",
  "/dev/dxg",
  "/dev/kfd",
)


def accelerator_evidence(environ=None, device_globs=ACCELERATOR_DEVICE_GLOBS) -> Optional[str]:
  """What shows an accelerator on this machine (a device node, a TPU PCI device, a TPU environment
  variable), or None. Looks only at files and the environment: no backend or libtpu is started."""
  environ = os.environ if environ is None else environ
  for name in TPU_ENV_VARS:
    if environ.get(name):
      return f"${name}"
  for pattern in device_globs:
    found = sorted(glob.glob(pattern))
    if found:
      return found[0]
  try:  # JAX's own test for attached TPU chips (PCI vendor/device ids under /sys/bus/pci)
    from jax._src import hardware_utils  # pylint: disable=import-outside-toplevel

    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
  except Exception:  # pylint: disable=broad-except  # moved in another JAX: the device nodes decide
    chips = 0
  return f"{chips} TPU PCI device(s)" if chips else None


def select_platform(environ=None) -> Optional[str]:
  """Sets `jax_platforms` to 'cpu' on a machine without accelerators (see the module docstring);
  returns what it set, None when JAX keeps choosing (explicit JAX_PLATFORMS or config, an accelerator
  present, or backends already started)."""
  import jax  # pylint: disable=import-outside-toplevel

  environ = os.environ if environ is None else environ
  if "JAX_PLATFORMS" in environ or jax.config.jax_platforms:
    return None
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

    if xla_bridge.backends_are_initialized():
      return None
  except Exception:  # pylint: disable=broad-except
    pass
  if accelerator_evidence(environ) is not None:
    return None
  jax.config.update("jax_platforms", "cpu")
  return "cpu"


def configure_jax() -> None:
  """Global JAX settings every program needs before it builds anything.

  Platform: `select_platform` (CPU only on a machine without accelerators, so libtpu is never started
  there; an explicit JAX_PLATFORMS wins). Partitionable threefry: random bits do not depend on how an
  array is sharded, so the same seed gives the same initialisation and dropout/mask draws on 1 device, 8
  fake devices or a pod (resume onto a different device count relies on it). Idempotent.
  """
  import jax  # pylint: disable=import-outside-toplevel

  select_platform()
  jax.config.update("jax_threefry_partitionable", True)


def define_flags() -> None:
  """--distributed, --coordinator_address, --num_processes, --process_id (idempotent).

  Call from the program's own flag definitions so they appear in its --help.
  """
  if "distributed" in FLAGS:
    return
  flags.DEFINE_bool(
    "distributed", False, "Join a multi-process JAX job (jax.distributed.initialize): one process per host."
  )
  flags.DEFINE_string(
    "coordinator_address",
    None,
    "With --distributed: HOST:PORT of process 0's coordination service (default: "
    "detected on Cloud TPU / SLURM / MPI).",
  )
  flags.DEFINE_integer("num_processes", None, "With --distributed: total number of processes.")
  flags.DEFINE_integer("process_id", None, "With --distributed: this process's id in [0, num_processes).")
  import sys  # pylint: disable=import-outside-toplevel

  for name in FLAG_NAMES:  # --help lists the key flags of the program being run (sys.argv[0])
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])


def initialize(
  coordinator_address: Optional[str] = None,
  num_processes: Optional[int] = None,
  process_id: Optional[int] = None,
) -> None:
  """jax.distributed.initialize with gloo CPU collectives; None arguments are auto-detected by JAX."""
  import jax  # pylint: disable=import-outside-toplevel

  given = [coordinator_address is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given) and not coordinator_address:
    # JAX can detect the rest only on clusters it knows; a partial set is almost always a typo.
    raise ValueError(
      "--num_processes/--process_id given without --coordinator_address=HOST:PORT; "
      "pass all three (or none on Cloud TPU / SLURM)"
    )
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id={process_id} must be in [0, --num_processes={num_processes})")
  configure_jax()  # the platform is chosen before anything can start a backend
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )
  _start_peer_watch()


def _start_peer_watch() -> None:
  """tipsito/distributed/peer_loss.py's watch of the other processes, over JAX's distributed client."""
  try:  # the joined job as JAX recorded it (asking jax.process_count() would start the backend now)
    from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel

    state = jax_distributed.global_state
    client, process_id, num_processes = state.client, int(state.process_id), int(state.num_processes)
  except Exception:  # pylint: disable=broad-except
    client, process_id, num_processes = None, 0, 0
  if num_processes <= 1:
    return
  if client is None:
    from absl import logging  # pylint: disable=import-outside-toplevel

    logging.warning("No JAX distributed client: a lost peer process ends this one as JAX decides.")
    return
  peer_loss.start(client, process_id, num_processes)


def initialize_from_flags() -> None:
  """Initializes when --distributed is set; the other three flags without it are an error. Chooses the
  platform first (configure_jax) in either case."""
  configure_jax()
  extra = [n for n in FLAG_NAMES[1:] if FLAGS[n].value is not None]
  if not FLAGS.distributed:
    if extra:
      raise ValueError(f"--{extra[0]} needs --distributed")
    return
  initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
