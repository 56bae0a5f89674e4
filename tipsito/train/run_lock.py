"""One training run per workdir: the lock `<workdir>/run.lock` that process 0 of a run holds.

Why: a launcher that retries, a second terminal or a host that came back could start the same training
command twice on one workdir; both processes then trained side by side and wrote steps, config.json and
the export into the same folders. The lock makes the second launch stop before it writes anything,
naming the holder (host, pid, start time) and what to do, while a lock left behind by a run that died
(SIGKILL, OOM, a lost VM) is taken over with a warning, so a crashed run still resumes with the same
command.

How, by storage:

* local (and NFS) workdirs: an exclusive `fcntl.flock` on the file. The kernel drops it when the holding
  process ends however it ends, so "is the holder alive" is the lock itself: a lock file that can be
  locked belonged to a run that is gone (the pid no longer holds it) and is taken over. The descriptor is
  close-on-exec, so spawned grain workers never inherit the lock.
* gs:// workdirs: the object `run.lock`, created with the store's own precondition (`ifGenerationMatch=0`:
  create only if absent) through gcsfs. The holder refreshes it every `REFRESH_EVERY_S` seconds (a
  metadata update conditioned on its generation, so a holder whose lock was taken over learns it); a
  lock not refreshed for `STALE_AFTER_S` seconds is stale and is deleted on the condition that it is
  still that generation and metageneration (no refresh came in between), then created anew. Without
  gcsfs (or on another object store) there is no precondition to rely on: the run warns and takes no
  lock.

Only process 0 of a pod holds the lock; the others learn its outcome (tipsito/train/loop.py), so a busy
workdir stops every process and the lock never stops host 1 of a healthy pod. Read-only users of a
workdir (export, evaluate, a workdir teacher, config.init_from) take no lock.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import uuid
from typing import Optional

from tipsito import paths

LOCK_FILE = "run.lock"
REFRESH_EVERY_S = 30.0  # the holder rewrites `refreshed` this often (gs://: the object's metadata)
STALE_AFTER_S = 300.0  # gs://: a lock not refreshed for this long belongs to a run that is gone


class WorkdirBusy(SystemExit):
  """Another live run holds the workdir's lock. A SystemExit: the command ends with this message and
  exit status 1, without a traceback (nothing was written, there is nothing to debug)."""

  def __init__(self, message: str):
    super().__init__(message)
    self.message = message

  def __str__(self) -> str:
    return self.message


class LockLost(RuntimeError):
  """The run's lock was taken over by another launch (gs://: it was not refreshed in time)."""


def _now_iso() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _me(token: str) -> dict:
  return {
    "host": socket.gethostname(),
    "pid": os.getpid(),
    "started": _now_iso(),
    "refreshed": _now_iso(),
    "token": token,
  }


def describe(holder: Optional[dict]) -> str:
  """'host H, pid P, started T (last refreshed R)' for a lock's content."""
  if not holder:
    return "an unknown holder (the lock file is empty or unreadable)"
  return (
    f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')} "
    f"(last refreshed {holder.get('refreshed', '?')})"
  )


def _busy(where: str, holder: Optional[dict], how_long: str) -> WorkdirBusy:
  return WorkdirBusy(
    f"tipsito: the workdir is in use by another training run: {where} is held by {describe(holder)}. "
    "Nothing was written. Wait for that run to end (or stop it) and run the same command again to "
    f"resume, or pass another --workdir. {how_long}"
  )


