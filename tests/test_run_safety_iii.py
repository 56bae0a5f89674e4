"""Run safety III: one run per workdir (tipsito/train/run_lock.py), no grain workers left behind by a hard
kill (tipsito/data/pipeline.py `_end_with_parent`), and a quiet recovery from an unreadable latest step
(tipsito/train/checkpointing.py).

Why: each was a fault a pod meets that went unnoticed. Two launches on one workdir both trained and wrote
into the same folders; every SIGKILL of a run with `input.num_workers > 0` left its workers sleeping with
parent 1 (about 236 MB each); a rerun after a truncated latest step recovered but printed hundreds of
"Event loop is closed" tracebacks. Runs here are the tiny CLIP config of tests/test_run_safety_ii.py on
32 px shapes, as CLI subprocesses in sessions of their own; every process a test starts is killed at its
end, and every wait is bounded.
"""

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tipsito.train import loop
from tipsito.train import run_lock

import test_run_safety_ii as rs2  # the data fixture, damage() and the state comparison helpers
from test_gcs_emulator import BUCKET, gcs_env  # noqa: F401  (the loopback GCS emulator fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL = 6
data_dir = rs2.data_dir  # the module's shapes dataset (a fixture)

CONFIG_FILE = textwrap.dedent('''
  """The tiny CLIP run of tests/test_run_safety_ii.py `tiny()` (args: data=DIR,workers=W)."""
  from tipsito.config import defaults


  def get_config(arg=None):
    a = dict(kv.split("=", 1) for kv in arg.split(","))
    c = defaults.tiny_config("clip", batch_size=8, total_steps=6)
    c.max_len = 16
    c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
    c.model.image.update(dict(depth=1, posemb_grid=4))
    c.data = defaults.data_config("shapes", data_dir=a["data"], caption_keys=("caption_detailed",))
    c.ckpt.update(dict(every_steps=2, keep=10, async_save=True))  # async: the layout whose damage flooded the log
    c.input.num_workers = int(a.get("workers", 0))
    c.export.enabled = False
    return c
''')


def _cmd(tmp_path, data_dir, workdir, workers=0):
  f = tmp_path / "tiny_cfg.py"
  f.write_text(CONFIG_FILE)
  return [
    sys.executable,
    "-m",
    "tipsito.train",
    "--config",
    f"{f}:data={data_dir},workers={workers}",
    "--workdir",
    str(workdir),
  ]


