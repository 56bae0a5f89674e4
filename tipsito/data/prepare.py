"""Where a run's datasets live, checked (or built) before training starts.

Why its own module: a missing dataset must stop a run before anything is written to the workdir, and the
demo's built-in dataset (`data.build_if_missing`) is built into the workdir on first use; both are data
questions the training loop (tipsito/train/loop.py) only asks, in this order: `resolve_data_dirs`,
`check_data_available`, then `ensure_dataset` on every process.
"""

from __future__ import annotations

import jax
import ml_collections as mlc

from tipsito import paths
from tipsito.data import conversion
from tipsito.data import sources


def resolve_data_dirs(config: mlc.ConfigDict, workdir: str) -> mlc.ConfigDict:
  """`data.data_dir=None` with `data.build_if_missing` means `<workdir>/data` (demo: no setup at all);
  evals without their own data_dir then read the same folder. Returns a copy."""
  config = mlc.ConfigDict(config.to_dict())
  if config.data.build_if_missing and not config.data.data_dir:
    config.data.data_dir = paths.join(workdir, "data")
    for ev in config.evals.values():
      if isinstance(ev, mlc.ConfigDict) and not ev.get("data_dir"):
        ev.data_dir = config.data.data_dir
  return config


def check_data_available(config: mlc.ConfigDict) -> None:
  """Fails before anything is written when the training dataset is not prepared, naming where it was
  looked for and the convert command that builds it (datasets built on first use are skipped)."""
  d = config.data
  if d.build_if_missing:
    return
  data_dir = d.data_dir or sources.default_data_dir()
  try:
    sources.resolve_dataset_dir(d.name, data_dir)
  except (FileNotFoundError, ValueError) as e:
    raise FileNotFoundError(
      f"config.data.name={d.name!r}, config.data.data_dir={d.data_dir!r}: {e}. Nothing was written."
    ) from None


def ensure_dataset(config: mlc.ConfigDict) -> None:
  """Builds a built-in dataset (e.g. procedural `shapes`) into data.data_dir when it is missing.

  Call on every process: process 0 builds, the others wait for it."""
  d = config.data
  if not d.build_if_missing:
    return
  kw = dict(d.build_options or {})
  if jax.process_index() == 0:
    conversion.convert(d.name, d.data_dir, verbose=True, **kw)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    multihost_utils.sync_global_devices("dataset_built")
