"""Converters of the Debian-packaged datasets (tuxpaint, fashion_mnist) and reading them back.

Why: these are the real-image demo/eval sets; the tests pin the record schema, the example count
(785 captioned stamps) and that both `tfds.data_source` and `open_source` read them without TF
decoding. tuxpaint is converted once per session (it takes a few seconds).
"""

import io
import os

import numpy as np
import pytest
from PIL import Image

from tipsito.data import convert
from tipsito.data import sources

TUX_DIR = "/usr/share/tuxpaint/stamps"
FASHION_DIR = "/usr/share/datasets/fashion-mnist"

needs_tux = pytest.mark.skipif(not os.path.isdir(TUX_DIR), reason="tuxpaint-stamps-default not installed")
needs_fashion = pytest.mark.skipif(
  not os.path.isdir(FASHION_DIR), reason="dataset-fashion-mnist not installed"
)


@pytest.fixture(scope="session")
def tux_dir(tmp_path_factory):
  """Data dir with the full tuxpaint conversion (via the CLI entry function)."""
  if not os.path.isdir(TUX_DIR):
    pytest.skip("tuxpaint-stamps-default not installed")
  d = tmp_path_factory.mktemp("tux")
  result = convert.main(["tuxpaint", "--data_dir", str(d), "--num_workers", "2", "--image_size", "160"])
  return d, result


@pytest.fixture(scope="session")
def fashion_dir(tmp_path_factory):
  """Data dir with a limited fashion_mnist conversion (120 per split, upscaled to 32)."""
  if not os.path.isdir(FASHION_DIR):
    pytest.skip("dataset-fashion-mnist not installed")
  d = tmp_path_factory.mktemp("fashion")
  result = convert.main(
    ["fashion_mnist", "--data_dir", str(d), "--limit", "120", "--num_workers", "2", "--image_size", "32"]
  )
  return d, result


@needs_tux
def test_tuxpaint_count_and_report(tux_dir):
  """All 785 captioned stamps are converted, none skipped, report written."""
  d, result = tux_dir
  assert result.split_sizes == {"train": 785}
  assert result.report.written == 785 and not result.report.skipped
  assert os.path.exists(os.path.join(result.dataset_dir, "conversion_report.json"))


@needs_tux
def test_tuxpaint_reads_back_with_tfds_data_source(tux_dir):
  """Plain tfds.data_source reads the dataset by name, with the full schema."""
  import tensorflow_datasets as tfds

  d, _ = tux_dir
  ds = tfds.data_source(
    "tuxpaint",
    data_dir=str(d),
    decoders={"image": tfds.decode.SkipDecoding(), "segmentation": tfds.decode.SkipDecoding()},
  )
  assert len(ds["train"]) == 785
  ex = ds["train"][3]
  assert set(ex) == {
    "image",
    "alt_text",
    "caption_category",
    "caption_detailed",
    "label",
    "segmentation",
    "id",
  }
  assert isinstance(ex["image"], bytes) and ex["image"][:4] == b"\x89PNG"


@needs_tux
def test_tuxpaint_open_source_fields(tux_dir):
  """Images, masks (alpha -> label+1), cleaned captions and labels agree."""
  d, _ = tux_dir
  src, info = sources.open_source(
    {"name": "tuxpaint", "split": "train", "data_dir": str(d), "label_key": "label"}
  )
  assert len(src) == 785 and info.num_classes == 16
  assert info.caption_keys == ("caption_category", "caption_detailed")
  labels, captions = set(), set()
  for i in range(0, 785, 13):
    r = src[i]
    img = np.asarray(Image.open(io.BytesIO(r["image"])))
    seg = np.asarray(Image.open(io.BytesIO(r["segmentation"])))
    assert img.ndim == 3 and img.shape[2] == 3 and max(img.shape[:2]) <= 160 * 1.25
    assert seg.shape == img.shape[:2]
    assert set(np.unique(seg)) <= {0, r["label"] + 1} and (seg > 0).any() and (seg == 0).any()
    assert r["alt_text"] and "\u201c" not in r["alt_text"] and ".utf8=" not in r["alt_text"]
    assert r["captions"] == (r["caption_category"], r["caption_detailed"])
    assert r["id"].startswith("tuxpaint/")
    labels.add(r["label"])
    captions.add(r["alt_text"])
  assert len(labels) >= 10 and len(captions) > 40


@needs_fashion
def test_fashion_mnist_limited_convert(fashion_dir):
  """--limit and --image_size work; labels and template captions agree."""
  d, result = fashion_dir
  assert result.split_sizes == {"train": 120, "test": 120}
  src, info = sources.open_source(
    {"name": "fashion_mnist", "split": "test", "data_dir": str(d), "label_key": "label"}
  )
  assert len(src) == 120 and info.num_classes == 10
  for i in range(0, 120, 17):
    r = src[i]
    img = np.asarray(Image.open(io.BytesIO(r["image"])))
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    assert 0 <= r["label"] < 10
    assert info.label_names[r["label"]] in r["alt_text"]
    assert "segmentation" not in r


@needs_fashion
def test_fashion_mnist_tfds_name_with_config(fashion_dir):
  """TFDS ships its own 'fashion_mnist'; ours reads back as 'fashion_mnist/default'."""
  import tensorflow_datasets as tfds

  d, _ = fashion_dir
  ds = tfds.data_source("fashion_mnist/default", data_dir=str(d))
  assert len(ds["train"]) == 120
  ex = ds["train"][0]
  assert ex["image"].shape == (32, 32, 3)  # default TFDS numpy decoding (PIL) also works


@needs_fashion
def test_idx_reader_matches_package_counts():
  """The idx reader handles the gzipped package files."""
  from tipsito.data.builders import fashion_mnist

  labels = fashion_mnist.read_idx(os.path.join(FASHION_DIR, "t10k-labels-idx1-ubyte"))
  assert labels.shape == (10000,) and labels.max() == 9