def _env():
  return rs2._cli_env(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")


class _Runs:
  """Starts CLI runs, each in a session of its own; `kill_all` ends every process of each session."""

  def __init__(self):
    self.procs = []

  def start(self, cmd, log, **kw):
    p = subprocess.Popen(
      cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kw
    )
    self.procs.append(p)
    return p

  def kill_all(self):
    for p in self.procs:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass


@pytest.fixture
def runs():
  r = _Runs()
  yield r
  r.kill_all()


@pytest.fixture(scope="module")
def module_runs():
  r = _Runs()
  yield r
  r.kill_all()


def _wait_for(cond, timeout, what, proc=None, log=None):
  deadline = time.time() + timeout
  while not cond():
    if proc is not None and proc.poll() is not None:
      pytest.fail(f"{what}: the run ended first (exit {proc.returncode}):\n{_tail(log)}")
    if time.time() > deadline:
      pytest.fail(f"{what}: not within {timeout} s\n{_tail(log)}")
    time.sleep(0.2)


def _tail(log, n=4000):
  if log is None:
    return ""
  with open(log, errors="replace") as f:
    return f.read()[-n:]


def _children(pid):
  """Pids of the live (not zombie) processes whose parent is `pid`."""
  out = []
  for d in os.listdir("/proc"):
    if not d.isdigit():
      continue
    try:
      with open(f"/proc/{d}/stat") as f:
        stat = f.read()
    except OSError:
      continue
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    if int(fields[1]) == pid and fields[0] != "Z":
      out.append(int(d))
  return out


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      stat = f.read()
  except OSError:
    return False
  return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


# --- the lock, in process ---------------------------------------------------------------------------


def test_lock_refuses_a_second_holder_and_is_released(tmp_path):
  w = str(tmp_path / "w")
  first = run_lock.RunLock(w, refresh_every_s=0.1).acquire()
  holder = json.loads((tmp_path / "w" / run_lock.LOCK_FILE).read_text())
  assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
  time.sleep(0.5)
  refreshed = json.loads((tmp_path / "w" / run_lock.LOCK_FILE).read_text())
  assert refreshed["started"] == holder["started"] and refreshed["token"] == holder["token"]
  with pytest.raises(run_lock.WorkdirBusy) as e:
    run_lock.RunLock(w).acquire()  # another open file description: flock conflicts even in one process
  msg = str(e.value)
  assert f"host {socket.gethostname()}, pid {os.getpid()}, started {holder['started']}" in msg, msg
  assert "Nothing was written" in msg and "--workdir" in msg
  first.release()
  assert not (tmp_path / "w" / run_lock.LOCK_FILE).exists()
  run_lock.RunLock(w).acquire().release()  # free again


# --- two launches, a SIGKILL, orphans --------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
  """A clean run of the CLI config (checkpoints 2, 4, 6)."""
  tmp_path = tmp_path_factory.mktemp("reference")
  ref = tmp_path / "ref"
  r = subprocess.run(_cmd(tmp_path, data_dir, ref), cwd=ROOT, env=_env(), capture_output=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return ref


def test_second_launch_refuses_naming_the_holder_and_the_first_ends_bitwise_equal(
  tmp_path, data_dir, reference, runs
):
  ref = reference
  w = tmp_path / "w"
  log_a = tmp_path / "a.log"
  with open(log_a, "w") as fa:
    a = runs.start(_cmd(tmp_path, data_dir, w), fa)
  _wait_for(lambda: (w / run_lock.LOCK_FILE).exists(), 300, "the first run's lock", a, log_a)
  # The second launch in this process (JAX already imported), so that it reaches the workdir while the
  # first still trains even on a loaded machine; the CLI ends the same way (WorkdirBusy is a SystemExit
  # whose message is printed, exit status 1).
  with pytest.raises(run_lock.WorkdirBusy) as e:
    loop.train_and_evaluate(rs2.tiny(data_dir, ckpt__async_save=True), str(w))
  assert a.poll() is None, "the first run ended before the second launch was refused"
  msg = str(e.value)
  assert isinstance(e.value.code, str) and msg.startswith(
    "tipsito: the workdir is in use by another training run"
  )
  assert f"held by host {socket.gethostname()}, pid {a.pid}, started " in msg, msg
  assert "Nothing was written" in msg and "--workdir" in msg
  assert a.wait(timeout=600) == 0, _tail(log_a)
  assert not (w / run_lock.LOCK_FILE).exists()  # released at the end
  ref_state, ref_data = rs2._state(str(ref), TOTAL)
  state, data = rs2._state(str(w), TOTAL)
  rs2._assert_same_tree(state, ref_state)
  assert data == ref_data


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, data_dir, module_runs):
  """A run with 2 grain workers, SIGKILLed (the process alone, as the OOM killer does) once step 2 is
  saved: (command, workdir, its pid, its child pids before the kill)."""
  tmp_path = tmp_path_factory.mktemp("killed")
  w = tmp_path / "w"
  log = tmp_path / "killed.log"
  cmd = _cmd(tmp_path, data_dir, w, workers=2)
  with open(log, "w") as f:
    p = module_runs.start(cmd, f)
  _wait_for(lambda: (w / "checkpoints" / "2").is_dir(), 600, "checkpoint 2", p, log)
  kids = _children(p.pid)
  os.kill(p.pid, signal.SIGKILL)
  p.wait(timeout=30)
  return cmd, w, p.pid, kids


def test_sigkilled_run_leaves_no_worker_behind(killed_run):
  _, _, pid, kids = killed_run
  assert len(kids) >= 2, kids  # the 2 grain workers (and multiprocessing's resource tracker)
  deadline = time.time() + 10
  while [k for k in kids if _alive(k)] and time.time() < deadline:
    time.sleep(0.2)
  left = [k for k in kids if _alive(k)]
  assert left == [], f"{len(left)} of the {len(kids)} processes of killed run {pid} still alive: {left}"


def test_stale_lock_after_sigkill_is_taken_over_by_the_rerun(killed_run):
  cmd, w, pid, _ = killed_run
  holder = json.loads((w / run_lock.LOCK_FILE).read_text())
  assert holder["pid"] == pid  # the killed run never released it
  r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert re.search(rf"Taking over the lock {re.escape(str(w / run_lock.LOCK_FILE))} .*pid {pid},", r.stderr)
  # The kill lands once step 2 is saved; a loaded machine may have saved step 4 by then: the rerun resumes
  # from the latest complete checkpoint, whichever it is, and finishes the run.
  resumed = re.search(r"Resumed from \S+ at step (\d+)", r.stderr)
  assert resumed and int(resumed.group(1)) in (2, 4), r.stderr[-3000:]
  assert f"Done: steps {resumed.group(1)} -> 6" in r.stderr, r.stderr[-3000:]
  assert not (w / run_lock.LOCK_FILE).exists()


# --- quiet recovery ---------------------------------------------------------------------------------


def test_rerun_after_a_truncated_latest_step_logs_no_traceback(tmp_path, data_dir, reference):
  w = tmp_path / "w"
  shutil.copytree(reference, w)
  cmd = _cmd(tmp_path, data_dir, w)
  rs2.damage(str(w / "checkpoints" / str(TOTAL)), "truncate", every_file=True)
  r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]
  assert "Traceback" not in out and "Event loop is closed" not in out, out[-3000:]
  warnings = [line for line in out.splitlines() if re.match(r"W\d{4} ", line)]
  assert len(warnings) <= 3, "\n".join(warnings)
  moved = [line for line in warnings if "Moved unreadable checkpoint" in line]
  assert len(moved) == 1, warnings
  assert re.search(
    rf"Checkpoint .*/{TOTAL} cannot be restored \(.*\)\. Moved unreadable checkpoint .*/{TOTAL} aside to "
    rf".*/{TOTAL}\.corrupt-\d{{8}}T\d{{6}}Z \(nothing was deleted\)\. Restored step 4 of ",
    moved[0],
  ), moved[0]
  assert "Done: steps 4 -> 6" in out


