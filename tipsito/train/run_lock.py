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
  lock. Who holds it decides how long a new launch waits (a scheduler's automatic restart after a hard
  failure must get in without a person):
  - a holder on this host (same host name, kernel boot and pid namespace: `_host_identity`) whose process
    is gone (its pid is not alive with the start time it wrote) is taken over at once, with one warning,
    as a dead local holder is;
  - a holder on another host is watched: a refresh coming in means it is alive (refused, WorkdirBusy);
    no refresh until the lock is `STALE_AFTER_S` old means it is gone (taken over). While waiting a
    progress line is logged every `PROGRESS_EVERY_S`. `TIPSITO_LOCK_WAIT=0` refuses at once instead.
  The acquire also recognises its own lock by its token (a create whose answer was lost to a dropped
  connection is retried by gcsfs and then sees its own object), so faults never make a run refuse itself.

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
import time
import uuid
from typing import Optional

from tipsito import paths

LOCK_FILE = "run.lock"
REFRESH_EVERY_S = 30.0  # the holder rewrites `refreshed` this often (gs://: the object's metadata)
STALE_AFTER_S = 300.0  # gs://: a lock not refreshed for this long belongs to a run that is gone
PROGRESS_EVERY_S = 15.0  # gs://: a launch waiting for another host's lock logs a line this often
WAIT_ENV = "TIPSITO_LOCK_WAIT"  # "0": a gs:// lock of another host is refused at once, never waited for


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


def _read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read().strip()
  except OSError:
    return ""


def _host_identity() -> dict:
  """What makes a pid on this machine mean the same process: the host name, the kernel's boot id (a
  rebooted VM, or a pod rescheduled onto another node under the same name, has another) and the pid
  namespace (two containers on one kernel do not see each other's pids)."""
  try:
    pidns = os.readlink("/proc/self/ns/pid")
  except OSError:
    pidns = ""
  return {
    "host": socket.gethostname(),
    "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
    "pid_ns": pidns,
  }


def _pid_start(pid: int) -> str:
  """The start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22), '' unknown."""
  stat = _read_text(f"/proc/{int(pid)}/stat")
  return stat[stat.rindex(")") + 2 :].split()[19] if ")" in stat else ""


def on_this_host(holder: Optional[dict]) -> bool:
  """Whether a lock's holder ran on this host, as `_host_identity` defines it (unknown fields: no)."""
  if not holder:
    return False
  me = _host_identity()
  return all(me[k] and holder.get(k) == me[k] for k in me)


def holder_alive(holder: dict) -> bool:
  """Whether the holder's process (on this host: `on_this_host`) still runs: its pid exists, is no
  zombie, and started when the holder wrote (a reused pid is another process)."""
  try:
    pid = int(holder.get("pid"))
  except (TypeError, ValueError):
    return True  # cannot tell: assume alive
  stat = _read_text(f"/proc/{pid}/stat")
  if not stat:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except OSError:
      return True
    return True
  if stat[stat.rindex(")") + 2 :].split()[0] in ("Z", "X"):
    return False
  started = holder.get("pid_start")
  return not started or started == _pid_start(pid)


def _me(token: str) -> dict:
  return {
    **_host_identity(),
    "pid": os.getpid(),
    "pid_start": _pid_start(os.getpid()),
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
    paths.quiet_gcsfs_retry_tracebacks()
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

  def _stamp(self, info: dict) -> tuple:
    """What changes when the holder refreshes or the lock changes hands."""
    return (info.get("generation"), info.get("metageneration"), (info.get("metadata") or {}).get("refreshed"))

  def _take_over(self, info: dict) -> bool:
    """Deletes the lock read as `info` if nobody refreshed or replaced it since; whether it did."""
    try:
      self.fs.call(
        "DELETE",
        "b/{}/o/{}",
        self.bucket,
        self.key,
        ifGenerationMatch=info["generation"],
        ifMetagenerationMatch=info["metageneration"],
      )
    except FileNotFoundError:
      return False  # gone meanwhile (or our retried DELETE already removed it): create again
    except OSError as e:
      if isinstance(e, FileExistsError) or "412" in str(e) or "precondition" in str(e).lower():
        return False  # refreshed or replaced meanwhile: look again
      raise
    return True

  def acquire(self) -> None:
    try:
      self._acquire()
    except Exception as e:  # pylint: disable=broad-except  # an outage: one clear error, no traceback
      if paths.is_storage_outage(e):
        raise paths.StorageUnavailable(
          "taking the run lock", self.url, e, bound=f"gcsfs: about {paths.GCSFS_RETRY_BOUND_S} s per request"
        ) from None
      raise

  def _acquire(self) -> None:
    me = _me(self.token)
    wait = os.environ.get(WAIT_ENV, "1").strip().lower() not in ("0", "false", "no")
    watched, next_progress = None, 0.0
    poll_s = max(0.2, min(5.0, self.stale_after_s / 20))
    for _ in range(10000):
      gen = self._create(me)
      if gen is not None:
        self._generation = gen
        return
      info = self._info()
      if info is None:
        continue  # released meanwhile: try again
      holder = self._holder(info)
      if holder.get("token") == self.token:  # our own create, whose answer a dropped connection lost
        self._generation = info["generation"]
        return
      age = self._age_s(info)
      if on_this_host(holder):
        if holder_alive(holder):
          raise _busy(self.url, holder, "Its process is alive on this host.")
        if self._take_over(info):
          logging.warning(
            "Taking over the lock %s of a run that ended without releasing it (%s; that process no longer "
            "runs on this host): it was killed or crashed. Resuming from its checkpoints.",
            self.url,
            describe(holder),
          )
        continue
      if age >= self.stale_after_s:
        if self._take_over(info):
          logging.warning(
            "Taking over the lock %s of a run that has not refreshed it for %.0f s (%s): it was killed "
            "or lost. Resuming from its checkpoints.",
            self.url,
            age,
            describe(holder),
          )
        continue
      how = (
        f"A lock on object storage held by another host is taken over once it has not been refreshed "
        f"for {self.stale_after_s:.0f} s (it was refreshed {age:.0f} s ago)"
      )
      if not wait:
        raise _busy(self.url, holder, f"{how}; {WAIT_ENV}=0 asked not to wait for that.")
      stamp = self._stamp(info)
      if watched is None:
        watched = stamp
      elif stamp != watched:
        raise _busy(self.url, holder, f"{how}; it was refreshed while this launch waited: that run is alive.")
      now = time.monotonic()
      if now >= next_progress:
        logging.warning(
          "Waiting for the lock %s, held by %s on another host and not refreshed for %.0f s: taken over "
          "in %.0f s unless its holder refreshes it meanwhile (then this launch stops). %s=0 refuses at "
          "once instead.",
          self.url,
          describe(holder),
          age,
          max(0.0, self.stale_after_s - age),
          WAIT_ENV,
        )
        next_progress = now + PROGRESS_EVERY_S
      time.sleep(min(poll_s, max(0.05, self.stale_after_s - age)))
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
    except FileNotFoundError:  # taken over, or a retried DELETE whose first answer was lost: gone
      pass
    except Exception as e:  # pylint: disable=broad-except  # never a second failure on the way out
      logging.warning(
        "Could not release the lock %s (%s). The next launch on this host takes it over at once; one on "
        "another host after %.0f s.",
        self.url,
        " ".join(str(e).split())[:200],
        self.stale_after_s,
      )


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
