"""Writing exports (tipsito/export_format.py) from training params, and `python -m tipsito.export`.

Sources:
  * the end of a training run: `write_training_export(setup, params, output, step=...)`;
  * a training workdir's latest checkpoint, or checkpoint N: `--workdir DIR [--step N] --output DIR`
    (`export_from_workdir`);
  * an existing export or a Hugging Face Tipsv2Model folder: `--from DIR --output DIR`;
  * released TIPS weights: `--tips_image_npz V.npz --tips_text_npz T.npz [--tokenizer F.model]
    --output DIR` (architecture inferred from shapes, tipsito/tips_import.py).
`--format` picks what is written (tipsito/interop/sources.py: FORMATS): `tipsito` (default, read by
`tipsito.load`; ends in `tipsito.export_format.write_export`, which refuses training-only parts: fusion
module, DINO/iBOT heads, mask token), `hf_tipsv2` (a folder `transformers.Tipsv2Model` opens,
tipsito/interop/hf_tipsv2.py) or `tips_npz` (the official TIPS `.npz` pair, tipsito/interop/tips_npz.py).
Training-time evals use the export's subset in memory (`training_encoder`), so what they measure is what
the export holds.

Flags are defined only when run as a program (`run()`), so importing this module (the training loop,
tests, other entry points) never collides with other absl flags.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import jax
import numpy as np
from absl import app
from absl import flags
from absl import logging

from tipsito import export_format

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Defines the CLI flags (idempotent)."""
  if 'tips_image_npz' in FLAGS:
    return
  flags.DEFINE_string('tips_image_npz', None,
                      'Official TIPS vision checkpoint (.npz).')
  flags.DEFINE_string('tips_text_npz', None,
                      'Official TIPS text checkpoint (.npz).')
  flags.DEFINE_string('tokenizer', None,
                      'SentencePiece model to ship with the export (optional; '
                      'without it the export embeds token ids only).')
  flags.DEFINE_string('workdir', None, 'tipsito training workdir to export.')
  flags.DEFINE_integer('step', None, 'With --workdir: the checkpoint step to export (default: the latest).')
  flags.DEFINE_string('from', None, 'An existing tipsito export or Hugging Face Tipsv2Model folder to '
                      'convert (see --format).')
  flags.DEFINE_enum('format', 'tipsito', ['tipsito', 'hf_tipsv2', 'tips_npz', 'hf_clip', 'open_clip'],
                    'What to write: a tipsito export, a Hugging Face Tipsv2Model folder, or the official '
                    'TIPS .npz pair.')
  flags.DEFINE_string('output', None, 'Output directory.')


# --------------------------------------------------------------------------
# From training params (a Setup of tipsito/train/step.py and its params)
# --------------------------------------------------------------------------

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
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from tipsito.models import layer_stack  # pylint: disable=g-import-not-at-top
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
  from tipsito.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
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
        output, image_config=img, text_config=txt, params=p, temperature=temperature,
        tokenizer_path=tokenizer_path(setup.config), image_proj='image_proj' in p,
        extra={'source': 'tipsito-train', 'recipe': setup.config.recipe, 'step': int(step),
               'image_size': int(setup.config.input.global_size)})
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices('export_written')
  return output


def training_encoder(setup, params: dict):
  """In-memory inference Encoder of training `params`: exactly what the export would hold (evals)."""
  from tipsito import inference  # pylint: disable=g-import-not-at-top
  from tipsito.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  img, txt = export_configs(setup)
  tok = tok_lib.from_config(setup.config)
  return inference.Encoder.from_params(img, txt, export_params(params), temperature_of(params), tok)


def export_from_workdir(workdir: str, output: str, step: Optional[int] = None) -> str:
  """Exports the encoders of a training workdir's latest checkpoint (or of checkpoint `step`).

  Why: any checkpoint of a run (not only the final one) can become an inference model; the workdir's
  config.json rebuilds the state layout, and only image/text (+ image_proj) are kept.
  """
  from tipsito.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  what = f'--workdir {workdir}' + (f' --step {step}' if step is not None else '')
  setup, state = workdir_lib.restore_latest(workdir, what=what, step=step)
  return write_training_export(setup, state.params, output, step=int(state.step))


# --------------------------------------------------------------------------
# From official TIPS weights
# --------------------------------------------------------------------------

def export_tips_npz(image_npz: str, text_npz: str, output: str,
                    tokenizer: Optional[str] = None) -> str:
  """Imports released TIPS .npz weights and writes a tipsito export."""
  from tipsito import tips_import  # pylint: disable=g-import-not-at-top
  icfg, tcfg, params, temperature = tips_import.import_tips_npz(image_npz, text_npz)
  return export_format.write_export(
      output, image_config=icfg, text_config=tcfg, params=params,
      temperature=temperature, tokenizer_path=tokenizer,
      extra={'source': 'tips_npz', 'tips_image_npz': str(image_npz),
             'tips_text_npz': str(text_npz)})


def main(argv: Sequence[str]) -> None:
  """CLI body: read the source (official .npz, workdir [step], export or Tipsv2 folder), write --format."""
  from tipsito.interop import sources  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not FLAGS.output:
    raise app.UsageError('--output is required')
  src = FLAGS['from'].value
  given = [n for n, v in (('--tips_image_npz/--tips_text_npz', FLAGS.tips_image_npz or FLAGS.tips_text_npz),
                          ('--workdir', FLAGS.workdir), ('--from', src)) if v]
  if len(given) != 1:
    raise app.UsageError('give exactly one source: --workdir W [--step N], --from DIR, or '
                         f'--tips_image_npz/--tips_text_npz (got {given or "none"})')
  if FLAGS.step is not None and not FLAGS.workdir:
    raise app.UsageError('--step goes with --workdir (the checkpoint step of a training workdir)')
  fmt = FLAGS.format
  if FLAGS.tips_image_npz or FLAGS.tips_text_npz:
    if not (FLAGS.tips_image_npz and FLAGS.tips_text_npz):
      raise app.UsageError('give both --tips_image_npz and --tips_text_npz')
    if fmt == 'tipsito':
      out = export_tips_npz(FLAGS.tips_image_npz, FLAGS.tips_text_npz, FLAGS.output, FLAGS.tokenizer)
    else:
      model = sources.from_tips_npz(FLAGS.tips_image_npz, FLAGS.tips_text_npz, FLAGS.tokenizer)
      out = sources.write(model, FLAGS.output, fmt)
  elif FLAGS.workdir and fmt == 'tipsito':
    out = export_from_workdir(FLAGS.workdir, FLAGS.output, step=FLAGS.step)
  else:
    model = (sources.from_workdir(FLAGS.workdir, FLAGS.step) if FLAGS.workdir
             else sources.load_source(src))
    if FLAGS.tokenizer:
      model.tokenizer_path = FLAGS.tokenizer
    out = sources.write(model, FLAGS.output, fmt)
  logging.info('wrote %s to %s', fmt, out)
  print(out)


def run() -> None:
  """Console-script entry point (tipsito-export)."""
  _define_flags()
  app.run(main)


if __name__ == '__main__':
  run()
