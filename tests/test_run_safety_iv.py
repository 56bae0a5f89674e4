"""Run safety IV: object storage that fails now and then (tests/fault_proxy.py in front of the GCS emulator),
restart after a hard failure on gs://, and a quiet recovery from any damaged file of a checkpoint step.

Why: on a pod everything lives in object storage, whose clients see 429s, 5xx and dropped connections as a
matter of course; a scheduler restarts a crashed job with the same command at once; and a step can be
damaged in any of its files. Each test here is one of those faults. The emulator and the proxy run on
127.0.0.1 for the length of the module and are stopped at its end; every subprocess has a timeout.
The trainings under faults (a tiny run that saves, stops, resumes and exports on gs:// at 5 %, and each
request kind at 20 %) take minutes of back-off sleeps: they run with TIPSITO_FAULT_MATRIX=1.
"""

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import fault_proxy
from gcs_fixtures import BUCKET, ROOT, faulty_gcs  # noqa: F401  pylint: disable=unused-import  # emulator + proxy
from tipsito.train import checkpointing

HEAVY = "TIPSITO_FAULT_MATRIX"  # runs the trainings under faults (docs/testing.md)


def _script(tmp_path, name, text, env, *args, timeout=120, extra_env=None):
  f = tmp_path / f"{name}.py"
  f.write_text(text)
  t0 = time.time()
  r = subprocess.run(
    [sys.executable, str(f), *args],
    cwd=ROOT,
    env={**env, **(extra_env or {})},
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return r, time.time() - t0


def _result(r):
  lines = [s for s in r.stdout.splitlines() if s.startswith("RESULT ")]
  assert lines, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
  return json.loads(lines[-1][len("RESULT ") :])


# --- the kinds of request the proxy tells apart ------------------------------------------------------


def test_proxy_classifies_requests_by_kind():
  k = fault_proxy.kind_of
  assert k("POST", "/upload/storage/v1/b/tipsito/o?uploadType=media&name=w/run.lock") == "lock"
  assert k("GET", "/storage/v1/b/tipsito/o/w%2Frun.lock") == "lock"
  assert k("GET", "/storage/v1/b/tipsito/o/w%2Fcheckpoints%2F2%2Fstate%2Fd%2F0123abcd") == "array"
  assert k("GET", "/storage/v1/b/tipsito/o/w%2Fcheckpoints%2F2%2Fstate%2Fmanifest.ocdbt") == "array"
  assert (
    k("GET", "/storage/v1/b/tipsito/o/tfds%2Fshapes%2Fshapes-train.array_record-00000-of-00001") == "data"
  )
  assert k("GET", "/storage/v1/b/tipsito/o/w%2Fexport%2Fparams%2Fx") == "export"
  assert k("GET", "/storage/v1/b/tipsito/o?prefix=w%2Fcheckpoints%2F") == "metadata"
  assert k("GET", "/storage/v1/b/tipsito/o/w%2Fconfig.json") == "metadata"
  body = b'--x\r\nContent-Type: application/json\r\n\r\n{"name": "w/run.lock"}\r\n--x\r\n'
  assert k("POST", "/upload/storage/v1/b/tipsito/o?uploadType=multipart&ifGenerationMatch=0", body) == "lock"


RESUMABLE_UPLOAD = textwrap.dedent("""\
    import sys
    import gcsfs
    fs = gcsfs.GCSFileSystem(retries=6)
    data = bytes(range(256)) * 1100  # larger than the block: a resumable upload in two chunks
    with fs.open(sys.argv[1], "wb", block_size=2**18) as f:
      f.write(data)
    print("RESULT", str(fs.cat(sys.argv[1]) == data).lower())
""")


def test_a_dropped_final_chunk_of_a_resumable_upload_is_answered_as_gcs_does(faulty_gcs, tmp_path):
  # The store completed the upload, the client never heard and retries the final chunk: GCS answers
  # with the object, fake-gcs-server with 404 (the session is gone), which ended runs of the fault matrix
  # on `_CHECKPOINT_METADATA` (gcsfs: FileNotFoundError). The proxy answers as GCS does.
  env, proxy = faulty_gcs
  before = proxy.completed_sessions_replayed
  proxy.drop_completing = 1
  try:
    r, _ = _script(tmp_path, "upload", RESUMABLE_UPLOAD, env, f"{BUCKET}/resumable/_CHECKPOINT_METADATA")
  finally:
    proxy.drop_completing = 0
  assert _result(r) is True
  assert proxy.completed_sessions_replayed == before + 1


# --- restart after a hard failure: the gs:// lock ---------------------------------------------------

LOCK_SCENARIOS = textwrap.dedent("""\
    import json, logging, os, subprocess, sys, threading, time
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s", stream=sys.stderr)
    import gcsfs
    from tipsito.train import run_lock
    run_lock.PROGRESS_EVERY_S = 1.0
    G = sys.argv[1]
    fs = gcsfs.GCSFileSystem()
    out = {}

    class Count(logging.Handler):
      def __init__(self):
        super().__init__(); self.lines = []
      def emit(self, record):
        if record.name == "root":  # tipsito's own lines (the emulator's auth notes are google.auth's)
          self.lines.append(record.getMessage())
    count = Count(); logging.getLogger().addHandler(count)

    def plant(url, holder):
      fs.pipe_file(url, json.dumps(holder).encode())

    # 1. the holder ran on this host and is dead: taken over at once, one warning
    dead = subprocess.Popen([sys.executable, "-c", "pass"]); dead.wait()
    url = f"{G}/dead/run.lock"
    plant(url, {**run_lock._host_identity(), "pid": dead.pid, "pid_start": "1", "started": "t0",
                "refreshed": run_lock._now_iso(), "token": "old"})
    count.lines.clear(); t = time.time()
    lock = run_lock.RunLock(f"{G}/dead", stale_after_s=300).acquire()
    out["dead_s"] = time.time() - t
    out["dead_warnings"] = [m for m in count.lines]
    out["dead_holder_now_me"] = json.loads(fs.cat_file(url))["pid"] == os.getpid()
    lock.release()

    # 2. another host stopped refreshing: waited for up to its stale time, with progress lines
    other = {"host": "other-vm", "boot_id": "b", "pid_ns": "p", "pid": 1, "started": "t0", "token": "x"}
    url = f"{G}/other/run.lock"
    plant(url, {**other, "refreshed": run_lock._now_iso()})
    count.lines.clear(); t = time.time()
    lock = run_lock.RunLock(f"{G}/other", stale_after_s=3).acquire()
    out["other_s"] = time.time() - t
    out["other_lines"] = list(count.lines)
    lock.release()

    # 3. the same, asked not to wait
    plant(url, {**other, "refreshed": run_lock._now_iso()})
    os.environ["TIPSITO_LOCK_WAIT"] = "0"
    t = time.time()
    try:
      run_lock.RunLock(f"{G}/other", stale_after_s=300).acquire(); out["nowait"] = "ACQUIRED"
    except run_lock.WorkdirBusy as e:
      out["nowait"] = str(e)
    out["nowait_s"] = time.time() - t
    del os.environ["TIPSITO_LOCK_WAIT"]

    # 4. another host that keeps refreshing: refused once a refresh is seen
    stop = threading.Event()
    def refresher():
      while not stop.wait(0.5):
        try:
          b, k, _ = fs.split_path(url)
          fs.call("PATCH", "b/{}/o/{}", b, k, json={"metadata": {"refreshed": run_lock._now_iso()}})
        except Exception as e:
          print("refresh failed", e, file=sys.stderr)
    th = threading.Thread(target=refresher, daemon=True); th.start()
    t = time.time()
    try:
      run_lock.RunLock(f"{G}/other", stale_after_s=30).acquire(); out["alive"] = "ACQUIRED"
    except run_lock.WorkdirBusy as e:
      out["alive"] = str(e)
    out["alive_s"] = time.time() - t
    stop.set(); th.join()
    print("RESULT " + json.dumps(out))
""")


def test_gcs_lock_after_a_hard_failure(faulty_gcs, tmp_path):
  env, proxy = faulty_gcs
  proxy.rate = 0.0
  r, _ = _script(tmp_path, "scenarios", LOCK_SCENARIOS, env, f"gs://{BUCKET}/locks")
  out = _result(r)
  # 1: at once, one warning naming the dead holder
  assert out["dead_s"] < 10 and out["dead_holder_now_me"], out
  assert len(out["dead_warnings"]) == 1, out["dead_warnings"]
  assert re.match(
    r"Taking over the lock gs://.*/dead/run.lock of a run that ended without releasing it",
    out["dead_warnings"][0],
  )
  assert "no longer runs on this host" in out["dead_warnings"][0]
  # 2: waited about its stale time, with progress lines, then taken over
  assert 2.0 <= out["other_s"] < 20, out
  progress = [m for m in out["other_lines"] if m.startswith("Waiting for the lock")]
  assert len(progress) >= 2 and "host other-vm" in progress[0] and "TIPSITO_LOCK_WAIT=0" in progress[0]
  assert [m for m in out["other_lines"] if m.startswith("Taking over")], out["other_lines"]
  # 3: refused at once
  assert out["nowait"].startswith("tipsito: the workdir is in use") and "TIPSITO_LOCK_WAIT=0" in out["nowait"]
  assert out["nowait_s"] < 10
  # 4: a live holder elsewhere is never taken over
  assert "refreshed while this launch waited" in out["alive"], out["alive"]
  assert out["alive_s"] < 20


LOCK_RACE = textwrap.dedent("""\
    import json, logging, sys, threading, time
    logging.basicConfig(level=logging.ERROR)
    from tipsito.train import run_lock
    G, rounds = sys.argv[1], int(sys.argv[2])
    out = {"second_got_in": 0, "rounds": 0, "errors": []}
    t0 = time.time()
    for i in range(rounds):
      w = f"{G}/race{i}"
      a = run_lock.RunLock(w, stale_after_s=300).acquire()
      try:
        run_lock.RunLock(w, stale_after_s=300).acquire()
        out["second_got_in"] += 1
      except run_lock.WorkdirBusy:
        pass
      a.release()
      b = run_lock.RunLock(w, stale_after_s=300).acquire()   # free again: no deadlock
      b.release()
      out["rounds"] += 1
    out["s"] = time.time() - t0
    print("RESULT " + json.dumps(out))
""")


def test_gcs_lock_under_faults_neither_deadlocks_nor_admits_a_second_run(faulty_gcs, tmp_path):
  env, proxy = faulty_gcs
  # 20 % of lock requests fail; dropped connections (the store acted, the client never heard) included, so
  # a create whose answer was lost is retried and finds the run's own lock
  proxy.rate, proxy.kinds, proxy.max_faults = 0.2, {"lock"}, None
  before = dict(proxy.injected)
  try:
    r, wall = _script(tmp_path, "race", LOCK_RACE, env, f"gs://{BUCKET}/locks", "4", timeout=300)
    proxy.faults = ("drop",)
    r2, _ = _script(tmp_path, "race", LOCK_RACE, env, f"gs://{BUCKET}/locks_drop", "4", timeout=300)
  finally:
    proxy.rate, proxy.kinds, proxy.faults = 0.0, set(fault_proxy.KINDS), fault_proxy.FAULTS
  out2 = _result(r2)
  assert out2["rounds"] == 4 and out2["second_got_in"] == 0, out2
  out = _result(r)
  assert proxy.injected["lock"] > before["lock"], ("no fault was injected", proxy.requests, proxy.injected)
  assert out["rounds"] == 4 and out["second_got_in"] == 0, out
  assert "Traceback" not in r.stderr, r.stderr[-3000:]


OUTAGE = textwrap.dedent("""\
    import json, logging, sys, time
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    from tipsito.train import run_lock
    G, phase = sys.argv[1], sys.argv[2]
    if phase == "release":
      lock = run_lock.RunLock(f"{G}/outage", stale_after_s=300).acquire()
      print("HELD", flush=True)
      input()  # the test switches the outage on, then writes a line
      t = time.time(); lock.release(); print("RELEASED %.1f" % (time.time() - t), flush=True)
    else:
      run_lock.RunLock(f"{G}/outage2", stale_after_s=300).acquire()
""")


def test_outage_ends_with_one_clear_error_and_release_adds_none(faulty_gcs, tmp_path):
  """The store down for good: taking the lock ends in one StorageUnavailable line naming the operation and
  the gs:// path, exit status 1, within gcsfs's bound; a run holding the lock when the outage began
  releases it on its way out with one warning and no second failure (both at once: one bound of wall)."""
  env, proxy = faulty_gcs
  from tipsito import paths

  f = tmp_path / "outage.py"
  f.write_text(OUTAGE)
  holder = subprocess.Popen(
    [sys.executable, str(f), f"gs://{BUCKET}/locks", "release"],
    cwd=ROOT,
    env=env,
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "HELD"
    proxy.outage = True
    holder.stdin.write("go\n")
    holder.stdin.flush()
    t0 = time.time()
    r = subprocess.run(
      [sys.executable, str(f), f"gs://{BUCKET}/locks", "acquire"],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=200,
    )
    wall = time.time() - t0
    out, herr = holder.communicate(timeout=200)
  finally:
    proxy.outage = False
    holder.kill()
  err = r.stderr
  assert r.returncode == 1, (r.returncode, err[-3000:])
  assert "Traceback" not in err, err[-3000:]
  assert wall < paths.GCSFS_RETRY_BOUND_S + 30, wall
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"tipsito: taking the run lock gs://{BUCKET}/locks/outage2/run.lock failed"), last
  assert "gcloud storage ls" in last and "resumes from its last complete checkpoint" in last
  assert sum(line.startswith("tipsito:") for line in err.splitlines()) == 1, err

  assert holder.returncode == 0 and "RELEASED" in out, herr[-3000:]
  assert "Traceback" not in herr, herr[-3000:]
  warnings = [line for line in herr.splitlines() if "Could not release" in line]
  assert len(warnings) == 1 and warnings[0].startswith("WARNING root Could not release the lock"), herr[
    -3000:
  ]


# --- quiet recovery from any damaged file of a step (local disk) -------------------------------------


def _tiny_state(offset):
  import jax.numpy as jnp

  return {
    "params": {"w": jnp.arange(1000.0).reshape(10, 100) + offset, "b": jnp.ones(3) * offset},
    "opt_state": {"mu": jnp.zeros((7, 5), jnp.bfloat16) + offset},
    "step": jnp.asarray(offset, jnp.int32),
  }


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
  """Steps 1 and 2 of a tiny state with a data-iterator state each, saved async as the loop saves."""
  base = tmp_path_factory.mktemp("walk") / "checkpoints"
  ck = checkpointing.Checkpointer(str(base), every_steps=1, keep=5, async_save=True)
  for s in (1, 2):
    ck.save(s, _tiny_state(s), {"position": s})
  ck.close()
  return base


def _files(step_dir):
  return sorted(os.path.relpath(os.path.join(d, f), step_dir) for d, _, fs in os.walk(step_dir) for f in fs)


def _kind(rel):
  if rel.endswith("commit_success.txt"):
    return "commit marker"
  if rel.startswith("data/"):
    return "data-iterator state"
  if "/d/" in rel or rel.endswith(".ocdbt"):
    return "array data"
  return "metadata"


def test_every_damaged_file_of_a_step_falls_back_with_one_warning(
  two_steps, tmp_path, caplog, capfd, recwarn
):
  """Each file of the latest step, truncated to a third or emptied in turn: the restore falls back to
  step 1 with one warning naming step 2 and the file, no traceback, and step 1's state and data position
  bit for bit; or, for a file the step no longer reads (OCDBT nodes its merged manifest superseded), it
  restores step 2 whole, bit for bit, silently."""
  import shutil

  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ),
    _tiny_state(0),
  )
  kinds, intact = set(), []
  for rel in _files(two_steps / "2"):
    for how in ("truncate", "empty"):
      w = tmp_path / f"w{len(kinds)}_{abs(hash((rel, how)))}"  # a new path each time: no cached reads
      shutil.copytree(two_steps, w)
      f = w / "2" / rel
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 3 if how == "truncate" else 0)
      caplog.clear()
      capfd.readouterr()
      with caplog.at_level(logging.WARNING):
        ck = checkpointing.Checkpointer(str(w), every_steps=1, keep=5)
        try:
          state, data = ck.restore(abstract, warn_skipped=False)  # as the training loop restores
          ck.quarantine_unreadable()
          step = ck.restored_step
        finally:
          ck.close()
      out, err = capfd.readouterr()
      assert "Traceback" not in out + err and "Exception ignored" not in out + err, (rel, how, err[-3000:])
      warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
      if step == 2:
        assert "ocdbt.process_" in rel, (rel, how, "restored a damaged step")
        assert warnings == [], (rel, how, warnings)
        intact.append(rel)
        expect, position = _tiny_state(2), 2
      else:
        assert step == 1, (rel, how, step)
        assert len(warnings) == 1, (rel, how, warnings)
        assert f"Checkpoint {w / '2'} cannot be restored" in warnings[0], warnings[0]
        # the file, or for some array data the OCDBT folder (TensorStore then names no data file)
        named = [str(w / "2" / rel)] + (
          [f"{w / '2' / 'state'}/ (array data)"] if _kind(rel) == "array data" else []
        )
        assert any(n in warnings[0] for n in named), (rel, how, warnings[0])
        assert [p.name for p in w.iterdir() if ".corrupt-" in p.name], "step 2 not moved aside"
        expect, position = _tiny_state(1), 1
        kinds.add(_kind(rel))
      assert data == {"position": position}
      for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expect)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), (rel, how)
  import gc

  gc.collect()
  never = [str(x.message) for x in recwarn.list if "never awaited" in str(x.message)]
  assert never == [], never
  assert kinds == {"commit marker", "data-iterator state", "array data", "metadata"}, kinds
  assert len(intact) < len(_files(two_steps / "2")), intact


