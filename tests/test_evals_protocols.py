"""Zero-shot segmentation benchmarks (ade150, pc59, pc60, voc21): what is scored, at which size, how.

Why: a segmentation number is only comparable with the papers' when the class list, the ignored labels,
the background rule, the resize rule and the window averaging are theirs. Each test builds label maps
and patch features whose confusion matrix is written out by hand here, so a change to any of these rules
changes a count. The fake encoders read a code from the red channel at each patch centre (or average a
patch's colours, like a pooling model) and return chosen feature vectors; their texts are looked up by
the exact prompt string, so the class order and the prompts are checked too.
"""

import numpy as np
import pytest

from tipsito.config import defaults
from tipsito.config import validation
from tipsito.data import eval_input
from tipsito.evals import class_names
from tipsito.evals.registry import make_evaluator
from tipsito.evals.registry import make_evaluators
from tipsito.evals.runner import run_all
from tipsito.evals import segmentation
from tipsito.evals import templates

P = 8  # the fakes' patch size
TCL = templates.TCL9


def unit(v):
  v = np.asarray(v, np.float64)
  return v / np.linalg.norm(v)


class CodeEncoder:
  """Stand-in for tipsito.inference.Encoder: value at a patch = `vectors[red at the patch centre]`.

  Texts: `text[prompt]` for every prompt the evaluator may build (a KeyError names a wrong prompt).
  Inputs must be patch multiples (the evaluator resizes them); their shapes are recorded.
  """

  image_config = {"patch_size": P}
  tokenizer = "fake"  # strings are accepted

  def __init__(self, text, vectors, dim):
    self.text = text
    self.vectors = vectors
    self.dim = dim
    self.shapes = []

  def features(self, images):
    codes = images[:, P // 2 :: P, P // 2 :: P, 0].astype(np.int64)
    zero = np.zeros(self.dim)
    return np.stack([[[self.vectors.get(int(c), zero) for c in row] for row in img] for img in codes])

  def embed_images(self, images, project=False, values=True):
    images = np.asarray(images)
    assert images.shape[1] % P == 0 and images.shape[2] % P == 0, images.shape
    self.shapes.append(images.shape)
    v = self.features(images).astype(np.float32)
    return {"cls": np.zeros((len(images), 1, self.dim), np.float32), "patches": v, "values": v}

  def embed_texts(self, texts):
    return np.stack([self.text[t] for t in texts]).astype(np.float32)


def onehot_setup(names, prompts=TCL):
  """Orthonormal class text embeddings: e_i for class i (one spare dimension); every template alike."""
  dim = len(names) + 1
  eye = np.eye(dim)
  return {t.format(n): eye[i] for i, n in enumerate(names) for t in prompts}, eye, dim


def stripes(columns, height, width, vertical=True):
  """(height, width) uint8 map of equal stripes with the given values (left to right / top to bottom)."""
  n = len(columns)
  idx = (np.arange(width if vertical else height) * n) // (width if vertical else height)
  line = np.asarray(columns, np.uint8)[idx]
  return np.tile(line, (height, 1)) if vertical else np.tile(line[:, None], (1, width))


def rgb(red):
  img = np.zeros(red.shape + (3,), np.uint8)
  img[..., 0] = red
  return img


def source_of(records):
  return lambda split: records


# ------------------------------------------------------------------------------------------- helpers
def test_bilinear_taps_are_half_pixel_and_clamped():
  # 2 -> 8: source x = (i + 0.5) / 4 - 0.5, clamped at 0; index clamped at 1 (PyTorch's bilinear).
  i0, i1, f = segmentation.bilinear_taps(2, 8)
  np.testing.assert_array_equal(i0, [0, 0, 0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(i1, [1, 1, 1, 1, 1, 1, 1, 1])
  np.testing.assert_allclose(f, [0, 0, 0.125, 0.375, 0.625, 0.875, 0.125, 0.375])
  x = np.array([[[0.0], [8.0]]])  # (1, 2, 1): resampled along width
  out = np.asarray(segmentation.resize_bilinear(x, (1, 8)))[0, :, 0]
  np.testing.assert_allclose(out, [0, 0, 1, 3, 5, 7, 8, 8])


def test_window_boxes_follow_the_notebook_grid():
  # A 448 x 597 image, 448 windows every 336 px: the second window is moved back to end at 597.
  assert segmentation.window_boxes(448, 597, 448, 336) == [(0, 0, 448, 448), (0, 149, 448, 597)]
  assert segmentation.window_boxes(10, 10, 4, 3) == [
    (y, x, y + 4, x + 4) for y in (0, 3, 6) for x in (0, 3, 6)
  ]
  assert segmentation.window_boxes(3, 5, 4, 2) == [(0, 0, 3, 4), (0, 1, 3, 5)]  # clipped to the image


# ------------------------------------------------------------------------------------------- schema
def test_benchmarks_define_classes_background_and_sizes():
  expect = {
    "ade150": (150, None, True),
    "pc59": (59, None, True),
    "pc60": (60, 0, False),
    "voc21": (21, 0, False),
  }
  for name, (n, bg, reduce0) in expect.items():
    cfg = segmentation.resolve_config(dict(type="segmentation", dataset="d", benchmark=name))
    assert len(cfg["class_names"]) == n and cfg["background_index"] == bg, name
    assert cfg["reduce_zero_label"] is reduce0 and cfg["ignore_index"] == 255
    assert cfg["resize"] == "short_side" and cfg["image_size"] == 448
    assert (cfg["crop_size"], cfg["stride"]) == (448, 336) and cfg["protocol"] == "whole"
    if bg is not None:
      assert cfg["class_names"][bg] == "background"
  assert segmentation.resolve_config(dict(benchmark="ade150"))["class_names"] == list(class_names.ADE150)
  assert class_names.PC60[1:] == class_names.PC59 and class_names.VOC21[1:] == class_names.VOC20
  # Overridable: the short side, the protocol and its windows.
  cfg = segmentation.resolve_config(dict(benchmark="pc59", image_size=336, protocol="slide", stride=224))
  assert (cfg["image_size"], cfg["protocol"], cfg["stride"], cfg["crop_size"]) == (336, "slide", 224, 448)


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(benchmark="ade20k"), "benchmark='ade20k'"),
    (dict(benchmark="ade150", class_names=["a"]), r"defines \['class_names'\]"),
    (
      dict(benchmark="pc60", background_index=1, reduce_zero_label=True),
      r"defines \['background_index', 'reduce_zero_label'\]",
    ),
    (dict(benchmark="voc21", resize="resize"), "defines"),
    (dict(benchmark="ade150", bg_threshold=0.3), "no background class"),
    (dict(protocol="ade150"), "protocol='ade150'"),
    (dict(resize="squash"), "resize='squash'"),
    (dict(stride=0), "stride=0"),
  ],
)
def test_wrong_segmentation_configs_fail_early(bad, match):
  with pytest.raises(ValueError, match=match):
    segmentation.resolve_config(bad)
  with pytest.raises(ValueError, match=match):
    make_evaluator("seg", dict(type="segmentation", dataset="d", **bad))
  c = defaults.base_config("clip", "tiny/16", total_steps=10, batch_size=8)
  c.evals.seg = dict(type="segmentation", dataset="d", **bad)
  with pytest.raises(validation.ConfigError, match="config.evals.seg"):
    validation.validate(c)
  c.evals.seg.enabled = False  # disabled evals are not built, so not checked
  validation.validate(c)


