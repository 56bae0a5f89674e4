"""`python -m tipsito.export`: the command line of the exports (tipsito/export_format.py); the library is
tipsito/train/exporting.py (training params) and tipsito/interop/sources.py (the other sources).

Sources:
  * the end of a training run: `exporting.write_training_export(setup, params, output, step=...)`;
  * a training workdir's latest checkpoint, or checkpoint N: `--workdir DIR [--step N] --output DIR`
    (`exporting.export_from_workdir`);
  * an existing export or a Hugging Face Tipsv2Model folder: `--from DIR --output DIR`;
  * released TIPS weights: `--tips_image_npz V.npz --tips_text_npz T.npz [--tokenizer F.model]
    --output DIR` (architecture inferred from shapes, tipsito/tips_import.py; `sources.export_tips_npz`).
`--format` picks what is written (tipsito/interop/sources.py: FORMATS): `tipsito` (default, read by
`tipsito.load`; ends in `tipsito.export_format.write_export`, which refuses training-only parts: fusion
module, DINO/iBOT heads, mask token), `hf_tipsv2` (a folder `transformers.Tipsv2Model` opens,
tipsito/interop/hf_tipsv2.py) or `tips_npz` (the official TIPS `.npz` pair, tipsito/interop/tips_npz.py).
Training-time evals use the export's subset in memory (`exporting.training_encoder`), so what they
measure is what the export holds.

Flags are defined only when run as a program (`run()`), so importing this module (the training loop,
tests, other entry points) never collides with other absl flags.
"""

from __future__ import annotations

from typing import Sequence

from absl import app
from absl import flags
from absl import logging

from tipsito import command
from tipsito import paths
from tipsito.interop import sources
from tipsito.train import exporting

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Defines the CLI flags (idempotent)."""
  if 'tips_image_npz' in FLAGS:
    return
  flags.DEFINE_string('tips_image_npz', None, 'Official TIPS vision checkpoint (.npz).')
  flags.DEFINE_string('tips_text_npz', None, 'Official TIPS text checkpoint (.npz).')
  flags.DEFINE_string(
    'tokenizer',
    None,
    'SentencePiece model to ship with the export (optional; without it the export embeds token ids only).',
  )
  flags.DEFINE_string('workdir', None, 'tipsito training workdir to export.')
  flags.DEFINE_integer('step', None, 'With --workdir: the checkpoint step to export (default: the latest).')
  flags.DEFINE_string(
    'from', None, 'An existing tipsito export or Hugging Face Tipsv2Model folder to convert (see --format).'
  )
  flags.DEFINE_enum(
    'format',
    'tipsito',
    ['tipsito', 'hf_tipsv2', 'tips_npz', 'hf_clip', 'open_clip'],
    'What to write: a tipsito export, a Hugging Face Tipsv2Model folder, or the official TIPS .npz pair.',
  )
  flags.DEFINE_string('output', None, 'Output directory.')


def _writing(output: str):
  """An object-store outage while writing `output` ends in one line naming it (tipsito/paths.py
  `StorageUnavailable`); the checkpoints it was read from are untouched, so the same command redoes it."""
  return paths.storage_errors_named('writing the export', output, bound=paths.CHECKPOINT_RETRY_BOUND)


def main(argv: Sequence[str]) -> None:
  """CLI body: read the source (official .npz, workdir [step], export or Tipsv2 folder), write --format."""
  command.no_arguments(argv)
  if not FLAGS.output:
    raise app.UsageError('--output is required')
  src = FLAGS['from'].value
  given = [
    n
    for n, v in (
      ('--tips_image_npz/--tips_text_npz', FLAGS.tips_image_npz or FLAGS.tips_text_npz),
      ('--workdir', FLAGS.workdir),
      ('--from', src),
    )
    if v
  ]
  if len(given) != 1:
    raise app.UsageError(
      'give exactly one source: --workdir W [--step N], --from DIR, or '
      f'--tips_image_npz/--tips_text_npz (got {given or "none"})'
    )
  if FLAGS.step is not None and not FLAGS.workdir:
    raise app.UsageError('--step goes with --workdir (the checkpoint step of a training workdir)')
  fmt = FLAGS.format
  if FLAGS.tips_image_npz or FLAGS.tips_text_npz:
    if not (FLAGS.tips_image_npz and FLAGS.tips_text_npz):
      raise app.UsageError('give both --tips_image_npz and --tips_text_npz')
    if fmt == 'tipsito':
      with _writing(FLAGS.output):
        out = sources.export_tips_npz(
          FLAGS.tips_image_npz, FLAGS.tips_text_npz, FLAGS.output, FLAGS.tokenizer
        )
    else:
      model = sources.from_tips_npz(FLAGS.tips_image_npz, FLAGS.tips_text_npz, FLAGS.tokenizer)
      with _writing(FLAGS.output):
        out = sources.write(model, FLAGS.output, fmt)
  elif FLAGS.workdir and fmt == 'tipsito':
    out = exporting.export_from_workdir(FLAGS.workdir, FLAGS.output, step=FLAGS.step)
  else:
    model = (
      exporting.model_from_workdir(FLAGS.workdir, FLAGS.step) if FLAGS.workdir else sources.load_source(src)
    )
    if FLAGS.tokenizer:
      model.tokenizer_path = FLAGS.tokenizer
    with _writing(FLAGS.output):
      out = sources.write(model, FLAGS.output, fmt)
  logging.info('wrote %s to %s', fmt, out)
  print(out)


run = command.entry_point(_define_flags, main)  # tipsito-export


if __name__ == '__main__':
  run()