# --- a run under faults: save, stop, resume, export on gs:// ----------------------------------------

FAULTED_RUN = textwrap.dedent("""\
    import json, logging, os, sys
    import numpy as np
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    import tipsito
    from tipsito.config import defaults
    from tipsito.data import convert
    from tipsito.train import loop, observability, workdir as workdir_lib

    local, G = sys.argv[1], sys.argv[2]
    _writer = observability.create_writer  # TensorFlow's GCS filesystem cannot reach the emulator
    observability.create_writer = lambda d, *a, **k: _writer(os.path.join(local, "events", d[-4:]), *a, **k)
    data = os.path.join(local, "data")
    if not os.path.isdir(data):
      convert.convert("shapes", data, split_sizes={"train": 16, "test": 8}, image_size=32, verbose=False,
                      num_workers=1)

    def cfg(export_dir):
      c = defaults.tiny_config("clip", batch_size=8, total_steps=4)
      c.max_len = 16
      c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
      c.model.image.update(dict(depth=1, posemb_grid=4))
      c.data = defaults.data_config("shapes", data_dir=data, caption_keys=("caption_detailed",))
      c.ckpt.update(dict(every_steps=1, keep=2, async_save=True))
      c.export.dir = export_dir
      return c

    out = {}
    if sys.argv[3] == "reference":
      loop.train_and_evaluate(cfg(os.path.join(local, "export_ref")), os.path.join(local, "ref"))
    else:
      W = f"{G}/faulted"
      loop.train_and_evaluate(cfg(f"{G}/export"), W, max_steps=2)   # saves 1, 2, then stops
      loop.train_and_evaluate(cfg(f"{G}/export"), W)                # resumes at 2, ends at 4, exports
      out["step"] = workdir_lib.latest_checkpoint_step(W)
      images = np.random.RandomState(0).randint(0, 256, (2, 32, 32, 3)).astype(np.uint8)
      a = np.asarray(tipsito.load(f"{G}/export").embed_images(images)["cls"])
      b = np.asarray(tipsito.load(os.path.join(local, "export_ref")).embed_images(images)["cls"])
      out["equal"] = bool(np.array_equal(a, b))
    print("RESULT " + json.dumps(out))
""")