# --------------------------------------------------------------------------------------- benchmarks
def run_benchmark(name, records, enc, **kw):
  cfg = dict(type="segmentation", dataset="fake", benchmark=name, image_size=8, batch_size=2, num_workers=1)
  cfg.update(kw)
  ev = make_evaluator("seg", cfg, source_fn=source_of(records))
  return ev, ev.run(enc)


def test_ade150_ignores_0_and_255_keeps_the_aspect_and_scores_at_label_size():
  names = class_names.ADE150
  text, eye, dim = onehot_setup(names)
  # Label map 16 x 48 (raw ADE values: v = class v - 1, 0 = "other"), image short side -> 8 (8 x 24).
  label = stripes([1, 3, 13], 16, 48)  # wall | sky | person
  label[:4] = 255  # ignored rows
  label[12:, 32:] = 0  # "other": ignored too
  # Predicted classes per patch, coded in red: wall, sky, and "ceiling" (5) where the GT is person.
  image = rgb(stripes([10, 12, 14], 16, 48))
  enc = CodeEncoder(text, {10: eye[0], 12: eye[2], 14: eye[5]}, dim)
  ev, res = run_benchmark("ade150", [{"image": image, "segmentation": label}], enc)
  assert enc.shapes == [(2, 8, 24, 3)]  # aspect kept (48/16 = 24/8), padded batch of 2
  cm = np.zeros((150, 150), np.int64)  # rows GT, columns prediction, pixels of the 16 x 48 map
  cm[0, 0] = 12 * 16  # wall, rows 4-15
  cm[2, 2] = 12 * 16  # sky
  cm[12, 5] = 8 * 16  # person predicted as ceiling, rows 4-11 (12-15 are "other")
  np.testing.assert_array_equal(ev.last_confusion, cm)
  # IoU: wall 1, sky 1, person 0, ceiling 0; the 146 classes absent from GT and prediction don't count.
  assert res["seg/miou"] == pytest.approx(100 * (1 + 1 + 0 + 0) / 4)
  assert res["seg/pixel_acc"] == pytest.approx(100 * 384 / 512)
  assert res["seg/num_classes"] == 150


