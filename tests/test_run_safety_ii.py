"""Run safety II (one process): corrupt checkpoints, clean failure paths, CPU runs without libtpu, and the
decision of the peer-loss watch.

Why: each case here trapped or misled a user. A truncated or incomplete latest checkpoint was skipped on
resume, but training then reached that step again and Orbax refused to save it (StepAlreadyExistsError),
on every rerun; a failed run ended in hundreds of "Event loop is closed" lines and leaked shared memory
instead of its error; with the `[tpu-plan]` extra installed every CPU run started libtpu, printed its
errors and fought over its lock file. The multi-process cases (2 processes x 4 CPU devices, peer loss)
are tests/test_multihost_safety.py. Runs are tiny CLIP configs on 32 px shapes.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from tipsito import distributed
from tipsito.train import exporting
from tipsito.distributed import peer_loss
from tipsito.config import defaults
from tipsito.train import assembly
from tipsito.train import checkpointing
from tipsito.train import loop
from tipsito.train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL = 6
EVERY = 2
QUARANTINE = re.compile(r"^(\d+)\.corrupt-\d{8}T\d{6}Z(-\d+)?$")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  from tipsito.data import convert

  d = str(tmp_path_factory.mktemp("data"))
  convert.convert(
    "shapes", d, split_sizes={"train": 32, "test": 8}, image_size=32, verbose=False, num_workers=1
  )
  return d


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
  """The in-process runs compile the same step: share it through JAX's persistent compilation cache."""
  import jax

  old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  yield
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def tiny(data_dir, **kw):
  c = defaults.tiny_config("clip", batch_size=8, total_steps=TOTAL)
  c.max_len = 16
  c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.data = defaults.data_config("shapes", data_dir=data_dir, caption_keys=("caption_detailed",))
  c.ckpt.update(dict(every_steps=EVERY, keep=10, async_save=False))
  c.export.enabled = False
  for k, v in kw.items():
    node = c
    *path, last = k.split("__")
    for p in path:
      node = node[p]
    node[last] = v
  return c


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
  """An uninterrupted run: checkpoints 2, 4, 6."""
  w = str(tmp_path_factory.mktemp("reference"))
  loop.train_and_evaluate(tiny(data_dir), w)
  return w


def _tree(d):
  """{relative path: size} of every file under d."""
  return {
    os.path.relpath(os.path.join(r, f), d): os.path.getsize(os.path.join(r, f))
    for r, _, fs in os.walk(d)
    for f in fs
  }


def _array_files(step_dir):
  """The array data files of a step's train state (OCDBT `d/` folders), largest first."""
  files = [
    os.path.join(r, f)
    for r, _, fs in os.walk(os.path.join(step_dir, "state"))
    for f in fs
    if os.path.basename(r) == "d"
  ]
  return sorted(files, key=os.path.getsize, reverse=True)


def damage(step_dir, how, *, every_file=False):
  """Truncates or deletes the largest array file of a step (the kind of damage a killed writer or a
  lost object leaves), or every array file (which arrays share a file varies from run to run, so a
  reader of the params alone may not need the largest one)."""
  files = _array_files(step_dir)
  for f in files if every_file else files[:1]:
    if how == "truncate":
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 3)
    else:
      os.remove(f)


def _state(workdir, step):
  from tipsito.train import step as step_lib

  setup = step_lib.build(workdir_lib.load_config(workdir))
  ck = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"), every_steps=0, keep=10, async_save=False
  )
  try:
    return ck.restore(checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings), step)
  finally:
    ck.close()


