"""Multi-host training as on a pod: 2 JAX processes x 4 CPU devices on loopback, against 1 process.

Why: tipsito trains on TPU pods with one JAX process per host. Everything that only breaks with several
processes is exercised here with real processes (`tipsito.distributed.initialize` on 127.0.0.1, gloo
CPU collectives) driving `tipsito.train.loop.train_and_evaluate` on the real grain pipeline:
  * the same per-term losses as 1 process x 8 devices on the same global batch (to 1e-5);
  * every host saves and restores its own data-iterator state;
  * SIGTERM to one process -> both stop after the same step, save it, and exit with
    PREEMPTED_EXIT_CODE; the rerun finishes with a final state bitwise equal to an uninterrupted run
    (this is also the N + stop + resume == 2N check, with the stop step chosen by the sync protocol);
  * training-time evals (batches split over processes) and the export on FSDP-sharded params;
  * a 2-process checkpoint refuses to restore its data on 1 process (message names both counts);
  * elastic restore: a checkpoint written on 8 devices continues on 4 and on 1 device.
All runs share one module-scoped fixture; every process is killed at the end, also on failure.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL = 8  # steps of every run
CKPT_EVERY = 4  # periodic checkpoints (the elastic runs restart from step 4 of the 1-process run)
SIGTERM_AT = 2  # process 1 of the preempted run sends itself SIGTERM when it fetches this step's batch
TIMEOUT = 420  # seconds per launch
# The cheapest recipe to compile (the multi-host machinery does not depend on the loss; per-term losses
# of every recipe on 1 vs 8 devices: tests/test_train_sharding.py). TIPSITO_MULTIHOST_RECIPE=tipsito
# runs the same checks on the full recipe (about twice as long).
RECIPE = os.environ.get("TIPSITO_MULTIHOST_RECIPE", "clip")

WORKER = textwrap.dedent(r'''
  import json, os, signal, sys, time
  args = json.loads(sys.argv[1])
  from tipsito import distributed
  if args["num_processes"] > 1:
    distributed.initialize(args["coordinator"], args["num_processes"], args["process_id"])
  import jax
  import numpy as np
  from absl import logging as absl_logging
  absl_logging.set_verbosity("info")
  absl_logging.set_stderrthreshold("info")
  jax.config.update("jax_default_matmul_precision", "highest")
  from tipsito.config import defaults
  from tipsito.data import pipeline
  from tipsito.train import checkpointing, loop

  c = defaults.tiny_config(args["recipe"], batch_size=8, total_steps=args["total"])
  c.tokenizer = None
  c.max_len = 16
  c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.data = defaults.data_config("shapes", data_dir=args["data_dir"], caption_keys=("caption_detailed",))
  c.ckpt.update(dict(every_steps=args["ckpt_every"], keep=5, async_save=True))
  c.sharding.min_size = 1  # shard every divisible leaf: the export and evals must gather real shards
  c.log_every_steps = 1
  if args["evals"]:
    c.evals.zeroshot = dict(type="zeroshot", dataset="shapes", data_dir=args["data_dir"], image_size=32,
                            batch_size=8, max_examples=8, text_batch_size=8, prepare=False)

  class Iter:
    """The process's grain shard(s). `shards` > process count: one process emulates the global batch of
    `shards` processes (rows of shard 0, then shard 1, ...: the order of the devices in the mesh)."""
    def __init__(self):
      n = args["shards"]
      mine = range(n) if jax.process_count() == 1 else [jax.process_index()]
      self.its = [pipeline.make_train_iterator(c, process_index=i, process_count=n) for i in mine]
      self.fetched = 0
    def __iter__(self):
      return self
    def __next__(self):
      self.fetched += 1
      if args["sigterm_at"] and jax.process_index() == 1 and self.fetched == args["sigterm_at"]:
        os.kill(os.getpid(), signal.SIGTERM)
      if args["sigterm_at"] and self.fetched >= args["sigterm_at"]:
        time.sleep(1.0)  # gives the preemption notice time to reach every process before the end
      bs = [next(it) for it in self.its]
      return {k: np.concatenate([b[k] for b in bs]) for k in bs[0]}
    def get_state(self):
      if args["sigterm_at"] and jax.process_index() == 1 and self.fetched >= args["sigterm_at"]:
        os.kill(os.getpid(), signal.SIGTERM)  # again, as the save starts: must not disturb it
      return {"shards": [it.get_state() for it in self.its]}
    def set_state(self, state):
      for it, s in zip(self.its, state["shards"]):
        it.set_state(s)

  it = Iter()
  out = {"process": jax.process_index(), "devices": jax.device_count()}
  try:
    out["metrics"] = loop.train_and_evaluate(c, args["workdir"], data_iter=it, max_steps=args["max_steps"])
  except checkpointing.Preempted as e:
    out["preempted_step"] = e.step
    print("RESULT" + json.dumps(out), flush=True)
    raise
  finally:
    for i in it.its:
      i.close()
  print("RESULT" + json.dumps(out), flush=True)
''')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(workdir, data_dir, *, processes=2, devices=4, shards=2, max_steps=None, sigterm_at=0, evals=True):
  """Runs the worker as `processes` processes x `devices` CPU devices; returns [(rc, result, log)]."""
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  # LLVM optimisation off: every run (1 or 2 processes) uses the same flags; it only shortens compiles.
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
  env["JAX_THREEFRY_PARTITIONABLE"] = "1"
  # No persistent compilation cache: executables with gloo collectives restored from it can hang.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  coordinator = f"127.0.0.1:{_free_port()}"
  procs, logs = [], []
  try:
    for i in range(processes):
      args = dict(
        coordinator=coordinator,
        num_processes=processes,
        process_id=i,
        workdir=str(workdir),
        data_dir=data_dir,
        total=TOTAL,
        ckpt_every=CKPT_EVERY,
        shards=shards,
        max_steps=max_steps,
        sigterm_at=sigterm_at,
        evals=evals,
        recipe=RECIPE,
      )
      log = open(os.path.join(str(workdir) + f".p{i}.log"), "w+")
      logs.append(log)
      procs.append(
        subprocess.Popen(
          [sys.executable, "-c", WORKER, json.dumps(args)],
          cwd=ROOT,
          env=env,
          stdout=log,
          stderr=subprocess.STDOUT,
        )
      )
    deadline = time.time() + TIMEOUT
    for p in procs:
      p.wait(timeout=max(1.0, deadline - time.time()))
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
  return out


def _ok(results):
  for rc, res, text in results:
    assert rc == 0 and res is not None, text[-6000:]
  return [res for _, res, _ in results]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
  base = tmp_path_factory.mktemp("mh")
  r = {"dirs": {k: str(base / k) for k in ("one", "two", "term")}}
  r["one"] = _ok(launch(r["dirs"]["one"], data_dir, processes=1, devices=8))
  r["two"] = _ok(launch(r["dirs"]["two"], data_dir))
  r["term"] = launch(r["dirs"]["term"], data_dir, sigterm_at=SIGTERM_AT)
  r["term_rerun"] = _ok(launch(r["dirs"]["term"], data_dir))
  return r


def _checkpoint(workdir, step=None, *, with_data=True):
  from tipsito.train import checkpointing, step as step_lib, workdir as workdir_lib

  setup = step_lib.build(workdir_lib.load_config(workdir))
  ck = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"), every_steps=0, keep=5, async_save=False
  )
  try:
    abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
    return ck.restore(abstract, step, with_data=with_data)
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


def test_two_processes_match_one_process(runs):
  (one,), two = runs["one"], runs["two"]
  assert one["devices"] == 8 and [t["devices"] for t in two] == [8, 8]
  m1, m2a, m2b = one["metrics"], two[0]["metrics"], two[1]["metrics"]
  losses = [k for k in m1 if k.startswith("loss/")]
  assert "loss/total" in losses and len(losses) >= 2, losses  # every term of RECIPE + the total
  for k in losses:
    assert m2a[k] == m2b[k], k  # both hosts log the same numbers
    assert m2a[k] == pytest.approx(m1[k], abs=1e-5, rel=1e-5), k
  # Training-time evals ran on both processes (batches split between them) with the numbers of 1 process.
  assert m2a["zeroshot/num_examples"] == m2b["zeroshot/num_examples"] == m1["zeroshot/num_examples"] == 8
  for k in ("zeroshot/top1", "zeroshot/top5"):
    assert m2a[k] == m2b[k] == pytest.approx(m1[k], abs=1e-6), k


def test_every_host_saves_its_own_data_state(runs):
  two = runs["dirs"]["two"]
  files = _data_files(two, TOTAL)
  assert sorted(files) == ["process_0-of-2.json", "process_1-of-2.json"]
  s0, s1 = (files[f]["shards"][0] for f in sorted(files))
  assert s0["seen"] == s1["seen"] == TOTAL * 4  # each host's own position (4 examples per step)
  # The 1-process run emulating both shards is at the same two positions.
  one_files = _data_files(runs["dirs"]["one"], TOTAL)
  assert list(one_files) == ["process_0-of-1.json"]
  assert one_files["process_0-of-1.json"]["shards"] == [s0, s1]


def test_sigterm_on_one_host_stops_both_at_the_same_step(runs):
  from tipsito.train import checkpointing

  term = runs["term"]
  rcs = [rc for rc, _, _ in term]
  assert rcs == [checkpointing.PREEMPTED_EXIT_CODE] * 2, [t[-3000:] for _, _, t in term]
  steps = [res["preempted_step"] for _, res, _ in term]
  assert steps[0] == steps[1] and SIGTERM_AT <= steps[0] < TOTAL, steps
  saved = sorted(int(s) for s in os.listdir(os.path.join(runs["dirs"]["term"], "checkpoints")) if s.isdigit())
  assert steps[0] in saved
  assert sorted(_data_files(runs["dirs"]["term"], steps[0])) == ["process_0-of-2.json", "process_1-of-2.json"]
  for _, _, text in term:
    assert f"Stopping at step {steps[0]} after SIGTERM" in text


def test_resume_after_sigterm_is_bitwise_equal_to_uninterrupted(runs):
  two, term = runs["dirs"]["two"], runs["dirs"]["term"]
  s_two, d_two = _checkpoint(two, TOTAL, with_data=False)
  s_term, _ = _checkpoint(term, TOTAL, with_data=False)
  assert int(s_two.step) == int(s_term.step) == TOTAL
  _assert_same_tree(s_two, s_term)
  assert _data_files(two, TOTAL) == _data_files(term, TOTAL)  # both hosts' data positions
  assert runs["term_rerun"][0]["metrics"]["loss/total"] == runs["two"][0]["metrics"]["loss/total"]


def test_export_written_once_and_loads(runs):
  import tipsito

  two = runs["dirs"]["two"]
  enc = tipsito.load(os.path.join(two, "export"))
  state, _ = _checkpoint(two, TOTAL, with_data=False)
  np.testing.assert_array_equal(
    np.asarray(enc.params["image"]["patch_embed"]["kernel"]),
    np.asarray(state.params["image"]["patch_embed"]["kernel"]),
  )
  emb = enc.embed_texts(["a red circle"])
  assert emb.shape == (1, 64) and np.all(np.isfinite(np.asarray(emb)))


def test_restore_with_other_process_count_names_both(runs):
  from tipsito.train import checkpointing

  with pytest.raises(checkpointing.DataStateMismatch, match="saved by 2 processes but this run has 1"):
    _checkpoint(runs["dirs"]["two"])
  state, data = _checkpoint(runs["dirs"]["two"], with_data=False)  # params alone restore fine
  assert int(state.step) == TOTAL and data is None


@pytest.mark.parametrize("devices", [4, 1])
def test_elastic_restore_onto_fewer_devices(runs, data_dir, tmp_path, devices):
  """The 1-process x 8-device run's step-4 checkpoint continues on `devices` devices to the same end."""
  src = runs["dirs"]["one"]
  dst = str(tmp_path / f"elastic{devices}")
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("export", "events.*"))
  shutil.rmtree(os.path.join(dst, "checkpoints", str(TOTAL)))
  (res,) = _ok(launch(dst, data_dir, processes=1, devices=devices, evals=False))
  assert res["devices"] == devices
  ref = runs["one"][0]["metrics"]
  for k in [k for k in ref if k.startswith("loss/")]:
    assert res["metrics"][k] == pytest.approx(ref[k], abs=1e-5, rel=1e-5), k
