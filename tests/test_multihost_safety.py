"""Run safety II on 2 JAX processes x 4 CPU devices (loopback, gloo): damaged checkpoints and a lost peer.

Why: a pod run must survive what a single host survives, and every host must take the same decision.
  * the latest checkpoints are damaged (an array file of step 6 truncated; process 1's data-iterator
    file of step 4 deleted, so only process 1 cannot read step 4): the same command again restores step 2
    on both processes, moves 6 and 4 aside (process 0 renames, both wait), trains 2 -> 8 and ends with a
    train state and data positions bitwise equal to an uninterrupted run;
  * one process is SIGKILLed mid-run: the other exits by itself within a bounded time with
    PEER_LOST_EXIT_CODE (76) and one line naming the lost process and the step to resume from; the same
    command again finishes bitwise equal to the uninterrupted run.
Every process of every launch is killed at the end, also on failure. How the processes are started is
the same as tests/test_multihost.py (with the loop's own grain pipeline here).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL = 8
EVERY = 2
TIMEOUT = 480  # seconds per launch
PEER_LOST_BOUND = 120  # seconds from the SIGKILL to the survivor's own exit
QUARANTINE = re.compile(r"^(\d+)\.corrupt-\d{8}T\d{6}Z(-\d+)?$")

WORKER = textwrap.dedent(r'''
  import json, sys
  args = json.loads(sys.argv[1])
  from tipsito import distributed
  distributed.initialize(args["coordinator"], 2, args["process_id"])
  import jax
  from absl import logging as absl_logging
  absl_logging.set_verbosity("info")
  absl_logging.set_stderrthreshold("info")
  jax.config.update("jax_default_matmul_precision", "highest")
  from tipsito.config import defaults
  from tipsito.train import loop

  c = defaults.tiny_config("clip", batch_size=8, total_steps=args["total"])
  c.tokenizer = None
  c.max_len = 16
  c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.data = defaults.data_config("shapes", data_dir=args["data_dir"], caption_keys=("caption_detailed",))
  c.ckpt.update(dict(every_steps=args["every"], keep=10, async_save=False))
  c.sharding.min_size = 1  # every divisible leaf sharded: both processes hold real shards
  c.log_every_steps = 1
  c.export.enabled = False
  c.input.num_workers = args["workers"]
  out = {"process": jax.process_index()}
  out["metrics"] = loop.train_and_evaluate(c, args["workdir"], max_steps=args["max_steps"])
  print("RESULT" + json.dumps(out), flush=True)
''')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(workdir, data_dir, *, max_steps=None, kill_after_step=None, workers=1):
  """2 processes x 4 CPU devices, each with `workers` grain worker processes (shared memory that every
  exit must release); with `kill_after_step`, process 1 gets SIGKILL once that step's
  checkpoint is committed and it logged the next step. Returns ([(rc, result, log)], seconds from the
  SIGKILL to process 0's exit or None)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # gloo executables from the cache can hang
  coordinator = f"127.0.0.1:{_free_port()}"
  procs, logs, paths = [], [], []
  t_kill = t_exit0 = None
  try:
    for i in range(2):
      args = dict(
        coordinator=coordinator,
        process_id=i,
        workdir=str(workdir),
        data_dir=data_dir,
        total=TOTAL,
        every=EVERY,
        max_steps=max_steps,
        workers=workers,
      )
      paths.append(f"{workdir}.p{i}.log")
      logs.append(open(paths[-1], "w+"))
      procs.append(
        subprocess.Popen(
          [sys.executable, "-c", WORKER, json.dumps(args)],
          cwd=ROOT,
          env=env,
          stdout=logs[-1],
          stderr=subprocess.STDOUT,
        )
      )
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and any(p.poll() is None for p in procs):
      if kill_after_step and t_kill is None and procs[1].poll() is None:
        committed = os.path.isdir(os.path.join(str(workdir), "checkpoints", str(kill_after_step)))
        if committed and f"step {kill_after_step + 1}/{TOTAL}" in open(paths[1]).read():
          procs[1].send_signal(signal.SIGKILL)
          t_kill = time.time()
      if t_kill is not None and t_exit0 is None and procs[0].poll() is not None:
        t_exit0 = time.time()
      time.sleep(0.2)
    if t_kill is not None and t_exit0 is None and procs[0].poll() is not None:
      t_exit0 = time.time()
  finally:
    for p in procs:  # on failure or timeout: no process outlives the test
      if p.poll() is None:
        p.kill()
      p.wait()
  out = []
  for p, log in zip(procs, logs):
    log.seek(0)
    text = log.read()
    log.close()
    lines = [l for l in text.splitlines() if l.startswith("RESULT")]
    out.append((p.returncode, json.loads(lines[-1][len("RESULT") :]) if lines else None, text))
  return out, (None if t_kill is None or t_exit0 is None else t_exit0 - t_kill)


def _ok(results):
  for rc, res, text in results:
    assert rc == 0 and res is not None, text[-6000:]
  return [res for _, res, _ in results]


def _largest_array_file(step_dir):
  files = [
    os.path.join(r, f)
    for r, _, fs in os.walk(os.path.join(step_dir, "state"))
    for f in fs
    if os.path.basename(r) == "d"
  ]
  return max(files, key=os.path.getsize)


def _tree(d):
  return {
    os.path.relpath(os.path.join(r, f), d): os.path.getsize(os.path.join(r, f))
    for r, _, fs in os.walk(d)
    for f in fs
  }


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  return tmp_path_factory.mktemp("mhs")


@pytest.fixture(scope="module")
def reference(base, data_dir):
  """The uninterrupted run: checkpoints 2, 4, 6, 8."""
  w = str(base / "ref")
  return w, _ok(launch(w, data_dir)[0])


@pytest.fixture(scope="module")
def damaged(base, data_dir):
  """A run stopped after saving step 6, steps 6 and 4 damaged, then the same command again."""
  w = str(base / "dmg")
  _ok(launch(w, data_dir, max_steps=6)[0])  # checkpoints 2, 4, 6, as if killed after saving 6
  ck = os.path.join(w, "checkpoints")
  truncated = _largest_array_file(os.path.join(ck, "6"))
  with open(truncated, "r+b") as f:
    f.truncate(os.path.getsize(truncated) // 3)
  os.remove(os.path.join(ck, "4", "data", "process_1-of-2.json"))  # only process 1 cannot read step 4
  before = {s: _tree(os.path.join(ck, s)) for s in ("2", "4", "6")}
  return w, before, launch(w, data_dir)[0]


@pytest.fixture(scope="module")
def peer(base, data_dir):
  """A run whose process 1 is SIGKILLed after step 2 was committed, then the same command again."""
  w = str(base / "peer")
  killed, exit_s = launch(w, data_dir, kill_after_step=2)
  steps = sorted(os.listdir(os.path.join(w, "checkpoints")))
  return w, killed, exit_s, steps, launch(w, data_dir)[0]


def _state(workdir, step):
  from tipsito.train import checkpointing, step as step_lib, workdir as workdir_lib

  setup = step_lib.build(workdir_lib.load_config(workdir))
  ck = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"), every_steps=0, keep=10, async_save=False
  )
  try:
    abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
    return ck.restore(abstract, step, with_data=False)[0]
  finally:
    ck.close()


def _data_files(workdir, step):
  d = os.path.join(workdir, "checkpoints", str(step), "data")
  return {f: json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d)) if f.endswith(".json")}


