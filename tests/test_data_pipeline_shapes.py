"""End to end on a real array_record dataset: convert `shapes` -> open_source -> grain pipeline / eval input.

Why: the in-memory tests pin the pipeline's logic; this one pins the seams with the builders'
reader (field renaming, caption discovery, encoded bytes) and the shipped SentencePiece tokenizer.
"""

import numpy as np
import pytest

from tipsito.config import defaults
from tipsito.data import convert
from tipsito.data import eval_input
from tipsito.data import pipeline
from tipsito.data import tokenizer as tok_lib


@pytest.fixture(scope='module')
def shapes_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp('shapes_pipe')
  convert.convert(
    'shapes',
    str(d),
    config_name='tiny',
    image_size=32,
    split_sizes={'train': 24, 'test': 10},
    num_workers=1,
    verbose=False,
  )
  return str(d)


def _config(data_dir):
  """A complete config (the schema's defaults, tipsito/config/schema.py) reading the converted dataset
  with TIPSv2's crops and tipsito's second view, at test sizes."""
  c = defaults.base_config('tipsito', 'tiny/16', batch_size=4)
  c.update(dict(seed=0, tokenizer=None, max_len=16))
  c.model.image.patch_size = 8
  c.model.text.flavour = 'tips'
  c.data = defaults.data_config(
    'shapes', name='shapes/tiny', data_dir=data_dir, caption_keys=(), label_key='label'
  )
  c.input.update(
    dict(
      global_size=32,
      local_size=16,
      num_local=2,
      mask_ratio=0.5,
      mask_type='block',
      augment='tips',
      augment_view2=None,
      view2_crop_scale=None,
      prefetch=1,
    )
  )
  return c


def test_alt_text_key_none_draws_text_from_the_caption_fields_on_disk(shapes_dir):
  """`data.alt_text_key=None` with the alt-text among `data.caption_keys` (the captions study's
  `sampled_1cls` arm) through the real reader: 'text' is drawn per example from those fields, so it is
  sometimes a synthetic caption, and 'text2' is the same caption. (The renaming in `pipeline.open_source`
  once turned None back into 'alt_text', and the arm trained on the alt-text alone.)"""
  texts = {}
  for alt_key, caps in (('alt_text', ('caption_detailed',)), (None, ('alt_text', 'caption_detailed'))):
    cfg = _config(shapes_dir)
    cfg.data.alt_text_key, cfg.data.caption_keys = alt_key, caps
    cfg.input.num_epochs = 1
    with pipeline.make_train_iterator(cfg, process_index=0, process_count=1) as it:
      texts[alt_key] = [(b['label'], b['text'], b['text2']) for b in it]
  drawn_caption = 0  # both runs read the records in one order (it depends on the seed only)
  for (labels_alt, text_alt, _), (labels, text, text2) in zip(texts['alt_text'], texts[None], strict=True):
    np.testing.assert_array_equal(labels, labels_alt)
    np.testing.assert_array_equal(text, text2)
    drawn_caption += int((text != text_alt).any(axis=1).sum())
  assert drawn_caption > 0  # 24 records, each a caption with probability 1/2


def test_train_iterator_on_converted_shapes(shapes_dir):
  cfg = _config(shapes_dir)
  tok = tok_lib.Tokenizer(None, max_len=16)
  with pipeline.make_train_iterator(cfg, process_index=0, process_count=1) as it:
    b = next(it)
    state = it.get_state()
    nxt = next(it)
  assert b['image'].shape == (4, 32, 32, 3) and b['image2'].shape == (4, 32, 32, 3)
  assert b['local_crops'].shape == (4, 2, 16, 16, 3) and b['mask'].shape == (4, 4, 4)
  assert (b['mask'].sum((1, 2)) == 8).all()
  assert b['text'].shape == (4, 16) and b['text'].dtype == np.int32
  assert b['label'].dtype == np.int32 and b['label'].min() >= 0
  shapes = ('circle', 'square', 'triangle', 'star', 'hexagon', 'diamond', 'cross', 'pentagon')
  for t in tok.detokenize(b['text']):  # CLS1: the short alt-text, e.g. 'a red circle'
    assert any(s in t for s in shapes), t
  assert not np.array_equal(b['text'], b['text2'])  # CLS2: a synthetic caption
  with pipeline.make_train_iterator(cfg, process_index=0, process_count=1) as it2:
    it2.set_state(state)
    again = next(it2)
  for k in nxt:
    np.testing.assert_array_equal(nxt[k], again[k])


def test_eval_batches_segmentation(shapes_dir):
  """Eval input on the converted dataset: padded batches, label maps aligned, every record once."""
  src, names = eval_input.open_records('shapes/tiny', 'test', shapes_dir)
  fields = eval_input.EvalFields(
    image_size=24, resize='resize', label_key='label', mask=eval_input.MaskSpec()
  )
  labels = []
  for b in eval_input.eval_batches(src, fields, 4):
    assert b['image'].shape == (4, 24, 24, 3) and b['segmentation'].shape == (4, 24, 24)
    labels.extend(b['label'][b['_valid']].tolist())
    assert b['segmentation'][b['_valid']].max() > 0
  assert labels == [src[i]['label'] for i in range(10)] and len(names) == 8