def _faulted_run(faulty_gcs, tmp_path, rate, kinds=fault_proxy.KINDS, name="faulted"):
  env, proxy = faulty_gcs
  r, _ = _script(
    tmp_path, "run", FAULTED_RUN, env, str(tmp_path), f"gs://{BUCKET}/{name}", "reference", timeout=600
  )
  _result(r)
  proxy.rate, proxy.kinds = rate, set(kinds)
  before = sum(proxy.injected.values())
  try:
    r, wall = _script(
      tmp_path, "run", FAULTED_RUN, env, str(tmp_path), f"gs://{BUCKET}/{name}", "faulted", timeout=600
    )
  finally:
    proxy.rate, proxy.kinds = 0.0, set(fault_proxy.KINDS)
  return _result(r), sum(proxy.injected.values()) - before, wall


@pytest.mark.skipif(not os.environ.get(HEAVY), reason=f"heavy (minutes): set {HEAVY}=1")
def test_run_under_faults_on_gs_ends_bitwise_equal_to_a_clean_one(faulty_gcs, tmp_path):
  """5 % of every request answered 429 / 503 or dropped: the run saves, stops, resumes and exports on
  gs:// and its export equals a fault-free local run's bit for bit (measured: 490 s on a loaded 2-core
  machine, most of it the clients' back-off sleeps, so it runs only when asked)."""
  out, injected, wall = _faulted_run(faulty_gcs, tmp_path, 0.05)
  assert injected > 0, "no fault was injected"
  assert out["step"] == 4 and out["equal"], out