def _assert_same_tree(a, b):
  fa = jax.tree_util.tree_flatten_with_path(jax.device_get(a))[0]
  fb = jax.tree.leaves(jax.device_get(b))
  assert len(fa) == len(fb)
  for (path, x), y in zip(fa, fb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def _assert_equal_to_reference(reference, workdir):
  ref = reference[0]
  _assert_same_tree(_state(workdir, TOTAL), _state(ref, TOTAL))
  assert _data_files(workdir, TOTAL) == _data_files(ref, TOTAL)  # both hosts' data positions


def test_damaged_steps_are_moved_aside_on_both_processes(damaged):
  w, before, rerun = damaged
  assert [r["process"] for r in _ok(rerun)] == [0, 1]
  ck = os.path.join(w, "checkpoints")
  names = sorted(os.listdir(ck))
  moved = {QUARANTINE.match(n).group(1): n for n in names if QUARANTINE.match(n)}
  assert sorted(moved) == ["4", "6"], names
  assert sorted(set(names) - set(moved.values())) == ["2", "4", "6", "8"], names  # nothing else removed
  for s in ("4", "6"):  # moved whole (the damage included), never deleted
    assert _tree(os.path.join(ck, moved[s])) == before[s]
  assert _tree(os.path.join(ck, "2")) == before["2"]
  for _, _, text in rerun:  # every process says the same, and restored step 2
    for s in ("4", "6"):
      assert (
        f"Moved unreadable checkpoint {os.path.join(ck, s)} aside to {os.path.join(ck, moved[s])}" in text
      )
    assert "Restored step 2 of" in text
  # process 1 is the one that could not read step 4; process 0 learnt it from the agreement
  p0, p1 = rerun[0][2], rerun[1][2]
  assert "process_1-of-2.json is missing" in p1
  assert f"{ck}/4 cannot be restored (unreadable on another process" in p0


def test_damaged_rerun_ends_bitwise_equal_to_uninterrupted(reference, damaged):
  w, _, rerun = damaged
  _assert_equal_to_reference(reference, w)
  assert _ok(rerun)[0]["metrics"]["loss/total"] == reference[1][0]["metrics"]["loss/total"]


def test_survivor_of_a_lost_peer_exits_by_itself_with_the_documented_status(peer):
  from tipsito.distributed import peer_loss

  w, killed, exit_s, steps, _ = peer
  (rc0, _, log0), (rc1, _, _) = killed
  assert rc1 == -signal.SIGKILL
  assert rc0 == peer_loss.PEER_LOST_EXIT_CODE == 76, log0[-6000:]
  assert exit_s is not None and exit_s < PEER_LOST_BOUND, exit_s
  committed = max(int(s) for s in steps if s.isdigit())
  assert committed >= 2, steps
  last = log0.strip().splitlines()[-1]
  ck = os.path.join(w, "checkpoints")
  assert re.fullmatch(
    r"tipsito: peer process 1 of 2 disappeared \(sent no heartbeat for \d+s\); process 0 stops with "
    rf"exit status 76: run the same command again on every host to resume from step {committed} "
    rf"\({re.escape(os.path.join(ck, str(committed)))}\)\.",
    last,
  ), last
  for noise in (
    "Fatal Python error",
    "Check failure stack trace",
    "Event loop is closed",
    "leaked shared_memory",
  ):
    assert noise not in log0, log0[-6000:]


def test_rerun_after_a_lost_peer_ends_bitwise_equal_to_uninterrupted(reference, peer):
  _ok(peer[4])
  _assert_equal_to_reference(reference, peer[0])
