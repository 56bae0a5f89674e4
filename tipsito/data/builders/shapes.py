"""TFDS builder `shapes`: procedural coloured shapes with captions, labels and segmentation masks.

Why: a dataset that needs no files or downloads, builds in seconds and exercises every part of
training (alt-text + two synthetic captions for CLS1/CLS2, class labels for zero-shot/kNN,
per-pixel masks for zero-shot segmentation). Deterministic: example i of a split depends only on
(seed, split, i), see `shapes_gen.generate`.

Record schema (array_record):
  image: PNG RGB (S,S,3); alt_text: short caption ("a red circle", the largest object);
  caption_detailed: every object with size, colour, position and the background;
  caption_gemini: a paraphrase of the detailed caption (different wording), so caption sampling
  over several synthetic fields is exercised; label: ClassLabel of the main (largest) shape;
  segmentation: PNG uint8 (S,S,1), value = class index + 1 of the top-most object, 0 = background;
  id: 'shapes-<split>-<index>'.
"""

from __future__ import annotations

import dataclasses

import tensorflow_datasets as tfds

from tipsito.data.builders import _common
from tipsito.data.builders import shapes_gen


@dataclasses.dataclass(eq=False)
class ShapesConfig(tfds.core.BuilderConfig):
  """Size knobs of `shapes`; tests use a tiny config (e.g. image_size=32, 16/8 examples).

  max_objects / object_sizes / colours shape the difficulty: the default (1-4 objects, small to large) is a
  cluttered scene; the CPU demo uses 1-2 medium/large objects so a tiny ViT can learn shape classes.
  """

  image_size: int = 224
  train_size: int = 2000
  test_size: int = 200
  seed: int = 0
  max_objects: int = 4
  object_sizes: tuple[str, ...] = shapes_gen.SIZE_NAMES
  colours: tuple[str, ...] = tuple(shapes_gen.COLOURS)


def _make_example(args):
  """Worker: (split, index, config fields) -> (key, tfds example with encoded PNGs)."""
  split, index, image_size, seed, max_objects, object_sizes, colours = args
  ex = shapes_gen.generate(
    index,
    split=split,
    image_size=image_size,
    seed=seed,
    max_objects=max_objects,
    sizes=object_sizes,
    colours=colours,
  )
  ex["image"] = _common.png_bytes(ex["image"])
  ex["segmentation"] = _common.png_bytes(ex["segmentation"])
  return ex["id"], ex


class Shapes(tfds.core.GeneratorBasedBuilder):
  """Procedural shapes dataset (see module docstring for the schema)."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [ShapesConfig(name="default", description="224px, 2000 train / 200 test")]
  DEFAULT_CONFIG_NAME = "default"

  def __init__(self, *, num_workers: int = 1, overrides: dict | None = None, **kwargs):
    """overrides: ShapesConfig fields (image_size, train_size, ...) replacing the config's values."""
    self._num_workers = num_workers
    self._overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    super().__init__(**kwargs)

  @property
  def options(self) -> ShapesConfig:
    """The config with `overrides` applied (what is actually generated)."""
    return dataclasses.replace(self.builder_config, **self._overrides)

  def _info(self) -> tfds.core.DatasetInfo:
    """Schema: image, alt_text, caption_detailed, caption_gemini, label (8 shapes), segmentation, id."""
    return self.dataset_info_from_configs(
      description=__doc__,
      features=_common.make_features(
        ("detailed", "gemini"), label_names=shapes_gen.SHAPE_CLASSES, segmentation=True
      ),
      supervised_keys=("image", "label"),
    )

  def split_size_estimates(self) -> dict[str, int]:
    """Examples per split (used to choose the number of shards before generating)."""
    cfg = self.options
    return {"train": cfg.train_size, "test": cfg.test_size}

  def _split_generators(self, dl_manager):
    """'train' and 'test' with the configured sizes (a size of 0 drops the split)."""
    del dl_manager
    cfg = self.options
    sizes = {"train": cfg.train_size, "test": cfg.test_size}
    return {split: self._generate_examples(split, n) for split, n in sizes.items() if n > 0}

  def _generate_examples(self, split: str, n: int):
    """Generates examples in the worker pool; order and content depend only on the indices."""
    cfg = self.options
    items = (
      (split, i, cfg.image_size, cfg.seed, cfg.max_objects, tuple(cfg.object_sizes), tuple(cfg.colours))
      for i in range(n)
    )
    for status, value in _common.parallel_map(_make_example, items, self._num_workers, chunksize=32):
      assert status == "ok", value
      yield value
