"""The export of training params: what a training run's encoders become (tipsito/export_format.py).

Why a library module of its own: the training loop writes the export at the end of a run
(`write_training_export`) and evaluates its in-memory twin during training (`training_encoder`, so what
the evals measure is what the export holds); `python -m tipsito.export --workdir` (tipsito/export.py, the
command line only), `evaluate --checkpoint W` and the interop writers (`model_from_workdir`) export a
workdir's checkpoint the same way.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from tipsito import export_format
from tipsito import inference
from tipsito.data import tokenizer as tok_lib
from tipsito.interop import sources
from tipsito.models import layer_stack
from tipsito.train import assembly


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
  img = dict(setup.model.image_cfg)
  img['use_mask_token'] = False
  img['remat'] = False
  txt = dict(setup.model.text_cfg)
  txt['remat'] = False
  for d in (img, txt):
    if 'scan' in d:
      d['scan'] = False  # export_params unstacks scanned towers
    for k in ('dtype', 'param_dtype'):
      if k in d:
        d[k] = 'float32'
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
  img, txt = export_configs(setup)
  p = export_params(params)
  temperature = temperature_of(params)
  if jax.process_index() == 0:
    output = export_format.write_export(
      output,
      image_config=img,
      text_config=txt,
      params=p,
      temperature=temperature,
      tokenizer_path=tokenizer_path(setup.config),
      image_proj='image_proj' in p,
      extra={
        'source': 'tipsito-train',
        'recipe': setup.config.recipe,
        'step': int(step),
        'image_size': int(setup.config.input.global_size),
      },
    )
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('export_written')
  return output


def training_encoder(setup, params: dict):
  """In-memory inference Encoder of training `params`: exactly what the export would hold (evals)."""
  img, txt = export_configs(setup)
  tok = tok_lib.from_config(setup.config)
  return inference.Encoder.from_params(img, txt, export_params(params), temperature_of(params), tok)


def export_from_workdir(workdir: str, output: str, step: Optional[int] = None) -> str:
  """Exports the encoders of a training workdir's latest checkpoint (or of checkpoint `step`).

  Why: any checkpoint of a run (not only the final one) can become an inference model; the workdir's
  config.json rebuilds the state layout, and only image/text (+ image_proj) are kept.
  """
  what = f'--workdir {workdir}' + (f' --step {step}' if step is not None else '')
  setup, state = assembly.restore_latest(workdir, what=what, step=step)
  return write_training_export(setup, state.params, output, step=int(state.step))


def model_from_workdir(workdir, step: Optional[int] = None) -> sources.Model:
  """A training workdir's checkpoint at `step` (default: the latest), the export's subset only, as the
  in-memory model every `--format` writer takes (tipsito/interop/sources.py)."""
  what = f'--workdir {workdir}' + (f' --step {step}' if step is not None else '')
  setup, state = assembly.restore_latest(workdir, what=what, step=step)
  img, txt = export_configs(setup)
  params = export_params(state.params)
  extra = {
    'source': 'tipsito-train',
    'recipe': setup.config.recipe,
    'step': int(state.step),
    'image_size': int(setup.config.input.global_size),
  }
  if 'logit_bias' in state.params:  # SigLIP: `--format open_clip` writes it (an export keeps no bias)
    extra['logit_bias'] = float(np.asarray(jax.device_get(state.params['logit_bias'])))
  return sources.Model(img, txt, params, temperature_of(state.params), tokenizer_path(setup.config), extra)
