"""The dense heads' protocols (tipsito/dense/eval.py) and inputs (tipsito/dense/data.py) on known answers.

Why: NYUv2 and ADE20K are not on this machine, so each protocol is checked where the answer is known:
RMSE / delta1 of a known error, the Eigen crop's pixels, the mIoU of a confusion matrix, a sliding window
over a per-pixel function (equal to the whole image), the SigLoss' scale invariance, and the normals that
the depth of a plane gives.
"""

import jax.numpy as jnp
import numpy as np

from tipsito.dense import data as data_lib
from tipsito.dense import eval as eval_lib


def test_depth_metrics_known_error_and_eigen_crop():
  gt = np.full((480, 640), 2.0, np.float32)
  pred = np.full((240, 320), 2.0, np.float32)
  pred[:, :160] = 3.0  # left half 1 m too far: ratio 1.5 > 1.25
  m = eval_lib.depth_metrics([pred], [gt], 1e-3, 10.0)
  np.testing.assert_allclose(m["rmse"], np.sqrt(0.5), rtol=1e-3)  # half the pixels at 1 m error
  np.testing.assert_allclose(m["delta1"], 50.0, atol=0.2)
  crop = eval_lib.eigen_mask((480, 640))
  assert crop.sum() == (471 - 45) * (601 - 41) and crop[45, 41] and not crop[44, 41]
  me = eval_lib.depth_metrics([pred], [gt], 1e-3, 10.0, eigen_crop=True)
  left = (320 - 41) / (601 - 41)  # the crop's share of the left half
  np.testing.assert_allclose(me["delta1"], 100 * (1 - left), atol=0.3)


def test_miou_of_a_confusion():
  gt = np.array([0, 0, 1, 1, 2, 255])
  pred = np.array([0, 1, 1, 1, 0, 2])
  c = eval_lib.confusion(pred, gt, 3, 255)
  assert c.sum() == 5  # the ignored pixel is not counted
  # IoU: class 0 = 1/3, class 1 = 2/3, class 2 = 0/1
  np.testing.assert_allclose(eval_lib.miou(c)["miou"], 100 * (1 / 3 + 2 / 3 + 0) / 3)


def test_sliding_window_of_a_per_pixel_function_is_the_whole_image():
  rng = np.random.default_rng(0)
  img = rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)

  def fn(x):  # logits = the pixel's colour, at full resolution
    return x.astype(np.float32)

  out = eval_lib.slide_logits(img, 32, 8, fn, 3)
  from PIL import Image

  ref = np.asarray(Image.fromarray(img).resize((out.shape[1], out.shape[0]), Image.BILINEAR)).astype(
    np.float32
  )
  assert out.shape[0] == 32 and out.shape[1] % 8 == 0  # short side = window, long side whole patches
  np.testing.assert_allclose(out, ref, atol=1e-4)


def test_sigloss_is_scale_invariant_up_to_its_mean_term():
  gt = jnp.asarray(np.random.default_rng(0).uniform(1, 5, (1, 8, 8)), jnp.float32)
  assert float(eval_lib.depth_loss(gt, gt, 1e-3, 10.0)) < 1e-5
  l2 = float(eval_lib.depth_loss(2 * gt, gt, 1e-3, 10.0))
  np.testing.assert_allclose(l2, np.sqrt(0.15) * np.log(2), rtol=1e-4)  # Var(g) = 0, mean(g) = log 2


def test_normals_from_depth_of_planes():
  h = w = 32
  flat = np.full((h, w), 3.0, np.float32)  # a fronto-parallel plane
  n, v = data_lib.normals_from_depth(flat)
  np.testing.assert_allclose(n[v], np.tile([0, 0, -1], (v.sum(), 1)), atol=1e-6)
  assert not v[0].any() and v[1:-1, 1:-1].all()
  step = flat.copy()
  step[:, 16:] = 6.0  # a depth jump: the border pixels are not valid
  _, v2 = data_lib.normals_from_depth(step)
  assert not v2[5, 15] and not v2[5, 16] and v2[5, 10]


def test_normals_metrics_angles():
  g = np.tile(np.array([0, 0, -1.0], np.float32), (4, 4, 1))
  p = np.tile(np.array([0, 1, -1.0], np.float32), (4, 4, 1))  # 45 degrees off
  m = eval_lib.normals_metrics([p], [g], [np.ones((4, 4), bool)])
  np.testing.assert_allclose([m["mean_angle"], m["median_angle"]], [45, 45], atol=1e-3)
  assert m["within_30"] == 0 and m["within_11.25"] == 0


def test_scenes_split_matches_the_generator():
  s = data_lib.scenes_split("test", 2, image_size=32)
  assert s.images.shape == (2, 32, 32, 3) and s.num_classes == 13
  assert s.targets["depth"].min() >= 2.0 and s.targets["depth"].max() <= 10.0
  assert set(np.unique(s.targets["segmentation"])) <= set(range(13))


def test_slide_eval_with_one_window_is_single_scale():
  """--slide wiring (tipsito/dense/train.py): a window the size of the image is one window, so the
  sliding-window mIoU equals the single-scale one on the same head."""
  import jax
  from dense_fixtures import CFG, TOWER, random_head, random_tower
  from tipsito.dense import train
  from tipsito.models import dpt
  from tipsito.models import kwargs as kwargs_lib
  from tipsito.models.vit import VisionTransformer

  cfg = dpt.DPTConfig(**{**CFG.to_dict(), "layers": (1, 2, 3, 4), "num_labels": 2})
  icfg, _ = kwargs_lib.complete_tower_config(TOWER, "image", "test")
  vit = VisionTransformer(**kwargs_lib.module_kwargs(icfg, VisionTransformer))
  split = data_lib.toy_split("test", 4, image_size=32)
  tower = random_tower(vit, split.images[:1], 1)
  blocks = train.frozen_blocks(icfg, tower, split.images, cfg.stages(4))
  head = random_head(cfg, "segmentation", train._take(blocks, slice(0, 1)), 2)
  single = train.evaluate(cfg, "segmentation", head, blocks, split)

  @jax.jit  # one compile for every window (op by op, this test took minutes)
  def window(x):
    b = vit.apply({"params": tower}, jnp.asarray(x), return_blocks=cfg.stages(4))["blocks"]
    return dpt.DPTHead(cfg, "segmentation").apply({"params": head}, b)

  slid = train.evaluate(
    cfg, "segmentation", head, blocks, split, slide_fn=lambda im: eval_lib.slide_logits(im, 32, 8, window, 2)
  )
  np.testing.assert_allclose(slid["miou"], single["miou"], atol=1e-6)
