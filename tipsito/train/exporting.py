"""The export of training params: what a training run's encoders become (tipsito/export_format.py).

Why a library module of its own: the training loop writes the export at the end of a run
(`write_training_export`) and evaluates its in-memory twin during training (`training_encoder`, so what
the evals measure is what the export holds); `python -m tipsito.export --workdir` (tipsito/export.py, the
command line only), `evaluate --checkpoint W` and the interop writers (`model_from_workdir`) export a
workdir's checkpoint the same way.

A workdir's checkpoint is exported from what it holds (`read_workdir`): the encoders' part of the saved
state, read by the checkpoint's own metadata, and the towers' configs from its config.json. No teacher is
read: a distilled student exports on a machine where its teacher is not.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from tipsito import distributed
from tipsito import export_format
from tipsito import inference
from tipsito import objective
from tipsito import paths
from tipsito.data import tokenizer as tok_lib
from tipsito.interop import sources
from tipsito.models import kwargs as kwargs_lib
from tipsito.models import layer_stack
from tipsito.objective.model import TrainModel
from tipsito.train import checkpointing
from tipsito.train import sharding as sharding_lib
from tipsito.train import step as step_lib
from tipsito.train import workdir as workdir_lib

# The scalars an export writes beside the encoders: the temperature (from logit_scale) and SigLIP's bias
# (`--format open_clip`).
_SCALARS = ('logit_scale', 'logit_bias')


def temperature_of(params: dict) -> float:
  """T of logits = cos / T for the export: 1 / exp(logit_scale) (TIPS convention). A replicated scalar:
  readable on every process."""
  if 'logit_scale' not in params:
    return 1.0
  return float(1.0 / np.exp(np.asarray(jax.device_get(params['logit_scale']), np.float64)))


def export_params(params: dict) -> dict:
  """The inference subset of the student params as host numpy arrays, on every process.

  Encoders (+ image projection), no mask token: heads, fusion, distill projection, temperature/bias
  leaves, optimizer state and EMA never get here. Only this subset is gathered: FSDP shards living on
  other hosts' devices come over with `multihost_utils.process_allgather` (a collective: every process
  must call this), so evals and the export work on a pod as on one device.
  """
  out = export_format.select_export_params(params)
  out = jax.tree.map(np.asarray, multihost_utils.process_allgather(out, tiled=True))
  return layer_stack.to_per_layer(out)  # exports are per-layer (scanned towers unstacked)


def export_configs(setup) -> tuple[dict, dict]:
  """(image_config, text_config) of the exported encoders of a training Setup, as JSON-friendly dicts:
  inference settings (no mask token, no remat, per-layer, float32)."""
  return _tower_configs(setup.model)


def _tower_configs(model: TrainModel) -> tuple[dict, dict]:
  """`export_configs` of the training model `model`; both state every key of their module
  (tipsito/models/kwargs.py: complete_tower_config), as the export writer and reader require."""
  img, _ = kwargs_lib.complete_tower_config(model.image_cfg, 'image', 'the training model')
  txt, _ = kwargs_lib.complete_tower_config(model.text_cfg, 'text', 'the training model')
  img['use_mask_token'] = False
  img['remat'] = False
  txt['remat'] = False
  for d in (img, txt):
    d['scan'] = False  # export_params unstacks scanned towers
    d['dtype'] = d['param_dtype'] = 'float32'
  return img, txt


def tokenizer_path(config) -> str:
  """The SentencePiece file to ship with the export (the demo model when config.tokenizer is None)."""
  if config.tokenizer:
    return os.path.expanduser(config.tokenizer)
  return tok_lib.DEFAULT_TOKENIZER


def write_training_export(setup, params: dict, output: str, *, step: int) -> str:
  """Exports the encoders of training `params` (built by `setup`) to `output`.

  Call on every process: the params are gathered collectively, process 0 writes the export once, and
  the others wait for it (so `tipsito.load(output)` works on any host when this returns).
  """
  return _write(setup.config, setup.model, params, output, step=step)


def _write(config, model: TrainModel, params: dict, output: str, *, step: int) -> str:
  """`write_training_export` of the run of `config` whose training model is `model`."""
  img, txt = _tower_configs(model)
  p = export_params(params)
  temperature = temperature_of(params)
  if jax.process_index() == 0:
    with paths.storage_errors_named('writing the export', output, bound=paths.CHECKPOINT_RETRY_BOUND):
      output = export_format.write_export(
        output,
        image_config=img,
        text_config=txt,
        params=p,
        temperature=temperature,
        tokenizer_path=tokenizer_path(config),
        image_proj='image_proj' in p,
        extra=_provenance(config, step),
      )
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('export_written')
  return output


def _provenance(config, step: int) -> dict:
  """What an export of a training run records of it (config.json `extra`)."""
  return {
    'source': 'tipsito-train',
    'recipe': config.recipe,
    'step': int(step),
    'image_size': int(config.input.global_size),
  }


def training_encoder(setup, params: dict):
  """In-memory inference Encoder of training `params`: exactly what the export would hold (evals)."""
  img, txt = _tower_configs(setup.model)
  tok = tok_lib.from_config(setup.config)
  return inference.Encoder.from_params(img, txt, export_params(params), temperature_of(params), tok)


@dataclasses.dataclass(frozen=True)
class SavedEncoders:
  """What the export of a training workdir's checkpoint is made of (`read_workdir`).

  config: the workdir's config.json; model: its training model, for the towers' configs only (never
  initialised); params: the export's params (tipsito/export_format.py `select_export_params`) and the
  scalars `_SCALARS` the run has, as restored; step: the checkpoint's step.
  """

  config: Any
  model: TrainModel
  params: dict
  step: int


def read_workdir(workdir, step: Optional[int] = None, *, what: Optional[str] = None) -> SavedEncoders:
  """The encoders of a training workdir's latest readable checkpoint (or of checkpoint `step`), without
  rebuilding its run: only the part of the state an export holds is read, by the checkpoint's own
  metadata (tipsito/train/checkpointing.py `restore_latest_part`), placed as training places it
  (`config.sharding` on `config.mesh`). Call on every process.

  Why not the run's state: a distilled student's state layout depends on its teacher (the distillation
  projection's width, whether the teacher brought its own heads), so rebuilding it read the teacher
  (tipsito/train/teacher.py) for what the export never holds; the student's towers depend on its config
  alone (`step.build_model`, as training builds them). `what` names the workdir's role in errors
  (default: `--workdir W [--step N]`).
  """
  what = what or f'--workdir {workdir}' + (f' --step {step}' if step is not None else '')
  distributed.configure_jax()
  config = workdir_lib.load_config(workdir)
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = [tuple(r) for r in config.sharding.rules]

  def export_part(saved):
    params = saved['params']
    keep = export_format.select_export_params(params)
    keep.update({k: params[k] for k in _SCALARS if k in params})
    part = {'step': saved['step'], 'params': keep}
    shardings = sharding_lib.tree_shardings(part, mesh, rules, min_size=int(config.sharding.min_size))
    return checkpointing.abstract_with_shardings(part, shardings)

  state = checkpointing.restore_latest_part(workdir, export_part, what=what, step=step)
  # The distillation projection's width (the teacher's) is left unset: the export never holds it.
  model = step_lib.build_model(config, objective.get_recipe(config.recipe))
  return SavedEncoders(config, model, state['params'], int(state['step']))


def export_from_workdir(workdir: str, output: str, step: Optional[int] = None) -> str:
  """Exports the encoders of a training workdir's latest checkpoint (or of checkpoint `step`).

  Why: any checkpoint of a run (not only the final one) can become an inference model; the workdir's
  config.json gives the towers' configs, and only image/text (+ image_proj) are read and kept.
  """
  saved = read_workdir(workdir, step)
  return _write(saved.config, saved.model, saved.params, output, step=saved.step)


def encoder_from_workdir(workdir, step: Optional[int] = None, *, what: Optional[str] = None):
  """In-memory inference Encoder of a training workdir's checkpoint (`read_workdir`): exactly what
  `export_from_workdir` would write, read without the run's teacher."""
  saved = read_workdir(workdir, step, what=what)
  img, txt = _tower_configs(saved.model)
  tok = tok_lib.from_config(saved.config)
  return inference.Encoder.from_params(
    img, txt, export_params(saved.params), temperature_of(saved.params), tok
  )


def model_from_workdir(workdir, step: Optional[int] = None) -> sources.Model:
  """A training workdir's checkpoint at `step` (default: the latest), the export's subset only, as the
  in-memory model every `--format` writer takes (tipsito/interop/sources.py)."""
  saved = read_workdir(workdir, step)
  img, txt = _tower_configs(saved.model)
  extra = _provenance(saved.config, saved.step)
  if 'logit_bias' in saved.params:  # SigLIP: `--format open_clip` writes it (an export keeps no bias)
    extra['logit_bias'] = float(np.asarray(jax.device_get(saved.params['logit_bias'])))
  return sources.Model(
    img,
    txt,
    export_params(saved.params),
    temperature_of(saved.params),
    tokenizer_path(saved.config),
    extra,
  )
