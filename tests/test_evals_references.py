"""Location-blind references, the shuffle null, object-only metrics and bootstrap intervals (issue 42).

Why these tests: a dense number is read against references that need no learning, so each reference is
checked against values computed by hand on a 2 x 4 label map; the localisation margin must be 0 for a
model that copies one answer everywhere, about 0 for one that paints each object with a random present
class, and largest for the oracle; intervals must be reproducible and bracket their value.
"""

import numpy as np
import pytest

from tipsito.evals import pictures
from tipsito.evals import probes
from tipsito.evals import references as refs
from tipsito.evals import zeroshot
from tipsito.evals.registry import make_evaluator

# 0 = background; classes 1 (3 pixels, the largest object) and 2 (2 pixels); 255 ignored.
GT = np.array([[0, 1, 1, 2], [0, 1, 2, 255]])
C = 3


def test_reference_confusions_by_hand():
  r = refs.reference_confusions(GT, C, 255, background=0)
  # present_class: object pixels spread over P = {0, 1, 2}; background pixels kept.
  np.testing.assert_allclose(r["present_class"], [[2, 0, 0], [1, 1, 1], [2 / 3, 2 / 3, 2 / 3]])
  # per object: over O = {1, 2}, perfect figure/ground.
  np.testing.assert_allclose(r["present_class_per_object"], [[2, 0, 0], [0, 1.5, 1.5], [0, 1, 1]])
  np.testing.assert_allclose(r["object"], [[0, 0, 0], [0, 1.5, 1.5], [0, 1, 1]])
  assert refs.acc_of(r["present_class"]) == pytest.approx((2 + 1 + 2 / 3) / 7)
  assert refs.acc_of(r["present_class_per_object"]) == pytest.approx((2 + 1.5 + 1) / 7)
  assert refs.acc_of(r["object"]) == pytest.approx(0.5)
  # IoU: background 2 / (2 + 11/3 - 2); class 1: 1 / (3 + 5/3 - 1); class 2: (2/3) / (2 + 5/3 - 2/3).
  assert refs.miou_of(r["present_class"]) == pytest.approx((6 / 11 + 3 / 11 + 2 / 9) / 3)
  assert refs.miou_of(r["object"]) == pytest.approx((1.5 / 4 + 1 / 3.5) / 2)
  # The non-largest object is class 2.
  np.testing.assert_array_equal(refs.nonlargest_rows(GT, C, 255, 0), [False, False, True])


def test_shuffle_null_by_hand_and_a_copy_model_is_its_own_null():
  pred = np.array([[0, 1, 2, 2], [0, 1, 1, 0]])  # object pixels predicted 1, 2, 1 (class 1), 2, 1 (class 2)
  cm = refs.object_confusion(pred, GT, C, 255, 0)
  np.testing.assert_array_equal(cm, [[0, 0, 0], [0, 2, 1], [0, 1, 1]])
  null = refs.shuffle_null_confusion(pred, GT, C, 255, 0)  # outer(n, m) / N, n = m = (3, 2), N = 5
  np.testing.assert_allclose(null, [[0, 0, 0], [0, 9 / 5, 6 / 5], [0, 6 / 5, 4 / 5]])
  assert refs.acc_of(null) == pytest.approx(13 / 25)
  copy = np.full_like(GT, 2)
  np.testing.assert_allclose(
    refs.shuffle_null_confusion(copy, GT, C, 255, 0), refs.object_confusion(copy, GT, C, 255, 0)
  )
  assert refs.shuffle_null_confusion(np.zeros((1, 2)), np.array([[0, 255]]), C, 255, 0).sum() == 0


def test_batched_metrics_equal_the_split_metric():
  from tipsito.evals import metrics  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  cms = rng.integers(0, 5, size=(4, 6, 6)).astype(float)
  cms[2, 3] = 0
  cms[2, :, 3] = 0
  for cm, miou, acc, mean in zip(cms, refs.miou_of(cms), refs.acc_of(cms), refs.mean_acc_of(cms)):
    want = metrics.miou_from_confusion(cm)
    assert (miou, acc, mean) == pytest.approx((want["miou"], want["pixel_acc"], want["mean_acc"]))