def test_pc59_ignores_background_and_pc60_scores_it():
  text59, eye59, dim59 = onehot_setup(class_names.PC59)
  text60, eye60, dim60 = onehot_setup(class_names.PC60)
  # One 32 x 16 portrait map (short side 16 -> 8: image 16 x 8, a 2 x 1 patch grid); raw PASCAL
  # Context values: 0 background, v = PC59[v - 1]; 255 void. Horizontal stripes: background | cat.
  label = stripes([0, 8], 32, 16, vertical=False)
  label[:, :2] = 255
  image = rgb(stripes([20, 21], 32, 16, vertical=False))
  # The background patch looks like "sky" (PC59 index 49) to the model; the cat patch like a cat.
  enc59 = CodeEncoder(text59, {20: eye59[49], 21: eye59[7]}, dim59)
  ev, res = run_benchmark("pc59", [{"image": image, "segmentation": label}], enc59)
  assert enc59.shapes == [(2, 16, 8, 3)]
  cm = np.zeros((59, 59), np.int64)
  cm[7, 7] = 16 * 14  # cat rows 16-31, columns 2-15; the background rows are ignored
  np.testing.assert_array_equal(ev.last_confusion, cm)
  assert res["seg/miou"] == 100.0 and res["seg/pixel_acc"] == 100.0
  # pc60: background is class 0 and is scored; the same "sky"-looking patch is a miss.
  enc60 = CodeEncoder(text60, {20: eye60[50], 21: eye60[8]}, dim60)
  ev, res = run_benchmark("pc60", [{"image": image, "segmentation": label}], enc60)
  cm = np.zeros((60, 60), np.int64)
  cm[0, 50] = 16 * 14  # background predicted as sky
  cm[8, 8] = 16 * 14
  np.testing.assert_array_equal(ev.last_confusion, cm)
  assert res["seg/miou"] == pytest.approx(100 * (0 + 0 + 1) / 3)  # background, sky, cat
  assert res["seg/pixel_acc"] == pytest.approx(50.0)
  # The background is prompted with its name, like every class (a missing prompt is a KeyError).
  assert ev.seg_class_names()[0] == "background"


