"""The eval input path: fixed-size padded batches, every example exactly once, in order, whatever the
number of decoding threads; label maps from a field or from alpha.

Why: evaluators count only `_valid` rows, so padding must be marked and no record may be dropped or
repeated; the encoder's jitted functions compile once only if every batch has the same shape.
"""

import io

import numpy as np
import pytest
from PIL import Image

from tipsito.data import eval_input


def _png(arr):
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, 'PNG')
  return buf.getvalue()


def make_source(n):
  rng = np.random.default_rng(0)
  return [
    dict(
      image=_png(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)),
      label=i,
      alt_text=f'alt {i}',
      caption_b=f'b {i}',
      caption_a=f'a {i}',
    )
    for i in range(n)
  ]


@pytest.mark.parametrize('workers', [1, 3])
def test_eval_batches_pad_and_count_each_example_once(workers):
  src = make_source(23)
  fields = eval_input.EvalFields(image_size=16, label_key='label', captions=True)
  batches = list(eval_input.eval_batches(src, fields, 6, num_workers=workers))
  assert len(batches) == 4
  labels = []
  for b in batches:
    assert b['image'].shape == (6, 16, 16, 3) and b['image'].dtype == np.uint8
    assert b['_valid'].dtype == bool and len(b['captions']) == 6
    labels.extend(b['label'][b['_valid']].tolist())
  assert labels == list(range(23))  # dataset order, each once
  np.testing.assert_array_equal(batches[-1]['_valid'], [True] * 5 + [False])
  assert batches[-1]['image'][5].sum() == 0 and batches[-1]['captions'][5] == []
  assert batches[0]['captions'][1] == ['alt 1', 'a 1', 'b 1']  # alt-text, then caption_* sorted


def test_eval_batches_max_examples_is_a_spread_subset():
  fields = eval_input.EvalFields(image_size=8, label_key='label')
  batches = list(eval_input.eval_batches(make_source(10), fields, 4, max_examples=4))
  assert len(batches) == 1 and batches[0]['label'].tolist() == [0, 2, 5, 7]


def test_ground_truth_from_alpha_and_reduce_zero_label():
  rgba = np.zeros((8, 8, 4), np.uint8)
  rgba[:, 4:, 3] = 255
  rec = {'image': _png(rgba), 'label': 2}
  fields = eval_input.EvalFields(image_size=8, mask=eval_input.MaskSpec(source='auto'))
  ex = eval_input.read_example(rec, fields)
  assert (ex['image'][:, :4] == 255).all()  # transparent pixels composite on white
  assert (ex['segmentation'][:, :4] == 0).all() and (ex['segmentation'][:, 4:] == 3).all()
  spec = eval_input.MaskSpec(source='segmentation', reduce_zero_label=True)
  seg = np.array([[0, 1], [2, 255]], np.uint8)
  mask = eval_input.ground_truth_mask({'segmentation': seg}, None, (2, 2), spec)
  np.testing.assert_array_equal(mask, [[255, 0], [1, 255]])
  with pytest.raises(KeyError):
    eval_input.read_example({'img': rec['image']}, fields)


def test_short_side_size_keeps_the_aspect_ratio():
  # The TIPS notebook's rule: short side -> S, long side int(S * long / short) (truncated).
  assert eval_input.short_side_size(512, 683, 448) == (448, 597)  # 448 * 683 / 512 = 597.6
  assert eval_input.short_side_size(683, 512, 448) == (597, 448)
  assert eval_input.short_side_size(300, 300, 448) == (448, 448)
  assert eval_input.short_side_size(448, 1000, 448) == (448, 1000)  # already at S: untouched
  assert eval_input.short_side_size(20, 30, 8) == (8, 12)


@pytest.mark.parametrize('workers', [1, 3])
def test_short_side_examples_keep_the_label_map_at_its_own_size(workers):
  rng = np.random.default_rng(1)
  recs = []
  for i, (h, w) in enumerate([(24, 40), (40, 24), (16, 16)]):
    seg = rng.integers(0, 5, (h, w), dtype=np.uint8)
    recs.append(
      {'image': _png(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), 'segmentation': seg, 'label': i}
    )
  fields = eval_input.EvalFields(
    image_size=12, resize='short_side', label_key='label', mask=eval_input.MaskSpec(source='segmentation')
  )
  exs = list(eval_input.eval_examples(recs, fields, num_workers=workers, chunk_size=2))
  assert [e['label'] for e in exs] == [0, 1, 2]
  assert [e['image'].shape for e in exs] == [(12, 20, 3), (20, 12, 3), (12, 12, 3)]
  for e, r in zip(exs, recs):  # the label map is the record's, pixel for pixel
    np.testing.assert_array_equal(e['segmentation'], r['segmentation'])
  with pytest.raises(ValueError, match='short_side'):
    next(eval_input.eval_batches(recs, fields, 2))