class _LocalLock:
  """flock on `<workdir>/run.lock` (see the module docstring)."""

  def __init__(self, path: str, token: str):
    self.path, self.token = path, token
    self._fd: Optional[int] = None

  def acquire(self) -> None:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec (PEP 446)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        raise _busy(
          self.path,
          _read_json(self.path),
          "A local lock is released the moment its process ends, however it ends.",
        ) from None
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:  # not a file the previous holder unlinked while we opened it
        break
      os.close(fd)
    self._fd = fd
    previous = _read_fd(fd)
    if previous:
      logging.warning(
        "Taking over the lock %s of a run that ended without releasing it (%s; its pid no longer holds "
        "the lock): it was killed or crashed. Resuming from its checkpoints.",
        self.path,
        describe(previous),
      )
    self._write(_me(self.token))

  def _write(self, content: dict) -> None:
    data = json.dumps(content, indent=2).encode()
    os.lseek(self._fd, 0, os.SEEK_SET)
    os.ftruncate(self._fd, 0)
    os.write(self._fd, data)
    os.fsync(self._fd)

  def refresh(self) -> None:
    if self._fd is not None:
      content = _read_fd(self._fd) or _me(self.token)
      content["refreshed"] = _now_iso()
      self._write(content)

  def release(self) -> None:
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.unlink(self.path)  # while still locked: a waiting launcher re-checks the inode
    except FileNotFoundError:
      pass
    finally:
      os.close(fd)


def _read_fd(fd: int) -> Optional[dict]:
  os.lseek(fd, 0, os.SEEK_SET)
  chunks = []
  while True:
    b = os.read(fd, 65536)
    if not b:
      break
    chunks.append(b)
  try:
    return json.loads(b"".join(chunks).decode()) or None
  except ValueError:
    return None


def _read_json(path: str) -> Optional[dict]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.loads(f.read()) or None
  except (OSError, ValueError):
    return None


class _GcsLock:
  """The `run.lock` object with generation preconditions (see the module docstring)."""

  def __init__(self, url: str, token: str, stale_after_s: float):
    import gcsfs  # pylint: disable=import-outside-toplevel

    self.url, self.token, self.stale_after_s = url, token, float(stale_after_s)
    self.fs = gcsfs.GCSFileSystem()
    self.bucket, self.key, _ = self.fs.split_path(url)
    self._generation: Optional[str] = None

  def _info(self) -> Optional[dict]:
    """The object's resource (generation, metageneration, metadata), None when absent."""
    try:
      return self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)
    except FileNotFoundError:
      return None

  def _create(self, content: dict) -> Optional[str]:
    """Creates the object if absent; its generation, or None when it exists."""
    try:
      self.fs.pipe_file(self.url, json.dumps(content, indent=2).encode(), mode="create")
    except (FileExistsError, OSError) as e:
      if isinstance(e, FileExistsError) or "412" in str(e) or "precondition" in str(e).lower():
        return None
      raise
    info = self._info()
    return None if info is None else info["generation"]

  def _holder(self, info: dict) -> dict:
    content = _read_url_json(self.fs, self.url) or {}
    content.update({k: v for k, v in (info.get("metadata") or {}).items() if k == "refreshed"})
    return content

  def _age_s(self, info: dict) -> float:
    """Seconds since the lock was created or last refreshed: the later of the object's `updated` time
    (the store's clock) and the `refreshed` metadata the holder wrote (some stores, the emulator among
    them, do not move `updated` on a metadata change)."""
    times = [info.get("updated"), (info.get("metadata") or {}).get("refreshed")]
    latest = max(datetime.datetime.fromisoformat(t.replace("Z", "+00:00")) for t in times if t)
    return (datetime.datetime.now(datetime.timezone.utc) - latest).total_seconds()

  def acquire(self) -> None:
    me = _me(self.token)
    for _ in range(5):
      gen = self._create(me)
      if gen is not None:
        self._generation = gen
        return
      info = self._info()
      if info is None:
        continue  # released meanwhile: try again
      age = self._age_s(info)
      holder = self._holder(info)
      if age < self.stale_after_s:
        raise _busy(
          self.url,
          holder,
          f"A lock on object storage is taken over once it has not been refreshed for "
          f"{self.stale_after_s:.0f} s (it was refreshed {age:.0f} s ago).",
        )
      try:  # only if nobody refreshed or replaced it since we read it
        self.fs.call(
          "DELETE",
          "b/{}/o/{}",
          self.bucket,
          self.key,
          ifGenerationMatch=info["generation"],
          ifMetagenerationMatch=info["metageneration"],
        )
      except FileNotFoundError:
        continue
      except OSError as e:
        if "412" in str(e) or "precondition" in str(e).lower():
          continue  # refreshed or replaced meanwhile: look again
        raise
      logging.warning(
        "Taking over the lock %s of a run that has not refreshed it for %.0f s (%s): it was killed or "
        "lost. Resuming from its checkpoints.",
        self.url,
        age,
        describe(holder),
      )
    raise _busy(self.url, _read_url_json(self.fs, self.url), "The lock kept changing hands while we looked.")

  def refresh(self) -> None:
    if self._generation is None:
      return
    try:
      self.fs.call(
        "PATCH",
        "b/{}/o/{}",
        self.bucket,
        self.key,
        ifGenerationMatch=self._generation,
        json={"metadata": {"refreshed": _now_iso(), "token": self.token}},
      )
    except (FileNotFoundError, OSError) as e:
      if isinstance(e, FileNotFoundError) or "412" in str(e) or "precondition" in str(e).lower():
        gen, self._generation = self._generation, None
        raise LockLost(
          f"the lock {self.url} (generation {gen}) was removed or taken over by another launch"
        ) from e
      raise

  def release(self) -> None:
    if self._generation is None:
      return
    gen, self._generation = self._generation, None
    try:
      self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=gen)
    except (FileNotFoundError, OSError) as e:  # taken over meanwhile: not ours to delete
      logging.warning("Could not release the lock %s: %r", self.url, e)