def test_voc21_background_prompted_or_thresholded():
  text, eye, dim = onehot_setup(class_names.VOC21)
  # 16 x 48 -> 8 x 24: background | dog (12) | background, 255 on the border column.
  label = stripes([0, 12, 0], 16, 48)
  label[:, -1] = 255
  image = rgb(stripes([30, 31, 32], 16, 48))
  vectors = {30: eye[0], 31: eye[12], 32: unit(eye[0] + 4 * eye[15])}  # last patch: rather "person"
  ev, res = run_benchmark("voc21", [{"image": image, "segmentation": label}], CodeEncoder(text, vectors, dim))
  cm = np.zeros((21, 21), np.int64)
  cm[0, 0] = 16 * 16
  cm[12, 12] = 16 * 16
  cm[0, 15] = 16 * 15  # the right background stripe (minus the void column) taken for a person
  np.testing.assert_array_equal(ev.last_confusion, cm)
  assert res["seg/miou"] == pytest.approx(100 * (256 / (256 + 240) + 1 + 0) / 3)
  # TCL's convention: background not prompted, constant score 0.5; cosines 1 (dog), 0.97 (person) win,
  # the all-zero feature of the first stripe scores 0 < 0.5 -> background.
  vectors = {30: np.zeros(dim), 31: eye[12], 32: unit(eye[0] + 4 * eye[15])}
  prompts = {k: v for k, v in text.items() if "background" not in k}  # a background prompt -> KeyError
  ev, res = run_benchmark(
    "voc21", [{"image": image, "segmentation": label}], CodeEncoder(prompts, vectors, dim), bg_threshold=0.5
  )
  np.testing.assert_array_equal(ev.last_confusion, cm)  # same confusion, other route


