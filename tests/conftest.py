"""Shared pytest setup: CPU-only JAX, deterministic RNG, paths to the conformance vectors."""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
jax.config.update("jax_default_matmul_precision", "highest")

DATA_DIR = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def conformance_dir() -> pathlib.Path:
  """Directory holding the reference vectors copied from shared/conformance."""
  return DATA_DIR


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
  """A tiny `shapes` dataset (48 train / 8 test images at 32 px) for tests that drive the real loop and
  pipeline; a test module may define its own `data_dir` instead."""
  from tipsito.data import convert  # pylint: disable=import-outside-toplevel

  d = str(tmp_path_factory.mktemp("data"))
  convert.convert("shapes", d, split_sizes={"train": 48, "test": 8}, image_size=32, verbose=False)
  return d


def run_synthetic_steps(config, steps: int):
  """`steps` jitted train steps of `config` on one device, on one fixed synthetic batch (vocab 100).

  Returns (setup, state, frozen, per-step metrics as floats); shared by the recipe and distillation tests.
  """
  from tipsito.data.synthetic import synthetic_batch  # pylint: disable=import-outside-toplevel
  from tipsito.train import assembly, sharding, step as step_lib  # pylint: disable=import-outside-toplevel

  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  setup = assembly.build(config, mesh, vocab_size=100)  # with config.distill's teacher, if any
  state = setup.init_state()
  step_fn = step_lib.jit_train_step(setup)
  batch = sharding.global_batch(synthetic_batch(config, seed=1), mesh)
  frozen = setup.frozen()
  hist = []
  for _ in range(steps):
    state, m = step_fn(state, batch, frozen)
    hist.append({k: float(v) for k, v in jax.device_get(m).items()})
  return setup, state, frozen, hist
