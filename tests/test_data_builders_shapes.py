"""The procedural `shapes` dataset: schema, determinism, label/mask/caption consistency, source errors.

Why: shapes is the dataset every other test and the CPU demo train on; a change that makes it
non-deterministic or lets captions disagree with the pixels would silently break those.
"""

import io

import numpy as np
import pytest
from PIL import Image

from tipsito.data import convert
from tipsito.data import sources
from tipsito.data.builders import shapes_gen

TINY = dict(image_size=32, split_sizes={"train": 24, "test": 8}, num_workers=1, verbose=False)


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
  """The same tiny shapes config built twice into separate data dirs (one with 2 workers)."""
  a = tmp_path_factory.mktemp("shapes_a")
  b = tmp_path_factory.mktemp("shapes_b")
  convert.convert("shapes", str(a), config_name="tiny", **TINY)
  convert.convert("shapes", str(b), config_name="tiny", **{**TINY, "num_workers": 2})
  return a, b


def _records(data_dir, split):
  """All records of a split of the tiny shapes build."""
  return _records_of(data_dir, "shapes/tiny", split)


def _records_of(data_dir, name, split):
  """All records of a split of a shapes build named `name` ('shapes/<config>')."""
  src, info = sources.open_source(
    {"name": name, "split": split, "data_dir": str(data_dir), "label_key": "label"}
  )
  return [src[i] for i in range(len(src))], info


def test_deterministic_across_builds(two_builds):
  """Two builds (1 and 2 workers) give identical records in identical order."""
  a, b = two_builds
  for split, n in (("train", 24), ("test", 8)):
    ra, _ = _records(a, split)
    rb, _ = _records(b, split)
    assert len(ra) == len(rb) == n
    assert ra == rb  # same order, same bytes, same captions


def test_schema_and_consistency(two_builds):
  """Label, captions and mask describe the same main object."""
  a, _ = two_builds
  recs, info = _records(a, "train")
  assert info.caption_keys == ("caption_detailed", "caption_gemini")
  assert info.label_names == shapes_gen.SHAPE_CLASSES and info.segmentation_key == "segmentation"
  assert len({r["id"] for r in recs}) == len(recs)
  for r in recs:
    img = np.asarray(Image.open(io.BytesIO(r["image"])))
    seg = np.asarray(Image.open(io.BytesIO(r["segmentation"])))
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    assert seg.shape == (32, 32) and seg.max() <= len(shapes_gen.SHAPE_CLASSES)
    name = info.label_names[r["label"]]
    assert r["alt_text"].endswith(name) and name in r["caption_detailed"] and name in r["caption_gemini"]
    assert (r["label"] + 1) in np.unique(seg)  # the main object is visible in the mask
    assert r["captions"] == (r["caption_detailed"], r["caption_gemini"])
    assert r["caption_detailed"] != r["caption_gemini"]


def test_test_split_differs_from_train(two_builds):
  """Splits are seeded differently (no leaked duplicates)."""
  a, _ = two_builds
  train, _ = _records(a, "train")
  test, _ = _records(a, "test")
  assert not {r["image"] for r in train} & {r["image"] for r in test}


def test_generator_is_pure():
  """Example i depends only on i (and seed/split/size)."""
  x = shapes_gen.generate(7, image_size=48)
  y = shapes_gen.generate(7, image_size=48)
  assert x["caption_detailed"] == y["caption_detailed"] and np.array_equal(x["image"], y["image"])
  assert not np.array_equal(x["image"], shapes_gen.generate(8, image_size=48)["image"])


def test_tfds_data_source_reads_shapes(two_builds):
  """TFDS default numpy decoding also works on our records."""
  import tensorflow_datasets as tfds

  a, _ = two_builds
  ds = tfds.data_source("shapes/tiny", data_dir=str(a))
  ex = ds["test"][0]
  assert ex["image"].shape == (32, 32, 3) and ex["segmentation"].shape == (32, 32, 1)


def test_open_source_errors_name_dataset_and_field(two_builds, tmp_path):
  """Misconfigurations fail early with the dataset and field named."""
  a, _ = two_builds
  with pytest.raises(KeyError, match=r"shapes/tiny.*caption_paligemma"):
    sources.open_source({"name": "shapes/tiny", "data_dir": str(a), "caption_keys": ("caption_paligemma",)})
  with pytest.raises(KeyError, match=r"no split 'validation'"):
    sources.open_source({"name": "shapes/tiny", "data_dir": str(a), "split": "validation"})
  with pytest.raises(KeyError, match="label"):
    sources.open_source({"name": "shapes/tiny", "data_dir": str(a), "label_key": "labels"})
  with pytest.raises(FileNotFoundError, match="tuxpaint"):
    sources.open_source({"name": "tuxpaint", "data_dir": str(tmp_path)})
  src, _ = sources.open_source({"name": "shapes", "data_dir": str(a)})  # the only config is picked
  assert len(src) == 24 and "label" not in src[0]
  src, _ = sources.open_source({"name": "shapes/tiny", "data_dir": str(a), "segmentation_key": None})
  assert "segmentation" not in src[0]
  with pytest.raises(IndexError):
    src[len(src)]


def test_source_is_picklable(two_builds):
  """grain workers receive the source by pickling."""
  import pickle

  a, _ = two_builds
  src, _ = sources.open_source({"name": "shapes/tiny", "data_dir": str(a), "split": "test"})
  clone = pickle.loads(pickle.dumps(src))
  assert clone[-1] == src[len(src) - 1]
  assert [r["id"] for r in src.__getitems__([0, 2])] == [src[0]["id"], src[2]["id"]]


def test_build_options_restrict_objects_sizes_and_colours(tmp_path):
  """max_objects / object_sizes / colours reach the records (the CPU demo relies on them)."""
  convert.convert(
    "shapes",
    str(tmp_path),
    config_name="simple",
    max_objects=1,
    object_sizes=("large",),
    colours=("red", "blue"),
    **TINY,
  )
  recs, _ = _records_of(tmp_path, "shapes/simple", "train")
  assert len(recs) == 24
  for r in recs:
    assert r["caption_detailed"].count(",") == 1  # one object phrase, then ', on a ... background.'
    assert r["caption_detailed"].split()[1] == "large"
    assert r["alt_text"].split()[1] in ("red", "blue")
  # Default options keep the default stream: example i is unchanged by the new keyword arguments.
  x = shapes_gen.generate(5, image_size=32)
  y = shapes_gen.generate(
    5, image_size=32, max_objects=4, sizes=shapes_gen.SIZE_NAMES, colours=tuple(shapes_gen.COLOURS)
  )
  assert x["caption_detailed"] == y["caption_detailed"] and np.array_equal(x["image"], y["image"])


@pytest.mark.parametrize(
  "kwargs, key",
  [
    (dict(max_objects=0), "max_objects"),
    (dict(object_sizes=("huge",)), "object_sizes"),
    (dict(colours=("red", "mauve")), "colours"),
    (dict(colours=()), "colours"),
  ],
)
def test_bad_build_options_name_the_key(tmp_path, kwargs, key):
  """A wrong option fails before anything is written, naming the key and the valid values."""
  with pytest.raises(ValueError, match=key):
    convert.convert("shapes", str(tmp_path), **kwargs, **TINY)
  assert not list(tmp_path.iterdir())
  with pytest.raises(ValueError, match="only apply to shapes"):
    convert.convert("fashion_mnist", str(tmp_path), max_objects=2, verbose=False)