@pytest.mark.skipif(not os.environ.get(HEAVY), reason=f"heavy (minutes): set {HEAVY}=1")
@pytest.mark.parametrize("kind", fault_proxy.KINDS)
def test_fault_matrix_at_20_percent_by_kind(faulty_gcs, tmp_path, kind):
  out, injected, _ = _faulted_run(faulty_gcs, tmp_path, 0.2, kinds={kind}, name=f"m_{kind}")
  assert out["step"] == 4 and out["equal"], (kind, out)


# --- a save cut off mid-write on gs:// ---------------------------------------------------------------

CUT_SAVE = textwrap.dedent("""\
    import json, logging, os, sys, time
    import jax, jax.numpy as jnp, numpy as np
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    from tipsito.train import checkpointing
    W, phase = sys.argv[1], sys.argv[2]

    def state(k):
      return {"params": {"w": jnp.arange(4096.0).reshape(64, 64) * k, "b": jnp.ones(5) * k},
              "step": jnp.asarray(k, jnp.int32)}

    from etils import epath
    partial = [os.fspath(q)[len(W) + 1 :] for q in (epath.Path(W) / "2").glob("*")] if phase != "save" else []
    ck = checkpointing.Checkpointer(W, every_steps=1, keep=5, async_save=True)
    if phase == "save":
      ck.save(1, state(1), {"position": 1}); ck.wait()
      print("SAVED 1", flush=True)
      input()  # the test slows array writes down
      ck.save(2, state(2), {"position": 2})
      print("SAVING 2", flush=True)
      time.sleep(600)  # killed meanwhile
    else:
      dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state(0))
      out = {"steps": ck.all_steps(), "partial": partial}
      s, data = ck.restore(abstract, warn_skipped=False)
      ck.quarantine_unreadable()
      out["restored"] = ck.restored_step
      out["equal"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                         for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(state(1))))
      out["data"] = data
      ck.save(2, state(2), {"position": 2}); ck.wait()  # the step number is free again
      s2, d2 = ck.restore(abstract, 2)
      out["steps_after"] = ck.all_steps()
      out["equal2"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                          for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(state(2))))
      ck.close()
      print("RESULT " + json.dumps(out))
""")


