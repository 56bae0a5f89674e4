"""Input-pipeline throughput: `python -m tipsito.data.pipeline_bench [--num_images N] [--workers 0,2]`.

Why: a TPU host must feed its chips; the target is >= 100 images/s per CPU core for both the ITO
two-view (2 x 224) and the TIPSv2 1+6 multi-crop (224 + 6 x 98) transforms from ~400 px sources.
This measures (1) the per-example transforms in one process, one thread (= images/s per worker),
on synthetic ~400 px JPEG and PNG sources, and (2) the end-to-end grain pipeline (decode, captions,
tokens, views, masks, batching) with W worker processes. Prints a table, a per-op CPU breakdown of
each transform (open, decode, crop+resize, flip, each jitter op, grayscale, blur, to-array; via the
transforms' `timings` hook, so a regression in one op is visible), and one JSON line.
`run_data_bench()` returns the numbers. The train step has its own benchmark, tipsito/bench/step_bench.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from typing import Sequence

import numpy as np

from tipsito.data import pipeline
from tipsito.data import tokenizer as tok_lib
from tipsito.data.synthetic import synthetic_source
from tipsito.data import grain_ops
from tipsito.data import transforms as T

__all__ = ['synthetic_source', 'run_data_bench', 'main']


def _transform_rate(source: Sequence[dict], transform, min_seconds: float) -> tuple[float, float]:
  """(images per wall second, images per CPU second of this thread) of open_image + transform,
  cycling over the source in this thread. The CPU-time figure is the per-core rate even on a
  shared, oversubscribed machine, where wall-clock time also counts other people's work."""
  rng = np.random.default_rng(0)
  for r in source[:2]:  # warm-up
    transform.random_map({'image': T.open_image(r['image'])}, rng)
  n, t0, c0 = 0, time.perf_counter(), time.thread_time()
  while True:
    for r in source:
      transform.random_map({'image': T.open_image(r['image'])}, rng)
      n += 1
    dt = time.perf_counter() - t0
    if dt >= min_seconds:
      return n / dt, n / max(time.thread_time() - c0, 1e-9)


#: Per-op rows of the breakdown, in pipeline order ('open' = header parse, `T.open_image`).
OPS = (
  'open',
  'decode',
  'crop_resize',
  'flip',
  'jitter_brightness',
  'jitter_contrast',
  'jitter_saturation',
  'jitter_hue',
  'grayscale',
  'blur',
  'to_array',
)


def op_breakdown(source: Sequence[dict], transform, passes: int = 2) -> dict:
  """CPU time per op of open_image + transform, via the transforms' `timings` hook.

  Returns {op: (ms per image, ms per call, calls per image)} plus 'other' (sampling, dicts,
  timer overhead: total minus the ops) and 'total' (ms per image). One thread, CPU clock."""
  rng = np.random.default_rng(1)
  timings: dict = {}
  n = 0
  c0 = time.process_time()
  for _ in range(passes):
    for r in source:
      t0 = time.process_time()
      img = T.open_image(r['image'])
      timings['open'] = timings.get('open', 0.0) + time.process_time() - t0
      timings['open#n'] = timings.get('open#n', 0) + 1
      transform.random_map({'image': img}, rng, timings=timings)
      n += 1
  total = time.process_time() - c0
  out = {}
  for op in OPS:
    if op in timings:
      calls = timings[op + '#n']
      out[op] = (1e3 * timings[op] / n, 1e3 * timings[op] / calls, calls / n)
  other = total - sum(timings[op] for op in OPS if op in timings)
  out['other'] = (1e3 * other / n, math.nan, math.nan)
  out['total'] = (1e3 * total / n, math.nan, math.nan)
  return out


def format_breakdown(name: str, bd: dict) -> str:
  """Text table of `op_breakdown`."""
  lines = [
    f'{name}: CPU ms per op (per image = per record, all its views)',
    f'  {"op":<18} {"ms/image":>9} {"ms/call":>8} {"calls/image":>11} {"share":>6}',
  ]
  tot = bd['total'][0]
  for op, (per_img, per_call, calls) in bd.items():
    pc = '' if per_call is None or math.isnan(per_call) else f'{per_call:8.3f}'
    cl = '' if calls is None or math.isnan(calls) else f'{calls:11.2f}'
    lines.append(f'  {op:<18} {per_img:9.3f} {pc:>8} {cl:>11} {100 * per_img / tot:5.1f}%')
  return '\n'.join(lines)