def test_slide_averages_softmax_probabilities_not_cosines():
  # Crafted: two 8 x 16 windows over an 8 x 24 image overlap on x in [8, 16). The fake sees the whole
  # window (like a transformer): window A (marker 201 on the left) gives every patch the cosines a,
  # window B (marker 202 on the right) the cosines b.
  a = np.array([0.4, -0.6, 0.6])
  b = np.array([-0.3, 0.6, -0.7])
  softmax = lambda v: np.exp(v) / np.exp(v).sum()
  assert np.argmax((a + b) / 2) == 0  # averaging cosines would say class 0 in the overlap,
  assert np.argmax((softmax(a) + softmax(b)) / 2) == 1  # averaging probabilities says class 1
  eye = np.eye(4)
  names = ["thing #0", "thing #1", "thing #2"]
  text = {n: eye[i] for i, n in enumerate(names)}

  class WindowContext(CodeEncoder):
    def features(self, images):
      out = []
      for img in images:
        cos = a if (img[..., 0] == 201).any() else b if (img[..., 0] == 202).any() else np.zeros(3)
        f = np.concatenate([cos, [np.sqrt(max(0.0, 1 - cos @ cos))]])  # unit: cosines = first 3 dims
        out.append(np.broadcast_to(f, (img.shape[0] // P, img.shape[1] // P, 4)))
      return np.stack(out)

  image = rgb(stripes([201, 200, 202], 8, 24))
  label = stripes([2, 1, 1], 8, 24)  # A alone: argmax a = 2; overlap: 1 (softmax); B alone: 1
  ev = make_evaluator(
    "seg",
    dict(
      type="segmentation",
      dataset="fake",
      class_names=names,
      background_index=None,
      resize="short_side",
      image_size=8,
      protocol="slide",
      crop_size=16,
      stride=8,
      batch_size=2,
      templates="identity",
    ),
    source_fn=source_of([{"image": image, "segmentation": label}]),
  )
  enc = WindowContext(text, {}, 4)
  res = ev.run(enc)
  assert enc.shapes == [(2, 8, 16, 3)]  # the two windows in one batch
  cm = np.zeros((3, 3), np.int64)
  cm[2, 2] = 64
  cm[1, 1] = 128
  np.testing.assert_array_equal(ev.last_confusion, cm)
  assert res["seg/miou"] == 100.0
  # (with cosine averaging the overlap would be class 0: cm[1, 0] = 64, mIoU (0 + 0.5 + 1) / 3)


def test_inputs_are_resized_to_patch_multiples_so_scores_align():
  # A pooling model (value = mean colour of the patch, zero padding like the real tower's centre pad)
  # at patch 16 on 36 px images: fed as is, the tower pads 6 px each side and the 3 patch scores,
  # upsampled over 36 px, are shifted against the pixels; resized to 48 px first they are not.
  class Pooling:
    image_config = {"patch_size": 16}
    tokenizer = "fake"

    def embed_images(self, images, project=False, values=True):
      x = np.asarray(images, np.float64) / 255.0
      ph, pw = -x.shape[1] % 16, -x.shape[2] % 16
      x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
      b, h, w, _ = x.shape
      v = x.reshape(b, h // 16, 16, w // 16, 16, 3).mean((2, 4)).astype(np.float32)
      return {"cls": np.zeros((b, 1, 3), np.float32), "patches": v, "values": v}

    def embed_texts(self, texts):
      return np.stack([np.eye(3)[int(t[-1])] for t in texts]).astype(np.float32)

  label = stripes([0, 1, 2], 36, 36)
  image = np.zeros((36, 36, 3), np.uint8)
  for c in range(3):
    image[..., c] = 255 * (label == c)
  ev = make_evaluator(
    "seg",
    dict(
      type="segmentation",
      dataset="fake",
      image_size=36,
      batch_size=1,
      class_names=["thing #0", "thing #1", "thing #2"],
      background_index=None,
      templates="identity",
    ),
    source_fn=source_of([{"image": image, "segmentation": label}]),
  )
  res = ev.run(Pooling())
  assert res["seg/miou"] == 100.0 and res["seg/pixel_acc"] == 100.0
  assert segmentation.to_patch_multiple(image, 16).shape == (48, 48, 3)


# ------------------------------------------------------------------------------ the oracle (issue 25)
class Oracle(CodeEncoder):
  """Value embedding of every patch = the text embedding of its ground-truth class.

  Each prompt has its own random embedding; a class's text embedding is the mean of its normalised
  prompt embeddings, renormalised (computed here, not by the evaluator). The red channel of a patch is
  its raw label; raw labels that are not a class (ignored ones) get an unrelated random vector.
  """

  def __init__(self, names, class_of_raw, dim=256, seed=0, background_prompted=True):
    rng = np.random.default_rng(seed)
    prompts = {t.format(n): rng.normal(size=dim) for n in names for t in TCL}
    class_emb = {i: unit(np.mean([unit(prompts[t.format(n)]) for t in TCL], 0)) for i, n in enumerate(names)}
    vectors = {raw: class_emb[c] for raw, c in class_of_raw.items() if c is not None}
    for raw, c in class_of_raw.items():
      if c is None:
        vectors[raw] = rng.normal(size=dim)  # not a class: anything
    if not background_prompted:  # TCL threshold: background has no text; its patches have no feature
      prompts = {k: v for k, v in prompts.items() if "background" not in k}
      vectors[0] = np.zeros(dim)
    super().__init__(prompts, vectors, dim)


def oracle_records(raw_labels, ignore_raw, scale, seed=0, alternate_background=False):
  """Patch-aligned maps of several shapes and orientations (8 * scale label px per 8 px patch after the
  short-side resize to 8): stripes of random raw labels, some stripes and a border of ignored labels."""
  rng = np.random.default_rng(seed)
  recs = []
  for i, (h, w, vertical) in enumerate(
    [(1, 3, True), (3, 1, False), (1, 1, True), (1, 4, True), (2, 1, False)]
  ):
    h, w = 8 * scale * h, 8 * scale * w
    n = (w if vertical else h) // (8 * scale)
    cols = rng.choice(raw_labels, size=n)
    if alternate_background:
      cols[::2] = 0
    if i == 3:
      cols[1] = ignore_raw[0]  # a whole ignored stripe (the oracle gives it a random feature)
    label = stripes(cols, h, w, vertical)
    label[-1, :] = ignore_raw[-1]  # an ignored bottom row
    recs.append({"image": rgb(label), "segmentation": label})
  return recs


@pytest.mark.parametrize(
  "bench, protocol, extra",
  [
    ("ade150", "whole", {}),
    ("ade150", "slide", dict(crop_size=16, stride=8)),
    ("pc60", "whole", {}),  # background prompted
    ("voc21", "slide", dict(crop_size=16, stride=8)),
    ("voc21", "whole", dict(bg_threshold=0.5)),
    ("pc60", "slide", dict(crop_size=16, stride=8, bg_threshold=0.5)),
  ],
)
def test_oracle_scores_100_through_the_training_eval_path(monkeypatch, bench, protocol, extra):
  names = segmentation.BENCHMARKS[bench].class_names
  if bench in ("ade150", "pc59"):  # raw v = class v - 1; 0 and 255 ignored
    class_of_raw = {v: v - 1 for v in range(1, len(names) + 1)}
    class_of_raw.update({0: None, 255: None})
    raw, ignore = list(range(1, len(names) + 1)), [0, 255]
  else:  # raw v = class v, 0 = background (scored); 255 ignored
    class_of_raw = {v: v for v in range(len(names))}
    class_of_raw[255] = None
    raw, ignore = list(range(len(names))), [255]
  thresholded = "bg_threshold" in extra
  # 'whole': label maps twice the resized image (scores upsampled straight to them). 'slide': at the
  # image's size, since there the averaged probabilities are resampled a second time (image -> label
  # map, as in the TIPS notebook), which can move a boundary by one label pixel when the map is larger.
  records = oracle_records(
    raw[1:] if thresholded else raw, ignore, 2 if protocol == "whole" else 1, alternate_background=thresholded
  )
  # The path training uses: config.evals -> make_evaluators -> run_all; only the record reader is faked.
  monkeypatch.setattr(eval_input, "open_records", lambda *a, **k: (records, None))
  config = {
    "evals": {
      "zs_seg": dict(
        type="segmentation",
        benchmark=bench,
        dataset="fake",
        split="validation",
        image_size=8,
        batch_size=2,
        num_workers=1,
        protocol=protocol,
        **extra,
      )
    }
  }
  enc = Oracle(names, class_of_raw, background_prompted=not thresholded)
  metrics, _ = run_all(make_evaluators(config), enc)
  assert metrics["zs_seg/miou"] == pytest.approx(100.0)
  assert metrics["zs_seg/pixel_acc"] == pytest.approx(100.0)
  assert metrics["zs_seg/num_examples"] == 5 and metrics["zs_seg/num_classes"] == len(names)
  if protocol == "whole":  # aspect kept: 8 x 24, 24 x 8, 8 x 8, 8 x 32, 16 x 8, one queue per shape
    assert sorted({s[1:3] for s in enc.shapes}) == [(8, 8), (8, 24), (8, 32), (16, 8), (24, 8)]


def test_many_shapes_flush_early_and_count_every_example_once():
  # 'whole' keeps one queue per input shape; with many shapes the longest queue is flushed early
  # (padded) so host memory stays bounded. Every example is still scored exactly once.
  names = ["thing #0", "thing #1"]
  text, eye, dim = onehot_setup(names, ["{}"])
  recs = []
  for i, w in enumerate([8, 16, 24, 8, 32, 16, 40, 8]):
    label = np.full((8, w), i % 2, np.uint8)
    recs.append({"image": rgb(label + 50), "segmentation": label})
  cfg = dict(
    type="segmentation",
    dataset="fake",
    class_names=names,
    background_index=None,
    resize="short_side",
    image_size=8,
    batch_size=2,
    templates="identity",
  )
  for cap, batches in ((8, 6), (1, 8)):
    ev = make_evaluator("seg", cfg, source_fn=source_of(recs))
    ev.MAX_QUEUED_BATCHES = cap  # 1: flush the longest queue when more than 2 examples wait
    enc = CodeEncoder(text, {50: eye[0], 51: eye[1]}, dim)
    res = ev.run(enc)
    assert res["seg/num_examples"] == 8 and res["seg/pixel_acc"] == 100.0
    np.testing.assert_array_equal(
      ev.last_confusion, [[8 * (8 + 24 + 32 + 40), 0], [0, 8 * (16 + 8 + 16 + 8)]]
    )
    # cap 8: full batches for widths 8 and 16, then 24, 32, 40 and the last 8 at the end; cap 1: every
    # example leaves in its own padded batch.
    assert len(enc.shapes) == batches, cap