def test_save_cut_off_mid_write_on_gs_resumes_from_the_last_complete_step(faulty_gcs, tmp_path):
  """The process is SIGKILLed while Orbax writes step 2 to gs:// (its array writes slowed down by the
  proxy): the rerun lists step 1 only, restores it bit for bit, and writes step 2 again."""
  import signal

  env, proxy = faulty_gcs
  w = f"gs://{BUCKET}/cut/checkpoints"
  f = tmp_path / "cut.py"
  f.write_text(CUT_SAVE)
  p = subprocess.Popen(
    [sys.executable, str(f), w, "save"],
    cwd=ROOT,
    env=env,
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,
  )
  try:
    assert p.stdout.readline().strip() == "SAVED 1", p.stderr.read()[-3000:]
    proxy.delay_s, proxy.delay_kinds = 1.0, {"array"}
    n0 = len(proxy.seen)
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "SAVING 2"
    deadline = time.time() + 120
    while not any(k == "array" and "cut/checkpoints/2" in t for k, _, t in proxy.seen[n0:]):
      assert time.time() < deadline and p.poll() is None, "no array write of step 2 seen"
      time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
  finally:
    proxy.delay_s, proxy.delay_kinds = 0.0, set()
    try:
      os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  r, _ = _script(tmp_path, "cut", CUT_SAVE, env, w, "resume", timeout=300)
  out = _result(r)
  assert out["partial"] and "2/commit_success.txt" not in out["partial"], out  # cut off mid-write
  assert out["steps"] == [1] and out["restored"] == 1 and out["equal"], out
  assert out["data"] == {"position": 1}
  assert out["steps_after"] == [1, 2] and out["equal2"], out
  assert "Traceback" not in r.stderr, r.stderr[-3000:]


