"""Peer loss in a multi-process run: a process that disappears (SIGKILL, host crash, lost VM) is named by
the others, which stop with `PEER_LOST_EXIT_CODE` and one line saying how to resume.

Why: every collective of a multi-process step needs every process. When one dies, the others either get
an error from the collective (gloo on CPU: "Connection reset by peer") or wait in it; at exit, or once
JAX's coordination service stops receiving the dead process's heartbeats (`heartbeat_timeout_seconds`,
100 s by default), JAX aborts every survivor (exit 134) with a page of coordination-service trace, and
nothing says which process went away or that the run resumes. JAX's hook for that moment (the
coordination client's `missed_heartbeat_callback`) cannot be given a Python function (its status argument
has no Python conversion), so tipsito keeps its own, cheaper liveness record in the same coordination
service, through JAX's distributed client: every process writes a counter under `KEY_PREFIX` every
`BEAT_INTERVAL_S` seconds and reads everyone's. A peer whose counter has not moved for `LOST_AFTER_S`
seconds (well inside JAX's heartbeat timeout, so this comes first), or a coordination service that cannot
be reached for as long (process 0, which hosts it, is gone), is lost. The watching process then prints one
line (which process, and the step the same command resumes from), runs the clean-ups the training loop
registered (closing the data iterator: grain worker processes and their shared memory), and exits with
`PEER_LOST_EXIT_CODE` without JAX's shutdown barrier, which could only wait for the dead peer and abort.
A process that ends normally (any exit that reaches the interpreter's shutdown, also an error or exit 75)
first writes `DONE`, so that its peers never take a finished process for a lost one.

The training loop also asks (`wait_for_verdict`) when a multi-process run stops on an error, before it
reports it: a collective that failed because a peer died ends the same way; with every peer alive the
error is reported after a couple of heartbeats.
Single-process runs start nothing here. Started by tipsito/distributed/__init__.py `initialize`.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

# Exit status of a process whose peer disappeared (sysexits.h EX_PROTOCOL, "remote error"). Like 75
# (preempted, tipsito/train/checkpointing.py), it means: the committed checkpoints are consistent;
# relaunch the same command on every host to resume.
PEER_LOST_EXIT_CODE = 76
BEAT_INTERVAL_S = 2.0
LOST_AFTER_S = 30.0
KEY_PREFIX = "tipsito/peer_watch/"
DONE = "done"

_watch: Optional["PeerWatch"] = None
_resume_hint: Optional[Callable[[], str]] = None
_cleanups: list = []
_lock = threading.Lock()
_main_waiting = threading.Event()  # the main thread is in wait_for_verdict
_exiting = threading.Lock()  # held by the one thread that performs the lost-peer exit


def set_resume_hint(fn: Optional[Callable[[], str]]) -> None:
  """`fn()` says how the run resumes ("... resume from step 75"), asked at the moment a peer is lost."""
  global _resume_hint
  _resume_hint = fn


def add_cleanup(fn: Callable[[], None]) -> None:
  """Runs `fn` (bounded in time) before a lost-peer exit; for process-local resources only."""
  with _lock:
    _cleanups.append(fn)


def remove_cleanup(fn: Callable[[], None]) -> None:
  with _lock:
    if fn in _cleanups:
      _cleanups.remove(fn)


class PeerWatch:
  """The liveness record of one process; `check` is the decision, `run` the thread around it.

  `client` is JAX's distributed client (key_value_set / key_value_dir_get); `clock` and `on_lost` are
  injectable for tests.
  """

  def __init__(
    self,
    client,
    process_id: int,
    num_processes: int,
    *,
    interval: float = BEAT_INTERVAL_S,
    lost_after: float = LOST_AFTER_S,
    on_lost: Optional[Callable[[str], None]] = None,
    clock: Callable[[], float] = time.monotonic,
  ):
    self.client = client
    self.process_id = int(process_id)
    self.num_processes = int(num_processes)
    self.interval = float(interval)
    self.lost_after = float(lost_after)
    self.on_lost = on_lost or exit_peer_lost
    self.clock = clock
    self._beat = 0
    t0 = clock()
    self._last = {p: (None, t0) for p in range(self.num_processes) if p != self.process_id}  # value, when
    self._changes = {p: 0 for p in self._last}
    self._done: set = set()
    self._unreachable_since: Optional[float] = None
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self.verdict: Optional[str] = None

  # --- decision ------------------------------------------------------------------------------------
  def observe(self, entries: Optional[list], now: float) -> Optional[str]:
    """Takes one read of every process's record (None: the coordination service did not answer);
    returns the one-line reason when a peer is lost, else None."""
    if entries is None:
      if self._unreachable_since is None:
        self._unreachable_since = now
      if now - self._unreachable_since >= self.lost_after and 0 != self.process_id:
        return (
          f"peer process 0 of {self.num_processes} (the coordinator, which hosts JAX's coordination "
          f"service) disappeared: the service has not answered for {now - self._unreachable_since:.0f}s"
        )
      return None
    self._unreachable_since = None
    values = {}
    for key, value in entries:
      name = key.rsplit("/", 1)[-1]
      if name.isdigit():
        values[int(name)] = value
    lost = []
    for p, (old, since) in self._last.items():
      if p in self._done:
        continue
      new = values.get(p)
      if new == DONE:
        self._done.add(p)
      elif new != old:
        self._last[p] = (new, now)
        self._changes[p] += 1
      elif now - since >= self.lost_after:
        lost.append((p, now - since, old is None))
    if not lost:
      return None
    names = ", ".join(str(p) for p, _, _ in lost)
    quiet = max(s for _, s, _ in lost)
    what = "never reported" if all(never for _, _, never in lost) else "sent no heartbeat"
    plural = "es" if len(lost) > 1 else ""
    return f"peer process{plural} {names} of {self.num_processes} disappeared ({what} for {quiet:.0f}s)"

  def changes(self) -> dict:
    """How many heartbeat changes this watch has observed, per peer."""
    return dict(self._changes)

  def all_alive_after(self, base: dict, beats: int = 2) -> bool:
    """Every peer that has not finished showed `beats` more heartbeats than in `base` (`changes()`).
    Two, not one: the first change seen after an error may be a beat written just before a peer died."""
    return all(self._changes[p] - base.get(p, 0) >= beats for p in self._last if p not in self._done)

  # --- thread ---------------------------------------------------------------------------------------
  def beat(self) -> None:
    self._beat += 1
    self.client.key_value_set(f"{KEY_PREFIX}{self.process_id}", str(self._beat), allow_overwrite=True)

  def read(self) -> Optional[list]:
    try:
      return self.client.key_value_dir_get(KEY_PREFIX)
    except Exception:  # pylint: disable=broad-except  # service unreachable: judged by `observe`
      return None

  def step(self) -> Optional[str]:
    """One beat and one read; the verdict (also stored) when a peer is lost."""
    try:
      self.beat()
    except Exception:  # pylint: disable=broad-except
      pass  # the read below fails too and is judged there
    if self._stop.is_set():
      return None
    reason = self.observe(self.read(), self.clock())
    if reason and not self._stop.is_set():
      self.verdict = reason
      return reason
    return None

  def _run(self) -> None:
    while not self._stop.wait(self.interval):
      reason = self.step()
      if reason:
        if not _main_waiting.is_set():  # else the main thread, in wait_for_verdict, ends the process
          self.on_lost(reason)
        return

  def start(self) -> "PeerWatch":
    self.beat()
    self._thread = threading.Thread(target=self._run, name="tipsito-peer-watch", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    """Writes DONE (peers stop watching this process) and ends the thread. Idempotent."""
    if self._stop.is_set():
      return
    self._stop.set()
    try:
      self.client.key_value_set(f"{KEY_PREFIX}{self.process_id}", DONE, allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass


def start(client, process_id: int, num_processes: int) -> Optional[PeerWatch]:
  """Starts the watch of this process (once; nothing with one process) and stops it at exit."""
  global _watch
  if num_processes <= 1 or _watch is not None:
    return _watch
  _watch = PeerWatch(
    client, process_id, num_processes, interval=BEAT_INTERVAL_S, lost_after=LOST_AFTER_S
  ).start()
  # atexit runs last-registered first: this runs before JAX's own shutdown (registered at `import jax`).
  atexit.register(_watch.stop)
  return _watch


def wait_for_verdict(timeout: Optional[float] = None) -> Optional[str]:
  """After an error in a multi-process run: waits until every peer has shown two heartbeats since the
  call (it is alive: returns None, the error is the caller's to report; a few seconds), or until the
  watch names a lost peer: returns that one-line reason, and the caller ends the process with
  `exit_peer_lost` (from the main thread, which can first free what it holds). At most `timeout`
  (default LOST_AFTER_S plus two beats). Returns None at once without a watch (one process)."""
  w = _watch
  if w is None or w._stop.is_set():  # pylint: disable=protected-access
    return None
  base = w.changes()
  deadline = time.monotonic() + (w.lost_after + 2 * w.interval if timeout is None else timeout)
  logging.warning("Stopping on an error: checking that every peer process is still alive.")
  _main_waiting.set()
  try:
    while time.monotonic() < deadline and not w.verdict:
      if w.all_alive_after(base):
        return None
      time.sleep(0.2)
  finally:
    _main_waiting.clear()
  return w.verdict


def _bounded(fn: Callable[[], None], limit_s: float) -> None:
  """Runs `fn` in a daemon thread for at most `limit_s` seconds (a stuck clean-up must not keep a
  process whose peer is gone alive)."""
  t = threading.Thread(target=fn, daemon=True)
  t.start()
  t.join(limit_s)


def _release_process_resources() -> None:
  """What the interpreter's shutdown would release and os._exit skips: the registered clean-ups (the
  training loop's data iterator: grain worker processes), grain's pending shared-memory unlinks, and
  multiprocessing's finalizers (semaphores, queues, children), so that the resource tracker finds
  nothing left to report after the exit line."""
  _run_cleanups()
  _release_interpreter_resources()


def _run_cleanups() -> None:
  with _lock:
    fns = list(reversed(_cleanups))
  for fn in fns:
    try:
      fn()
    except Exception:  # pylint: disable=broad-except
      pass


def _release_interpreter_resources() -> None:
  import gc  # pylint: disable=import-outside-toplevel

  gc.collect()
  try:  # grain unlinks freed shared-memory blocks on a thread pool (private; absent in other versions):
    # let it finish, then have every later free unlink at once (a closed pool would drop them)
    from grain._src.python.ipc import shared_memory_array  # pylint: disable=import-outside-toplevel

    cls = shared_memory_array.SharedMemoryArray
    pool = cls._del_thread_pool  # pylint: disable=protected-access
    if pool is not None:
      cls._disable_async_del()  # pylint: disable=protected-access
      pool.close()
      pool.join()
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    from multiprocessing import util  # pylint: disable=import-outside-toplevel

    util._exit_function()  # pylint: disable=protected-access  # what multiprocessing runs at exit
  except Exception:  # pylint: disable=broad-except
    pass
  gc.collect()


def exit_peer_lost(reason: str, *, limit_s: float = 30.0) -> None:
  """The lost-peer exit: the clean-ups (bounded), one line, exit PEER_LOST_EXIT_CODE. Never returns;
  when two threads get here, the second waits for the first to end the process."""
  if not _exiting.acquire(blocking=False):
    while True:
      time.sleep(3600)
  w = _watch
  me = f"process {w.process_id}" if w else "this process"
  hint = "run the same command again on every host to resume from the latest checkpoint"
  if _resume_hint is not None:
    try:
      hint = _resume_hint()
    except Exception:  # pylint: disable=broad-except
      pass
  _bounded(_release_process_resources, limit_s)
  sys.stdout.flush()
  sys.stderr.write(f"tipsito: {reason}; {me} stops with exit status {PEER_LOST_EXIT_CODE}: {hint}.\n")
  sys.stderr.flush()
  os._exit(PEER_LOST_EXIT_CODE)  # pylint: disable=protected-access  # JAX's shutdown would only abort
