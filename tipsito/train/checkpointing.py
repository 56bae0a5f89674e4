"""Orbax checkpoint manager for the train state plus every host's data-iterator state.

Why: TPU jobs are preempted; a resumed run must continue exactly where it stopped — same parameters,
optimiser state, EMA teacher, centres, RNG *and* the same next batch on every host. The TrainState is one
pytree saved as an Orbax StandardSave item (sharded, async). The grain iterator state is per host (each
process reads its own strided shard), so it is saved with grain's own Orbax handler
(`grain.checkpoint.CheckpointSave`), which every process writes as `data/process_<i>-of-<n>.json` inside
the same atomically committed step (Orbax's JSON items are written by the primary host only, which would
lose every other host's position).

Preemption: SIGTERM on any host must stop *all* hosts after the same step. With several processes this
uses JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`: the coordination
service's notifier catches SIGTERM and agrees on the next step, on TPU, GPU and CPU alike); a single
process uses a Python SIGTERM handler. The loop saves that step and raises `Preempted`, a `SystemExit`
with code `PREEMPTED_EXIT_CODE` (75, EX_TEMPFAIL: "try again"), so a restart policy relaunches the job and
the run resumes. Further SIGTERMs only set the same flag again: they never interrupt the save.

Restore picks the latest complete step; if it cannot be read (truncated or missing files) it warns with
the error and falls back to the previous one. Paths go through etils epath, so gs:// workdirs work.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
from typing import Any, Optional

import grain
import grain.checkpoint as grain_checkpoint
import jax
import orbax.checkpoint as ocp
from etils import epath

from tipsito import paths

# Exit status of a run stopped by SIGTERM after its checkpoint was saved (sysexits.h EX_TEMPFAIL).
PREEMPTED_EXIT_CODE = 75
DATA_ITEM = "data"
_LEGACY_DATA_ITEM = re.compile(r"data_(\d+)$")  # one JSON item per host (primary-only: pre multi-host)
_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json$")


class Preempted(SystemExit):
  """Raised by the loop after the preemption checkpoint is committed; exits with PREEMPTED_EXIT_CODE."""

  def __init__(self, step: int):
    super().__init__(PREEMPTED_EXIT_CODE)
    self.step = int(step)

  def __str__(self) -> str:
    return f"preempted: checkpoint saved at step {self.step}; exit code {PREEMPTED_EXIT_CODE}"


class DataStateMismatch(ValueError):
  """The checkpoint's data states were written by a different number of processes."""


as_path = paths.as_path  # epath.Path of a local path (made absolute) or a URL such as gs://bucket/dir


