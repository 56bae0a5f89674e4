"""The declared batch (tipsito/data/batch.py): the views decoded once, the shapes the pipeline really emits,
the synthetic batch and the planner's shape spec.

Why: the batch is declared in one module and filled in another (tipsito/data/pipeline.py); these tests hold
the declaration to what the pipeline emits for every `config.input.views`, so the planner and the
benchmarks compile the step for the batch that training feeds it.
"""

import hashlib

import jax
import numpy as np
import pytest

from test_data_pipeline_iter import StubTokenizer, make_config, make_source
from test_recipes_all import tiny
from tipsito import choices
from tipsito.data import batch as batch_lib
from tipsito.data import pipeline
from tipsito.data.synthetic import synthetic_batch


def _shapes(arrays: dict) -> dict:
  return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in arrays.items()}


def _declared(config, b: int) -> dict:
  return {k: (f.shape, f.dtype) for k, f in batch_lib.BatchLayout.from_config(config).shapes(b).items()}


def test_views_decoded_once():
  got = {v: (lay.global_views, lay.local_crops, lay.two_views) for v, lay in choices.VIEW_LAYOUTS.items()}
  assert got == {
    "single": (1, False, False),
    "two_views": (2, False, True),
    "multicrop": (1, True, False),
    "multicrop_two_views": (2, True, True),
  }
  assert choices.VIEWS == tuple(got) and choices.TWO_VIEWS == ("two_views", "multicrop_two_views")
  with pytest.raises(ValueError, match=r"config.input.views='multicrops'; valid values: \['single'"):
    choices.view_layout("multicrops")


@pytest.mark.parametrize("mask_ratio", [0.0, 0.5])
@pytest.mark.parametrize(
  "views,augment",
  [("single", "tips"), ("two_views", "ito"), ("two_views", "none"), ("multicrop", "tips")]
  + [("multicrop_two_views", "tips")],
)
def test_declared_shapes_are_what_the_pipeline_emits(views, augment, mask_ratio):
  """num_local=3 everywhere: views without multi-crop must have no local crops, in both places."""
  cfg = make_config(batch_size=2, views=views, augment=augment, mask_ratio=mask_ratio, num_local=3)
  with pipeline.make_train_iterator(
    cfg, source=make_source(4), process_index=0, process_count=1, tokenizer=StubTokenizer()
  ) as it:
    b = next(it)
  assert set(b) - set(_declared(cfg, 2)) == {batch_lib.LABEL}  # data.label_key is set; no term reads it
  del b[batch_lib.LABEL]
  assert _shapes(b) == _declared(cfg, 2)


@pytest.mark.parametrize(
  "recipe,fields",
  [
    ("clip", {"image", "text", "text2"}),
    ("ito", {"image", "image2", "text", "text2"}),
    ("tipsv2", {"image", "local_crops", "mask", "text", "text2"}),
    ("tipsito", {"image", "image2", "local_crops", "mask", "text", "text2"}),
    ("distill", {"image", "local_crops", "text", "text2"}),
  ],
)
def test_synthetic_batch_and_shape_spec_follow_the_layout(recipe, fields):
  c = tiny(recipe)
  host = synthetic_batch(c, batch_size=3, seed=0)
  assert set(host) == fields and _shapes(host) == _declared(c, 3)
  if batch_lib.MASK in host:  # mask_ratio of the patches of the global crop's (ceil) patch grid
    g = -(-c.input.global_size // c.model.image.patch_size)
    assert host[batch_lib.MASK].shape[1:] == (g, g)
    assert (host[batch_lib.MASK].sum((1, 2)) == round(c.input.mask_ratio * g * g)).all()
  spec = batch_lib.shape_spec(c)  # the global batch, no sharding
  assert all(isinstance(s, jax.ShapeDtypeStruct) and s.sharding is None for s in spec.values())
  assert _shapes(spec) == _declared(c, c.input.batch_size)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  assert {s.sharding for s in batch_lib.shape_spec(c, batch_size=3, sharding=one).values()} == {one}


def test_synthetic_batch_draws_what_it_drew_before_the_declaration():
  """Its random stream is the one it had when it listed the fields itself (the benchmarks' and tests'
  batches, and so the recipes' fingerprints, stay bitwise): field order and every value."""
  b = synthetic_batch(tiny("tipsito"), seed=1)
  h = hashlib.sha256()
  for k, v in b.items():
    h.update(k.encode())
    h.update(v.tobytes())
  assert list(b) == ["image", "text", "text2", "image2", "local_crops", "mask"]
  assert h.hexdigest() == "8fab8d696eaabede70396c5eb6599d5972a7290dd4329f05aba6ec8d464d25a5"
