"""Dense benchmark readers (tipsito/data/dense_benchmarks.py) on tiny fixtures in the published layouts.

Why fixtures: the readers must find the files where ADE20K, Pascal VOC 2012, Pascal Context and NYUv2
put them, apply each benchmark's label rule, and say what layout they expected when a path is missing;
a few 32-pixel files in those folders show all three without the real datasets.
"""

import io
import os

import numpy as np
import pytest
from PIL import Image

from tipsito.data import dense_benchmarks
from tipsito.data import eval_input
from tipsito.evals.registry import make_evaluator

from test_evals_probes import FakeEncoder  # pylint: disable=g-bad-import-order

SIZE = 32


def _save(path, arr, palette=False):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  img = Image.fromarray(arr)
  if palette:  # VOC's SegmentationClass PNGs are palette images whose indices are the labels
    img.putpalette([v for i in range(256) for v in (i, 255 - i, (7 * i) % 256)])
  img.save(path, **(dict(quality=100, subsampling=0) if path.endswith(".jpg") else {}))


def stripes(rng, num_values):
  """Label map of vertical 8-px stripes and the image coding them in red (10 * label + 5: JPEG-safe)."""
  cells = np.repeat(rng.integers(0, num_values, size=(1, SIZE // 8)), SIZE // 8, axis=0)
  mask = np.kron(cells, np.ones((8, 8), np.int64)).astype(np.uint8)
  img = np.zeros((SIZE, SIZE, 3), np.uint8)
  img[..., 0] = 10 * mask + 5
  return img, mask


def make_ade20k(root, n=(6, 3)):
  rng = np.random.default_rng(0)
  base = os.path.join(root, "ADEChallengeData2016")
  for split, count in zip(("training", "validation"), n):
    for i in range(count):
      img, mask = stripes(rng, 4)  # 0 = other (ignored), 1..3
      _save(os.path.join(base, "images", split, f"ADE_{split[:5]}_{i:08d}.jpg"), img)
      _save(os.path.join(base, "annotations", split, f"ADE_{split[:5]}_{i:08d}.png"), mask)
  return base


def make_voc(root, year="VOC2012", target="SegmentationClass", lists="Segmentation", n=(8, 4), values=4):
  rng = np.random.default_rng(1)
  base = os.path.join(root, "VOCdevkit", year)
  for split, count in zip(("train", "val"), n):
    stems = []
    for i in range(count):
      stem = f"2007_{split}{i:03d}"
      img, mask = stripes(rng, values)
      if target == "SegmentationClass":
        mask[:, :1] = 255  # an object border column: ignored
      _save(os.path.join(base, "JPEGImages", stem + ".jpg"), img)
      _save(os.path.join(base, target, stem + ".png"), mask, palette=target == "SegmentationClass")
      stems.append(stem)
    os.makedirs(os.path.join(base, "ImageSets", lists), exist_ok=True)
    with open(os.path.join(base, "ImageSets", lists, split + ".txt"), "w") as f:
      f.write("\n".join(stems) + "\n")
  return base


def make_nyuv2(root, n=(6, 3)):
  rng = np.random.default_rng(2)
  for folder, count in zip(("sync", "official_splits/test"), n):
    for i in range(count):
      v = int(rng.integers(10, 250))
      img = np.zeros((SIZE, SIZE, 3), np.uint8)
      img[..., 0] = v
      depth = np.full((SIZE, SIZE), 20 * v, np.uint16)
      scene = os.path.join(root, folder, f"bedroom_{i % 2:04d}")
      _save(os.path.join(scene, f"rgb_{i:05d}.jpg"), img)
      _save(os.path.join(scene, f"sync_depth_{i:05d}.png"), depth)


def test_ade20k_layout_and_reduce_zero_label(tmp_path):
  make_ade20k(str(tmp_path))
  src = dense_benchmarks.open_split("ade20k", "validation", str(tmp_path))
  assert len(src) == 3 and src[0]["id"] == "ADE_valid_00000000"
  raw = eval_input.decode_mask(src[0]["segmentation"])
  bench = dense_benchmarks.BENCHMARKS["ade20k"]
  spec = eval_input.MaskSpec(reduce_zero_label=bench.reduce_zero_label)
  gt = eval_input.ground_truth_mask(src[0], None, (SIZE, SIZE), spec)
  np.testing.assert_array_equal(gt, np.where(raw == 0, 255, raw - 1))
  # The ADEChallengeData2016 folder itself is accepted as the root too.
  assert len(dense_benchmarks.open_split("ade20k", "train", str(tmp_path / "ADEChallengeData2016"))) == 6


def test_voc2012_palette_labels_and_split_lists(tmp_path):
  make_voc(str(tmp_path))
  src = dense_benchmarks.open_split("voc2012", "train", str(tmp_path))
  assert len(src) == 8 and src[0]["id"] == "2007_train000"
  mask = eval_input.decode_mask(src[0]["segmentation"])
  assert mask[0, 0] == 255 and set(np.unique(mask)) <= {0, 1, 2, 3, 255}
  assert Image.open(io.BytesIO(src[0]["segmentation"])).mode == "P"


def test_pascal_context_layout(tmp_path):
  make_voc(str(tmp_path), "VOC2010", "SegmentationClassContext", "SegmentationContext")
  src = dense_benchmarks.open_split("pascal_context", "validation", str(tmp_path / "VOCdevkit"))
  assert len(src) == 4
  assert dense_benchmarks.BENCHMARKS["pascal_context"].num_classes == 59


def test_nyuv2_layout_depth_in_metres(tmp_path):
  make_nyuv2(str(tmp_path))
  src = dense_benchmarks.open_split("nyuv2", "test", str(tmp_path))
  assert len(src) == 3 and src[0]["id"] == "bedroom_0000/00000"
  depth = eval_input.ground_truth_depth(src[0], eval_input.DepthSpec())
  assert depth.dtype == np.float32 and 0.2 <= float(depth[0, 0]) <= 5.0


@pytest.mark.parametrize("name", sorted(dense_benchmarks.BENCHMARKS))
def test_missing_path_names_the_layout(tmp_path, name):
  with pytest.raises(dense_benchmarks.LayoutError, match="expected the published layout") as e:
    dense_benchmarks.open_split(name, sorted(dense_benchmarks.BENCHMARKS[name].splits)[0], str(tmp_path))
  assert dense_benchmarks.BENCHMARKS[name].layout in str(e.value)
  with pytest.raises(dense_benchmarks.LayoutError, match="data_dir"):
    dense_benchmarks.open_split(name, "train", str(tmp_path / "nowhere"))


def test_missing_annotation_is_named(tmp_path):
  make_voc(str(tmp_path))
  os.remove(tmp_path / "VOCdevkit" / "VOC2012" / "SegmentationClass" / "2007_val001.png")
  with pytest.raises(dense_benchmarks.LayoutError, match="2007_val001.png"):
    dense_benchmarks.open_split("voc2012", "validation", str(tmp_path))


FAST = dict(steps=300, lr=0.05, probe_batch_size=8, batch_size=8, image_size=SIZE)


def test_linear_segmentation_on_voc_fixture(tmp_path):
  make_voc(str(tmp_path), n=(16, 6), values=6)
  cfg = dict(
    type="linear_segmentation", dataset="voc2012", data_dir=str(tmp_path), split="validation", **FAST
  )
  res = make_evaluator("voc", cfg).run(FakeEncoder("code"))
  assert res["voc/num_classes"] == 21 and res["voc/num_examples"] == 6
  assert res["voc/miou"] == pytest.approx(100.0)  # the border column (255) is not scored


def test_linear_depth_on_nyuv2_fixture(tmp_path):
  make_nyuv2(str(tmp_path), n=(16, 4))
  cfg = dict(type="linear_depth", dataset="nyuv2", data_dir=str(tmp_path), split="test", **FAST)
  res = make_evaluator("nyu", cfg).run(FakeEncoder("depth"))
  assert res["nyu/num_examples"] == 4
  assert res["nyu/rmse"] < 0.05 and res["nyu/delta1"] == pytest.approx(100.0)
