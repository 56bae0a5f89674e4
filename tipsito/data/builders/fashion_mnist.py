"""TFDS builder `fashion_mnist`: Fashion-MNIST from Debian's `dataset-fashion-mnist` idx files.

Why: 70k labelled real (if tiny) images, installed by a package, for kNN / zero-shot classification
evals and for throughput tests; captions are templates so it also works as an image-text set.

Inputs: `/usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`.
Record schema (array_record), splits 'train' (60000) and 'test' (10000):
  image: PNG RGB (gray replicated to 3 channels), 28x28 or `image_size` (bicubic upscale);
  alt_text: "a photo of a <class>"; caption_detailed: "a grayscale photo of a <class>, <description>";
  caption_category: "a piece of clothing: <class>" / "an accessory: <class>" / "footwear: <class>";
  label: ClassLabel (10 names below); id: 'fashion_mnist-<split>-<index>'.
"""

from __future__ import annotations

import dataclasses
import gzip
import os

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from tipsito.data.builders import _common
from tipsito.data.builders import class_words

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
CLASS_NAMES = class_words.FASHION_MNIST_CLASS_NAMES
_DESCRIPTIONS = {
  "t-shirt": "a short-sleeved top",
  "trouser": "a pair of long pants",
  "pullover": "a warm knitted top",
  "dress": "a one-piece garment",
  "coat": "a long outer garment",
  "sandal": "an open summer shoe",
  "shirt": "a top with a collar",
  "sneaker": "a sports shoe",
  "bag": "a bag to carry things",
  "ankle boot": "a boot reaching the ankle",
}
_GROUP = {"sandal": "footwear", "sneaker": "footwear", "ankle boot": "footwear", "bag": "an accessory"}
_FILES = {"train": "train", "test": "t10k"}


@dataclasses.dataclass(eq=False)
class FashionMnistConfig(tfds.core.BuilderConfig):
  """image_size: 0 keeps 28x28; otherwise images are upscaled (bicubic) to this square size."""

  image_size: int = 0


def read_idx(path: str) -> np.ndarray:
  """Reads an idx file (optionally gzipped; `path` may omit the .gz) into a numpy array."""
  if not os.path.exists(path) and os.path.exists(path + ".gz"):
    path = path + ".gz"
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    data = f.read()
  if data[:2] != b"\x00\x00" or data[2] != 0x08:
    raise ValueError(f"{path}: not an unsigned-byte idx file (magic {data[:4]!r})")
  ndim = data[3]
  dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
  arr = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
  if arr.size != int(np.prod(dims)):
    raise ValueError(f"{path}: expected {np.prod(dims)} values, found {arr.size} (truncated?)")
  return arr.reshape(dims)


def captions_for(label: int) -> dict:
  """Template captions of one class (shared with the tokenizer trainer)."""
  name = CLASS_NAMES[label]
  art = "an" if name[0] in "aeiou" else "a"
  group = _GROUP.get(name, "a piece of clothing")
  return {
    "alt_text": f"a photo of {art} {name}",
    "caption_detailed": f"a grayscale photo of {art} {name}, {_DESCRIPTIONS[name]}",
    "caption_category": f"{group}: {name}",
  }


def _make_example(args):
  """Worker: (split, index, image (28,28) uint8, label, image_size) -> (key, example)."""
  split, index, image, label, image_size = args
  img = Image.fromarray(image, "L")
  if image_size and image_size != image.shape[0]:
    img = img.resize((image_size, image_size), Image.BICUBIC)
  ex = {
    "image": _common.png_bytes(img.convert("RGB")),
    "label": int(label),
    "id": f"fashion_mnist-{split}-{index:05d}",
    **captions_for(int(label)),
  }
  return ex["id"], ex


class FashionMnist(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Fashion-MNIST with template captions (see module docstring)."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [FashionMnistConfig(name="default", description="28x28 images")]
  DEFAULT_CONFIG_NAME = "default"

  def __init__(
    self,
    *,
    input_dir: str = DEFAULT_DIR,
    num_workers: int = 1,
    limit: int | None = None,
    overrides: dict | None = None,
    **kwargs,
  ):
    """overrides: FashionMnistConfig fields (image_size) replacing the config's values."""
    self._overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    self._input_dir = input_dir
    self._num_workers = num_workers
    self._limit = limit
    self.report = _common.SkipReport("fashion_mnist")
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    """Schema: image, alt_text, caption_detailed, caption_category, label (10 classes), id."""
    return self.dataset_info_from_configs(
      description=__doc__,
      features=_common.make_features(("detailed", "category"), label_names=CLASS_NAMES),
      supervised_keys=("image", "label"),
      homepage="https://github.com/zalandoresearch/fashion-mnist",
    )

  def split_size_estimates(self) -> dict[str, int]:
    """Examples per split (used to choose the number of shards before generating)."""
    full = {"train": 60000, "test": 10000}
    return {k: min(v, self._limit) if self._limit else v for k, v in full.items()}

  def _split_generators(self, dl_manager):
    """train (60000) and test (10000) from the idx files; fails clearly when the package is missing."""
    del dl_manager
    if not os.path.isdir(self._input_dir):
      raise FileNotFoundError(
        f"fashion_mnist: directory {self._input_dir!r} not found; install the Debian package "
        "'dataset-fashion-mnist' or pass --input DIR"
      )
    return {split: self._generate_examples(split, prefix) for split, prefix in _FILES.items()}

  def _generate_examples(self, split: str, prefix: str):
    """Reads one split's idx pair and PNG-encodes images in the worker pool (ordered)."""
    images = read_idx(os.path.join(self._input_dir, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(os.path.join(self._input_dir, f"{prefix}-labels-idx1-ubyte"))
    if len(images) != len(labels):
      raise ValueError(f"fashion_mnist/{split}: {len(images)} images but {len(labels)} labels")
    n = len(images) if not self._limit else min(self._limit, len(images))
    size = dataclasses.replace(self.builder_config, **self._overrides).image_size
    self.report.total += n
    items = ((split, i, images[i], labels[i], size) for i in range(n))
    for status, value in _common.parallel_map(_make_example, items, self._num_workers, chunksize=256):
      assert status == "ok", value
      self.report.written += 1
      yield value
