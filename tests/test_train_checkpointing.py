"""Checkpointer behaviour that needs no model: fallback past damaged checkpoints, per-host data files,
a clear error for another process count, epath paths.

Why: a preempted pod can leave a truncated latest step (killed mid-write on a file system without
atomic rename, a bucket with lost objects); the run must resume from the previous step and say why,
not crash in a restart loop or silently start over.
"""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito.train import checkpointing


def _state(v):
  return {"w": jnp.full((4, 3), float(v)), "step": jnp.asarray(v, jnp.int32)}


def _abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))


@pytest.fixture
def ckpt_dir(tmp_path):
  ck = checkpointing.Checkpointer(tmp_path / "checkpoints", every_steps=1, keep=5, async_save=False)
  for step in (1, 2, 3):
    ck.save(step, _state(step), {"position": step, "name": "shard"}, force=True)
  ck.close()
  return tmp_path / "checkpoints"


def _restore(d, **kw):
  ck = checkpointing.Checkpointer(d, every_steps=0, keep=5, async_save=False)
  try:
    return ck.restore(_abstract(), **kw)
  finally:
    ck.close()


def _files(d):
  return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]


def test_roundtrip_with_per_process_data_file(ckpt_dir):
  state, data = _restore(ckpt_dir)
  assert int(state["step"]) == 3 and data == {"position": 3, "name": "shard"}
  assert [f for f in os.listdir(ckpt_dir / "3" / "data") if f.endswith(".json")] == ["process_0-of-1.json"]
  state, data = _restore(ckpt_dir, step=2)
  assert int(state["step"]) == 2 and data["position"] == 2


def test_truncated_latest_falls_back_to_previous_with_warning(ckpt_dir, caplog):
  for f in _files(ckpt_dir / "3" / "state"):
    if os.sep + "d" + os.sep in f:  # the array data files of the OCDBT store
      with open(f, "r+b") as fh:
        fh.truncate(0)
  with caplog.at_level(logging.WARNING):
    state, data = _restore(ckpt_dir)
  assert int(state["step"]) == 2 and data["position"] == 2
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full((4, 3), 2.0))
  text = caplog.text
  assert os.path.join(str(ckpt_dir), "3") in text and "falling back" in text


def test_missing_files_fall_back_twice(ckpt_dir, caplog):
  os.remove(ckpt_dir / "3" / "data" / "process_0-of-1.json")
  for f in _files(ckpt_dir / "2" / "state"):
    os.remove(f)
  with caplog.at_level(logging.WARNING):
    state, data = _restore(ckpt_dir)
  assert int(state["step"]) == 1 and data["position"] == 1
  assert "step 3" in caplog.text and "step 2" in caplog.text


def test_nothing_restorable_is_an_error(ckpt_dir):
  for step in (1, 2, 3):
    os.remove(ckpt_dir / str(step) / "data" / "process_0-of-1.json")
  with pytest.raises(RuntimeError, match="can be restored"):
    _restore(ckpt_dir)


def test_other_process_count_is_an_error_naming_both(ckpt_dir):
  d = ckpt_dir / "3" / "data"
  os.rename(d / "process_0-of-1.json", d / "process_0-of-2.json")
  (d / "process_1-of-2.json").write_text("{}")
  with pytest.raises(checkpointing.DataStateMismatch, match="saved by 2 processes but this run has 1"):
    _restore(ckpt_dir)
  state, data = _restore(ckpt_dir, with_data=False)  # params-only restores still work
  assert int(state["step"]) == 3 and data is None


def test_paths_go_through_epath(tmp_path):
  assert str(checkpointing.as_path("gs://bucket/run/checkpoints")) == "gs://bucket/run/checkpoints"
  assert str(checkpointing.as_path("rel/dir")) == os.path.abspath("rel/dir")


def test_preempted_exits_with_documented_code():
  e = checkpointing.Preempted(7)
  assert isinstance(e, SystemExit) and e.code == checkpointing.PREEMPTED_EXIT_CODE == 75 and e.step == 7


def test_single_process_sigterm_sets_the_preemption_flag(tmp_path):
  import signal

  old = signal.getsignal(signal.SIGTERM)
  ck = checkpointing.Checkpointer(tmp_path / "c", every_steps=0, keep=1, async_save=False)
  try:
    ck.install_sigterm_handler()
    assert not ck.reached_preemption(1)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # a second one changes nothing
    assert ck.reached_preemption(2) and ck.preempted
  finally:
    signal.signal(signal.SIGTERM, old)
    ck.close()