# --- a permanent outage on the checkpoint save, restore and export paths -----------------------------

CKPT_OUTAGE = textwrap.dedent("""\
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    import gcs_fixtures
    exec(gcs_fixtures.FAST_BACKOFF)  # the clients' back-off sleeps shortened (tests/gcs_fixtures.py)
    import jax, jax.numpy as jnp, numpy as np
    from etils import epath
    from tipsito import paths
    from tipsito.train import checkpointing
    W = sys.argv[1]

    def state(k):
      return {"params": {"w": jnp.arange(4096.0).reshape(64, 64) * k, "b": jnp.ones(5) * k},
              "step": jnp.asarray(k, jnp.int32)}

    def outage(kinds):  # the test turns the outage of these request kinds on ("none": off)
      print("OUTAGE " + kinds, flush=True); input()

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state(0))
    out = {}
    ck = checkpointing.Checkpointer(W, every_steps=1, keep=1, async_save=True)  # keep=1: only step 1 is left
    ck.save(1, state(1), {"position": 1}); ck.wait()
    for kinds in ("metadata", "array"):  # the save's metadata (gcsfs), then its array data (tensorstore)
      outage(kinds)
      try:
        ck.save(2, state(2), {"position": 2}); ck.wait(); out["save_" + kinds] = "SAVED"
      except paths.StorageUnavailable as e:
        out["save_" + kinds] = str(e)
      ck.close()  # as the training loop closes it on its way out: no second failure
      outage("none")
      ck = checkpointing.Checkpointer(W, every_steps=1, keep=1, async_save=True)
    outage("metadata")
    try:
      ck.restore(abstract, warn_skipped=False); out["restore"] = "RESTORED"
    except paths.StorageUnavailable as e:
      out["restore"] = str(e)
    ck.close()
    outage("none")
    ck = checkpointing.Checkpointer(W, every_steps=1, keep=1, async_save=True)
    s, data = ck.restore(abstract, warn_skipped=False)
    ck.quarantine_unreadable()
    out.update(steps=ck.all_steps(), restored=ck.restored_step, data=data,
               equal=all(np.array_equal(np.asarray(a), np.asarray(b))
                         for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(state(1)))),
               moved_aside=[p.name for p in epath.Path(W).iterdir() if ".corrupt-" in p.name])
    ck.close()
    print("RESULT " + json.dumps(out), flush=True)
""")


