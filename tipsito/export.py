"""`python -m tipsito.export`: write an inference checkpoint for `tipsito.load`.

Two sources:
  * released TIPS weights: --tips_image_npz V.npz --tips_text_npz T.npz
    [--tokenizer F.model] --output DIR (architecture inferred from shapes);
  * a tipsito training workdir: --workdir DIR --output DIR (the training
    code restores the latest checkpoint, see `export_from_workdir`).
Both end in `tipsito.checkpoint.write_export`, which refuses training-only
parts (fusion module, DINO/iBOT heads, mask token).

Flags are defined only when run as a program (`run()`), so importing this
module (tests, other entry points) never collides with other absl flags.
"""
from __future__ import annotations

from typing import Optional, Sequence

from absl import app
from absl import flags
from absl import logging

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
  flags.DEFINE_string('output', None, 'Output directory.')


def export_tips_npz(image_npz: str, text_npz: str, output: str,
                    tokenizer: Optional[str] = None) -> str:
  """Imports released TIPS .npz weights and writes a tipsito export."""
  from tipsito import checkpoint  # pylint: disable=g-import-not-at-top
  icfg, tcfg, params, temperature = checkpoint.import_tips_npz(image_npz,
                                                               text_npz)
  return checkpoint.write_export(
      output, image_config=icfg, text_config=tcfg, params=params,
      temperature=temperature, tokenizer_path=tokenizer,
      extra={'source': 'tips_npz', 'tips_image_npz': str(image_npz),
             'tips_text_npz': str(text_npz)})


def export_from_workdir(workdir: str, output: str) -> str:
  """Exports the encoders of a training workdir's latest checkpoint.

  Why: any checkpoint of a run (not only the final one) can become an inference model; the training
  code knows the state layout, so it restores the student params and keeps image/text (+ image_proj).
  """
  from tipsito.train import loop  # pylint: disable=g-import-not-at-top
  return loop.export_from_workdir(workdir, output)


def main(argv: Sequence[str]) -> None:
  """CLI body: dispatch to the TIPS-npz or the workdir export."""
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not FLAGS.output:
    raise app.UsageError('--output is required')
  if FLAGS.tips_image_npz or FLAGS.tips_text_npz:
    if not (FLAGS.tips_image_npz and FLAGS.tips_text_npz):
      raise app.UsageError('give both --tips_image_npz and --tips_text_npz')
    out = export_tips_npz(FLAGS.tips_image_npz, FLAGS.tips_text_npz,
                          FLAGS.output, FLAGS.tokenizer)
  elif FLAGS.workdir:
    out = export_from_workdir(FLAGS.workdir, FLAGS.output)
  else:
    raise app.UsageError('give --tips_image_npz/--tips_text_npz or --workdir')
  logging.info('wrote export to %s', out)
  print(out)


def run() -> None:
  """Console-script entry point (tipsito-export)."""
  _define_flags()
  app.run(main)


if __name__ == '__main__':
  run()
