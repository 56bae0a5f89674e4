"""PCA maps and segmentation overlays: shapes, dtypes, determinism, PNG and TensorBoard writing."""

import numpy as np
from PIL import Image

from tipsito.evals import pictures


def _two_region_features(b=2, h=6, w=8, d=16, seed=0):
  """Left half and right half of every image have different feature means (first PC separates them)."""
  rng = np.random.default_rng(seed)
  f = rng.normal(scale=0.05, size=(b, h, w, d)).astype(np.float32)
  f[:, :, : w // 2, 0] += 3.0
  f[:, :, w // 2 :, 0] -= 3.0
  return f


def test_pca_rgb_shape_dtype_and_structure():
  f = _two_region_features()
  for joint in (False, True):
    rgb = pictures.pca_rgb(f, joint=joint)
    assert rgb.shape == (2, 6, 8, 3) and rgb.dtype == np.uint8
    # First component (red) separates the halves: one half bright, the other dark.
    left, right = rgb[:, :, :4, 0].astype(int).mean(), rgb[:, :, 4:, 0].astype(int).mean()
    assert abs(left - right) > 150
  # Deterministic (sign-fixed) colours.
  np.testing.assert_array_equal(pictures.pca_rgb(f), pictures.pca_rgb(f.copy()))
  # Degenerate inputs (fewer dims than components) still give 3 channels.
  assert pictures.pca_rgb(np.random.rand(1, 2, 2, 2)).shape == (1, 2, 2, 3)


def test_pca_grid_and_overlay():
  images = np.random.default_rng(0).integers(0, 255, size=(2, 48, 64, 3), dtype=np.uint8)
  grid = pictures.pca_grid(images, pictures.pca_rgb(_two_region_features()))
  assert grid.shape == (96, 128, 3) and grid.dtype == np.uint8
  pred = np.zeros((48, 64), np.uint8)
  gt = np.full((48, 64), 255, np.uint8)
  ov = pictures.segmentation_overlay(images[0], pred, gt, num_classes=3)
  assert ov.shape == (48, 192, 3) and ov.dtype == np.uint8
  pal = pictures.palette(10)
  assert pal.shape == (256, 3) and len({tuple(c) for c in pal[:10]}) == 10


def test_write_png_and_tensorboard(tmp_path):
  pic = pictures.pca_grid(np.zeros((1, 16, 16, 3), np.uint8), pictures.pca_rgb(_two_region_features(1, 4, 4)))

  class W:
    def __init__(self):
      self.calls = []

    def write_images(self, step, images):
      self.calls.append((step, {k: v.shape for k, v in images.items()}))

  w = W()
  paths = pictures.write_pictures({"eval/pca": pic}, step=7, writer=w, directory=tmp_path)
  assert w.calls == [(7, {"eval/pca": (1, 16, 32, 3)})]
  assert [p.split("/")[-1] for p in paths] == ["eval_pca_00000007.png"]
  np.testing.assert_array_equal(np.asarray(Image.open(paths[0])), pic)


def test_clu_writer_accepts_pictures(tmp_path):
  from clu import metric_writers

  writer = metric_writers.create_default_writer(str(tmp_path), just_logging=False)
  pictures.write_pictures({"x/pca": np.zeros((8, 8, 3), np.uint8)}, step=1, writer=writer)
  writer.flush()
  writer.close()
  assert any("events" in p.name for p in tmp_path.iterdir())