def _assert_same_tree(a, b):
  fa = jax.tree_util.tree_flatten_with_path(jax.device_get(a))[0]
  fb = jax.tree.leaves(jax.device_get(b))
  assert len(fa) == len(fb)
  for (path, x), y in zip(fa, fb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


CONFIG_FILE = textwrap.dedent('''
  """A tiny CLIP run on a prebuilt shapes dataset (args: data=DIR,steps=N,workers=W)."""
  from tipsito.config import defaults


  def get_config(arg=None):
    a = dict(kv.split("=", 1) for kv in arg.split(",")) if arg else {}
    c = defaults.tiny_config("clip", batch_size=8, total_steps=int(a.get("steps", 4)))
    c.max_len = 16
    c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
    c.model.image.update(dict(depth=1, posemb_grid=4))
    c.data = defaults.data_config("shapes", data_dir=a["data"], caption_keys=("caption_detailed",))
    c.ckpt.update(dict(every_steps=1, keep=5, async_save=True))
    c.input.num_workers = int(a.get("workers", 0))
    c.export.enabled = False
    return c
''')


def _cli_env(**extra):
  """The test's environment without JAX_PLATFORMS and TPU variables; C++ logs shown (level 0)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and k not in distributed.TPU_ENV_VARS}
  env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="0")
  env.update(extra)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def _train_cmd(tmp_path, data_dir, workdir, *args, **cfg):
  f = tmp_path / "tiny_cfg.py"
  f.write_text(CONFIG_FILE)
  arg = ",".join([f"data={data_dir}"] + [f"{k}={v}" for k, v in cfg.items()])
  return [sys.executable, "-m", "tipsito.train", "--config", f"{f}:{arg}", "--workdir", str(workdir), *args]


# --- corrupt-step quarantine ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_damaged_latest_step_is_moved_aside_and_the_run_ends_bitwise_equal(
  tmp_path, data_dir, reference, caplog, how
):
  w = str(tmp_path / "w")
  ckdir = os.path.join(w, "checkpoints")
  loop.train_and_evaluate(tiny(data_dir), w, max_steps=4)  # as if killed right after step 4 was saved
  assert sorted(os.listdir(ckdir)) == ["2", "4"]
  damage(os.path.join(ckdir, "4"), how)
  damaged_4, kept_2 = _tree(os.path.join(ckdir, "4")), _tree(os.path.join(ckdir, "2"))

  with caplog.at_level("WARNING"):
    loop.train_and_evaluate(tiny(data_dir), w)  # the same command again: 2 -> 6, step 4 written again

  names = sorted(os.listdir(ckdir))
  moved = [n for n in names if QUARANTINE.match(n)]
  assert len(moved) == 1 and moved[0].startswith("4.corrupt-"), names
  assert sorted(set(names) - set(moved)) == ["2", "4", "6"], names  # nothing else removed
  assert _tree(os.path.join(ckdir, moved[0])) == damaged_4  # moved whole, never deleted
  assert _tree(os.path.join(ckdir, "2")) == kept_2
  # Orbax's listings (the resume guard's and the checkpointer's) do not take the moved folder for a step.
  assert workdir_lib.latest_checkpoint_step(w) == TOTAL
  ck = checkpointing.Checkpointer(ckdir, every_steps=0, keep=10, async_save=False)
  assert ck.all_steps() == [2, 4, TOTAL]
  ck.close()
  assert (
    f"Moved unreadable checkpoint {os.path.join(ckdir, '4')} aside to {os.path.join(ckdir, moved[0])}"
    in caplog.text
  )
  assert "Restored step 2 of" in caplog.text

  ref_state, ref_data = _state(reference, TOTAL)
  state, data = _state(w, TOTAL)
  assert int(state.step) == TOTAL
  _assert_same_tree(state, ref_state)
  assert data == ref_data  # the data iterator is at the same position too


def test_every_step_unreadable_stops_before_writing(tmp_path, data_dir):
  w = str(tmp_path / "w")
  loop.train_and_evaluate(tiny(data_dir), w, max_steps=4)
  damage(os.path.join(w, "checkpoints", "4"), "truncate")
  damage(os.path.join(w, "checkpoints", "2"), "delete")
  before = {p: (s, os.path.getmtime(os.path.join(w, p))) for p, s in _tree(w).items()}
  with pytest.raises(checkpointing.NoReadableCheckpoint) as e:
    loop.train_and_evaluate(tiny(data_dir), w)
  msg = str(e.value)
  assert "no checkpoint in" in msg and "step 4: " in msg and "step 2: " in msg, msg
  assert msg.index("step 4: ") < msg.index("step 2: ")
  assert "Nothing was moved or written" in msg
  assert {p: (s, os.path.getmtime(os.path.join(w, p))) for p, s in _tree(w).items()} == before


def test_readers_of_a_workdir_fall_back_and_move_nothing(tmp_path, reference):
  from tipsito.train import step as step_lib

  w = str(tmp_path / "copy")
  shutil.copytree(reference, w)
  damage(os.path.join(w, "checkpoints", str(TOTAL)), "truncate", every_file=True)
  listing = sorted(os.listdir(os.path.join(w, "checkpoints")))
  good, _ = _state(reference, 4)

  # export --workdir (evaluate --checkpoint W and workdir teachers read through the same function)
  exporting.export_from_workdir(w, str(tmp_path / "export"))
  import tipsito

  enc = tipsito.load(str(tmp_path / "export"))
  np.testing.assert_array_equal(
    np.asarray(enc.params["image"]["patch_embed"]["kernel"]),
    np.asarray(good.params["image"]["patch_embed"]["kernel"]),
  )
  _, state = assembly.restore_latest(w, what="test")
  assert int(state.step) == 4
  # config.init_from (params only)
  setup = step_lib.build(workdir_lib.load_config(w))
  abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
  params = checkpointing.restore_params(w, abstract.params)
  _assert_same_tree(params, good.params)
  assert sorted(os.listdir(os.path.join(w, "checkpoints"))) == listing  # read-only: nothing moved


def test_init_from_a_run_whose_latest_step_is_corrupt_starts_from_the_previous_one(
  tmp_path, data_dir, reference
):
  """`config.init_from` reads another run read-only, as a resume reads its own workdir: a corrupt latest
  step of the init run is skipped (the previous readable one is used) and nothing in that run's
  directory is moved or written."""
  src = str(tmp_path / "stage1")
  shutil.copytree(reference, src)
  damage(os.path.join(src, "checkpoints", str(TOTAL)), "truncate", every_file=True)
  before = _tree(src)
  good, _ = _state(reference, TOTAL - EVERY)
  setup = assembly.build(tiny(data_dir, init_from=src))
  state = assembly.init_from(setup, setup.init_state())
  _assert_same_tree(state.params, good.params)
  assert int(state.step) == 0
  assert _tree(src) == before  # read-only: nothing moved, written or removed in the init run


# --- clean failure path ------------------------------------------------------------------------------


def test_failed_run_closes_once_and_ends_with_the_error_and_what_to_do(tmp_path, data_dir):
  """A run that stops on an error while grain worker processes and an async checkpoint manager are open
  (here: the non-finite guard) ends with the error and the way on, nothing after it."""
  w = tmp_path / "w"
  cmd = _train_cmd(
    tmp_path,
    data_dir,
    w,
    "--config.optim.lr=1e30",
    "--config.nonfinite.max_consecutive=2",
    steps=6,
    workers=1,
  )
  r = subprocess.run(
    cmd,
    cwd=ROOT,
    env=_cli_env(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2"),
    capture_output=True,
    text=True,
    timeout=600,
  )
  out = r.stdout + r.stderr
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 1, out[-4000:]
  assert lines[-2].startswith("tipsito.train.nonfinite.NonFiniteError: Stopping at step 2"), lines[-5:]
  assert lines[-1] == (
    f"tipsito: the run stopped; fix the cause above, then run the same command again "
    f"to resume from step 1 ({w}/checkpoints/1)."
  ), lines[-5:]
  assert out.count("Traceback (most recent call last)") == 1, out[-4000:]
  for cascade in (
    "Event loop is closed",
    "leaked shared_memory",
    "handle is closed",
    "cannot schedule new futures",
  ):
    assert cascade not in out, out[-4000:]


# --- CPU runs never start libtpu ---------------------------------------------------------------------


def test_accelerator_evidence_reads_files_and_environment_only(tmp_path, monkeypatch):
  from jax._src import hardware_utils

  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
  globs = (str(tmp_path / "accel*"), str(tmp_path / "vfio" / "[0-9]*"))
  assert distributed.accelerator_evidence({}, globs) is None
  (tmp_path / "vfio").mkdir()
  (tmp_path / "vfio" / "vfio").write_text("")  # the vfio control node exists without any device
  assert distributed.accelerator_evidence({}, globs) is None
  (tmp_path / "vfio" / "0").write_text("")
  assert distributed.accelerator_evidence({}, globs) == str(tmp_path / "vfio" / "0")
  assert distributed.accelerator_evidence({"TPU_WORKER_HOSTNAMES": "h0,h1"}, ()) == "$TPU_WORKER_HOSTNAMES"
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, None))
  assert distributed.accelerator_evidence({}, ()) == "4 TPU PCI device(s)"
  # An explicit JAX_PLATFORMS (even empty: "let JAX choose") is never overridden.
  assert distributed.select_platform({"JAX_PLATFORMS": ""}) is None


def test_platform_is_cpu_on_a_machine_without_accelerators():
  if distributed.accelerator_evidence() is not None:
    pytest.skip(f"this machine has an accelerator ({distributed.accelerator_evidence()})")
  code = (
    "from tipsito import distributed; import jax; print(distributed.select_platform()); "
    "print(jax.config.jax_platforms, jax.devices()[0].platform)"
  )
  r = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, env=_cli_env(), capture_output=True, text=True, timeout=300
  )
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["cpu", "cpu", "cpu"], r.stdout


def test_two_cpu_trainings_at_once_never_touch_libtpu(tmp_path, data_dir):
  from tipsito.planning import pod as plan

  if not plan.libtpu_available():
    pytest.skip("libtpu not installed (pip install -e '.[tpu-plan]'): nothing to keep away")
  if distributed.accelerator_evidence() is not None:
    pytest.skip(f"this machine has an accelerator ({distributed.accelerator_evidence()})")
  env = _cli_env()
  assert "JAX_PLATFORMS" not in env
  procs = []
  for name in ("a", "b"):
    log = open(tmp_path / f"{name}.log", "w+")
    procs.append(
      (
        subprocess.Popen(
          _train_cmd(tmp_path, data_dir, tmp_path / name, steps=2),
          cwd=ROOT,
          env=env,
          stdout=log,
          stderr=subprocess.STDOUT,
        ),
        log,
      )
    )
  deadline = time.time() + 600
  try:
    for p, _ in procs:
      p.wait(timeout=max(1.0, deadline - time.time()))
  finally:
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in procs:
    log.seek(0)
    text = log.read()
    log.close()
    assert p.returncode == 0, text[-4000:]
    assert "step 2/2" in text, text[-4000:]
    bad = re.findall(r".*(?:libtpu|\bTPU\b|backend 'tpu'|lock ?file).*", text, flags=re.IGNORECASE)
    assert not bad, bad[:5]


# --- the peer-loss watch's decision ------------------------------------------------------------------


class _Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def _watch(process_id=0, n=3):
  clock = _Clock()
  return peer_loss.PeerWatch(None, process_id, n, interval=1, lost_after=10, clock=clock), clock


def _kv(**beats):
  return [(f"{peer_loss.KEY_PREFIX}{k[1:]}", str(v)) for k, v in beats.items()]


def test_peer_watch_names_the_process_whose_heartbeat_stopped():
  w, clock = _watch()
  for t in range(1, 30):
    clock.t = float(t)
    # process 1 beats every second until t=5; process 2 keeps beating
    verdict = w.observe(_kv(p0=t, p1=min(t, 5), p2=t), clock.t)
    if t < 15:
      assert verdict is None, (t, verdict)
    else:
      assert verdict == "peer process 1 of 3 disappeared (sent no heartbeat for 10s)", (t, verdict)
      break
  else:
    raise AssertionError("never lost")


def test_peer_watch_ignores_finished_processes_and_names_a_lost_coordinator():
  w, clock = _watch(process_id=2)
  for t in range(1, 40):
    clock.t = float(t)
    entries = _kv(p0=t, p1=t if t < 3 else peer_loss.DONE, p2=t)
    assert w.observe(entries, clock.t) is None  # process 1 finished: never lost
  w, clock = _watch(process_id=1)
  w.observe(_kv(p0=1, p1=1, p2=1), 1.0)
  assert w.observe(None, 2.0) is None
  assert w.observe(None, 11.0) is None
  assert w.observe(None, 12.0).startswith("peer process 0 of 3 (the coordinator")
  w, _ = _watch(process_id=0)
  assert w.observe(None, 100.0) is None and w.observe(None, 200.0) is None  # process 0 hosts the service


def test_lost_peer_exit_is_one_line_after_the_cleanups(monkeypatch, capfd):
  import threading

  calls = []
  monkeypatch.setattr(os, "_exit", lambda code: calls.append(("exit", code)))
  monkeypatch.setattr(peer_loss, "_watch", peer_loss.PeerWatch(None, 0, 2))
  monkeypatch.setattr(peer_loss, "_exiting", threading.Lock())
  # multiprocessing's exit finalizers would run in the test process itself
  monkeypatch.setattr(peer_loss, "_release_interpreter_resources", lambda: calls.append(("release",)))
  peer_loss.add_cleanup(lambda: calls.append(("cleanup",)))
  peer_loss.set_resume_hint(lambda: "run the same command again on every host to resume from step 4 (W)")
  try:
    peer_loss.exit_peer_lost("peer process 1 of 2 disappeared (sent no heartbeat for 30s)")
  finally:
    peer_loss._cleanups.clear()
    peer_loss.set_resume_hint(None)
  assert calls == [("cleanup",), ("release",), ("exit", peer_loss.PEER_LOST_EXIT_CODE)]
  assert peer_loss.PEER_LOST_EXIT_CODE == 76
  err = capfd.readouterr().err
  assert err == (
    "tipsito: peer process 1 of 2 disappeared (sent no heartbeat for 30s); process 0 stops "
    "with exit status 76: run the same command again on every host to resume from step 4 "
    "(W).\n"
  )


def test_peer_watch_needs_two_new_heartbeats_to_call_a_peer_alive():
  """After an error the loop asks whether every peer is alive: the first change seen may be the last
  beat a peer wrote before it died, so only a second one counts."""
  w, _ = _watch()
  w.observe(_kv(p0=1, p1=1, p2=1), 1.0)
  base = w.changes()
  w.observe(_kv(p0=2, p1=2, p2=2), 2.0)  # process 1's last beat, written before it died
  assert not w.all_alive_after(base)
  w.observe(_kv(p0=3, p1=2, p2=3), 3.0)
  assert not w.all_alive_after(base)
  w.observe(_kv(p0=4, p1=3, p2=4), 4.0)  # process 1 is alive after all
  assert w.all_alive_after(base)
  base = w.changes()
  w.observe(_kv(p0=5, p1=peer_loss.DONE, p2=5), 5.0)  # a finished process needs no more heartbeats
  w.observe(_kv(p0=6, p1=peer_loss.DONE, p2=6), 6.0)
  assert w.all_alive_after(base)