def _with_outages(env, proxy, cmd, *, first=None):
  """Runs `cmd`; each `OUTAGE <kinds>` line it prints sets the proxy's outage to those request kinds
  ("none": off) and answers it; `first`: an outage of these kinds from the start. Returns (exit status,
  stdout, stderr); the outage is off afterwards."""
  if first:
    proxy.outage, proxy.outage_kinds = True, set(first)
  p = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  lines = []
  try:
    for line in p.stdout:
      lines.append(line)
      if line.startswith("OUTAGE "):
        kinds = line.split()[1]
        proxy.outage, proxy.outage_kinds = kinds != "none", set(kinds.split(","))
        p.stdin.write("go\n")
        p.stdin.flush()
    _, err = p.communicate(timeout=240)
  finally:
    proxy.outage, proxy.outage_kinds = False, None
    p.kill()
  return p.returncode, "".join(lines), err


def _one_clear_line(text, operation, path):
  assert text.startswith(f"tipsito: {operation} {path} failed: the object store did not answer"), text
  assert "gcloud storage ls" in text and "resumes from its last complete checkpoint" in text, text


def test_outage_on_checkpoint_save_restore_and_export_ends_with_one_line_and_loses_nothing(
  faulty_gcs, tmp_path
):
  """The store down for good while a checkpoint is saved (its metadata, which gcsfs carries; then its
  array data, which tensorstore carries), restored, or an export written: each ends in one
  StorageUnavailable naming the operation and the gs:// path (the export command: that one line, exit
  status 1), no traceback, and the close on the way out adds no second failure; with the store back,
  step 1 (keep=1) is still the latest complete checkpoint, nothing was moved aside, and it restores bit
  for bit. The clients' back-off sleeps are shortened here (tests/gcs_fixtures.py FAST_BACKOFF); gcsfs's
  real bound is measured by the lock outage above."""
  env, proxy = faulty_gcs
  w = f"gs://{BUCKET}/ckout/checkpoints"
  f = tmp_path / "ckpt_outage.py"
  f.write_text(CKPT_OUTAGE)
  rc, stdout, err = _with_outages(env, proxy, [sys.executable, str(f), w])
  assert rc == 0, (rc, err[-3000:])
  out = _result(subprocess.CompletedProcess([], rc, stdout, err))
  assert "Traceback" not in err, err[-3000:]
  _one_clear_line(out["save_metadata"], "saving checkpoint", f"{w}/2")
  _one_clear_line(out["save_array"], "saving checkpoint", f"{w}/2")
  assert "retry attempts failed" in out["save_array"], out["save_array"]  # tensorstore's error
  _one_clear_line(out["restore"], "restoring checkpoint", f"{w}/1")
  assert out["steps"] == [1] and out["restored"] == 1 and out["equal"], out
  assert out["data"] == {"position": 1} and out["moved_aside"] == [], out

  tips = os.path.join(ROOT, "tests", "data", "tips_model")
  export = f"gs://{BUCKET}/ckout/export"
  code = "import gcs_fixtures, runpy; exec(gcs_fixtures.FAST_BACKOFF); runpy.run_module('tipsito.export', run_name='__main__')"
  cmd = [sys.executable, "-c", code, f"--tips_image_npz={tips}/tiny_vit_mlp_vision.npz"]
  cmd += [f"--tips_text_npz={tips}/tiny_text.npz", f"--output={export}"]
  rc, _, err = _with_outages(env, proxy, cmd, first={"export", "metadata"})
  assert rc == 1 and "Traceback" not in err, (rc, err[-3000:])
  _one_clear_line(err.strip().splitlines()[-1], "writing the export", export)
  assert sum(line.startswith("tipsito:") for line in err.splitlines()) == 1, err[-3000:]


