"""Linear probes (tipsito/evals/probes.py) on features whose answer is known.

Why fakes: a probe is a linear layer trained on frozen features, so features that are a linear code of the
target must be read perfectly (100 % mIoU, RMSE ~ 0, 100 % top-1) and features that are pure noise must
stay at chance; a real model's numbers are only meaningful once both hold. The fake encoder reads the
answer from the image: red channel = 10 * class per 8-pixel stripe (segmentation), or the depth code.
"""

import io

import numpy as np
import pytest
from PIL import Image

from tipsito.data import eval_input
from tipsito.evals.registry import make_evaluator
from tipsito.evals import probes
from tipsito.evals import registry

PATCH = 8
SIZE = 32
D = 32
FAST = dict(steps=300, lr=0.05, probe_batch_size=8, batch_size=8, image_size=SIZE)


def _png(arr):
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, format="PNG")
  return buf.getvalue()


class FakeEncoder:
  """Patch tokens = one-hot of the red channel / 10 at each patch centre plus the red value / 255 ('code'),
  the red value / 255 alone ('depth'), or noise ('noise')."""

  def __init__(self, mode="code"):
    self.mode = mode

  def embed_images(self, images, project=False):
    images = np.asarray(images)
    b = images.shape[0]
    centres = images[:, PATCH // 2 :: PATCH, PATCH // 2 :: PATCH, 0].astype(np.int64)  # (B, h, w)
    gh, gw = centres.shape[1:]
    if self.mode in ("code", "depth"):
      patches = np.zeros((b, gh, gw, D), np.float32)
      if self.mode == "code":
        np.put_along_axis(patches, (centres // 10)[..., None] % (D - 1), 1.0, axis=-1)
      patches[..., D - 1] = centres / 255.0  # the depth code: a linear function of the red channel
    else:
      rng = np.random.default_rng(int(images.astype(np.int64).sum()) % (2**31))
      patches = rng.normal(size=(b, gh, gw, D)).astype(np.float32)
    cls = patches.mean(axis=(1, 2))
    return {"cls": cls[:, None], "patches": patches}


def seg_records(n, num_classes, seed):
  """Images of vertical stripes one patch wide; label map value = stripe class (0 = background)."""
  rng = np.random.default_rng(seed)
  recs = []
  for _ in range(n):
    cells = np.repeat(rng.integers(0, num_classes, size=(1, SIZE // PATCH)), SIZE // PATCH, axis=0)
    mask = np.kron(cells, np.ones((PATCH, PATCH), np.int64)).astype(np.uint8)
    img = np.zeros((SIZE, SIZE, 3), np.uint8)
    img[..., 0] = 10 * mask
    img[..., 1] = rng.integers(0, 256, size=(SIZE, SIZE))  # pixel noise the fake ignores
    recs.append(
      {"image": _png(img), "segmentation": _png(mask), "label": int(np.bincount(mask.ravel()).argmax())}
    )
  return recs


def depth_records(n, seed, gt_size=SIZE, offset_mm=0):
  """Images whose red value v codes a constant depth of 20 * v millimetres (0.2 .. 5 m), plus offset_mm."""
  rng = np.random.default_rng(seed)
  recs = []
  for _ in range(n):
    v = int(rng.integers(10, 250))
    img = np.zeros((gt_size, gt_size, 3), np.uint8)
    img[..., 0] = v
    depth = np.full((gt_size, gt_size), 20 * v + offset_mm, np.uint16)
    depth[0, 0] = 0  # one pixel without depth: not scored
    recs.append({"image": _png(img), "depth": _png(depth)})
  return recs


def splits(train, test):
  return lambda split: {"train": train, "test": test}[split]


def seg_eval(mode="code", seed=0, **kw):
  ev = make_evaluator(
    "lseg",
    {**dict(type="linear_segmentation", dataset="fake", num_classes=5, seed=seed, **FAST), **kw},
    source_fn=splits(seg_records(24, 5, 1), seg_records(16, 5, 2)),
  )
  return ev.run(FakeEncoder(mode))


def test_linear_segmentation_separable_features_reach_100_miou():
  res = seg_eval()
  assert res["lseg/miou"] == pytest.approx(100.0)
  assert res["lseg/pixel_acc"] == pytest.approx(100.0)
  assert res["lseg/num_examples"] == 16 and res["lseg/num_train"] == 24


def test_linear_segmentation_noise_stays_at_chance():
  res = seg_eval("noise")
  assert res["lseg/miou"] < 2 * res["lseg/miou_chance"] < 50.0


def test_linear_segmentation_ignore_index_is_not_scored():
  # reduce_zero_label: stripe class 0 becomes 255 (ignored), classes 1..4 -> 0..3.
  res = seg_eval(reduce_zero_label=True, num_classes=4)
  assert res["lseg/miou"] == pytest.approx(100.0)
  assert res["lseg/num_classes"] == 4


def test_probe_is_deterministic_given_its_seed():
  a, b, c = seg_eval("noise", seed=3), seg_eval("noise", seed=3), seg_eval("noise", seed=4)
  assert a == b
  assert a != c


def test_train_probe_same_seed_same_params():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(20, 4)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  kw = dict(steps=20, lr=0.1, weight_decay=0.0, batch_size=5)
  p1 = probes.train_probe(x, y, 2, probes.classification_loss, seed=1, **kw)
  p2 = probes.train_probe(x, y, 2, probes.classification_loss, seed=1, **kw)
  p3 = probes.train_probe(x, y, 2, probes.classification_loss, seed=2, **kw)
  np.testing.assert_array_equal(np.asarray(p1["w"]), np.asarray(p2["w"]))
  assert not np.array_equal(np.asarray(p1["w"]), np.asarray(p3["w"]))


@pytest.mark.parametrize("gt_size", [SIZE, 48])  # 48: GT larger than the encoder input, scored at 48x48
def test_linear_depth_linear_code_reaches_rmse_near_zero(gt_size):
  ev = make_evaluator(
    "ldepth",
    dict(type="linear_depth", dataset="fake", **FAST),
    source_fn=splits(depth_records(24, 1, gt_size), depth_records(12, 2, gt_size)),
  )
  res = ev.run(FakeEncoder("depth"))
  assert res["ldepth/rmse"] < 0.01  # metres, depths 0.2 .. 5 m (measured: 0.003)
  assert res["ldepth/delta1"] == pytest.approx(100.0)
  assert res["ldepth/num_examples"] == 12


def test_linear_depth_at_its_default_schedule_reaches_far_depths():
  """The default schedule (lr 1e-3, 1,000 steps) on depths of 6-11 m: the bias starts at the mean train
  depth, so the probe fits the linear code (started at 0, AdamW's ~1e-3 a step would leave it near 1 m)."""
  ev = make_evaluator(
    "ldepth",
    dict(type="linear_depth", dataset="fake", image_size=SIZE, batch_size=8),
    source_fn=splits(depth_records(24, 1, offset_mm=6000), depth_records(12, 2, offset_mm=6000)),
  )
  res = ev.run(FakeEncoder("depth"))
  assert res["ldepth/rmse"] < 0.5 and res["ldepth/delta1"] == pytest.approx(100.0), res


def test_linear_depth_noise_is_far_from_the_answer():
  ev = make_evaluator(
    "ldepth",
    dict(type="linear_depth", dataset="fake", **FAST),
    source_fn=splits(depth_records(24, 1), depth_records(12, 2)),
  )
  res = ev.run(FakeEncoder("noise"))
  assert res["ldepth/rmse"] > 0.5


def test_depth_metrics_known_values():
  gt = np.array([[1.0, 2.0], [4.0, 0.0]], np.float32)  # 0 = invalid
  pred = np.array([[1.0, 2.0], [2.0, 9.0]], np.float32)
  m = probes.depth_metrics(pred, gt, 1e-3, 10.0)
  assert m["rmse"] == pytest.approx(np.sqrt(4.0 / 3.0))
  assert m["delta1"] == pytest.approx(2.0 / 3.0)


def test_linear_classification_code_and_noise():
  train, test = seg_records(40, 5, 1), seg_records(20, 5, 2)
  for rec in train + test:  # one class per image: every stripe of class `label`
    mask = np.full((SIZE, SIZE), rec["label"], np.uint8)
    img = np.zeros((SIZE, SIZE, 3), np.uint8)
    img[..., 0] = 10 * mask
    rec["image"] = _png(img)
  cfg = dict(type="linear_classification", dataset="fake", num_classes=5, **FAST)
  good = make_evaluator("lcls", cfg, source_fn=splits(train, test)).run(FakeEncoder("code"))
  assert good["lcls/top1"] == pytest.approx(100.0)
  noise = make_evaluator("lcls", cfg, source_fn=splits(train, test)).run(FakeEncoder("noise"))
  assert noise["lcls/top1"] <= noise["lcls/top1_chance"] + 25.0


def test_read_example_depth_in_metres():
  rec = depth_records(1, 0, 48)[0]
  fields = eval_input.EvalFields(image_size=SIZE, resize="resize", depth=eval_input.DepthSpec())
  ex = eval_input.read_example(rec, fields)
  assert ex["depth"].shape == (SIZE, SIZE) and ex["depth"].dtype == np.float32
  raw = np.asarray(Image.open(io.BytesIO(rec["depth"])))
  assert ex["depth"][10, 10] == pytest.approx(raw[10, 10] / 1000.0)


def test_registry_probes_are_opt_in_in_builtin_suites():
  default = registry.builtin_evals("shapes")
  assert not any(cfg["type"].startswith("linear_") for cfg in default.values())
  probes_only = registry.builtin_evals("shapes", types=["linear_segmentation", "linear_classification"])
  assert sorted(probes_only) == ["shapes_linear_classification", "shapes_linear_segmentation"]
  for name, cfg in probes_only.items():
    registry.make_evaluator(name, cfg)  # every key is known to the evaluator


def _paper_config(name, arg):
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(__file__).resolve().parent.parent / "configs" / name
  spec = importlib.util.spec_from_file_location(f"cfg_{name[:-3]}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


@pytest.mark.parametrize(
  "name,arg,want",
  [
    (
      "tipsv2_g14.py",
      None,
      {"segmentation", "linear_segmentation_voc2012", "linear_segmentation_ade20k", "linear_depth_nyuv2"},
    ),
    ("tipsv2_distill.py", "student=B", {"segmentation", "linear_segmentation_voc2012", "linear_depth_nyuv2"}),
  ],
)
def test_paper_configs_evaluate_the_probes(name, arg, want):
  c = _paper_config(name, arg)
  assert want <= set(c.evals.keys())
  for ev in want - {"segmentation"}:
    make_evaluator(ev, c.evals[ev])  # every key is one the evaluator knows


@pytest.mark.parametrize(
  "change,match",
  [
    (dict(stepz=3), r": \['stepz'\] is not a key"),
    (dict(steps=0), r"\.steps=0 is out of range"),
    (dict(type="linear_segmentation"), r"\.dataset='nyuv2' is a depth benchmark"),
    (dict(split="validation"), r"\.split='validation' is not a split of nyuv2"),
  ],
)
def test_validation_refuses_a_bad_probe_config(change, match):
  """Keys and values when the config validates; a dense benchmark's kind and splits in the checks before
  training (tipsito/evals/config_checks.py `check_evals_on_disk`)."""
  from tipsito.config import validation  # pylint: disable=g-import-not-at-top
  from tipsito.evals import config_checks  # pylint: disable=g-import-not-at-top

  c = _paper_config("tipsv2_distill.py", "student=B")
  c.evals.linear_depth_nyuv2.update(change)
  with pytest.raises(validation.ConfigError, match=r"config\.evals\.linear_depth_nyuv2" + match):
    validation.validate(c)
    config_checks.check_evals_on_disk(c)


class PixelEncoder:
  """Patch tokens = the patch's own pixels (8 x 8 x 3, scaled to [0, 1]) and its row and column (one-hot,
  as a ViT's position embedding); CLS = their mean.

  Why: on a rendered testbed the pixels carry the colour and pattern of each object and the row the
  distance of the ground, so a linear probe on them must beat chance clearly; it checks the whole path from the
  built records (class and depth maps) to the metrics with an encoder whose answer is not given to it.
  """

  def embed_images(self, images, project=False):
    x = np.asarray(images, np.float32) / 255.0
    b, h, w, _ = x.shape
    patches = x.reshape(b, h // PATCH, PATCH, w // PATCH, PATCH, 3).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(b, h // PATCH, w // PATCH, PATCH * PATCH * 3)
    gh, gw = h // PATCH, w // PATCH
    rows = np.broadcast_to(np.eye(gh, dtype=np.float32)[None, :, None, :], (b, gh, gw, gh))
    cols = np.broadcast_to(np.eye(gw, dtype=np.float32)[None, None, :, :], (b, gh, gw, gw))
    patches = np.concatenate([patches, rows, cols], axis=-1)
    return {"cls": patches.mean(axis=(1, 2))[:, None], "patches": patches}


class ConstantEncoder(PixelEncoder):
  """Every patch token the same: a probe on it predicts one value (its bias)."""

  def embed_images(self, images, project=False):
    out = super().embed_images(images, project)
    return {k: np.ones_like(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def scenes_dir(tmp_path_factory):
  from tipsito.data import convert  # pylint: disable=g-import-not-at-top

  path = tmp_path_factory.mktemp("scenes")
  sizes = {"train": 48, "validation": 4, "test": 16}
  convert.convert("scenes", str(path), image_size=32, split_sizes=sizes, num_workers=1, verbose=False)
  return str(path)


def test_probes_on_a_tiny_scenes_build(scenes_dir):
  """The scenes suite's three probes run on the built records and beat chance with pixel features."""
  suite = registry.builtin_evals(
    "scenes",
    types=list(registry.OPT_IN_TYPES),
    data_dir=scenes_dir,
    image_size=SIZE,
    batch_size=16,
    steps=300,
    lr=0.05,
    probe_batch_size=16,
    prepare=False,
  )
  res = {}
  for name, cfg in suite.items():
    res.update(make_evaluator(name, cfg).run(PixelEncoder()))
  assert res["scenes_linear_segmentation/num_examples"] == 16
  assert res["scenes_linear_segmentation/pixel_acc"] > 50.0
  assert res["scenes_linear_segmentation/miou"] > 5 * res["scenes_linear_segmentation/miou_chance"]
  # Depth in metres at the ground truth's resolution: better than the same probe on constant features
  # (which can only learn the mean depth, its bias).
  assert res["scenes_linear_depth/num_examples"] == 16
  depth = "scenes_linear_depth"
  constant = make_evaluator(depth, suite[depth]).run(ConstantEncoder())
  assert res[f"{depth}/rmse"] < 0.9 * constant[f"{depth}/rmse"]
  assert res[f"{depth}/delta1"] > constant[f"{depth}/delta1"]
  assert res["scenes_linear_classification/top1"] > res["scenes_linear_classification/top1_chance"]
  # Issue 42's references: the probe on raw patch pixels (PixelEncoder's tokens hold those pixels, so the
  # two are close) and the best constant per image row, which must beat the mean depth on a ground plane.
  seg = "scenes_linear_segmentation"
  assert res[f"{seg}/raw_pixel_probe/miou"] > 3 * res[f"{seg}/miou_chance"]
  assert abs(res[f"{seg}/raw_pixel_probe/miou"] - res[f"{seg}/miou"]) < 15.0
  assert res[f"{depth}/row_reference_rmse"] < 0.9 * constant[f"{depth}/rmse"]
  assert res[f"{depth}/row_reference_rmse"] == constant[f"{depth}/row_reference_rmse"]  # no features used
  for key in (f"{seg}/miou", f"{depth}/rmse", f"{depth}/row_reference_rmse"):
    assert res[key + "_ci_lo"] <= res[key] <= res[key + "_ci_hi"], key


def test_probes_standalone_cli_on_an_imported_tips_export(tmp_path):
  """`python -m tipsito.evaluate` runs the probes on a real encoder (tiny official-format TIPS weights) and
  writes their metrics into the eval JSON like every other eval."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  from tipsito.data import convert  # pylint: disable=g-import-not-at-top

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  tips = os.path.join(root, "tests", "data", "tips_model")
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=root)
  data = tmp_path / "data"
  sizes = {"train": 16, "test": 8}
  convert.convert("shapes", str(data), config_name="tiny", image_size=28, split_sizes=sizes, verbose=False)
  export = tmp_path / "export"
  cmd = [sys.executable, "-m", "tipsito.export", "--output", str(export)]
  cmd += ["--tips_image_npz", f"{tips}/tiny_vit_mlp_vision.npz", "--tips_text_npz", f"{tips}/tiny_text.npz"]
  subprocess.run(cmd, check=True, cwd=root, env=env, capture_output=True, timeout=300)
  config = tmp_path / "probes_config.py"
  config.write_text(
    "import ml_collections as mlc\n"
    "from tipsito.evals import registry\n"
    "def get_config(arg=None):\n"
    "  c = mlc.ConfigDict()\n"
    f"  c.evals = registry.builtin_evals('shapes/tiny', types=list(registry.OPT_IN_TYPES), data_dir={str(data)!r},\n"
    "                                   image_size=28, batch_size=8, steps=20, prepare=False)\n"
    "  return c\n"
  )
  out_json = tmp_path / "results.json"
  cmd = [sys.executable, "-m", "tipsito.evaluate", "--config", str(config), "--checkpoint", str(export)]
  proc = subprocess.run(
    cmd + ["--output", str(out_json)], cwd=root, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  m = json.loads(out_json.read_text())["metrics"]
  assert m["shapes_linear_segmentation/num_train"] == 16 and m["shapes_linear_segmentation/num_examples"] == 8
  assert 0.0 <= m["shapes_linear_segmentation/miou"] <= 100.0
  assert 0.0 <= m["shapes_linear_classification/top1"] <= 100.0
  assert "shapes_linear_segmentation" in proc.stdout
