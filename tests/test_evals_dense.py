"""Dense metrics that separate patch-text alignment from a copied global answer (issue 31, item 2).

Why these tests: the segmentation eval scores three predictions (value embeddings, final patch tokens,
the CLS answer copied to every pixel) and the accuracy on objects other than each image's largest. They
check the metric on hand-made maps with known answers, that an oracle scores 100, that a model whose
patches all copy its global embedding scores exactly the global-copy reference, that the two feature
kinds read different encoder outputs, and the figure's sizes and legend.

The fake encoder: 32 x 32 images of 8-px patches whose red channel is 10 * class; texts "thing #c" embed
as one-hot c; each feature kind is a one-hot of the patch's class, of the image's CLS class or noise.
Classes come in vertical stripes one patch wide, so bilinear upsampling reproduces them exactly.
"""

import math
import re

import numpy as np
import pytest
from PIL import Image

from tipsito.evals.registry import make_evaluator
from tipsito.evals import metrics
from tipsito.evals import pictures
from tipsito.evals import segmentation

D = 16
PATCH = 8
NUM_CLASSES = 5  # 0 = background, 1..4 objects
NAMES = [f"thing #{c}" for c in range(NUM_CLASSES)]


def _onehot(idx):
  return np.eye(D, dtype=np.float32)[np.asarray(idx) % D]


