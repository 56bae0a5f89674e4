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