class _WordTokenizer:
  """Fallback when the SentencePiece demo model is unavailable (keeps the bench runnable)."""

  max_len = 64

  def tokenize(self, texts):
    """Same contract as Tokenizer.tokenize: (n, max_len) int32, 0-padded."""
    out = np.zeros((len(texts), self.max_len), np.int32)
    for i, t in enumerate(texts):
      ids = [zlib.crc32(w.encode()) % 30000 + 1 for w in t.lower().split()][: self.max_len]
      out[i, : len(ids)] = ids
    return out


def _tokenizer():
  """The shipped SentencePiece model when available, else the word stub."""
  try:
    return tok_lib.Tokenizer(None, max_len=64), 'sentencepiece'
  except Exception:  # pylint: disable=broad-except
    return _WordTokenizer(), 'word-stub'


def _bench_config(mode: str, batch_size: int, workers: int):
  """The config keys the pipeline reads, for the ITO (two views) or TIPSv2 (1+6 crops, mask) pipeline.

  Every key the schema declares in `input` and `data` is spelled out, as in a validated config, because
  tipsito/data/ cannot build one (tipsito/config/ imports tipsito/data/tokenizer.py, not the reverse);
  tests/test_data_pipeline_iter.py fails when the schema gains a key this lacks."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import ml_collections as mlc  # pylint: disable=g-import-not-at-top

  ito = mode == 'ito'
  return mlc.ConfigDict(
    dict(
      seed=0,
      tokenizer=None,
      max_len=64,
      model=dict(image=dict(patch_size=14 if not ito else 16), text=dict(flavour='tips')),
      data=dict(
        name=f'synthetic_{mode}',
        split='train',
        data_dir=None,
        build_if_missing=False,
        build_options=None,
        image_key='image',
        alt_text_key='alt_text',
        caption_keys=('caption_paligemma', 'caption_gemini'),
        label_key=None,
        max_skip_fraction=0.05,
        min_records_for_skip_check=None,
        **dataclasses.asdict(T.DEFAULT_LIMITS),
      ),
      input=dict(
        batch_size=batch_size,
        views='two_views' if ito else 'multicrop',
        global_size=224,
        local_size=98,
        num_local=0 if ito else 6,
        mask_ratio=0.0 if ito else 0.5,
        mask_type='random' if ito else 'block',
        augment='ito' if ito else 'tips',
        num_workers=workers,
        prefetch=2,
        shuffle_seed=0,
        shuffle=True,
        num_epochs=None,
        read_threads=None,
        augment_view2=None,
        mask_prob=1.0,
        global_crop_scale=None,
        local_crop_scale=None,
        view2_crop_scale=None,
        crop_ratio=None,
        microbatches=1,
      ),
    )
  )


def _pipeline_rate(
  source, mode: str, workers: int, batch_size: int, min_seconds: float, tokenizer
) -> tuple[float, float]:
  """(steady-state images/s, seconds to the first batch) of the full pipeline."""
  cfg = _bench_config(mode, batch_size, workers)
  t0 = time.perf_counter()
  with pipeline.make_train_iterator(
    cfg, source=source, process_index=0, process_count=1, tokenizer=tokenizer
  ) as it:
    next(it)
    first = time.perf_counter() - t0
    for _ in range(2 * workers):  # workers start one after another: time the steady state
      next(it)
    n, t1 = 0, time.perf_counter()
    while time.perf_counter() - t1 < min_seconds or n < 2 * batch_size:
      b = next(it)
      n += b['image'].shape[0]
    return n / (time.perf_counter() - t1), first


def run_data_bench(
  num_images: int = 48,
  workers: Sequence[int] = (0,),
  batch_size: int = 32,
  seconds: float = 3.0,
  size: int = 400,
  formats: Sequence[str] = ('JPEG', 'PNG'),
  pipeline_bench: bool = True,
  breakdown: bool = True,
) -> dict:
  """Measures the transforms (per worker) and the pipeline (per W); returns a flat result dict
  (plus 'breakdown': {transform_format: {op: [CPU ms per image, ms per call, calls per image]}}
  when `breakdown`, see `op_breakdown`)."""
  res = {
    'cpu_count': os.cpu_count(),
    'load_avg_1m': os.getloadavg()[0],
    'source_px': size,
    'num_images': num_images,
  }
  ito = grain_ops.ITOTwoViews(size=224)
  tips = grain_ops.MultiCrop(global_size=224, local_size=98, num_local=6)
  sources = {fmt: synthetic_source(num_images, fmt, size) for fmt in formats}
  for fmt, src in sources.items():
    for name, tr in (('ito_two_view', ito), ('tipsv2_1p6', tips)):
      wall, cpu = _transform_rate(src, tr, seconds)
      res[f'{name}_{fmt.lower()}_img_s'] = wall
      res[f'{name}_{fmt.lower()}_img_per_cpu_s'] = cpu
      if breakdown:
        res.setdefault('breakdown', {})[f'{name}_{fmt.lower()}'] = {
          op: [None if math.isnan(x) else round(x, 4) for x in v] for op, v in op_breakdown(src, tr).items()
        }
  if pipeline_bench:
    tok, tok_name = _tokenizer()
    res['tokenizer'] = tok_name
    src = sources.get('JPEG') or next(iter(sources.values()))
    for w in workers:
      for mode in ('ito', 'tipsv2'):
        rate, first = _pipeline_rate(src, mode, int(w), batch_size, seconds, tok)
        res[f'pipeline_{mode}_w{w}_img_s'] = rate
        res[f'pipeline_{mode}_w{w}_first_batch_s'] = first
  return res


def _table(res: dict) -> str:
  """Two-column text table of the results."""
  rows = [('metric', 'value')]
  for k, v in res.items():
    if k == 'breakdown':
      continue
    rows.append((k, f'{v:.1f}' if isinstance(v, float) else str(v)))
  width = max(len(r[0]) for r in rows)
  return '\n'.join(f'{a:<{width}}  {b:>10}' for a, b in rows)


def main(argv: Sequence[str] | None = None) -> dict:
  """CLI entry point; also callable as `main([...])`. `--convert [...]`: tipsito/data/convert_bench.py."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if '--convert' in argv:
    from tipsito.data import convert_bench  # CLI dispatch: that CLI imports this one's library

    return convert_bench.main([a for a in argv if a != '--convert'])
  ap = argparse.ArgumentParser(
    prog='python -m tipsito.data.pipeline_bench', description=__doc__.split('\n')[0]
  )
  ap.add_argument('--num_images', type=int, default=48, help='distinct synthetic source images')
  ap.add_argument('--workers', default='0', help='comma list of grain worker counts, e.g. 0,2')
  ap.add_argument('--batch_size', type=int, default=32)
  ap.add_argument('--seconds', type=float, default=3.0, help='minimum timing window per number')
  ap.add_argument('--size', type=int, default=400, help='source image side in pixels')
  ap.add_argument('--no_pipeline', action='store_true', help='transforms only')
  ap.add_argument('--no_breakdown', action='store_true', help='skip the per-op CPU breakdown')
  args = ap.parse_args(argv)
  workers = [int(w) for w in str(args.workers).split(',') if w.strip() != '']
  res = run_data_bench(
    args.num_images,
    workers,
    args.batch_size,
    args.seconds,
    args.size,
    pipeline_bench=not args.no_pipeline,
    breakdown=not args.no_breakdown,
  )
  print(
    'Input pipeline throughput. Transforms: one process, one thread = images/s per worker '
    '(*_img_s wall clock, *_img_per_cpu_s per CPU-second of that thread); pipeline_*: end to '
    'end with W grain workers (wall clock).'
  )
  print(_table(res))
  for name, bd in res.get('breakdown', {}).items():
    print(format_breakdown(name, bd))
  print(json.dumps({'data_bench': res}, sort_keys=True))
  sys.stdout.flush()
  return res


if __name__ == '__main__':
  main()