def test_bootstrap_is_reproducible_brackets_its_value_and_sparse_equals_dense(monkeypatch):
  rng = np.random.default_rng(1)
  values = rng.random(300) < 0.3
  m, lo, hi = refs.mean_interval(values)
  assert m == pytest.approx(values.mean()) and lo < m < hi
  assert (m, lo, hi) == refs.mean_interval(values)  # fixed seed
  assert hi - lo == pytest.approx(2 * 1.96 * np.sqrt(0.3 * 0.7 / 300), rel=0.2)  # the normal approximation
  assert np.isnan(refs.mean_interval(values, resamples=0)[1])

  def run():
    per = refs.PerImage()
    for i in range(40):
      per.add(cm=rng_cm(i))
    return refs.bootstrap(per, lambda s: {"miou": refs.miou_of(s["cm"])}, 200)

  def rng_cm(i):
    return np.random.default_rng(i).integers(0, 3, size=(8, 8))

  dense = run()
  monkeypatch.setattr(refs.PerImage, "DENSE_CELLS", 0)  # every statistic as CSR rows
  np.testing.assert_allclose(run()["miou"], dense["miou"], rtol=1e-12)


# ------------------------------------------------------------------------------------------ the evaluator
D, PATCH, K = 16, 8, 5  # 0 = background, 1..4 objects
NAMES = [f"thing #{c}" for c in range(K)]


def _onehot(idx):
  return np.eye(D, dtype=np.float32)[np.asarray(idx) % D]


