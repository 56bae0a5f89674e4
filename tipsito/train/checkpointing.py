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
the error and falls back to the previous one. Every process takes part in that choice: each tries the
step through a process-local, read-only reader (so a process that fails early never leaves the others
in a barrier), then all agree that a step is readable only if it was readable everywhere. A training run
then moves each unreadable newer step aside before it trains (`quarantine_unreadable`:
`checkpoints/75` -> `checkpoints/75.corrupt-<UTC time>`, a rename by process 0 while the others wait;
never deleted; Orbax's step listings only take all-digit names, so they ignore it), because Orbax would
otherwise refuse to save that step number again when training reaches it. Readers of another run's
workdir (export, evaluate, a workdir teacher, `config.init_from`) fall back the same way and move
nothing. When no step can be read, the error lists every step and why, and nothing has been moved or
written. Paths go through etils epath, so gs:// workdirs work (there the move is a copy and a delete).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import functools
import os
import re
import signal
import threading
import time
import traceback
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tipsito import paths

# Exit status of a run stopped by SIGTERM after its checkpoint was saved (sysexits.h EX_TEMPFAIL).
PREEMPTED_EXIT_CODE = 75
DATA_ITEM = "data"
_LEGACY_DATA_ITEM = re.compile(r"data_(\d+)$")  # one JSON item per host (primary-only: pre multi-host)
_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json$")
# `<step>.corrupt-<UTC time>`: where an unreadable step is moved (no "_": Orbax's legacy step listing
# would read "<anything>_<digits>" as a step).
CORRUPT_INFIX = ".corrupt-"
_OK, _UNREADABLE, _FATAL, _OUTAGE = 0, 1, 2, 3


class Preempted(SystemExit):
  """Raised by the loop after the preemption checkpoint is committed; exits with PREEMPTED_EXIT_CODE."""

  def __init__(self, step: int):
    super().__init__(PREEMPTED_EXIT_CODE)
    self.step = int(step)

  def __str__(self) -> str:
    return f"preempted: checkpoint saved at step {self.step}; exit code {PREEMPTED_EXIT_CODE}"


class DataStateMismatch(ValueError):
  """The checkpoint's data states were written by a different number of processes."""


class NoReadableCheckpoint(RuntimeError):
  """Every checkpoint step of a directory failed to restore; the message lists each with its error."""

  def __init__(self, directory: str, unreadable: list, *, what: str = ""):
    self.directory = directory
    self.unreadable = list(unreadable)
    lines = "\n  ".join(f"step {s}: {msg}" for s, msg in unreadable)
    who = f"{what}: " if what else ""
    super().__init__(
      f"{who}no checkpoint in {directory} can be restored (tried {len(unreadable)}):\n  {lines}\n"
      "Nothing was moved or written. If the files are only unreachable (permissions, an unmounted disk, "
      "a bucket), fix that and run the same command again; if they are lost, move that folder aside "
      "or use a new --workdir to start over."
    )


as_path = paths.as_path  # epath.Path of a local path (made absolute) or a URL such as gs://bucket/dir


@functools.cache
def _data_state_item() -> type:
  """The class `_DataStateItem` below. Why built on first use: grain is imported only where a data-iterator
  state is saved or restored, so the step and the step benchmark run without grain installed
  (tests/test_light_imports.py)."""
  import grain  # pylint: disable=import-outside-toplevel  # only a data-iterator state needs grain

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

  return _DataStateItem


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` for (TrainState, per-host data iterator state)."""

  def __init__(self, directory, *, every_steps: int, keep: int, async_save: bool = True):
    _install_quiet_hooks()
    self.path = as_path(directory)  # local or gs://
    self.directory = os.fspath(self.path)
    self.every_steps = int(every_steps)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=int(keep), save_interval_steps=1, create=True, enable_async_checkpointing=bool(async_save)
    )
    with storage_errors_named("opening the checkpoints", self.directory):
      self.manager = ocp.CheckpointManager(self.path, options=options)
    self._local_reader: Optional[ocp.CheckpointManager] = None
    self._closed = False
    self.unreadable: list = []  # (step, error) skipped by the last restore, newest first
    self.restored_step: Optional[int] = None  # the step the last restore without `step` read
    self._pending_step: Optional[int] = None  # the step of the last save started (async: maybe unfinished)
    self._storage_failed: Optional[paths.StorageUnavailable] = None  # the outage this checkpointer met
    self._preempted = threading.Event()
    self._use_jax_sync = False

  # --- preemption -----------------------------------------------------------------------------------
  def install_sigterm_handler(self) -> None:
    """Arms preemption detection (call once, before the first step, on every process).

    Several processes with the JAX preemption service (default on): the coordination service's own
    SIGTERM notifier is already installed by `jax.distributed.initialize`; a Python handler would replace
    it, so none is installed. Otherwise a Python handler sets a flag.
    """
    self._use_jax_sync = jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)
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

  @contextlib.contextmanager
  def _outage_named(self, operation: str, step: Optional[int] = None):
    """`storage_errors_named` for this checkpointer's `operation` (on step `step`'s folder, or on the
    directory); remembers the outage, so that `close` does not fail a second time on it."""
    where = self.directory if step is None else os.fspath(self._step_path(step))
    try:
      with storage_errors_named(operation, where):
        yield
    except paths.StorageUnavailable as e:
      self._storage_failed = self._storage_failed or e
      raise

  def save(self, step: int, state: Any, data_state: Any = None, *, force: bool = False) -> bool:
    """Saves (async when configured) on every process. Returns whether a save was started.

    On gs://, a store that still fails after its clients' retries ends in one `StorageUnavailable`
    naming the step (the previous save's, when that one failed in the background); Orbax commits a
    step only once all its files are written, so the previous checkpoint stays the latest complete one."""
    items = {"state": ocp.args.StandardSave(state)}
    if data_state is not None:
      import grain.checkpoint as grain_checkpoint  # pylint: disable=import-outside-toplevel  # see _data_state_item

      items[DATA_ITEM] = grain_checkpoint.CheckpointSave(_data_state_item()(_json_copy(data_state)))
    self.wait()  # the previous save's failure is named as its own
    if paths.is_url(self.directory):
      _drop_late_callbacks_of_failed_saves()
    self._pending_step = int(step)
    with self._outage_named("saving checkpoint", step):
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
          f"config.init_from={os.fspath(self.path.parent)!r} (params only, data from the start)."
        )
      mine = self._step_path(step) / DATA_ITEM / f"process_{jax.process_index()}-of-{saved}.json"
      if not mine.exists():
        raise FileNotFoundError(f"{mine} is missing (this process's data-iterator state)")
      import grain.checkpoint as grain_checkpoint  # pylint: disable=import-outside-toplevel  # see _data_state_item

      return {DATA_ITEM: grain_checkpoint.CheckpointRestore(_data_state_item()())}
    legacy = f"data_{jax.process_index()}"  # checkpoints written before per-host data states
    if (self._step_path(step) / legacy).exists():
      return {legacy: ocp.args.JsonRestore()}
    return {}

  def _reader(self) -> ocp.CheckpointManager:
    """The read-only, process-local manager every restore goes through (see the module docstring)."""
    if self._local_reader is None:
      self._local_reader = local_reader(self.path)
    return self._local_reader

  def _restore_step(self, abstract_state: Any, step: int, with_data: bool):
    check_step_files(self._step_path(step))
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if with_data:
      items.update(self._data_args(step))
    out = self._reader().restore(step, args=ocp.args.Composite(**items))
    data = None
    for name in items:
      if name == DATA_ITEM:
        data = out[name].state
      elif _LEGACY_DATA_ITEM.match(name):
        data = out[name]
    return out["state"], data

  def restore(
    self,
    abstract_state: Any,
    step: Optional[int] = None,
    *,
    with_data: bool = True,
    warn_skipped: bool = True,
  ):
    """(state, data_state or None) at `step` (default: latest readable); `abstract_state` carries the
    shardings of *this* run's mesh, so a checkpoint written on another device count is re-sharded.

    Without an explicit `step`, a checkpoint that fails to restore on any process (truncated or missing
    files) is skipped on every process with a warning naming the step and the error, and the previous one
    is tried; the skipped steps are kept in `unreadable` for `quarantine_unreadable`. None readable:
    NoReadableCheckpoint. A data state written by a different process count is an error
    (DataStateMismatch), never a silent restart. `warn_skipped=False`: the skips are logged at INFO only
    (the training loop warns once per step, when `quarantine_unreadable` moves it). Call on every process.
    """
    self.unreadable = []
    if step is not None:
      return self._restore_step(abstract_state, int(step), with_data)
    steps = same_on_every_process(self.all_steps())
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    self.restored_step, out, self.unreadable = restore_first_readable(
      steps,
      lambda s: self._restore_step(abstract_state, s, with_data),
      directory=self.directory,
      warn=warn_skipped,
    )
    return out

  def quarantine_unreadable(self) -> list[str]:
    """Moves every step the last `restore` skipped to `<step>.corrupt-<UTC time>` beside it (process 0
    renames, every process waits for it and fails with it), so that training can write those step numbers again; logs
    where each went. Returns the new paths. Call on every process, before the first save."""
    skipped, self.unreadable = self.unreadable, []
    if not skipped:
      return []
    stamp = _agreed_utc_stamp()
    targets = []
    failure = None
    if jax.process_index() == 0:
      try:
        for s, _ in skipped:
          src = self._step_path(s)
          src.rename(_free_quarantine_name(src, stamp))
      except Exception as e:  # pylint: disable=broad-except  # raised on every process below
        failure = e
    # Every process waits for process 0's renames and learns whether they worked (a plain barrier would
    # leave the others waiting when process 0 fails).
    if _worst_everywhere(_FATAL if failure else _OK) != _OK:
      if failure is not None and paths.is_url(self.directory) and paths.is_storage_outage(failure):
        raise paths.StorageUnavailable(  # the copy-and-delete of gs:// stopped: nothing was deleted
          "moving the unreadable checkpoints aside in",
          self.directory,
          failure,
          bound=paths.CHECKPOINT_RETRY_BOUND,
        )
      raise RuntimeError(
        f"could not move the unreadable checkpoints {[s for s, _ in skipped]} of "
        f"{self.directory} aside (process 0: {failure!r}); nothing was deleted"
      ) from failure
    for s, msg in skipped:
      dst = _existing_quarantine_name(self._step_path(s), stamp)
      targets.append(os.fspath(dst))
      logging.warning(
        "Checkpoint %s cannot be restored (%s). Moved unreadable checkpoint %s aside to %s (nothing "
        "was deleted). Restored step %s of %s instead; training will write step %d again.",
        self._step_path(s),
        msg,
        self._step_path(s),
        dst,
        self.restored_step,
        self.directory,
        s,
      )
    with self._outage_named("listing the checkpoints"):
      self.manager.reload()
    return targets

  def wait(self) -> None:
    """Blocks until pending async saves are committed (an outage: `StorageUnavailable` naming the step)."""
    if self._pending_step is None:
      self.manager.wait_until_finished()
      return
    with self._outage_named("saving checkpoint", self._pending_step):
      self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits and releases the manager's resources. Idempotent.

    After an outage this checkpointer already reported (`StorageUnavailable`), closing logs one warning
    instead of failing again: the run's error stays the one line that names the operation."""
    if self._closed:
      return
    self._closed = True
    try:
      if self._storage_failed is None:
        self.wait()
    finally:
      try:
        with contextlib.ExitStack() as stack:
          if self._local_reader is not None:
            stack.callback(self._local_reader.close)
          if self._storage_failed is None:
            self.manager.close()
          else:
            _close_after_outage(self.manager, self.directory)
      except paths.StorageUnavailable:
        if self._storage_failed is None:
          raise


def _close_after_outage(manager: ocp.CheckpointManager, directory: str) -> None:
  """Closes `manager` after an outage was reported: a failure (the store still down, or the failed save's
  error raised again) is one warning, no second error."""
  try:
    manager.close()
  except Exception as e:  # pylint: disable=broad-except  # the outage was reported already
    logging.warning(
      "Could not close the checkpoints of %s cleanly after the object store failed (%s); the last "
      "complete checkpoint is unchanged.",
      directory,
      " ".join(str(e).split())[:200] or type(e).__name__,
    )


def storage_errors_named(operation: str, path: str):
  """`paths.storage_errors_named` with the checkpoints' clients' bounds (gcsfs, tensorstore)."""
  return paths.storage_errors_named(operation, path, bound=paths.CHECKPOINT_RETRY_BOUND)


class DamagedCheckpointFile(ValueError):
  """A file of a checkpoint step is truncated or empty (found before Orbax reads the step)."""


# The commit marker Orbax writes on object storage (and on local disk alongside the atomic rename).
_COMMIT_MARKER = "commit_success.txt"
_COMMIT_TEXT = "Checkpoint commit was successful to "


def _is_json_file(rel: str) -> bool:
  name = rel.rsplit("/", 1)[-1]
  return (
    name in ("_CHECKPOINT_METADATA", "_METADATA", "_sharding")
    or name.endswith(".json")
    or "/array_metadatas/" in f"/{rel}"
  )


def _files_below(d: epath.Path) -> list:
  """Every file below `d`, sorted (epath's rglob refuses '**' on some backends)."""
  out = []
  for p in sorted(d.iterdir(), key=os.fspath):
    if p.is_dir():
      out.extend(_files_below(p))
    else:
      out.append(p)
  return out


def check_step_files(step_dir) -> None:
  """Raises DamagedCheckpointFile naming the first metadata file of a step that does not parse (JSON,
  truncated or empty) or a commit marker that is not whole.

  Why before Orbax: Orbax reads some of these files only in passing (the step's `_CHECKPOINT_METADATA`:
  it logs two ERROR lines and goes on), reads others deep inside a restore whose error names no file,
  and never reads a commit marker's content; a step whose write was disturbed in any of its files is
  then restored with log noise, or skipped with an error that does not say which file. Array data
  (OCDBT) is checked by reading it: its errors name the file (`_damaged_file`). Costs one listing and a
  few small reads (also on gs://)."""
  step_dir = as_path(step_dir)
  for f in _files_below(step_dir):
    rel = os.fspath(f)[len(os.fspath(step_dir)) + 1 :]
    if f.name == _COMMIT_MARKER:
      text = f.read_text()
      tail = "/" + "/".join([step_dir.name] + rel.split("/")[:-1])  # the folder it commits
      # On local disk the marker names the temporary folder Orbax then renamed ('2.orbax-checkpoint-tmp').
      target = re.sub(r"\.orbax-checkpoint-tmp[^/]*", "", text[len(_COMMIT_TEXT) :].strip().rstrip("/"))
      if not (text.startswith(_COMMIT_TEXT) and target.endswith(tail)):
        raise DamagedCheckpointFile(
          f"{os.fspath(f)}: the commit marker is truncated or empty ({len(text)} bytes)"
        )
    elif _is_json_file(rel) and not f.is_dir():
      data = f.read_bytes()
      try:
        json.loads(data.decode("utf-8"))
      except ValueError as e:
        raise DamagedCheckpointFile(
          f"{os.fspath(f)}: truncated or empty ({len(data)} bytes; {type(e).__name__}: {e})"
        ) from None


def local_reader(directory) -> ocp.CheckpointManager:
  """A read-only CheckpointManager whose restores involve this process only: no cross-process barrier
  (a process whose restore fails must not leave the others waiting in one). Every process still reads
  only the shards its devices need."""
  _install_quiet_hooks()
  me = jax.process_index()
  options = ocp.CheckpointManagerOptions(
    read_only=True,
    save_interval_steps=0,  # what read_only implies; set here so Orbax does not warn that it changed them
    create=False,
    multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}),
  )
  return ocp.CheckpointManager(as_path(directory), options=options)


def same_on_every_process(steps: list[int]) -> list[int]:
  """Process 0's list of steps on every process (hosts that list a shared directory may disagree)."""
  if jax.process_count() == 1:
    return list(steps)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  n = int(multihost_utils.broadcast_one_to_all(np.asarray(len(steps), np.int32)))
  if n == 0:
    return []
  mine = np.zeros((n,), np.int32)
  mine[: min(n, len(steps))] = np.asarray(steps[:n], np.int32)
  return [int(x) for x in multihost_utils.broadcast_one_to_all(mine)]


def _worst_everywhere(code: int) -> int:
  """The largest of every process's code (_OK < _UNREADABLE < _FATAL < _OUTAGE)."""
  if jax.process_count() == 1:
    return code
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return int(np.max(multihost_utils.process_allgather(np.asarray(code, np.int32))))


def restore_first_readable(
  steps: list[int],
  restore_fn: Callable[[int], Any],
  *,
  directory: str,
  what: str = "",
  read_only: bool = False,
  warn: bool = True,
) -> tuple[int, Any, list]:
  """(step, restore_fn(step), skipped) for the newest of `steps` that every process restored; `skipped`
  lists (step, error) of the newer ones. Every process calls it with the same `steps`.

  A step that fails anywhere is skipped everywhere (the processes must hold the same state). A
  DataStateMismatch on any process is raised on every process. None readable: NoReadableCheckpoint.
  Each skipped step is a warning (one line), and so is the step restored instead; `warn=False` logs them
  at INFO (a caller that reports the skips itself).
  """
  skipped = []
  for s in sorted(steps, reverse=True):
    out, err, fatal, outage = None, None, None, None
    where = f"{directory}/{s}"
    try:
      with _late_reads_of_a_failed_restore_dropped():
        out = restore_fn(s)
    except DataStateMismatch as e:
      fatal = e
    except paths.StorageUnavailable as e:
      outage = e
    except Exception as e:  # pylint: disable=broad-except  # damaged step: try the previous one
      if paths.is_url(directory) and paths.is_storage_outage(e):  # the store, not the step: stop
        outage = paths.StorageUnavailable(
          "restoring checkpoint", where, e, bound=paths.CHECKPOINT_RETRY_BOUND
        )
      else:
        err = _one_line(e)
    code = _worst_everywhere(_OUTAGE if outage else _FATAL if fatal else _UNREADABLE if err else _OK)
    if code == _OUTAGE:  # never skipped (nor later moved aside) for what the store did
      raise outage or paths.StorageUnavailable(
        "restoring checkpoint", where, RuntimeError("the store failed on another process (see its log)")
      )
    if code == _FATAL:
      raise fatal or DataStateMismatch(
        f"{directory}/{s}: another process refused its data-iterator state (see that process's log)"
      )
    if code == _UNREADABLE:
      err = err or "unreadable on another process (see that process's log)"
      skipped.append((s, err))
      (logging.warning if warn else logging.info)(
        "Checkpoint %s/%d cannot be restored (%s); falling back to the previous one%s.",
        directory,
        s,
        err,
        " (read-only: nothing is moved)" if read_only else "",
      )
      continue
    if skipped:
      (logging.warning if warn else logging.info)(
        "Restored step %d of %s instead of the latest (%s).",
        s,
        directory,
        "; ".join(f"step {t}: {m}" for t, m in skipped),
      )
    return s, out, skipped
  raise NoReadableCheckpoint(directory, skipped, what=what)


_FILE_IN_ERROR = re.compile(r'(?:local file|file|object) "([^"]+)"')


def _damaged_file(e: BaseException) -> Optional[str]:
  """The file a (TensorStore) read error names, searched through the exception's causes: Orbax wraps
  the read error of one array in 'Encountered error while reading array index', which names none."""
  seen, cur, folder = set(), e, None
  while cur is not None and id(cur) not in seen:
    seen.add(id(cur))
    found = _FILE_IN_ERROR.findall(str(cur))
    files = [f for f in found if not f.endswith("/")]
    if files:
      return files[-1]
    folder = folder or (found[-1] if found else None)
    cur = cur.__cause__ or cur.__context__
  # TensorStore named only the OCDBT database (a read past the end of a data file it does not name).
  return f"{folder} (array data)" if folder else None


def _one_line(e: BaseException) -> str:
  """'[file F: ]Type: first line of the message' (at most 300 characters): a TensorStore error spans
  tens of lines (its whole spec), which made one skipped step a page of log; the damaged file comes
  first, when the error names one."""
  first = (str(e).strip().splitlines() or [""])[0]
  f = None if isinstance(e, DamagedCheckpointFile) else _damaged_file(e)
  where = f"file {f}: " if f else ""
  return f"{where}{type(e).__name__}: {first[:300]}"


class _ClosedLoopTolerantEventLoop(asyncio.SelectorEventLoop):
  """An event loop that drops callbacks posted to it from other threads after it closed.

  Why: Orbax runs a restore in a fresh event loop (`orbax.checkpoint._src.asyncio_utils.run_sync`) and
  closes it as soon as the restore raises. A damaged step fails on its first unreadable array while
  TensorStore still reads the others; each of those reads, when it completes on TensorStore's thread,
  posts its result with `loop.call_soon_threadsafe`, which raises `RuntimeError: Event loop is closed`,
  and TensorStore prints that traceback: hundreds per skipped step (one per pending array). Nobody
  awaits those results any more, so dropping them here, where they arrive, is the whole fix."""

  def call_soon_threadsafe(self, callback, *args, context=None):
    if self.is_closed():
      return _close_coroutines(callback, args)
    try:
      return super().call_soon_threadsafe(callback, *args, context=context)
    except RuntimeError:
      if self.is_closed():  # closed between the check and the call
        return _close_coroutines(callback, args)
      raise

  def close(self):
    """Closes the coroutines that callbacks still queued here would have started (a task created just
    before Orbax closed the loop after a failed restore, whose first step never ran), which would otherwise
    be reported 'coroutine ... was never awaited' when collected."""
    for handle in list(self._ready):  # asyncio's queue of callbacks due to run
      task = getattr(handle._callback, "__self__", None)
      if isinstance(task, asyncio.Task) and not task.done():
        task.get_coro().close()
      _close_coroutines(handle._callback, handle._args)
    super().close()

  def call_exception_handler(self, context):
    """Drops '... exception was never retrieved' for Orbax's sibling tasks of a failed restore or save.

    Why: Orbax gathers one task per array; the first failure ends the restore (we report it once, and
    fall back or raise), and the siblings that fail on the same damaged step later are never awaited, so
    when they are garbage-collected asyncio logs each with its traceback and a page of tensorstore spec
    (tests/test_run_safety_iii.py, quiet recovery). Anything else still reaches the default handler."""
    if _is_orbax_sibling_failure(context):
      logging.debug("dropped an unretrieved Orbax task failure: %s", context.get("exception"))
      return None
    return super().call_exception_handler(context)


def _is_orbax_sibling_failure(context) -> bool:
  """An unretrieved failure of Orbax's: a task running Orbax's code, or a future without a coroutine whose
  exception was raised in Orbax (the `_GatheringFuture` of its `asyncio.gather` over the arrays) or is a
  TensorStore open, read or write error (the futures of the array reads themselves, which carry no Python
  frame: 'FAILED_PRECONDITION: Error reading "params..." in OCDBT database ...')."""
  if not str(context.get("message", "")).endswith("exception was never retrieved"):
    return False
  get_coro = getattr(context.get("future"), "get_coro", None)
  code = getattr(get_coro() if get_coro else None, "cr_code", None)
  if code is not None:
    return "orbax" in code.co_filename
  exc = context.get("exception")
  return _raised_in_orbax(exc) or bool(
    isinstance(exc, ValueError) and re.match(r"[A-Z_]+: Error (reading|writing|opening) ", str(exc))
  )


def _raised_in_orbax(exc) -> bool:
  """Whether `exc`, or an exception it was raised from, passed through a frame of Orbax's code."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if any("orbax" in frame.f_code.co_filename for frame, _ in traceback.walk_tb(exc.__traceback__)):
      return True
    exc = exc.__cause__ or exc.__context__
  return False


def _close_coroutines(callback, args) -> None:
  """Closes the unstarted coroutines a dropped callback carries (`asyncio.run_coroutine_threadsafe`
  posts a closure over one), so that none is later reported "coroutine ... was never awaited"."""
  cells = [
    c.cell_contents for c in (getattr(callback, "__closure__", None) or ()) if c.cell_contents is not None
  ]
  for value in [*args, *cells]:
    if asyncio.iscoroutine(value):
      value.close()
  return None


class _TolerantLoopPolicy(asyncio.DefaultEventLoopPolicy):
  _loop_factory = _ClosedLoopTolerantEventLoop


def _is_abandoned_array_read(unraisable) -> bool:
  """An Orbax array read (`_read_array_index_and_device_put`) closed unfinished after its restore failed.

  Why: that coroutine catches BaseException around its read and raises a new Exception, so when the
  failed restore's pending reads are closed (GeneratorExit), each one raises instead of closing and
  Python prints 'Exception ignored in: <coroutine ...>' with a traceback, one per pending array."""
  obj = getattr(unraisable, "object", None)
  code = getattr(obj, "cr_code", None)
  return code is not None and code.co_name == "_read_array_index_and_device_put"


def _install_quiet_hooks() -> None:
  """Drops the tracebacks of abandoned array reads (`_is_abandoned_array_read`) and Orbax's warning
  that our read-only reader (`local_reader`) is read-only; idempotent. Process-wide and lasting:
  the abandoned reads are closed when they are garbage-collected, after the restore returned."""
  import sys  # pylint: disable=import-outside-toplevel

  previous = sys.unraisablehook
  if not getattr(previous, "_tipsito_quiet", False):

    def hook(unraisable):
      if _is_abandoned_array_read(unraisable):
        logging.debug("dropped the error of an abandoned array read: %s", unraisable.exc_value)
        return
      previous(unraisable)

    hook._tipsito_quiet = True  # pylint: disable=protected-access
    sys.unraisablehook = hook
  absl_log = logging.getLogger("absl")
  if not any(isinstance(f, _ReadOnlyNoteDropped) for f in absl_log.filters):
    absl_log.addFilter(_ReadOnlyNoteDropped())
  if not any(isinstance(f, _OutageRecordsOneLine) for f in absl_log.filters):
    absl_log.addFilter(_OutageRecordsOneLine())


class _OutageRecordsOneLine(logging.Filter):
  """Orbax's records of a save that failed on an object-store outage, one line each, no traceback.

  Why: a failed background save is logged by Orbax four times with `logging.exception` (the array
  writer's thread, the metadata thread, the commit thread, `wait_until_finished`), each a traceback and
  a page of tensorstore spec, before our one `StorageUnavailable` line, which is the one that names
  the step and says what to do (docs/training.md, "Object-store faults")."""

  def filter(self, record) -> bool:
    err = record.exc_info[1] if record.exc_info else None
    if err is not None and "orbax" in (record.pathname or "") and paths.is_storage_outage(err):
      first = (record.getMessage().strip().splitlines() or [""])[0]
      record.msg, record.args = first[:200], ()
      record.exc_info, record.exc_text = None, None
    return True


class _ReadOnlyNoteDropped(logging.Filter):
  """Drops two Orbax lines: 'Given directory is read only' (every read-only manager warns it; ours are
  so on purpose) and 'Failed to json parse Metadata file' (an ERROR per listing of a step whose
  `_CHECKPOINT_METADATA` is damaged; `check_step_files` then skips that step with one warning naming
  the file)."""

  def filter(self, record) -> bool:
    msg = str(record.msg)
    return not (
      msg == "Given directory is read only=%s" or msg.startswith("Failed to json parse Metadata file")
    )


def _drop_late_callbacks_of_failed_saves() -> None:
  """Every event loop created from now on in this process is a `_ClosedLoopTolerantEventLoop`.

  Why process-wide and lasting: a save that fails on an object-store outage has the same late callbacks
  as a failed restore (tensorstore's pending writes completing into the closed loop of Orbax's background
  save: 'Event loop is closed' tracebacks after our one error line), and Orbax creates those loops in its
  own threads, at times no scoped block around `save` covers."""
  if not isinstance(asyncio.get_event_loop_policy(), _TolerantLoopPolicy):
    asyncio.set_event_loop_policy(_TolerantLoopPolicy())


@contextlib.contextmanager
def _late_reads_of_a_failed_restore_dropped():
  """Every event loop created inside (Orbax's restore loops) is a `_ClosedLoopTolerantEventLoop`; the
  loops keep that behaviour after the block, when the late reads of a failed restore come in."""
  _install_quiet_hooks()
  previous = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_TolerantLoopPolicy())
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(previous)


def _agreed_utc_stamp() -> str:
  """Process 0's current UTC time as YYYYmmddTHHMMSSZ, on every process."""
  t = np.asarray(time.gmtime()[:6], np.int32)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    t = np.asarray(multihost_utils.broadcast_one_to_all(t))
  return "%04d%02d%02dT%02d%02d%02dZ" % tuple(int(x) for x in t)


def _quarantine_names(src: epath.Path, stamp: str):
  base = f"{src.name}{CORRUPT_INFIX}{stamp}"
  yield src.parent / base
  i = 2
  while True:
    yield src.parent / f"{base}-{i}"
    i += 1


def _free_quarantine_name(src: epath.Path, stamp: str) -> epath.Path:
  return next(p for p in _quarantine_names(src, stamp) if not p.exists())


def _existing_quarantine_name(src: epath.Path, stamp: str) -> epath.Path:
  """The name process 0 chose: the last existing one of the sequence `_free_quarantine_name` walks."""
  last = None
  for p in _quarantine_names(src, stamp):
    if not p.exists():
      break
    last = p
  if last is None or src.exists():
    raise RuntimeError(f"{src} was not moved aside (expected {src.name}{CORRUPT_INFIX}{stamp} beside it)")
  return last


def _json_copy(state: Any) -> Any:
  """A deep copy through JSON (the state the loop read must not change before the save writes it)."""
  return json.loads(json.dumps(state))


def abstract_with_shardings(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings (restored arrays land directly where they belong)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def restore_latest_state(
  workdir, state_shapes: Any, state_shardings: Any, *, what: str, step: Optional[int] = None
) -> Any:
  """The latest readable TrainState of a training workdir (or the one of checkpoint `step`, no fallback;
  no data state), placed with `state_shardings`.

  Why one function: `evaluate --checkpoint W` and distillation from a workdir teacher read a finished (or
  running) workdir the same way as `export --workdir` (`restore_latest_part`): read-only (an unreadable
  latest step is skipped with a warning, never moved; the workdir may belong to a run still training).
  `what` names the caller's flag or key in the errors.
  """
  abstract = abstract_with_shardings(state_shapes, state_shardings)
  args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
  return _restore_read_only(workdir, lambda reader, s: reader.restore(s, args=args)["state"], what, step)


def saved_state_shapes(step_dir) -> Any:
  """The tree a checkpoint step's state item holds (dicts of `jax.ShapeDtypeStruct`), from its Orbax
  metadata: no array is read. What a reader of part of a state restores by (`restore_latest_part`)."""
  meta = ocp.StandardCheckpointHandler().metadata(as_path(step_dir) / "state")
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), meta.tree)


def restore_latest_part(workdir, part: Callable[[Any], Any], *, what: str, step: Optional[int] = None) -> Any:
  """Part of the latest readable state of a training workdir (or of checkpoint `step`), read read-only
  as `restore_latest_state` reads the whole. `part(saved)` gets the step's saved tree as shapes
  (`saved_state_shapes`: {'step', 'params', 'opt_state', 'ema', 'centers', 'rng'}) and returns the
  subtree to read, its leaves ShapeDtypeStructs carrying the shardings to place them with; only that
  subtree is read.

  Why: a reader that needs part of a run's state (the export: the encoders) then needs nothing to
  rebuild the run's whole state layout, which for a distilled student depends on its teacher (the width
  of the distillation projection, whether the teacher brought its own heads): the checkpoint says the
  shapes of what it holds.
  """
  ckpt_dir = as_path(workdir) / "checkpoints"

  def restore(reader, s):
    abstract = part(saved_state_shapes(ckpt_dir / str(s)))
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)
    args = ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True)
    )
    return reader.restore(s, args=args)["state"]

  return _restore_read_only(workdir, restore, what, step)


def _restore_read_only(workdir, restore: Callable[[Any, int], Any], what: str, step: Optional[int]) -> Any:
  """`restore(reader, s)` of the newest readable step `s` of `<workdir>/checkpoints` (or of `step` only),
  through a process-local read-only reader; an unreadable step is skipped with a warning, never moved."""
  ckpt_dir = as_path(workdir) / "checkpoints"
  with storage_errors_named("listing the checkpoints", os.fspath(ckpt_dir)):
    reader = local_reader(ckpt_dir)
    listed = sorted(int(s) for s in reader.all_steps())
  try:
    steps = same_on_every_process(listed)
    if not steps:
      raise FileNotFoundError(f"{what}: no checkpoint in {os.fspath(ckpt_dir)}")
    if step is not None:
      if int(step) not in steps:
        raise FileNotFoundError(
          f"{what}: no checkpoint of step {int(step)} in {os.fspath(ckpt_dir)} (steps: {steps})"
        )
      steps = [int(step)]

    def checked(s):
      check_step_files(ckpt_dir / str(s))
      return restore(reader, s)

    _, out, _ = restore_first_readable(
      steps,
      checked,
      directory=os.fspath(ckpt_dir),
      what=what,
      read_only=True,
    )
  finally:
    reader.close()
  return out


def restore_params(path, abstract_params: Any) -> Any:
  """Params only, from another run's workdir/checkpoint dir (stage-2 init via `config.init_from`).

  Accepts a workdir (uses `<workdir>/checkpoints`, latest readable step: read-only fallback as in
  `restore_latest_state`), a checkpoint dir, or a step dir (that step only).
  """
  path = as_path(path)
  with storage_errors_named("reading the checkpoints of config.init_from", os.fspath(path)):
    ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    only = None
    if path.name.isdigit() and (path / "state").is_dir():  # a step folder
      ckpt_dir, only = path.parent, int(path.name)
  what = f"config.init_from={os.fspath(path)!r}"
  restore_args = jax.tree.map(
    lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), {"params": abstract_params}
  )
  args = ocp.args.Composite(
    state=ocp.args.PyTreeRestore(  # just the params subtree of the state item
      item={"params": abstract_params}, restore_args=restore_args, partial_restore=True
    )
  )
  with storage_errors_named("listing the checkpoints", os.fspath(ckpt_dir)):
    reader = local_reader(ckpt_dir)
    listed = [only] if only is not None else sorted(int(s) for s in reader.all_steps())
  try:
    steps = listed if only is not None else same_on_every_process(listed)
    if not steps:
      raise FileNotFoundError(f"{what}: no checkpoint found in {os.fspath(ckpt_dir)}")

    def checked(s):
      check_step_files(ckpt_dir / str(s))
      return reader.restore(s, args=args)

    _, restored, _ = restore_first_readable(
      steps, checked, directory=os.fspath(ckpt_dir), what=what, read_only=True
    )
  finally:
    reader.close()
  return restored["state"]["params"]