class _DataStateItem(grain.DatasetIterator):
  """A frozen data-iterator state in the shape grain's Orbax handler expects (a DatasetIterator).

  Why a snapshot instead of the live iterator: the loop already read the state at the step boundary;
  the handler serialises `get_state()` as JSON, and on restore hands us the state through `set_state()`.
  """

  def __init__(self, state: Any = None):
    super().__init__()
    self.state = state

  def __next__(self):
    raise StopIteration

  def get_state(self):
    return self.state

  def set_state(self, state):
    self.state = state


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` for (TrainState, per-host data iterator state)."""

  def __init__(self, directory, *, every_steps: int, keep: int, async_save: bool = True):
    self.path = as_path(directory)  # local or gs://
    self.directory = os.fspath(self.path)
    self.every_steps = int(every_steps)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=int(keep), save_interval_steps=1, create=True,
        enable_async_checkpointing=bool(async_save))
    self.manager = ocp.CheckpointManager(self.path, options=options)
    self._preempted = threading.Event()
    self._use_jax_sync = False

  # --- preemption -----------------------------------------------------------------------------------
  def install_sigterm_handler(self) -> None:
    """Arms preemption detection (call once, before the first step, on every process).

    Several processes with the JAX preemption service (default on): the coordination service's own
    SIGTERM notifier is already installed by `jax.distributed.initialize`; a Python handler would replace
    it, so none is installed. Otherwise a Python handler sets a flag.
    """
    self._use_jax_sync = (jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service))
    if self._use_jax_sync or threading.current_thread() is not threading.main_thread():
      return

    def handler(signum, frame):
      del frame
      logging.warning("Signal %d received: will checkpoint and stop after this step.", signum)
      self._preempted.set()

    signal.signal(signal.SIGTERM, handler)

  def reached_preemption(self, step: int) -> bool:
    """True on every process after the same step once any process got SIGTERM. Call at every step."""
    if self._use_jax_sync:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      return bool(multihost_utils.reached_preemption_sync_point(int(step)))
    if jax.process_count() > 1:  # preemption service switched off: agree through a collective.
      import numpy as np  # pylint: disable=import-outside-toplevel
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      flags = multihost_utils.process_allgather(np.asarray(self._preempted.is_set(), np.int32))
      return bool(np.any(flags))
    return self._preempted.is_set()

  @property
  def preempted(self) -> bool:
    """True once this process got SIGTERM (single process; see `reached_preemption` for pods)."""
    return self._preempted.is_set()

  # --- save / restore -------------------------------------------------------------------------------
  def latest_step(self) -> Optional[int]:
    """Latest complete checkpoint step, None if the directory has none."""
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every complete checkpoint step, ascending."""
    return sorted(int(s) for s in self.manager.all_steps())

  def should_save(self, step: int) -> bool:
    """Periodic save every `every_steps` steps."""
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state: Any, data_state: Any = None, *, force: bool = False) -> bool:
    """Saves (async when configured) on every process. Returns whether a save was started."""
    items = {"state": ocp.args.StandardSave(state)}
    if data_state is not None:
      items[DATA_ITEM] = grain_checkpoint.CheckpointSave(_DataStateItem(_json_copy(data_state)))
    return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def _step_path(self, step: int) -> epath.Path:
    return self.path / str(int(step))

  def data_process_count(self, step: int) -> Optional[int]:
    """How many processes wrote the data states of `step` (None: no per-host data item)."""
    d = self._step_path(step) / DATA_ITEM
    if not d.exists():
      return None
    counts = {int(m.group(2)) for m in (_DATA_FILE.match(p.name) for p in d.iterdir()) if m}
    return counts.pop() if len(counts) == 1 else None

  def _data_args(self, step: int) -> dict:
    """Restore args of this process's data state at `step`; checks the process count first."""
    saved = self.data_process_count(step)
    if saved is None and (self._step_path(step) / DATA_ITEM).exists():
      raise FileNotFoundError(f"{self._step_path(step) / DATA_ITEM}: no readable process_<i>-of-<n>.json")
    if saved is not None:
      if saved != jax.process_count():
        raise DataStateMismatch(
            f"{self._step_path(step)}: the data-iterator states were saved by {saved} processes but this "
            f"run has {jax.process_count()}; each process reads its own strided shard, so its position "
            f"cannot be carried over. Resume with {saved} processes, or start a new workdir with "
            f"config.init_from={os.fspath(self.path.parent)!r} (params only, data from the start).")
      mine = self._step_path(step) / DATA_ITEM / f"process_{jax.process_index()}-of-{saved}.json"
      if not mine.exists():
        raise FileNotFoundError(f"{mine} is missing (this process's data-iterator state)")
      return {DATA_ITEM: grain_checkpoint.CheckpointRestore(_DataStateItem())}
    legacy = f"data_{jax.process_index()}"  # checkpoints written before per-host data states
    if (self._step_path(step) / legacy).exists():
      return {legacy: ocp.args.JsonRestore()}
    return {}

  def _restore_step(self, abstract_state: Any, step: int, with_data: bool):
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if with_data:
      items.update(self._data_args(step))
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    data = None
    for name in items:
      if name == DATA_ITEM:
        data = out[name].state
      elif _LEGACY_DATA_ITEM.match(name):
        data = out[name]
    return out["state"], data

  def restore(self, abstract_state: Any, step: Optional[int] = None, *, with_data: bool = True):
    """(state, data_state or None) at `step` (default: latest readable); `abstract_state` carries the
    shardings of *this* run's mesh, so a checkpoint written on another device count is re-sharded.

    Without an explicit `step`, a checkpoint that fails to restore (truncated or missing files) is
    skipped with a warning naming the step and the error, and the previous one is tried. A data state
    written by a different process count is an error (DataStateMismatch), never a silent restart.
    """
    if step is not None:
      return self._restore_step(abstract_state, int(step), with_data)
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    errors = []
    for s in reversed(steps):
      try:
        out = self._restore_step(abstract_state, s, with_data)
      except DataStateMismatch:
        raise
      except Exception as e:  # pylint: disable=broad-except  # damaged step: try the previous one
        msg = f"{type(e).__name__}: {str(e)[:500]}"
        errors.append(f"step {s}: {msg}")
        logging.warning("Checkpoint %s cannot be restored (%s); falling back to the previous one.",
                        self._step_path(s), msg)
        continue
      if errors:
        logging.warning("Restored step %d of %s instead of the latest (%s).", s, self.directory,
                        "; ".join(errors))
      return out
    raise RuntimeError(f"no checkpoint in {self.directory} can be restored:\n  " + "\n  ".join(errors))

  def wait(self) -> None:
    """Blocks until pending async saves are committed."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits and releases the manager's resources."""
    self.manager.wait_until_finished()
    self.manager.close()


def _json_copy(state: Any) -> Any:
  """A deep copy through JSON (the state the loop read must not change before the save writes it)."""
  return json.loads(json.dumps(state))


def abstract_with_shardings(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings (restored arrays land directly where they belong)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def restore_latest_state(workdir, state_shapes: Any, state_shardings: Any, *, what: str,
                         step: Optional[int] = None) -> Any:
  """The latest TrainState of a training workdir (or the one of checkpoint `step`; no data state), placed
  with `state_shardings`.

  Why one function: `export --workdir`, `evaluate --checkpoint W` and distillation from a workdir
  teacher all read a finished (or running) workdir the same way. `what` names the caller's flag or key in
  the error.
  """
  ckpt = Checkpointer(as_path(workdir) / "checkpoints", every_steps=0, keep=1, async_save=False)
  try:
    if ckpt.latest_step() is None:
      raise FileNotFoundError(f"{what}: no checkpoint in {ckpt.directory}")
    if step is not None and int(step) not in ckpt.all_steps():
      raise FileNotFoundError(f"{what}: no checkpoint of step {int(step)} in {ckpt.directory} "
                              f"(steps: {ckpt.all_steps()})")
    state, _ = ckpt.restore(abstract_with_shardings(state_shapes, state_shardings), step=step,
                            with_data=False)
  finally:
    ckpt.close()
  return state


def restore_params(path, abstract_params: Any) -> Any:
  """Params only, from another run's workdir/checkpoint dir (stage-2 init via `config.init_from`).

  Accepts a workdir (uses `<workdir>/checkpoints`, latest step), a checkpoint dir, or a step dir.
  """
  path = as_path(path)
  ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
  mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(read_only=True))
  step = mngr.latest_step()
  if step is None:
    raise FileNotFoundError(f"config.init_from={os.fspath(path)!r}: no checkpoint found in {ckpt_dir}")
  # Restore just the params subtree via a partial restore of the state item.
  restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item={"params": abstract_params},
      restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), {"params": abstract_params}),
      partial_restore=True)))
  mngr.close()
  return restored["state"]["params"]