class MapEncoder:
  """Red channel = 10 * class per 8-px patch. 'truth': each patch its class; 'copy': every patch the
  image's CLS class; 'per_object': each object class of the image replaced by a random object class
  present in it (seeded by the image), background kept."""

  tokenizer = "fake"
  image_config = {"patch_size": PATCH}

  def __init__(self, mode):
    self.mode = mode

  def embed_images(self, images, project=False, values=True):
    x = np.asarray(images)
    cls_map = x[:, PATCH // 2 :: PATCH, PATCH // 2 :: PATCH, 0].astype(np.int64) // 10
    out_map = cls_map.copy()
    for b in range(x.shape[0]):
      present = [c for c in np.unique(cls_map[b]) if c != 0]
      rng = np.random.default_rng(int(x[b].sum()) + 7 * b)
      if self.mode == "copy":
        out_map[b] = cls_map[b, 0, -1]
      elif self.mode == "per_object" and present:
        table = np.zeros(K, np.int64)  # background stays 0
        table[present] = rng.choice(present, size=len(present))
        out_map[b] = table[cls_map[b]]
    cls = _onehot(cls_map[:, 0, -1])
    return {"cls": cls[:, None], "values": _onehot(out_map), "patches": _onehot(out_map)}

  def embed_texts(self, texts):
    return _onehot([int(t.split("#")[1]) for t in texts])


def block_records(n, seed=0, size=32):
  """Images of 4 one-patch-wide columns of classes in [0, K) (bilinear upsampling reproduces columns
  exactly; 2-D corners would not be)."""
  rng = np.random.default_rng(seed)
  recs = []
  for _ in range(n):
    blocks = rng.integers(0, K, size=(1, 4))
    mask = np.kron(blocks, np.ones((size, size // 4), np.int64)).astype(np.uint8)
    img = np.zeros((size, size, 3), np.uint8)
    img[..., 0] = 10 * mask
    recs.append({"image": img, "segmentation": mask})
  return recs


def run_eval(mode, n=60, **kw):
  cfg = dict(type="segmentation", dataset="fake", batch_size=20, image_size=32, class_names=NAMES)
  cfg.update(background_index=0, templates="identity", bootstrap=200, global_copy=False)
  cfg.update(kw)
  recs = block_records(n)
  ev = make_evaluator("seg", cfg, source_fn=lambda split: recs)
  return ev, ev.run(MapEncoder(mode)), recs


def test_margin_is_zero_for_location_blind_models_and_largest_for_the_oracle():
  _, oracle, recs = run_eval("truth")
  _, copy, _ = run_eval("copy")
  _, per_object, _ = run_eval("per_object")
  for prefix in ("", "patches/"):
    for m in ("object_miou", "object_acc"):
      assert copy[f"seg/{prefix}margin/{m}"] == pytest.approx(0.0, abs=1e-9)
      rand = per_object[f"seg/{prefix}margin/{m}"]
      # 0 in expectation (references.py); on 60 images its sampling error is a few points, and the
      # interval must say so by holding 0.
      assert abs(rand) < 6.0, (prefix, m, rand)
      assert per_object[f"seg/{prefix}margin/{m}_ci_lo"] <= 0.0 <= per_object[f"seg/{prefix}margin/{m}_ci_hi"]
      assert oracle[f"seg/{prefix}margin/{m}"] > max(copy[f"seg/{prefix}margin/{m}"], rand) + 30.0
    assert oracle[f"seg/{prefix}object_acc"] == pytest.approx(100.0)
  # The oracle's null by hand: sum over images of sum_g n_g^2 / N, over the object pixels of the split.
  num = den = 0.0
  for r in recs:
    g = r["segmentation"][r["segmentation"] > 0]
    if g.size:
      n = np.bincount(g, minlength=K).astype(float)
      num, den = num + (n**2).sum() / g.size, den + g.size
  assert oracle["seg/shuffle_null/object_acc"] == pytest.approx(100 * num / den)
  assert oracle["seg/margin/object_acc"] == pytest.approx(100 - 100 * num / den)  # the most a model can get
  # The random per-object model scores its own reference on the object pixels (in expectation).
  assert per_object["seg/object_acc"] == pytest.approx(
    per_object["seg/present_class_per_object/object_acc"], abs=6
  )


def test_references_are_the_sum_of_the_hand_rules_and_intervals_sit_beside_every_key():
  _, res, recs = run_eval("truth", n=20)
  total = np.zeros((K, K))
  for r in recs:
    total += refs.reference_confusions(r["segmentation"], K, 255, 0)["present_class"]
  assert res["seg/present_class/miou"] == pytest.approx(100 * refs.miou_of(total))
  assert res["seg/present_class/pixel_acc"] == pytest.approx(100 * refs.acc_of(total))
  for key in [k for k in res if k.startswith(("seg/object_", "seg/margin/", "seg/present_class"))]:
    if not key.endswith(("_ci_lo", "_ci_hi")):
      assert res[key + "_ci_lo"] <= res[key] + 1e-9 <= res[key + "_ci_hi"] + 2e-9, key
  assert res["seg/miou_ci_lo"] <= res["seg/miou"] <= res["seg/miou_ci_hi"]


def test_object_only_prediction_never_answers_background():
  """A model whose object patches all score 'background' highest: the all-pixel numbers count it wrong,
  the object-only prediction takes its best object class instead."""

  class BackgroundFirst(MapEncoder):
    def embed_images(self, images, project=False, values=True):
      out = super().embed_images(images, project, values)
      for k in ("values", "patches"):
        out[k] = out[k] * 0.5 + _onehot(np.zeros(out[k].shape[:3], int))  # background wins, truth second
      return out

  ev, res, _ = run_eval("truth", n=10)
  bg = make_evaluator("seg", ev.cfg, source_fn=lambda s: block_records(10)).run(BackgroundFirst("truth"))
  assert bg["seg/object_acc"] == pytest.approx(100.0) and bg["seg/nonlargest_acc"] == pytest.approx(0.0)
  assert res["seg/object_acc"] == pytest.approx(100.0)


# ------------------------------------------------------------------------------------------ other columns
def test_zeroshot_present_class_by_hand():
  seg = np.array([[0, 1, 1], [3, 3, 255]])  # classes 0 and 2 present (values 1 and 3)
  assert zeroshot.present_class_top1(seg, 2, num_classes=4) == pytest.approx(0.5)
  assert zeroshot.present_class_top1(seg, 1, num_classes=4) == 0.0
  assert zeroshot.present_class_top1(np.array([[1]]), 0, num_classes=4) == 1.0


def test_depth_row_reference_by_hand():
  d = np.array([[[1.0, 3.0], [5.0, 0.0]], [[2.0, 2.0], [7.0, 20.0]]])  # 0 and 20 m are not valid
  np.testing.assert_allclose(probes.row_profile(d, 1e-3, 10.0), [2.0, 6.0])
  np.testing.assert_allclose(probes.row_reference_map(np.array([2.0, 6.0]), (2, 3)), [[2.0] * 3, [6.0] * 3])
  np.testing.assert_allclose(probes.row_reference_map(np.array([2.0, 6.0]), (4, 1))[:, 0], [2, 3, 5, 6])


def test_raw_patches_are_the_cells_pixels():
  img = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(1, 4, 4, 3)
  raw = probes.raw_patches(img, (2, 2))
  assert raw.shape == (1, 2, 2, 12)
  np.testing.assert_allclose(raw[0, 1, 0], img[0, 2:4, 0:2].reshape(-1) / 255.0)


# ------------------------------------------------------------------------------------------ pictures
def test_scenes_classes_are_drawn_in_their_colour_and_pattern():
  from tipsito.data.builders import scenes_gen  # pylint: disable=g-import-not-at-top

  names = ["background"] + list(scenes_gen.CLASSES)
  looks = pictures.class_looks(names, 0)
  red_stripes = names.index("red stripes")
  assert looks[red_stripes] == (scenes_gen.COLOURS["red"], "stripes")
  assert pictures.class_looks(["background", "cat"], 0) is None
  tile = pictures.textured(np.full((24, 24), red_stripes, np.uint8), looks, len(names))
  colours = {tuple(c) for c in tile.reshape(-1, 3)}
  assert colours == {scenes_gen.COLOURS["red"], scenes_gen.PATTERN_LIGHT}
  for pattern in scenes_gen.PATTERNS:  # every pattern shows both of its colours
    assert 0.1 < pictures.hatch(pattern, (24, 24)).mean() < 0.9


def test_overlay_has_a_caption_row_with_the_references():
  ev, res, _ = run_eval("truth", n=4, num_pictures=2)
  fig = ev.pictures["seg/overlay"]
  from tipsito.evals import segmentation  # pylint: disable=g-import-not-at-top

  lines = segmentation.caption_lines(res, "seg")
  assert any("present class" in line and "per object" in line for line in lines)
  assert any("margin" in line and "shuffle null" in line for line in lines)
  assert f"{res['seg/present_class/miou']:.1f}" in " ".join(lines)
  rows_only = pictures.segmentation_figure([fig[:10]], NAMES, [0, 1], K)  # no caption: shorter
  assert fig.shape[0] > 2 * pictures.MIN_PANEL and rows_only.shape[0] < fig.shape[0]


def test_zeroshot_eval_reports_its_present_class_reference_with_intervals():
  recs = block_records(12)
  for r in recs:  # the label: the class of the top-right patch, which MapEncoder's CLS names (0 = none)
    r["label"] = max(int(r["segmentation"][0, -1]) - 1, 0)
  cfg = dict(type="zeroshot", dataset="fake", batch_size=4, image_size=32, templates="identity")
  cfg.update(class_names=[f"thing #{c + 1}" for c in range(K - 1)], present_class=True, bootstrap=200)
  res = make_evaluator("zs", cfg, source_fn=lambda split: recs).run(MapEncoder("truth"))
  want = np.mean([zeroshot.present_class_top1(r["segmentation"], r["label"], K - 1) for r in recs])
  assert res["zs/present_class"] == pytest.approx(100 * want)
  assert res["zs/present_class_ci_lo"] <= res["zs/present_class"] <= res["zs/present_class_ci_hi"]
  assert res["zs/top1_ci_lo"] <= res["zs/top1"] <= res["zs/top1_ci_hi"]


def test_printed_tables_fold_each_interval_into_its_value():
  from tipsito import evaluate  # pylint: disable=g-import-not-at-top
  from tipsito.evals import runner  # pylint: disable=g-import-not-at-top
  from tipsito.evals import segmentation  # pylint: disable=g-import-not-at-top

  res = {"a/x": 1.0, "a/x_ci_lo": 0.5, "a/x_ci_hi": 1.5, "a/n": 3.0, "a/y_ci_lo": 2.0}
  assert runner.with_intervals_folded(res) == [
    ("a/x", "1.00 [0.50, 1.50]"),
    ("a/n", "3.00"),
    ("a/y_ci_lo", "2.00"),
  ]
  assert "1.00 [0.50, 1.50]" in evaluate.format_table(res)
  with pytest.raises(ValueError, match="bootstrap=-1 is out of range"):
    segmentation.resolve_config(dict(type="segmentation", bootstrap=-1))
