"""Evaluator tests with a fake encoder whose embeddings make the answer known.

Why fakes: the metric plumbing (prompts, padding, batching, upsampling, sliding windows, kNN bank) must
be right independently of any model; a perfect fake must score 100 and a random one near chance.

The fake encodes the class of an image (or of each patch) in the red channel (red = 10 * class, plus a
unique item id in green/blue for retrieval), and the class of a text as the integer after '#'.
"""

import io
import json
import os
import re

import numpy as np
import pytest
from PIL import Image

from tipsito.data import eval_input
from tipsito.evals import pictures
from tipsito.evals.registry import make_evaluator
from tipsito.evals.registry import make_evaluators
from tipsito.evals import registry
from tipsito.evals.runner import run_evaluators

D = 64
PATCH = 8


class FakeEncoder:
  """Stand-in for tipsito.inference.Encoder (same methods); 'perfect' or 'random' embeddings."""

  def __init__(self, mode="perfect", seed=0):
    self.mode = mode
    self.seed = seed
    self.temperature = 0.01
    self.tokenizer = "fake"  # not None: strings are accepted (None would make evals tokenize)
    self.image_calls = []
    self.text_calls = []

  def _onehot(self, idx):
    out = np.zeros(idx.shape + (D,), np.float32)
    np.put_along_axis(out, idx[..., None] % D, 1.0, axis=-1)
    return out

  def embed_images(self, images, project=False):
    images = np.asarray(images)
    self.image_calls.append((images.shape, project))
    b, h, w, _ = images.shape
    centres = images[:, PATCH // 2 :: PATCH, PATCH // 2 :: PATCH].astype(np.int64)  # (B, h/8, w/8, 3)
    patch_cls = centres[..., 0] // 10
    item = images[:, 0, 0, 1].astype(np.int64) + 256 * images[:, 0, 0, 2].astype(np.int64)
    image_cls = images[:, 0, 0, 0].astype(np.int64) // 10
    if self.mode == "perfect":
      values = self._onehot(patch_cls)
      cls0 = self._onehot(image_cls)
      cls1 = self._onehot(item)  # CLS2 carries the item id (retrieval with cls_index=1)
    else:
      rng = np.random.default_rng([self.seed, int(images.sum()) % (2**31)])
      values = rng.normal(size=(b, h // PATCH, w // PATCH, D)).astype(np.float32)
      cls0 = rng.normal(size=(b, D)).astype(np.float32)
      cls1 = rng.normal(size=(b, D)).astype(np.float32)
    return {"cls": np.stack([cls0, cls1], 1), "patches": values + 0.01, "values": values}

  def embed_texts(self, texts):
    self.text_calls.append(len(texts))
    ids = np.array([int(re.search(r"#(\d+)", t).group(1)) for t in texts])
    if self.mode == "perfect":
      return self._onehot(ids) * 3.0  # unnormalised on purpose
    rng = np.random.default_rng(self.seed + 1)
    return rng.normal(size=(len(texts), D)).astype(np.float32)


def _png(arr):
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, format="PNG")
  return buf.getvalue()


def make_records(n, num_classes, size=32, seed=0, encoded=False, grid=False, bg=True):
  """Records with images whose red channel is 10 * class (per 8x8 patch when grid)."""
  rng = np.random.default_rng(seed)
  recs = []
  for i in range(n):
    label = int(rng.integers(num_classes))
    if grid:  # per-patch-column classes (0 = background): vertical stripes one patch wide.
      # Stripes, not a 2-D grid: bilinear upsampling of score maps only reproduces nearest-patch labels
      # exactly in 1-D (in 2-D, two diagonal neighbours of one class can outvote the nearest patch).
      cells = rng.integers(0, num_classes + 1 if bg else num_classes, size=(1, size // PATCH))
      cells = np.repeat(cells, size // PATCH, axis=0)
      mask = np.kron(cells, np.ones((PATCH, PATCH), np.int64)).astype(np.uint8)
    else:
      mask = np.full((size, size), label + 1, np.uint8)
    img = np.zeros((size, size, 3), np.uint8)
    img[..., 0] = 10 * (mask if grid else label)
    img[..., 1] = i % 256
    img[..., 2] = i // 256
    if not grid:
      img[0, 0, 0] = 10 * label
    rec = {
      "image": _png(img) if encoded else img,
      "label": label,
      "segmentation": _png(mask) if encoded else mask,
      "alt_text": f"item #{i}",
      "caption_detailed": f"a detailed caption of item #{i}",
      "id": f"x{i}",
    }
    recs.append(rec)
  return recs


def source_of(splits):
  return lambda split: splits[split]


CLASSES = [f"thing #{c}" for c in range(10)]


# ---------------------------------------------------------------------------------------- zero-shot
@pytest.mark.parametrize("encoded", [False, True])
def test_zeroshot_perfect_is_100_and_padding_not_counted(encoded):
  recs = make_records(37, 10, encoded=encoded)  # 37 = 2 full batches of 16 + 5 (padded)
  ev = make_evaluator(
    "zs",
    dict(
      type="zeroshot",
      dataset="fake",
      batch_size=16,
      image_size=32,
      templates=["a photo of a {}.", "{}, drawn"],
      class_names=CLASSES,
    ),
    source_fn=source_of({"test": recs}),
  )
  enc = FakeEncoder()
  res = ev.run(enc)
  assert res["zs/top1"] == 100.0 and res["zs/top5"] == 100.0
  assert res["zs/num_examples"] == 37
  assert res["zs/chance"] == 10.0
  # Fixed-size batches only (one compile): every image call had batch 16; project=True by default.
  assert {c[0] for c in enc.image_calls} == {(16, 32, 32, 3)}
  assert all(c[1] for c in enc.image_calls)
  assert set(enc.text_calls) == {64}  # 20 prompts padded to text_batch_size


def test_zeroshot_random_is_near_chance():
  recs = make_records(300, 10, seed=3)
  ev = make_evaluator(
    "zs",
    dict(
      type="zeroshot", dataset="fake", batch_size=50, image_size=32, templates="simple", class_names=CLASSES
    ),
    source_fn=source_of({"test": recs}),
  )
  res = ev.run(FakeEncoder("random"))
  assert res["zs/top1"] < 25.0  # chance is 10%
  assert res["zs/top5"] < 75.0  # chance is 50%


def test_zeroshot_wrong_cls_index_and_max_examples():
  recs = make_records(40, 10)
  ev = make_evaluator(
    "zs",
    dict(
      type="zeroshot",
      dataset="fake",
      batch_size=16,
      image_size=32,
      cls_index=1,
      max_examples=20,
      class_names=CLASSES,
      templates="simple",
    ),
    source_fn=source_of({"test": recs}),
  )
  res = ev.run(FakeEncoder())
  assert res["zs/num_examples"] == 20
  assert res["zs/top1"] < 100.0  # CLS2 of the fake carries the item id, not the class


# ---------------------------------------------------------------------------------------- retrieval
def test_retrieval_perfect_and_counts():
  recs = make_records(21, 10)
  ev = make_evaluator(
    "ret",
    dict(type="retrieval", dataset="fake", batch_size=8, image_size=32, cls_index=1),
    source_fn=source_of({"test": recs}),
  )
  res = ev.run(FakeEncoder())
  for d in ("i2t", "t2i"):
    for k in (1, 5, 10):
      assert res[f"ret/{d}_r{k}"] == 100.0
  assert res["ret/num_images"] == 21
  assert res["ret/num_texts"] == 42  # alt_text + caption_detailed for every image, padding excluded


def test_retrieval_random_near_chance():
  recs = make_records(64, 10)
  ev = make_evaluator(
    "ret",
    dict(
      type="retrieval", dataset="fake", batch_size=32, image_size=32, cls_index=1, caption_keys=["alt_text"]
    ),
    source_fn=source_of({"test": recs}),
  )
  res = ev.run(FakeEncoder("random"))
  assert res["ret/num_texts"] == 64
  assert res["ret/i2t_r1"] < 20.0 and res["ret/t2i_r1"] < 20.0  # chance 1/64


# ------------------------------------------------------------------------------------- segmentation
def _seg_cfg(**kw):
  cfg = dict(
    type="segmentation",
    dataset="fake",
    batch_size=4,
    image_size=32,
    class_names=[f"thing #{c}" for c in range(5)],
    background_index=0,
  )
  cfg.update(kw)
  return cfg


@pytest.mark.parametrize("encoded", [False, True])
def test_segmentation_whole_perfect(encoded):
  recs = make_records(10, 4, grid=True, encoded=encoded)
  ev = make_evaluator("seg", _seg_cfg(num_pictures=2), source_fn=source_of({"test": recs}))
  res = ev.run(FakeEncoder())
  assert res["seg/miou"] == pytest.approx(100.0)
  assert res["seg/pixel_acc"] == pytest.approx(100.0)
  assert res["seg/num_examples"] == 10
  ov = ev.pictures["seg/overlay"]
  # 2 rows of [image | GT | values | patch tokens | global copy | PCA], panels 32 px scaled x8 to 256, a legend.
  rows = 2 * (pictures.TITLE_ROWS + 256 + pictures.GAP)
  assert ov.dtype == np.uint8 and ov.shape[1:] == (6 * 256 + 5 * pictures.GAP, 3) and ov.shape[0] > rows
  assert ev.pictures["seg/pca"].shape == (2 * 32, 2 * 32, 3)


def test_segmentation_bg_threshold_and_slide():
  # Background patches get value 0 (cos 0 with every class); with bg_threshold the background class is
  # not prompted and wins where the best foreground cosine < 0.5 -> still perfect.
  recs = make_records(6, 4, grid=True, size=48)

  class BgZero(FakeEncoder):
    def embed_images(self, images, project=False):
      out = super().embed_images(images, project)
      cls = np.asarray(images)[:, PATCH // 2 :: PATCH, PATCH // 2 :: PATCH, 0] // 10
      out["values"] = out["values"] * (cls > 0)[..., None]
      return out

  for protocol in ("whole", "slide"):
    ev = make_evaluator(
      "seg",
      _seg_cfg(image_size=48, bg_threshold=0.5, protocol=protocol, crop_size=32, stride=16),
      source_fn=source_of({"test": recs}),
    )
    enc = BgZero()
    res = ev.run(enc)
    assert res["seg/miou"] == pytest.approx(100.0), protocol
    if protocol == "slide":  # 4 windows of 32x32 per 48x48 image, encoded in fixed batches of 4
      assert {c[0] for c in enc.image_calls} == {(4, 32, 32, 3)}
      assert len(enc.image_calls) == 6  # 6 images * 4 windows / 4, padded batches of 4 images
    # The background class is never prompted in threshold mode.
    assert ev.seg_class_names()[0] == "thing #0"


def test_segmentation_random_is_poor_and_ignore_label():
  recs = make_records(8, 4, grid=True)
  for r in recs:  # mark a border as ignore: must not matter
    r["segmentation"] = r["segmentation"].copy()
    r["segmentation"][:, :4] = 255
  ev = make_evaluator("seg", _seg_cfg(), source_fn=source_of({"test": recs}))
  assert ev.run(FakeEncoder())["seg/miou"] == pytest.approx(100.0)
  assert ev.run(FakeEncoder("random"))["seg/miou"] < 50.0


def test_segmentation_from_alpha():
  rng = np.random.default_rng(0)
  recs = []
  for _ in range(5):
    label = int(rng.integers(3))
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., 3] = 0
    rgba[:, 8:24, 3] = 255  # opaque foreground stripe aligned to patches (1-D, see make_records)
    rgba[:, 8:24, 0] = 10 * (label + 1)
    recs.append({"image": _png(rgba), "label": label})
  # Foreground (label+1) = red 10*(label+1) in the fake; transparent background composites to white
  # (red 255 -> class 25), which is not a prompted class, so use the threshold mode for background.

  class WhiteIsBg(FakeEncoder):
    def embed_images(self, images, project=False):
      out = super().embed_images(images, project)
      c = np.asarray(images)[:, PATCH // 2 :: PATCH, PATCH // 2 :: PATCH, 0]
      out["values"] = out["values"] * (c < 255)[..., None]
      return out

  ev = make_evaluator(
    "fg",
    _seg_cfg(class_names=None, bg_threshold=0.5, mask_source="alpha"),
    source_fn=source_of({"test": recs}),
    class_names=["thing #1", "thing #2", "thing #3"],
  )
  assert ev.seg_class_names() == ["background", "thing #1", "thing #2", "thing #3"]
  assert ev.run(WhiteIsBg())["fg/miou"] == pytest.approx(100.0)


# --------------------------------------------------------------------------------------------- kNN
def test_knn_perfect_and_random():
  splits = {"train": make_records(60, 10, seed=1), "test": make_records(25, 10, seed=2)}
  cfg = dict(type="knn", dataset="fake", batch_size=16, image_size=32, k=5, class_names=CLASSES)
  ev = make_evaluator("knn", cfg, source_fn=source_of(splits))
  enc = FakeEncoder()
  res = ev.run(enc)
  assert res["knn/top1"] == 100.0
  assert res["knn/num_train"] == 60 and res["knn/num_examples"] == 25
  assert not any(c[1] for c in enc.image_calls)  # backbone features: project=False by default
  res = make_evaluator("knn", cfg, source_fn=source_of(splits)).run(FakeEncoder("random"))
  assert res["knn/top1"] < 40.0


# ------------------------------------------------------------------------------- registry + hook
def test_registry_config_errors_and_schedule():
  from tipsito.config.validation import ConfigError  # pylint: disable=g-import-not-at-top

  with pytest.raises(KeyError):
    make_evaluator("x", dict(type="nope", dataset="fake"))
  with pytest.raises(ConfigError, match=r"config\.evals\.x: \['typo_key'\] is not a key"):
    make_evaluator("x", dict(type="zeroshot", dataset="fake", typo_key=1))
  ev = make_evaluator("x", dict(type="knn", dataset="fake", every_steps=100))
  assert ev.should_run(200) and not ev.should_run(150) and not ev.should_run(0)
  assert ev.should_run(150, is_last=True)
  never = make_evaluator("y", dict(type="knn", dataset="fake"))
  assert not never.should_run(100) and never.should_run(7, is_last=True)


def test_make_evaluators_from_configdict():
  import ml_collections

  config = ml_collections.ConfigDict()
  config.evals = ml_collections.ConfigDict(
    {
      "a": {"type": "zeroshot", "dataset": "shapes", "every_steps": 10},
      "b": {"type": "knn", "dataset": "fashion_mnist", "enabled": False},
    }
  )
  evs = make_evaluators(config)
  assert list(evs) == ["a"] and evs["a"].cfg["every_steps"] == 10


def test_pad_batch():
  ex = [{"image": np.ones((2, 2, 3), np.uint8), "label": np.int32(3), "captions": ["a"]}]
  b = eval_input.pad_batch(ex, 3)
  assert b["image"].shape == (3, 2, 2, 3) and b["image"][1:].sum() == 0
  np.testing.assert_array_equal(b["_valid"], [True, False, False])
  assert b["captions"] == [["a"], [], []]


class RecordingWriter:
  def __init__(self):
    self.scalars, self.images, self.flushed = {}, {}, False

  def write_scalars(self, step, scalars):
    self.scalars[step] = dict(scalars)

  def write_images(self, step, images):
    self.images[step] = {k: np.asarray(v) for k, v in images.items()}

  def flush(self):
    self.flushed = True


def test_run_evaluators_writes_scalars_images_and_pngs(tmp_path):
  recs = make_records(9, 4, grid=True)
  evs = {
    "seg": make_evaluator(
      "seg", _seg_cfg(num_pictures=1, every_steps=5), source_fn=source_of({"test": recs})
    ),
    "zs": make_evaluator(
      "zs",
      dict(
        type="zeroshot",
        dataset="fake",
        image_size=32,
        batch_size=4,
        class_names=CLASSES[:5],
        templates="simple",
        every_steps=3,
      ),
      source_fn=source_of({"test": make_records(9, 5)}),
    ),
  }
  w = RecordingWriter()
  res = run_evaluators(evs, FakeEncoder(), step=10, writer=w, picture_dir=str(tmp_path), only_due=True)
  assert "seg/miou" in res and "zs/top1" not in res  # 10 is a multiple of 5, not of 3
  assert w.scalars[10]["seg/miou"] == pytest.approx(100.0) and w.flushed
  ov = w.images[10]["seg/overlay"]
  assert ov.shape[0] == 1 and ov.shape[2:] == (6 * 256 + 5 * pictures.GAP, 3)
  pngs = sorted(os.listdir(tmp_path))
  assert pngs == ["seg_overlay_00000010.png", "seg_pca_00000010.png"]
  assert np.asarray(Image.open(tmp_path / pngs[0])).shape == ov.shape[1:]
  json.dumps(res)  # plain floats


def test_subset_is_spread_and_deterministic():
  np.testing.assert_array_equal(eval_input.subset_indices(10, 4), [0, 2, 5, 7])
  np.testing.assert_array_equal(eval_input.subset_indices(3, 10), [0, 1, 2])
  assert len(set(eval_input.subset_indices(785, 100).tolist())) == 100


def test_builtin_suites():
  evs = registry.builtin_evals("shapes/tiny", image_size=64, max_examples=50, data_dir="/d")
  assert sorted(evs) == ["shapes_knn", "shapes_retrieval", "shapes_segmentation", "shapes_zeroshot"]
  assert evs["shapes_knn"]["train_split"] == "train" and evs["shapes_knn"]["max_train_examples"] == 200
  assert evs["shapes_segmentation"]["num_pictures"] == 4 and evs["shapes_zeroshot"]["num_pictures"] == 0
  assert sorted(registry.builtin_evals("tuxpaint")) == [
    "tuxpaint_retrieval",
    "tuxpaint_segmentation",
    "tuxpaint_zeroshot",
  ]
  assert registry.builtin_evals("tuxpaint")["tuxpaint_zeroshot"]["split"] == "train"  # only split
  assert sorted(registry.builtin_evals("fashion_mnist")) == ["fashion_mnist_knn", "fashion_mnist_zeroshot"]
  for name, cfg in {**evs, **registry.builtin_evals("fashion_mnist")}.items():
    make_evaluator(name, cfg)  # every key is a known config key


def test_tuxpaint_class_names_are_words():
  ev = make_evaluator("t", dict(type="zeroshot", dataset="tuxpaint", split="train"))
  names = ev.class_names()
  assert len(names) == 16 and names[0] == "animal" and "force of nature" in names
