"""The per-host grain training pipeline: sharding, exact resume, skip-and-count, batch format.

Why: a TPU pod trains for days across preemptions; each host must read its own disjoint part of
the data, resume to the very next batch, and survive bad records while counting them. These tests
use an in-memory random-access source and a tiny tokenizer so they run in seconds on CPU.
"""

import io

import numpy as np
import pytest
from PIL import Image

from tipsito.config import defaults
from tipsito.data import pipeline

CAPS = ('caption_a', 'caption_b', 'caption_c')
WORDS = {'alt': 1, 'a': 2, 'b': 3, 'c': 4}


class StubTokenizer:
  """Word-level stand-in for tipsito.data.tokenizer.Tokenizer (picklable, deterministic)."""

  max_len = 6

  def tokenize(self, texts):
    out = np.zeros((len(texts), self.max_len), np.int32)
    for i, t in enumerate(texts):
      ids = [WORDS.get(w, 0) or 100 + int(w) for w in t.split()][: self.max_len]
      out[i, : len(ids)] = ids
    return out


def _img(i, h=12, w=16, fmt='PNG'):
  rng = np.random.default_rng(i)
  buf = io.BytesIO()
  Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, fmt)
  return buf.getvalue()


def make_source(n, fmt='PNG'):
  return [
    dict(
      image=_img(i, fmt=fmt),
      alt_text=f'alt {i}',
      caption_a=f'a {i}',
      caption_b=f'b {i}',
      caption_c=f'c {i}',
      idx=i,
      id=str(i),
    )
    for i in range(n)
  ]


def make_config(
  batch_size=4, views='single', augment='none', mask_ratio=0.0, num_local=0, num_workers=0, **data_kw
):
  """A complete config (the schema's defaults, tipsito/config/schema.py) with the pipeline keys these
  tests choose: a key the schema adds reaches these tests with its default, as it reaches a real run."""
  c = defaults.base_config('clip', 'tiny/16', batch_size=batch_size)
  c.update(dict(seed=7, tokenizer=None, max_len=6))
  c.model.image.patch_size = 8
  c.model.text.flavour = 'tips'
  data = dict(name='toyset', caption_keys=CAPS, label_key='idx', min_records_for_skip_check=20)
  c.data = defaults.data_config('shapes', **{**data, **data_kw})
  c.input.update(
    dict(
      views=views,
      global_size=16,
      local_size=8,
      num_local=num_local,
      mask_ratio=mask_ratio,
      augment=augment,
      num_workers=num_workers,
      shuffle_seed=3,
    )
  )
  return c


def take(it, k):
  out = [next(it) for _ in range(k)]
  return out


def test_batch_format_all_fields():
  cfg = make_config(batch_size=4, views='multicrop_two_views', augment='ito', mask_ratio=0.5, num_local=3)
  with pipeline.make_train_iterator(
    cfg, source=make_source(10), process_index=0, process_count=2, tokenizer=StubTokenizer()
  ) as it:
    b = next(it)
  assert b['image'].shape == (2, 16, 16, 3) and b['image'].dtype == np.uint8
  assert b['image2'].shape == (2, 16, 16, 3) and b['image2'].dtype == np.uint8
  assert b['local_crops'].shape == (2, 3, 8, 8, 3) and b['local_crops'].dtype == np.uint8
  assert b['mask'].shape == (2, 2, 2) and b['mask'].dtype == bool
  assert (b['mask'].sum((1, 2)) == 2).all()
  assert b['text'].shape == (2, 6) and b['text'].dtype == np.int32 and (b['text'][:, 0] == 1).all()
  assert b['text2'].dtype == np.int32 and set(b['text2'][:, 0]) <= {2, 3, 4}
  assert b['label'].shape == (2,) and b['label'].dtype == np.int32
  assert not any(k.startswith('_') for k in b)


