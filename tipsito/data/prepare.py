"""Where a run's datasets live, checked (or built) before training starts.

Why its own module: a missing dataset must stop a run before anything is written to the workdir, and the
demo's built-in dataset (`data.build_if_missing`) is built into the workdir on first use; both are data
questions the training loop (tipsito/train/loop.py) only asks, in this order: `resolve_data_dirs`,
`check_data_available`, `check_tokenizer` (the other file a run reads before its first step), then
`ensure_dataset` on every process.
"""

from __future__ import annotations

import jax
import ml_collections as mlc

from tipsito import paths
from tipsito.config import recipes as recipes_lib
from tipsito.config import validation as config_validation
from tipsito.data import conversion
from tipsito.data import sources
from tipsito.data import tokenizer as tok_lib


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


def check_tokenizer(config: mlc.ConfigDict) -> None:
  """`config.tokenizer` must load, and its vocabulary must equal `config.model.text.vocab_size` (when that
  is not None, which means: take the size from the tokenizer).

  Checked here, with the data, before anything is written (tipsito/train/loop.py `_check_workdir`), not in
  config validation, which opens no file (a config validates in a process without the tokenizer library).
  Why: the paper configs size the embedding for the official 32k (TIPS) / 49k (CLIP) tokenizers while
  `config.tokenizer=None` is the 2k demo model; training would silently use 2k of 32k rows, and released
  text weights would be indexed by the wrong ids.
  """
  recipe = recipes_lib.get_recipe(config.recipe)
  vocab = config.model.text.vocab_size
  if "text" not in recipe.parts:
    return
  try:
    tok = tok_lib.from_config(config)  # the text flavour's special tokens count ('clip': SOT/EOT)
  except FileNotFoundError as e:
    raise config_validation.ConfigError(f"config.tokenizer={config.tokenizer!r}: {e}") from None
  if vocab is not None and tok.vocab_size != int(vocab):
    which = "None (the shipped demo model)" if config.tokenizer is None else repr(config.tokenizer)
    special = (
      f" ({tok.vocab_size - 2} of the model + SOT/EOT of the 'clip' text flavour)"
      if tok.flavour == "clip"
      else ""
    )
    raise config_validation.ConfigError(
      f"config.tokenizer={which} has a vocabulary of {tok.vocab_size}{special} but "
      f"config.model.text.vocab_size={vocab}; set --config.tokenizer to the SentencePiece model the text tower is sized for (e.g. the "
      f"official 32k TIPS model for vocab_size=32000), or --config.model.text.vocab_size=None to take the "
      f"size from the tokenizer"
    )


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