class StripeEncoder:
  """Each output kind is 'truth' (one-hot of the patch class), 'cls' (one-hot of the image's CLS class,
  copied to every patch) or 'noise'; CLS = one-hot of the class of the image's last patch column."""

  tokenizer = "fake"
  image_config = {"patch_size": PATCH}

  def __init__(self, values="truth", patches="truth"):
    self.kinds = {"values": values, "patches": patches}

  def embed_images(self, images, project=False, values=True):
    x = np.asarray(images)
    patch_cls = x[:, PATCH // 2 :: PATCH, PATCH // 2 :: PATCH, 0].astype(np.int64) // 10  # (B, h, w)
    cls = _onehot(patch_cls[:, 0, -1])  # (B, D)
    out = {"cls": cls[:, None]}
    for key, mode in self.kinds.items():
      if mode == "truth":
        out[key] = _onehot(patch_cls)
      elif mode == "cls":
        out[key] = np.broadcast_to(cls[:, None, None], patch_cls.shape + (D,)).copy()
      else:
        rng = np.random.default_rng(int(x.sum()) % (2**31))
        out[key] = rng.normal(size=patch_cls.shape + (D,)).astype(np.float32)
    return out

  def embed_texts(self, texts):
    return _onehot([int(re.search(r"#(\d+)", t).group(1)) for t in texts])


def stripe_records(n, seed=0, size=32):
  """Images of 4 one-patch-wide columns of classes in [0, NUM_CLASSES) (0 = background)."""
  rng = np.random.default_rng(seed)
  recs = []
  for _ in range(n):
    cols = rng.integers(0, NUM_CLASSES, size=size // PATCH)
    mask = np.repeat(np.repeat(cols, PATCH)[None], size, axis=0).astype(np.uint8)
    img = np.zeros((size, size, 3), np.uint8)
    img[..., 0] = 10 * mask
    recs.append({"image": img, "segmentation": mask})
  return recs


def run_eval(encoder, n=12, **kw):
  cfg = dict(
    type="segmentation",
    dataset="fake",
    batch_size=4,
    image_size=32,
    class_names=NAMES,
    background_index=0,
    templates="identity",
  )
  cfg.update(kw)
  ev = make_evaluator("seg", cfg, source_fn=lambda split: stripe_records(n))
  return ev, ev.run(encoder)


# ------------------------------------------------------------------------------------------ the metric
def test_largest_object_class_known_answers():
  gt = np.array([[0, 1, 1, 2], [0, 1, 2, 255]])
  assert metrics.largest_object_class(gt, 3, background_index=0) == 1
  assert metrics.largest_object_class(np.array([[1, 2], [2, 1]]), 3, background_index=0) == 1  # tie: lower
  assert metrics.largest_object_class(np.array([[0, 0, 0, 2]]), 3, background_index=0) == 2  # bg excluded
  assert metrics.largest_object_class(np.array([[0, 0, 0, 2]]), 3, background_index=None) == 0
  assert metrics.largest_object_class(np.array([[0, 255], [7, 0]]), 3, background_index=0) is None


def test_nonlargest_counts_known_answers():
  gt = np.array([[0, 1, 1, 2], [0, 1, 2, 255]])  # largest 1; non-largest: the two pixels of class 2
  pred = np.array([[0, 1, 2, 2], [1, 1, 0, 0]])
  np.testing.assert_array_equal(
    metrics.nonlargest_mask(gt, 3, background_index=0), [[0, 0, 0, 1], [0, 0, 1, 0]]
  )
  assert metrics.nonlargest_counts(pred, gt, 3, background_index=0) == (1, 2)
  assert metrics.nonlargest_counts(gt, gt, 3, background_index=0) == (2, 2)
  # One answer everywhere is right on the largest object or on the others, never on both.
  assert metrics.nonlargest_counts(np.full_like(gt, 1), gt, 3, background_index=0) == (0, 2)
  assert metrics.nonlargest_counts(np.zeros((1, 2)), np.array([[0, 1]]), 3, background_index=0) == (0, 0)
  with pytest.raises(ValueError, match="differ"):
    metrics.nonlargest_counts(np.zeros((2, 2)), np.zeros((2, 3)), 3)


# ------------------------------------------------------------------------------------------ evaluator
def test_oracle_scores_100_with_both_feature_kinds():
  ev, res = run_eval(StripeEncoder("truth", "truth"))
  for prefix in ("", "patches/"):
    for m in ("miou", "pixel_acc", "mean_acc", "nonlargest_acc"):
      assert res[f"seg/{prefix}{m}"] == pytest.approx(100.0), prefix + m
  assert res["seg/nonlargest_chance"] == pytest.approx(100.0 / NUM_CLASSES)
  assert 0.0 < res["seg/nonlargest_share"] < 100.0
  # The reference paints each image's CLS class (here: its last column's) on every pixel.
  gts = [r["segmentation"] for r in stripe_records(12)]
  copied = [np.full_like(g, g[0, -1]) for g in gts]
  assert res["seg/global_copy/pixel_acc"] == pytest.approx(
    100 * np.mean([np.mean(c == g) for c, g in zip(copied, gts)])
  )
  counts = np.sum(
    [metrics.nonlargest_counts(c, g, NUM_CLASSES, background_index=0) for c, g in zip(copied, gts)], 0
  )
  assert res["seg/global_copy/nonlargest_acc"] == pytest.approx(100 * counts[0] / counts[1])
  assert 0 < counts[0] < counts[1]  # the last column is sometimes, not always, a non-largest object


def test_global_copy_model_scores_the_reference_row():
  """Every patch (values and tokens) equals the CLS embedding: no metric beats 'global_copy'; here
  they are equal, since the copy model's prediction is the reference by construction."""
  for protocol in ("whole", "slide"):
    _, res = run_eval(StripeEncoder("cls", "cls"), protocol=protocol, crop_size=16, stride=8)
    for prefix in ("", "patches/"):
      for m in ("miou", "pixel_acc", "mean_acc", "nonlargest_acc"):
        assert res[f"seg/{prefix}{m}"] == pytest.approx(res[f"seg/global_copy/{m}"]), (protocol, prefix, m)
    assert res["seg/nonlargest_acc"] <= res["seg/global_copy/nonlargest_acc"]
  _, oracle = run_eval(StripeEncoder("truth", "truth"))
  assert oracle["seg/nonlargest_acc"] > res["seg/global_copy/nonlargest_acc"] + 30.0


def test_the_two_feature_kinds_read_different_features():
  _, res = run_eval(StripeEncoder(values="truth", patches="noise"))
  assert res["seg/miou"] == pytest.approx(100.0) and res["seg/patches/miou"] < 60.0
  _, res = run_eval(StripeEncoder(values="noise", patches="truth"))
  assert res["seg/patches/miou"] == pytest.approx(100.0) and res["seg/miou"] < 60.0
  assert res["seg/patches/nonlargest_acc"] == pytest.approx(100.0) and res["seg/nonlargest_acc"] < 60.0


def test_extra_kinds_can_be_switched_off_and_are_validated():
  _, res = run_eval(StripeEncoder(), n=4, patch_tokens=False, global_copy=False)
  assert not any(k.startswith(("seg/patches/", "seg/global_copy/")) for k in res)
  assert res["seg/miou"] == pytest.approx(100.0)
  with pytest.raises(ValueError, match="patch_tokens='yes' is not allowed"):
    segmentation.resolve_config(dict(type="segmentation", patch_tokens="yes"))


def test_single_object_images_have_no_nonlargest_pixels():
  cfg = dict(type="segmentation", dataset="fake", batch_size=2, image_size=32, class_names=NAMES)
  cfg.update(background_index=0, templates="identity")
  recs = [{"image": np.full((32, 32, 3), 10, np.uint8), "segmentation": np.ones((32, 32), np.uint8)}] * 2
  res = make_evaluator("seg", cfg, source_fn=lambda split: recs).run(StripeEncoder())
  assert math.isnan(res["seg/nonlargest_acc"]) and res["seg/nonlargest_share"] == 0.0


# ------------------------------------------------------------------------------------------ pictures
def test_figure_panels_are_at_least_256_px_with_titles_and_legend():
  ev, _ = run_eval(StripeEncoder(), n=4, num_pictures=3)
  fig = ev.pictures["seg/overlay"]
  panel = 256  # 32 px label maps scaled x8
  row = pictures.TITLE_ROWS + panel + pictures.GAP
  assert fig.dtype == np.uint8 and fig.shape[1] == 6 * panel + 5 * pictures.GAP
  assert fig.shape[0] > 3 * row  # three rows, then the legend
  # The first row's prediction panel (value embeddings, column 3) is the GT panel (column 2) here.
  y0, step = pictures.TITLE_ROWS, panel + pictures.GAP
  np.testing.assert_array_equal(
    fig[y0 : y0 + panel, 2 * step : 2 * step + panel], fig[y0 : y0 + panel, step : step + panel]
  )
  # Title strips hold dark text on white.
  assert fig[: pictures.TITLE_ROWS].min() < 100 and fig[: pictures.TITLE_ROWS].max() == 255


def test_legend_shows_each_listed_class_colour_and_wraps():
  pal = pictures.palette(NUM_CLASSES)
  strip = pictures.legend(NAMES, [0, 2, 3], NUM_CLASSES, width=600)
  colours = {tuple(c) for c in strip.reshape(-1, 3)}
  assert all(tuple(pal[c]) in colours for c in (0, 2, 3))
  assert tuple(pal[1]) not in colours and tuple(pal[4]) not in colours
  narrow = pictures.legend(NAMES, range(NUM_CLASSES), NUM_CLASSES, width=120)
  assert narrow.shape[1] == 120 and narrow.shape[0] > strip.shape[0]  # one entry a line


def test_segmentation_row_sizes_and_png_round_trip(tmp_path):
  gt = np.zeros((64, 48), np.uint8)
  gt[:, 24:] = 2
  image = np.zeros((64, 48, 3), np.uint8)
  pca = np.zeros((8, 6, 3), np.uint8)
  row = pictures.segmentation_row(image, gt, {"a": gt, "b": gt}, 3, pca)
  f = pictures.upscale_factor((64, 48))  # ceil(256 / 48) = 6
  assert f == 6 and row.shape == (pictures.TITLE_ROWS + 64 * f, 5 * 48 * f + 4 * pictures.GAP, 3)
  with pytest.raises(ValueError, match="resize the image first"):
    pictures.segmentation_row(image[:32], gt, {}, 3)
  fig = pictures.segmentation_figure([row], ["background", "x", "y"], [0, 2], 3)
  (path,) = pictures.write_pictures({"seg/overlay": fig}, step=3, directory=tmp_path)
  np.testing.assert_array_equal(np.asarray(Image.open(path)), fig)