@pytest.mark.parametrize('n,procs', [(24, 3), (25, 4)])
def test_process_shards_disjoint_and_covering(n, procs):
  """Per epoch of the global stream, the processes' shards partition the records."""
  cfg = make_config(batch_size=procs)  # per-host batch 1: count exactly
  src = make_source(n)
  seen = []
  for p in range(procs):
    with pipeline.make_train_iterator(
      cfg, source=src, process_index=p, process_count=procs, tokenizer=StubTokenizer()
    ) as it:
      # n records per epoch; process p gets global positions p, p+P, ... (< n*procs: P epochs)
      seen.append([int(next(it)['label'][0]) for _ in range(n)])
  flat = np.concatenate(seen)
  # over P full epochs every record appears exactly P times in total
  assert np.array_equal(np.bincount(flat, minlength=n), np.full(n, procs))
  if n % procs == 0:  # per epoch: disjoint and covering
    first = [set(s[: n // procs]) for s in seen]
    assert sum(len(s) for s in first) == n and set().union(*first) == set(range(n))
  # reshuffled each epoch: the second epoch's order differs from the first
  epochs = (
    np.concatenate([s[: n // procs] for s in seen]),
    np.concatenate([s[n // procs : 2 * (n // procs)] for s in seen]),
  )
  assert not np.array_equal(epochs[0], epochs[1])


def test_augmentation_depends_on_seed_epoch_record_only():
  """Same example -> same pixels for any process count; new epoch -> new draw."""
  cfg = make_config(batch_size=2, views='two_views', augment='ito')
  src = make_source(6)
  by_label = {}
  for procs in (1, 2):
    for p in range(procs):
      with pipeline.make_train_iterator(
        cfg, source=src, process_index=p, process_count=procs, tokenizer=StubTokenizer()
      ) as it:
        for _ in range(6 // 2 // procs * procs if procs == 1 else 3 // procs + 1):
          b = next(it)
          for j, lab in enumerate(b['label']):
            key = (procs, int(lab))
            by_label.setdefault(key, (b['image'][j], b['image2'][j]))
  common = [lab for (pr, lab) in by_label if pr == 2 and (1, lab) in by_label]
  assert common
  for lab in common:
    np.testing.assert_array_equal(by_label[(1, lab)][0], by_label[(2, lab)][0])
    np.testing.assert_array_equal(by_label[(1, lab)][1], by_label[(2, lab)][1])
  fn = pipeline.TrainExampleFn(
    src, pipeline.ExampleSpec.from_config(cfg), pipeline._Tokenizer(StubTokenizer()), seed=7
  )
  a, a2, b = fn((0, 1)), fn((0, 1)), fn((1, 1))
  np.testing.assert_array_equal(a['image'], a2['image'])
  assert not np.array_equal(a['image'], b['image'])


@pytest.mark.parametrize('workers', [0, 2])
def test_resume_gives_same_next_batches(workers):
  cfg = make_config(
    batch_size=4,
    views='two_views',
    augment='ito',
    mask_ratio=0.25,
    num_workers=workers,
    max_skip_fraction=0.2,
  )
  src = make_source(14)
  src[5]['image'] = b'broken'  # skip counters must resume too
  tok = StubTokenizer()
  with pipeline.make_train_iterator(cfg, source=src, process_index=0, process_count=1, tokenizer=tok) as it:
    take(it, 3)
    state = it.get_state()
    stats = it.stats
    expected = take(it, 4)
  import json

  state = json.loads(json.dumps(state))  # what a checkpoint stores
  with pipeline.make_train_iterator(cfg, source=src, process_index=0, process_count=1, tokenizer=tok) as it2:
    it2.set_state(state)
    assert it2.stats == stats
    got = take(it2, 4)
  for e, g in zip(expected, got):
    assert e.keys() == g.keys()
    for k in e:
      np.testing.assert_array_equal(e[k], g[k])


def _planted_bad_source():
  src = make_source(40, fmt='JPEG')
  good_jpeg = src[0]['image']
  bad = {
    1: ('image', b'', 'empty_image'),
    4: ('image', b'\x89PNG garbage', 'corrupt_image'),
    7: ('image', good_jpeg[: len(good_jpeg) // 2], 'corrupt_image'),  # truncated
    9: ('image', _img(0, h=1, w=30), 'tiny_image'),
    12: ('image', _img(0, h=4, w=90), 'extreme_aspect'),
    15: ('image', _img(0, h=64, w=64), 'huge_image'),  # over the tiny hard cap below
    18: ('alt_text', b'\xff\xfe bad utf8', 'bad_text'),
    21: ('alt_text', '   ', 'bad_text'),
    24: ('image', None, 'missing_image'),
    27: ('alt_text', None, 'missing_text'),
    30: ('idx', 'not-an-int', 'missing_label'),
  }
  expected = {}
  for i, (field, value, reason) in bad.items():
    src[i][field] = value
    expected[reason] = expected.get(reason, 0) + 1
  del src[33]['caption_a'], src[33]['caption_b']  # missing synthetic captions: not a skip

  class Flaky(list):
    def __getitem__(self, i):
      if i == 36:
        raise OSError('disk hiccup')
      return super().__getitem__(i)

  expected['read_error'] = 1
  bad_ids = set(bad) | {36}
  return Flaky(src), bad_ids, expected


@pytest.mark.parametrize('workers', [0, 2])
def test_planted_bad_records_are_skipped_and_counted(workers):
  src, bad_ids, expected = _planted_bad_source()
  cfg = make_config(
    batch_size=1,
    views='two_views',
    augment='ito',
    num_workers=workers,
    max_skip_fraction=0.5,
    hard_max_pixels=2000,
  )
  cfg.input.num_epochs = 1
  labels = []
  with pipeline.make_train_iterator(
    cfg, source=src, process_index=0, process_count=1, tokenizer=StubTokenizer()
  ) as it:
    for b in it:
      assert b['image'].shape == (1, 16, 16, 3)
      labels.append(int(b['label'][0]))
    stats = it.stats
  assert sorted(labels) == sorted(set(range(40)) - bad_ids)
  assert stats['skipped'] == len(bad_ids) and stats['seen'] == 40
  assert stats['skipped_by_reason'] == expected


def test_too_many_skips_names_the_dataset():
  src = make_source(60)
  for i in range(0, 60, 3):  # a third of the data is broken
    src[i]['image'] = b'corrupt'
  cfg = make_config(batch_size=2, name='my_broken_set', max_skip_fraction=0.1)
  with pytest.raises(pipeline.TooManySkippedError, match="my_broken_set"):
    with pipeline.make_train_iterator(
      cfg, source=src, process_index=0, process_count=1, tokenizer=StubTokenizer()
    ) as it:
      take(it, 40)
  # an all-bad dataset fails (inside the batcher) instead of spinning forever
  for r in src:
    r['image'] = b''
  with pytest.raises(pipeline.TooManySkippedError, match="my_broken_set.*empty_image"):
    with pipeline.make_train_iterator(
      cfg, source=src, process_index=0, process_count=1, tokenizer=StubTokenizer()
    ) as it:
      next(it)


def test_caption_sampling_uniform_through_pipeline():
  """CLS2 gets each synthetic field ~1/3 of the time (chi-square), CLS1 always the alt-text."""
  cfg = make_config(batch_size=10)
  counts = np.zeros(3)
  with pipeline.make_train_iterator(
    cfg, source=make_source(50), process_index=0, process_count=1, tokenizer=StubTokenizer()
  ) as it:
    for _ in range(60):  # 12 epochs x 50 records
      b = next(it)
      assert (b['text'][:, 0] == 1).all()
      np.testing.assert_array_equal(b['text'][:, 1] - 100, b['label'])
      np.testing.assert_array_equal(b['text2'][:, 1] - 100, b['label'])
      counts += np.bincount(b['text2'][:, 0] - 2, minlength=3)
  expected = counts.sum() / 3
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  assert chi2 < 13.82, (chi2, counts)  # chi-square 0.999 quantile, 2 dof


def test_one_cls_caption_drawn_from_alt_text_and_captions_without_alt_text_key():
  """`data.alt_text_key=None` with the alt-text among `data.caption_keys` (the captions study's one-CLS arm
  sampling alt-text and synthetic captions, TIPSv2 Table 13): 'text' is drawn per example uniformly over
  those fields (chi-square), and 'text2' is the same caption."""
  cfg = make_config(batch_size=10, alt_text_key=None, caption_keys=('alt_text', 'caption_a', 'caption_b'))
  counts = np.zeros(3)
  with pipeline.make_train_iterator(
    cfg, source=make_source(50), process_index=0, process_count=1, tokenizer=StubTokenizer()
  ) as it:
    for _ in range(60):
      b = next(it)
      np.testing.assert_array_equal(b['text'], b['text2'])
      np.testing.assert_array_equal(b['text'][:, 1] - 100, b['label'])
      counts += np.bincount(b['text'][:, 0] - 1, minlength=3)  # 'alt' -> 1, 'a' -> 2, 'b' -> 3
  expected = counts.sum() / 3
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  assert chi2 < 13.82, (chi2, counts)


def test_examples_identical_with_and_without_workers():
  """Per-example outputs depend on (seed, epoch, record) only, not on the worker count."""
  src = make_source(8)
  outs = {}
  for workers in (0, 2):
    cfg = make_config(
      batch_size=2, views='multicrop', augment='ito', num_local=2, mask_ratio=0.5, num_workers=workers
    )
    cfg.input.num_epochs = 1
    with pipeline.make_train_iterator(
      cfg, source=src, process_index=0, process_count=1, tokenizer=StubTokenizer()
    ) as it:
      for b in it:
        for j, lab in enumerate(b['label']):
          outs.setdefault(workers, {})[int(lab)] = {k: v[j] for k, v in b.items()}
  assert sorted(outs[0]) == sorted(outs[2]) == list(range(8))
  for lab in range(8):
    for k in outs[0][lab]:
      np.testing.assert_array_equal(outs[0][lab][k], outs[2][lab][k])


@pytest.mark.parametrize('mode', ['ito', 'tips'])
def test_pipeline_bench_config_spells_every_schema_key(mode):
  """tipsito/data/pipeline_bench.py spells its `input` and `data` sections out (tipsito/data/ may not
  import tipsito/config/); every key the schema declares there must be in them, so a key the schema adds
  fails here instead of a KeyError in `python -m tipsito.data.pipeline_bench`."""
  from tipsito.config import schema  # pylint: disable=g-import-not-at-top
  from tipsito.data import pipeline_bench  # pylint: disable=g-import-not-at-top

  cfg = pipeline_bench._bench_config(mode, batch_size=8, workers=0)  # pylint: disable=protected-access
  for section in ('input', 'data'):
    declared = {k.path.split('.', 1)[1] for k in schema.KEYS if k.path.startswith(section + '.')}
    declared = {k for k in declared if '.' not in k}
    missing = sorted(declared - set(cfg[section].keys()))
    assert not missing, f'pipeline_bench._bench_config lacks config.{section} keys {missing}'
