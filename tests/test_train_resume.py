"""Exact resume, checkpoints and export through the real loop and the real `shapes` pipeline.

Why: a preempted TPU run must continue bitwise-identically (parameters, optimiser state, EMA teacher,
centres, RNG and data order), and the final export must contain the inference encoders only.
Training 2N steps in one go must equal N steps, stop, restore from the workdir, N more.
"""

import os

import jax
import numpy as np
import pytest
from flax import traverse_util

from tipsito.config import defaults
from tipsito.train import loop

N = 2


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """The three runs compile the same step: share it through JAX's persistent compilation cache."""
  old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  yield
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def make_config(data_dir):
  c = defaults.tiny_config("tipsito", batch_size=8, total_steps=2 * N)
  c.tokenizer = None
  c.max_len = 16
  c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.data = defaults.data_config("shapes", data_dir=data_dir, caption_keys=("caption_detailed",))
  c.ckpt.update(dict(every_steps=N, keep=3, async_save=True))
  c.log_every_steps = 1
  return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, compile_cache):
  del compile_cache
  full = str(tmp_path_factory.mktemp("full"))
  split = str(tmp_path_factory.mktemp("split"))
  m_full = loop.train_and_evaluate(make_config(data_dir), full)
  m_half = loop.train_and_evaluate(make_config(data_dir), split, max_steps=N)
  assert not os.path.exists(os.path.join(split, "export"))  # stopped early: no export yet
  m_split = loop.train_and_evaluate(make_config(data_dir), split)  # resumes at N
  return full, split, m_full, m_half, m_split


def _restore(workdir):
  from tipsito.train import checkpointing, step as step_lib, workdir as workdir_lib

  config = workdir_lib.load_config(workdir)
  setup = step_lib.build(config)
  ck = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"), every_steps=0, keep=1, async_save=False
  )
  abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
  state, data = ck.restore(abstract)
  ck.close()
  return state, data


def test_resume_is_bitwise(runs):
  full, split, m_full, _, m_split = runs
  s_full, d_full = _restore(full)
  s_split, d_split = _restore(split)
  assert int(s_full.step) == int(s_split.step) == 2 * N
  a = jax.tree_util.tree_flatten_with_path(jax.device_get(s_full))[0]
  b = jax.tree.leaves(jax.device_get(s_split))
  assert len(a) == len(b)
  for (path, x), y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
  assert d_full == d_split  # data iterator position included
  assert m_full["loss/total"] == m_split["loss/total"]


def test_checkpoints_and_events_written(runs):
  full = runs[0]
  steps = sorted(int(s) for s in os.listdir(os.path.join(full, "checkpoints")) if s.isdigit())
  assert steps == [N, 2 * N]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(full))
  assert os.path.exists(os.path.join(full, "config.json"))


def test_head_only_ema_state_has_no_encoder_copy(runs):
  state, _ = _restore(runs[0])
  assert set(state.ema) == {"dino_head", "ibot_head"}
  n_ema = sum(x.size for x in jax.tree.leaves(state.ema))
  n_heads = sum(x.size for k in ("dino_head", "ibot_head") for x in jax.tree.leaves(state.params[k]))
  assert n_ema == n_heads


def test_export_is_inference_only_and_loads(runs, tmp_path):
  import tipsito
  from tipsito.train import exporting

  full = runs[0]
  for out in (os.path.join(full, "export"), exporting.export_from_workdir(full, str(tmp_path / "e2"))):
    enc = tipsito.load(out)
    flat = traverse_util.flatten_dict(enc.params, sep="/")
    assert set(enc.params) <= {"image", "text", "image_proj"}
    bad = ("fusion", "head", "mask_token", "ema", "opt", "logit", "distill", "center", "mu", "nu")
    assert not [k for k in flat if any(b in k.lower() for b in bad)], list(flat)
    out_img = enc.embed_images(np.zeros((2, 32, 32, 3), np.uint8))
    assert out_img["cls"].shape == (2, 2, 64)
    emb = enc.embed_texts(["a red circle", "two blue squares"])
    assert emb.shape == (2, 64) and np.all(np.isfinite(np.asarray(emb)))
  # The export's encoders equal the trained student's.
  state, _ = _restore(full)
  enc = tipsito.load(os.path.join(full, "export"))
  np.testing.assert_array_equal(
    np.asarray(enc.params["image"]["patch_embed"]["kernel"]),
    np.asarray(state.params["image"]["patch_embed"]["kernel"]),
  )
  assert enc.temperature == pytest.approx(1 / np.exp(float(state.params["logit_scale"])), rel=1e-6)
