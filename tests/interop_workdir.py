"""A tiny tipsito-trained TIPS-style workdir shared by the interop and inference-API tests.

Why a real workdir: `export --workdir W [--step N]`, `evaluate` on a step folder, `init_from` and the
HF export of "a model tipsito trained" all start from one; the towers are tiny (width 64, 2 layers, 8-px
patches on a 4x4 position grid, so 32 px is the native size), the pixels use the CLIP statistics (so the
exported image-processor statistics matter), and the text tower uses the shipped demo tokenizer.
"""

import fcntl
import os

import jax
import numpy as np
import pytest

from tipsito.config import defaults
from tipsito.config import presets

STEPS = (1, 2)


def tiny_config(recipe="tipsv2"):
  c = defaults.tiny_config(recipe, image_size=32)
  c.model.image.update(
    dict(patch_size=8, posemb_grid=4, pixel_mean=presets.CLIP_PIXEL_MEAN, pixel_std=presets.CLIP_PIXEL_STD)
  )
  c.optim.lr = 3e-2  # a few steps move every tower parameter visibly away from its initialisation
  return c


def make_trained_workdir(wd, recipe="tipsv2"):
  """Trains `STEPS[-1]` real steps on a synthetic batch, checkpointing each; returns (config, {step:
  host params})."""
  from tipsito.data.synthetic import synthetic_batch
  from tipsito.train import checkpointing, sharding, step as step_lib, workdir as workdir_lib

  c = tiny_config(recipe)
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  setup = step_lib.build(c, mesh)
  state = setup.init_state()
  step_fn = step_lib.jit_train_step(setup)
  batch = sharding.global_batch(synthetic_batch(c, seed=1), mesh)
  frozen = setup.frozen()
  workdir_lib.save_config(c, str(wd))
  ckpt = checkpointing.Checkpointer(str(wd / "checkpoints"), every_steps=1, keep=len(STEPS), async_save=False)
  params = {}
  for s in STEPS:
    state, _ = step_fn(state, batch, frozen)
    ckpt.save(s, state, force=True)
    params[s] = jax.device_get(state.params)
  ckpt.close()
  return c, params


def _save_params(path, params):
  from flax import traverse_util

  np.savez(path, **{k: np.asarray(v) for k, v in traverse_util.flatten_dict(params, sep="/").items()})


def _load_params(path):
  from flax import traverse_util

  with np.load(path, allow_pickle=False) as f:
    return traverse_util.unflatten_dict({k: f[k] for k in f.files}, sep="/")


@pytest.fixture(scope="session")
def trained_workdir(tmp_path_factory):
  """(workdir path, config, {step: params}) of the tiny tipsv2 run, trained once per test session: the
  pytest-xdist workers of a session share one workdir (the first trains it under a file lock, the others
  read it)."""
  if os.environ.get("PYTEST_XDIST_WORKER"):  # workers' temp dirs sit side by side in the session's dir
    root = tmp_path_factory.getbasetemp().parent / "interop_trained"
    root.mkdir(parents=True, exist_ok=True)
  else:
    root = tmp_path_factory.mktemp("interop_trained")
  wd = root / "workdir"
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      if not (root / "done").exists():
        wd.mkdir(exist_ok=True)
        _, params = make_trained_workdir(wd)
        for s in STEPS:
          _save_params(root / f"params_{s}.npz", params[s])
        (root / "done").write_text("ok")
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
  return wd, tiny_config(), {s: _load_params(root / f"params_{s}.npz") for s in STEPS}