def _failing_coroutine(filename):
  """A coroutine function whose code lives in `filename` (Orbax's tasks are told apart by their file)."""
  scope = {}
  exec(
    compile("async def read():\n  raise ValueError('OUT_OF_RANGE: damaged array')\n", filename, "exec"), scope
  )
  return scope["read"]


def test_unretrieved_failures_of_orbax_sibling_tasks_are_not_logged(caplog):
  # The rare race behind the test above: a damaged step's sibling reads fail after the restore gave up;
  # nobody retrieves them, and asyncio logged each one's traceback when it was garbage-collected.
  from tipsito.train import checkpointing  # pylint: disable=import-outside-toplevel

  import asyncio  # pylint: disable=import-outside-toplevel
  import gc  # pylint: disable=import-outside-toplevel

  def unretrieved(filename):
    loop = checkpointing._ClosedLoopTolerantEventLoop()  # pylint: disable=protected-access
    task = loop.create_task(_failing_coroutine(filename)())
    loop.run_until_complete(asyncio.sleep(0))  # the task runs and fails; nobody retrieves it
    loop.close()
    del task
    gc.collect()

  def unretrieved_gather(filename):
    # Orbax gathers its array reads: the `_GatheringFuture` has no coroutine, only the exception it got.
    loop = checkpointing._ClosedLoopTolerantEventLoop()  # pylint: disable=protected-access

    async def start():
      return asyncio.gather(_failing_coroutine(filename)())

    gathered = loop.run_until_complete(start())
    loop.run_until_complete(asyncio.sleep(0))  # the read fails, the gather finishes; nobody retrieves it
    loop.close()
    del gathered
    gc.collect()

  def unretrieved_future(message):
    # The futures of TensorStore's array reads carry only the exception, with no Python frame.
    loop = checkpointing._ClosedLoopTolerantEventLoop()  # pylint: disable=protected-access
    fut = loop.create_future()
    fut.set_exception(ValueError(message))
    loop.close()
    del fut
    gc.collect()

  errors = lambda: [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]  # noqa: E731
  with caplog.at_level(logging.DEBUG, logger="asyncio"):
    orbax_file = "/site-packages/orbax/checkpoint/_src/serialization/serialization.py"
    unretrieved(orbax_file)
    unretrieved_gather(orbax_file)
    unretrieved_future(
      'FAILED_PRECONDITION: Error reading "params.x/0.0" in OCDBT database at local file "w"'
    )
    unretrieved_future('OUT_OF_RANGE: Error opening "zarr3" driver: Error reading local file "w/d/x"')
    assert errors() == []
    unretrieved(__file__)  # any other failure still reaches asyncio's handler
    unretrieved_gather(__file__)
    unretrieved_future("something else went wrong")
    records = errors()
  assert [r.getMessage().split(" exception")[0] for r in records] == ["Task", "_GatheringFuture", "Future"]