def _read_url_json(fs, url: str) -> Optional[dict]:
  try:
    return json.loads(fs.cat_file(url).decode())
  except Exception:  # pylint: disable=broad-except
    return None


class RunLock:
  """The lock of one run: `acquire` (raises WorkdirBusy), refreshed by a daemon thread, `release`."""

  def __init__(
    self, workdir: str, *, stale_after_s: float = STALE_AFTER_S, refresh_every_s: float = REFRESH_EVERY_S
  ):
    self.workdir = paths.resolve(workdir)
    self.where = paths.join(self.workdir, LOCK_FILE)
    self.refresh_every_s = float(refresh_every_s)
    self.lost: Optional[str] = None
    token = uuid.uuid4().hex
    self._impl = None
    if not paths.is_url(self.workdir):
      self._impl = _LocalLock(self.where, token)
    elif self.workdir.startswith("gs://"):
      try:
        self._impl = _GcsLock(self.where, token, stale_after_s)
      except ImportError:
        logging.warning(
          "No workdir lock on %s: the lock needs gcsfs (`pip install gcsfs`) for the store's "
          "create-if-absent precondition. Make sure no other run uses this workdir.",
          self.workdir,
        )
    else:
      logging.warning(
        "No workdir lock on %s: only local folders and gs:// have one. Make sure no other run uses it.",
        self.workdir,
      )
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  @property
  def held(self) -> bool:
    return self._impl is not None and self._thread is not None

  def acquire(self) -> "RunLock":
    if self._impl is None:
      return self
    self._impl.acquire()
    self._thread = threading.Thread(target=self._refresh_loop, name="tipsito-run-lock", daemon=True)
    self._thread.start()
    logging.info("Holding the workdir lock %s", self.where)
    return self

  def _refresh_loop(self) -> None:
    while not self._stop.wait(self.refresh_every_s):
      try:
        self._impl.refresh()
      except LockLost as e:
        self.lost = str(e)
        logging.error("tipsito: %s; this run will stop at its next checkpoint.", e)
        return
      except Exception as e:  # pylint: disable=broad-except  # a failed refresh is retried next time
        logging.warning("Could not refresh the workdir lock %s: %r", self.where, e)

  def check(self) -> None:
    """Raises LockLost once another launch took the lock over (before this run writes a checkpoint)."""
    if self.lost:
      raise LockLost(f"{self.lost}: stopping before writing into {self.workdir} again")

  def release(self) -> None:
    """Stops the refresher and removes the lock (idempotent)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
    if self._impl is not None:
      try:
        self._impl.release()
      finally:
        self._impl = None