# --- TFDS records read from gs:// through the proxy (array_record's reader) --------------------------

DATA_READ = textwrap.dedent("""\
    import json, os, sys
    import numpy as np
    from etils import epath
    from tipsito.data import convert, sources
    local, G, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    data = os.path.join(local, "data")
    if phase == "upload":
      convert.convert("shapes", data, split_sizes={"train": 12, "test": 4}, image_size=16, verbose=False,
                      num_workers=1)
      for root, _, files in os.walk(data):
        for f in files:
          dst = epath.Path(G) / os.path.relpath(os.path.join(root, f), data)
          dst.parent.mkdir(parents=True, exist_ok=True)
          dst.write_bytes(open(os.path.join(root, f), "rb").read())
      print("RESULT {}")
    else:
      def records(d):
        src, _ = sources.open_source({"name": "shapes", "split": "train", "data_dir": d})
        return [src[i] for i in range(len(src))]
      a, b = records(G), records(data)
      same = len(a) == len(b) and all(
        sorted(x) == sorted(y) and all(np.array_equal(np.asarray(x[k]), np.asarray(y[k])) for k in x)
        for x, y in zip(a, b))
      print("RESULT " + json.dumps({"n": len(a), "same": bool(same)}))
""")


def test_tfds_records_read_from_gs_under_faults_are_retried(faulty_gcs, tmp_path):
  """array_record's reader (google-cloud-cpp) reading a TFDS dataset's records from gs:// while 30 % of
  its requests are answered 429 / 503 or dropped: every record arrives, equal to the local files' (its
  retries carry it; a permanent outage there ends after google-cloud-cpp's own time limit, which no
  option of ours shortens: docs/training.md, "Object-store faults")."""
  env, proxy = faulty_gcs
  env = {**env, "CLOUD_STORAGE_EMULATOR_ENDPOINT": proxy.url}
  g = f"gs://{BUCKET}/records/tfds"
  _result(_script(tmp_path, "records", DATA_READ, env, str(tmp_path), g, "upload", timeout=300)[0])
  # at most 40 faults more (max_faults counts the module's earlier tests' faults too)
  proxy.rate, proxy.kinds, proxy.max_faults = 0.3, {"data"}, sum(proxy.injected.values()) + 40
  before = proxy.injected["data"]
  try:
    r, _ = _script(tmp_path, "records", DATA_READ, env, str(tmp_path), g, "read", timeout=300)
  finally:
    proxy.rate, proxy.kinds, proxy.max_faults = 0.0, set(fault_proxy.KINDS), None
  out = _result(r)
  assert proxy.injected["data"] > before, ("no fault was injected", proxy.requests, proxy.injected)
  assert out == {"n": 12, "same": True}, out
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