# --- gs:// -------------------------------------------------------------------------------------------


HOLDER = textwrap.dedent("""\
    import sys, time
    from tipsito.train import run_lock
    run_lock.RunLock(sys.argv[1], refresh_every_s=0.3).acquire()
    print("held", flush=True)
    time.sleep(600)
""")

CONTENDER = textwrap.dedent("""\
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from tipsito.train import run_lock
    try:
      lock = run_lock.RunLock(sys.argv[1], stale_after_s=float(sys.argv[2])).acquire()
    except run_lock.WorkdirBusy as e:
      print("BUSY", e, flush=True)
      sys.exit(3)
    print("ACQUIRED", flush=True)
    lock.release()
""")


def test_gcs_lock_refuses_a_live_holder_and_takes_over_a_killed_one(gcs_env, tmp_path, runs):
  url = f"gs://{BUCKET}/lock_test_w"
  (tmp_path / "holder.py").write_text(HOLDER)
  (tmp_path / "contender.py").write_text(CONTENDER)
  log = tmp_path / "holder.log"
  with open(log, "w") as f:
    holder = subprocess.Popen(
      [sys.executable, str(tmp_path / "holder.py"), url],
      env=gcs_env,
      stdout=f,
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
  runs.procs.append(holder)
  _wait_for(lambda: "held" in _tail(log), 120, "the gs:// holder", holder, log)

  def contend(stale_after_s):
    return subprocess.run(
      [sys.executable, str(tmp_path / "contender.py"), url, str(stale_after_s)],
      env=gcs_env,
      capture_output=True,
      text=True,
      timeout=120,
    )

  time.sleep(3)  # several refreshes: the holder keeps the lock fresh beyond a 2 s staleness
  r = contend(2)
  assert r.returncode == 3, r.stdout + r.stderr
  assert f"{url}/{run_lock.LOCK_FILE} is held by host {socket.gethostname()}, pid {holder.pid}" in r.stdout
  os.kill(holder.pid, signal.SIGKILL)
  holder.wait(timeout=30)
  time.sleep(3)  # no refresh for longer than the staleness
  r = contend(2)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "ACQUIRED" in r.stdout
  assert re.search(rf"Taking over the lock {re.escape(url)}/run.lock .*pid {holder.pid},", r.stderr), r.stderr
  r = contend(2)  # released by the contender: free
  assert r.returncode == 0 and "Taking over" not in r.stderr, r.stdout + r.stderr


def test_closing_the_tolerant_loop_closes_the_coroutines_of_tasks_still_queued(caplog):
  # Orbax closes its restore loop as soon as a damaged step raises; a sibling task created just before
  # (Orbax's Store._get_array_metadatas) is still queued, its coroutine never started, and Python reported
  # "coroutine ... was never awaited" when it was collected (a CI flake of
  # test_run_safety_iv.py::test_every_damaged_file_of_a_step_falls_back_with_one_warning).
  from tipsito.train import checkpointing  # pylint: disable=import-outside-toplevel

  import asyncio  # pylint: disable=import-outside-toplevel
  import gc  # pylint: disable=import-outside-toplevel
  import warnings  # pylint: disable=import-outside-toplevel

  async def read_metadata():
    return 1

  def queued_then_closed(loop):
    task = loop.create_task(read_metadata())  # queued in the loop, never run
    handle = loop.call_soon(lambda coro: None, read_metadata())  # a queued callback carrying a coroutine
    loop.close()
    del task, handle
    gc.collect()

  def never_awaited() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      queued_then_closed(checkpointing._ClosedLoopTolerantEventLoop())  # pylint: disable=protected-access
      gc.collect()
    return [str(w.message) for w in caught if "never awaited" in str(w.message)]

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    assert never_awaited() == []
    # The check can fail: asyncio's own loop leaves both coroutines unawaited.
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      queued_then_closed(asyncio.SelectorEventLoop())
      gc.collect()
    assert sum("never awaited" in str(w.message) for w in caught) == 2, [str(w.message) for w in caught]
