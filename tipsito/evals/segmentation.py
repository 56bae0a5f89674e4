"""Zero-shot semantic segmentation from value embeddings (the TIPS / TIPSv2 protocol) and from the final
patch tokens, with a "global copy" reference row.

Why this protocol: it measures dense patch-text alignment, the property TIPSv2's iBOT++ targets. Patch
features are the *value embeddings* of the last block (MaskCLIP trick, `embed_images(...)['values']`,
with the export's projection when `project`), L2-normalised and compared by cosine with per-class text
embeddings averaged over TCL's 9 templates. Score maps are upsampled bilinearly (half-pixel centres, no
antialiasing, as PyTorch's `F.interpolate(mode='bilinear')` in the TIPS notebook) to the size of the
label map, the arg-max class is the prediction, and mIoU comes from one confusion matrix over the whole
split (`ignore_index` pixels skipped; classes absent from both GT and prediction excluded).

Benchmarks (`benchmark`, see `BENCHMARKS` and the README's table): 'ade150', 'pc59', 'pc60', 'voc21',
the four columns of TIPSv2 Tables 1, 3, 4 and 5. A benchmark fixes the class list
(tipsito/evals/class_names.py), the label mapping, the background rule and the resize rule:
- images: short side resized to `image_size` (448) keeping the aspect ratio (the TIPS notebook's
  `ShortSideResize`, `tipsito.data.eval_input.short_side_size`); the label map stays at its own size and
  predictions are upsampled to it before the confusion matrix;
- ade150 / pc59: no background class; label 0 ("other" / background) and 255 are ignored, v -> v - 1
  (`reduce_zero_label`), exactly 150 / 59 classes are scored;
- pc60 / voc21: label 0 is the class 'background' and is scored; 255 is ignored. By default the
  background is prompted like any class (the word 'background' in TCL's templates): TIPSv2 describes
  its protocol as the arg-max over "the text features of each class name", and neither TIPSv2 nor the
  TIPS notebook publishes a threshold for cosine scores. TCL's convention (a constant background score,
  its `bg_thresh`) is `bg_threshold=t`: background is not prompted and gets the constant score t, so in
  'whole' a pixel is background when its best cosine is below t (t is on the cosine scale; TCL's 0.4
  was tuned for its own masks and does not transfer).
Without `benchmark`, the keys below say it all (dataset class names, `background_index` etc.): the
built-in demo suites use this.

Protocols (`protocol`):
- 'whole' (TIPSv2 default, "simple protocol"): the image is encoded once; its patch-grid cosines are
  upsampled straight to the label map (TIPS notebook `predict_whole`).
- 'slide' (TCL; TIPSv2 Table 8): `crop_size` windows every `stride` pixels, the last one flush with the
  border (TIPS notebook `predict_slide`, mmseg's slide inference); each window's cosines are upsampled to
  the window, turned into **softmax probabilities** over classes (raw cosines, temperature 1, as the
  notebook), summed where windows overlap and divided by the per-pixel window count; the averaged
  probabilities are then upsampled to the label map.
Encoder inputs (images or windows) whose sides are not multiples of the encoder's patch size are resized
up to the next multiple first (bicubic; the notebook's `encode_image_value_attention` does the same), so
the patch grid covers exactly the image; without this the model's centre zero-padding would shift the
upsampled scores against the pixels.

Batching: examples are read one by one (`eval_input.eval_examples`; shapes differ) and encoded in
fixed-size padded batches of `batch_size` images of one shape ('whole': one queue per input shape) or
of `batch_size` windows ('slide'), so every shape compiles once.

Class names without a benchmark: `class_names` (index = GT value) or the dataset's ClassLabel names
with `background_name` inserted at `background_index` (tipsito builders: mask value = class + 1,
0 = background). GT masks: the record's segmentation field, or the alpha channel
(`mask_source='alpha'`: foreground = alpha >= 128, labelled label+1 when `alpha_label='label'`, else 1).
`reduce_zero_label` maps 0 -> 255 and v -> v-1 (ADE20K convention). With the fixed-size resize modes
('resize', 'center_crop') GT is resized with nearest neighbour together with the image; with
'short_side' it keeps its size. The GT maps are read by `tipsito.data.eval_input` (`MaskSpec`).

Config keys (besides the common ones; every key, its default and range are declared in
tipsito/config/schema.py `EVAL_KEYS`, the benchmarks' class names in tipsito/evals/config_checks.py): benchmark (None | 'ade150' | 'pc59' | 'pc60' |
'voc21'), protocol ('whole' | 'slide'), crop_size (None = the image's short side; benchmarks: 448),
stride (None = crop_size * 2 // 3; benchmarks: 336, the TIPS notebook's), bg_threshold (None),
templates (None = 'tcl'), patch_tokens (True), global_copy (True), and, only without a benchmark (a benchmark defines them, `BENCHMARK_KEYS`):
class_names, background_index (0), background_name ('background'), ignore_index (255),
reduce_zero_label (False), mask_source ('auto'), resize ('resize'); alpha_label ('label').
With a benchmark, image_size is the short side (default 448).
Metrics: '<name>/miou', '<name>/pixel_acc', '<name>/mean_acc' (percent), '<name>/miou_chance' (percent:
the expected mIoU of uniformly random class predictions on the same ground truth,
tipsito/evals/metrics.py `chance_miou_from_confusion`), '<name>/num_examples', '<name>/num_classes'.

Three predictions are scored (`KINDS`), each with miou, pixel_acc, mean_acc and nonlargest_acc:
- the value embeddings (above; their keys have no prefix and are what they always were);
- 'patches/...' (`patch_tokens`, default True): the final patch tokens (`embed_images(...)['patches']`,
  projected like the values), each patch labelled by the closest class text embedding: TIPSv2 §4 and its
  Figs. 6 and 9. The value trick can find alignment the raw tokens do not have; both are reported;
- 'global_copy/...' (`global_copy`, default True): a reference, not a model: the image's CLS zero-shot
  arg-max (token `cls_index`, the same class embeddings and scores) painted on every pixel ('slide':
  each window's CLS answer over its box, averaged like the patch scores). A model whose every patch token
  equals its CLS scores exactly this, so dense metrics at or below it show no patch-text alignment.
'nonlargest_acc' is the pixel accuracy on the objects that are not the image's largest (the class with
the most pixels of the GT map, ties to the lower index; background and ignored pixels are never counted;
tipsito/evals/metrics.py `nonlargest_counts`): one answer copied to every patch cannot be right there
and on the largest object at once. NaN when no image has a second object (single-object datasets).
'<name>/nonlargest_chance' is 100 / C (uniform random classes), '<name>/nonlargest_share' the share of
scored pixels counted by nonlargest_acc. Both extra kinds reuse the value pass's encoder outputs (no
second encoder call); 'patches' costs one more upsampling per image, 'global_copy' one per image in
'slide' only.

Issue 42's instruments (tipsito/evals/references.py documents each rule): every kind also has the
object-only metrics '<prefix>object_miou', 'object_acc', 'object_nonlargest_acc' (object pixels only,
arg-max over the object classes: the background is not a candidate; these are the primary numbers, the
all-pixel keys above keep their old values), their within-image shuffle null '<prefix>shuffle_null/...'
and the localisation margin '<prefix>margin/...' (metric minus null); the location-blind references
'present_class/<metric>' and 'present_class_per_object/<metric>' (expected values from the ground
truth); and a bootstrap 95 % interval '<key>_ci_lo' / '<key>_ci_hi' beside every metric (`bootstrap`
resamples of the eval images, fixed seed; 0 = none), with '<name>/bootstrap_resamples'.

Pictures (`num_pictures` > 0): '<name>/overlay', one row per example [image | ground truth | the
prediction of each kind | PCA of the patch tokens ('whole' only)], every panel scaled to >= 256 px, with a
legend of the classes shown and a caption row of the object-only numbers, null, margin and references
(tipsito/evals/pictures.py `segmentation_figure`; `scenes` classes drawn in their objects' colour and
pattern, `class_looks`); '<name>/pca' as before.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from tipsito.data import batch as batch_lib
from tipsito.data import eval_input
from tipsito.evals import config_checks
from tipsito.evals import evaluator
from tipsito.evals import metrics as metrics_lib
from tipsito.evals import pictures as pictures_lib
from tipsito.evals import references as refs_lib
from tipsito.evals import templates as templates_lib

# The benchmarks and the completion of a segmentation eval's settings (tipsito/evals/config_checks.py).
BENCHMARKS = config_checks.BENCHMARKS
BENCHMARK_KEYS = config_checks.BENCHMARK_KEYS
resolve_config = config_checks.resolve_segmentation_config

# The predictions scored, each with its metric-key prefix ('values' keeps the keys it always had).
KINDS = {"values": "", "patches": "patches/", "global_copy": "global_copy/"}


# ------------------------------------------------------------------------------------------------------
# Scores, resampling and sliding windows (pure functions, tested on hand-made cases)
# ------------------------------------------------------------------------------------------------------


@jax.jit
def patch_scores(values, class_emb, const_mask, const_value):
  """(..., D) features x (C, D) unit class embeddings -> (..., C) class scores.

  The score of class c is the cosine with its text embedding, or `const_value[c]` where `const_mask[c]`
  (a background scored by a constant, TCL's `bg_thresh`).
  """
  v = values / jnp.maximum(jnp.linalg.norm(values, axis=-1, keepdims=True), 1e-12)
  cos = jnp.einsum("...d,cd->...c", v, class_emb)
  return jnp.where(const_mask, const_value, cos)


def bilinear_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Source indices i0, i1 (int32) and weights of i1 (float32) of 1-D bilinear resampling n_in -> n_out.

  Half-pixel centres without antialiasing, source positions clamped at 0 and indices at n_in - 1: the
  arithmetic of PyTorch's `F.interpolate(mode='bilinear', align_corners=False)`.
  """
  src = np.maximum((np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5, 0.0)
  i0 = np.minimum(np.floor(src).astype(np.int32), n_in - 1)
  i1 = np.minimum(i0 + 1, n_in - 1).astype(np.int32)
  return i0, i1, (src - i0).astype(np.float32)


def _lerp(x, taps, axis: int):
  """Resamples axis `axis` of x with `bilinear_taps`."""
  i0, i1, frac = (jnp.asarray(t) for t in taps)
  shape = [1] * x.ndim
  shape[axis] = -1
  f = frac.reshape(shape)
  return jnp.take(x, i0, axis=axis) * (1.0 - f) + jnp.take(x, i1, axis=axis) * f


def resize_bilinear(x, out_hw: tuple[int, int]):
  """(h, w, C) -> (H, W, C) bilinear resampling (`bilinear_taps` along both axes)."""
  x = _lerp(x, bilinear_taps(x.shape[0], out_hw[0]), 0)
  return _lerp(x, bilinear_taps(x.shape[1], out_hw[1]), 1)


@functools.partial(jax.jit, static_argnames=("block",))
def _upsample_argmax(scores, h_i0, h_i1, h_f, w_i0, w_i1, w_f, block):
  rows = _lerp(scores, (h_i0, h_i1, h_f), 0)  # (H, w, C)
  blocks = rows.reshape((-1, block) + rows.shape[1:])  # the (H, W, C) map is never whole in memory

  def one(b):
    return jnp.argmax(_lerp(b, (w_i0, w_i1, w_f), 1), axis=-1).astype(jnp.int32)

  return jax.lax.map(one, blocks).reshape(rows.shape[0], -1)


def _padded_taps(n_in: int, n_out: int, multiple: int):
  """`bilinear_taps` padded (index 0, weight 0) up to a multiple of `multiple` outputs."""
  i0, i1, f = bilinear_taps(n_in, n_out)
  pad = -n_out % multiple
  return (np.pad(i0, (0, pad)), np.pad(i1, (0, pad)), np.pad(f, (0, pad)))


def upsample_argmax(scores, out_hw: tuple[int, int], pad_multiple: int = 32) -> np.ndarray:
  """(h, w, C) scores -> (H, W) int32 arg-max labels after bilinear upsampling to `out_hw`.

  The output is computed on a grid padded up to multiples of `pad_multiple` and cropped, so label maps
  of many sizes share a few compiled functions, `pad_multiple` rows at a time; ties go to the lower
  class index.
  """
  h, w = scores.shape[:2]
  out_h, out_w = int(out_hw[0]), int(out_hw[1])
  th = _padded_taps(h, out_h, pad_multiple)
  tw = _padded_taps(w, out_w, pad_multiple)
  return np.asarray(_upsample_argmax(jnp.asarray(scores), *th, *tw, block=pad_multiple))[:out_h, :out_w]


def window_boxes(h: int, w: int, crop: int, stride: int) -> list[tuple[int, int, int, int]]:
  """(y1, x1, y2, x2) of the sliding windows over an (h, w) image (TIPS notebook / mmseg slide mode).

  A grid of `stride` steps, the last window moved back to end at the border, every window `crop`
  square or clipped to the image when the image is smaller than `crop`.
  """

  def spans(n):
    out = []
    for i in range(max(n - crop + stride - 1, 0) // stride + 1):
      end = min(i * stride + crop, n)
      out.append((max(end - crop, 0), end))
    return out

  return [(y1, x1, y2, x2) for y1, y2 in spans(h) for x1, x2 in spans(w)]


@functools.partial(jax.jit, static_argnames=("boxes", "hw"))
def slide_average(window_scores, boxes, hw):
  """Per-pixel mean of the windows' softmax maps: (n, gh, gw, C) window scores -> (H, W, C).

  Each window's scores are upsampled bilinearly to its box, turned into softmax probabilities over
  classes, and summed into the image; the sum is divided by the number of windows covering the pixel.
  """
  c = window_scores.shape[-1]
  total = jnp.zeros(tuple(hw) + (c,), jnp.float32)
  count = jnp.zeros(tuple(hw) + (1,), jnp.float32)
  for i, (y1, x1, y2, x2) in enumerate(boxes):
    probs = jax.nn.softmax(resize_bilinear(window_scores[i].astype(jnp.float32), (y2 - y1, x2 - x1)), axis=-1)
    total = total.at[y1:y2, x1:x2].add(probs)
    count = count.at[y1:y2, x1:x2].add(1.0)
  return total / count


def to_patch_multiple(image: np.ndarray, patch: int) -> np.ndarray:
  """A uint8 (H, W, 3) image resized (bicubic) up to sides that are multiples of `patch`."""
  h, w = image.shape[:2]
  nh, nw = -(-h // patch) * patch, -(-w // patch) * patch
  if (nh, nw) == (h, w):
    return image
  return np.asarray(Image.fromarray(np.ascontiguousarray(image)).resize((nw, nh), Image.Resampling.BICUBIC))


def patch_size_of(encoder) -> int:
  """The image tower's patch size (`image_config['patch_size']`, or a `patch_size` attribute; else 1)."""
  cfg = getattr(encoder, "image_config", None) or {}
  return max(1, int(cfg.get("patch_size") or getattr(encoder, "patch_size", None) or 1))


def _pad_stack(images: list[np.ndarray], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Equal-shaped images -> (batch_size, ...) with zero rows after them, and the `_valid` mask."""
  arr = np.stack(images)
  n = arr.shape[0]
  if n < batch_size:
    arr = np.concatenate([arr, np.zeros((batch_size - n,) + arr.shape[1:], arr.dtype)], 0)
  return arr, np.arange(batch_size) < n


# ------------------------------------------------------------------------------------------------------
# The evaluator
# ------------------------------------------------------------------------------------------------------


class SegmentationEvaluator(evaluator.Evaluator):
  """mIoU of zero-shot segmentation by value-embedding (and patch-token) / text cosine."""

  TYPE = "segmentation"
  NEEDS_MASKS = True
  MAX_QUEUED_BATCHES = 8  # 'whole': examples waiting for a full batch of their shape, in batches

  def settings(self, cfg, *, need_dataset: bool) -> dict:
    """The completed settings, a benchmark's class names and label conventions included."""
    return resolve_config(cfg, name=self.name, need_dataset=need_dataset)

  # ------------------------------------------------------------------ classes and prompts
  def seg_class_names(self) -> list[str]:
    """Class names indexed by GT value (see module docstring)."""
    if self.cfg["class_names"]:
      return [str(c) for c in self.cfg["class_names"]]
    names = list(self.class_names())
    bg = self.cfg["background_index"]
    if bg is not None:
      names.insert(int(bg), str(self.cfg["background_name"]))
    return names

  def _class_embeddings(self, encoder, names):
    """(C, D) unit text embeddings (zero rows for constant-score classes), the (C,) mask of the
    constant-score classes and their (C,) scores."""
    bg = self.cfg["background_index"]
    thr = self.cfg["bg_threshold"]
    const = np.zeros(len(names), bool)
    const_value = np.zeros(len(names), np.float32)
    if bg is not None and thr is not None:
      const[int(bg)] = True
      const_value[int(bg)] = float(thr)
    if self.cfg["benchmark"] and self.cfg["templates"] is None:
      templates = templates_lib.get_templates("tcl")  # a benchmark's prompts, whatever the dataset
    else:
      templates = self.templates("tcl")
    emb_prompted = self.class_text_embeddings(encoder, [n for n, c in zip(names, const) if not c], templates)
    emb = np.zeros((len(names), emb_prompted.shape[1]), np.float32)
    emb[~const] = emb_prompted
    return emb, const, const_value

  # ------------------------------------------------------------------ GT masks
  def mask_spec(self) -> eval_input.MaskSpec:
    """GT label maps from the segmentation field or from alpha (see the module docstring)."""
    cfg = self.cfg
    return eval_input.MaskSpec(
      source=cfg["mask_source"],
      key=cfg["segmentation_key"],
      alpha_label_key=cfg["label_key"] if cfg["alpha_label"] == "label" else None,
      reduce_zero_label=bool(cfg["reduce_zero_label"]),
      ignore_index=int(cfg["ignore_index"]),
    )

  def examples(self) -> Iterator[dict]:
    """The split's examples one by one, in dataset order (image, segmentation; shapes may differ)."""
    return eval_input.eval_examples(
      self.source(),
      self.input_fields(need_mask=True),
      max_examples=self.cfg["max_examples"],
      num_workers=max(1, int(self.cfg["num_workers"])),
    )

  # ------------------------------------------------------------------ encoder passes
  def kinds(self) -> tuple[str, ...]:
    """The predictions this eval scores (`KINDS`): the value embeddings always, then the final patch
    tokens (`patch_tokens`) and the global-copy reference (`global_copy`) when enabled."""
    enabled = {"values": True, "patches": self.cfg["patch_tokens"], "global_copy": self.cfg["global_copy"]}
    return tuple(k for k in KINDS if enabled[k])

  def _encode_scores(self, encoder, images: list[np.ndarray], scorer):
    """Equal-shaped images (at most batch_size) as one zero-padded batch: (encoder outputs, the padded
    batch, its valid mask, {kind: device scores (batch_size, gh, gw, C)}).

    'values' scores the value embeddings, 'patches' the final patch tokens (`embed_images`'s
    'patches'), 'global_copy' the CLS token `cls_index` broadcast to every patch of the grid."""
    batch, valid = _pad_stack(images, int(self.cfg["batch_size"]))
    out = self.embed_images(encoder, batch, need_values=True)
    values = jnp.asarray(out["values"])
    scores = {"values": scorer(values)}
    if self.cfg["patch_tokens"]:
      if "patches" not in out:
        raise KeyError(
          f"eval {self.name!r}: encoder.embed_images returned no 'patches' (the final patch tokens); "
          "set patch_tokens=False to score the value embeddings only"
        )
      scores["patches"] = scorer(jnp.asarray(out["patches"]))
    if self.cfg["global_copy"]:
      cls = jnp.asarray(self.cls_features(out))[:, None, None, :]
      scores["global_copy"] = scorer(jnp.broadcast_to(cls, values.shape[:3] + cls.shape[-1:]))
    return out, batch, valid, scores

  def _predict_whole(self, encoder, examples, scorer, sink):
    """'whole': one queue of encoder inputs per shape, flushed at batch_size (or, the longest one,
    when more than MAX_QUEUED_BATCHES batches of examples wait); scores -> label map."""
    patch = patch_size_of(encoder)
    bs = int(self.cfg["batch_size"])
    queues: dict[tuple, list] = {}

    def flush(key):
      items = queues.pop(key)
      out, batch, valid, scores = self._encode_scores(encoder, [x for x, _ in items], scorer)
      sink.pca(out, batch, valid)
      for i, (_, ex) in enumerate(items):
        hw = ex[batch_lib.SEGMENTATION].shape
        preds, objects = {}, {}
        for kind, s in scores.items():
          if kind == "global_copy":  # one answer per image: the arg-max of its (constant) score grid
            preds[kind] = np.full(hw, int(jnp.argmax(s[i, 0, 0])), np.int32)
            objects[kind] = np.full(hw, int(jnp.argmax(self._objects_only(s[i, 0, 0]))), np.int32)
          else:
            preds[kind] = upsample_argmax(s[i], hw)
            objects[kind] = self._object_argmax(s[i], hw, preds[kind])
        sink.add(ex, preds, out.get("patches", out["values"])[i], objects)

    for ex in examples:
      x = to_patch_multiple(ex[batch_lib.IMAGE], patch)
      queues.setdefault(x.shape, []).append((x, ex))
      if len(queues[x.shape]) == bs:
        flush(x.shape)
      elif sum(len(q) for q in queues.values()) > self.MAX_QUEUED_BATCHES * bs:  # bounded host memory
        flush(max(queues, key=lambda k: len(queues[k])))
    for key in list(queues):
      flush(key)

  def _predict_slide(self, encoder, examples, scorer, sink):
    """'slide': windows of batch_size images at a time, encoded in fixed batches of batch_size windows
    of one shape; per image, the windows' softmax maps averaged, then upsampled to the label map."""
    patch = patch_size_of(encoder)
    bs = int(self.cfg["batch_size"])
    for chunk in eval_input.chunks(examples, bs):
      plans, queues = [], {}
      for j, ex in enumerate(chunk):
        h, w = ex[batch_lib.IMAGE].shape[:2]
        crop = int(self.cfg["crop_size"] or min(h, w))
        stride = int(self.cfg["stride"] or max(1, crop * 2 // 3))
        boxes = tuple(window_boxes(h, w, crop, stride))
        plans.append(boxes)
        for k, (y1, x1, y2, x2) in enumerate(boxes):
          x = to_patch_multiple(ex[batch_lib.IMAGE][y1:y2, x1:x2], patch)
          queues.setdefault(x.shape, []).append(((j, k), x))
      window_scores = {}
      for items in queues.values():
        for part in eval_input.chunks(items, bs):
          out, batch, valid, scores = self._encode_scores(encoder, [x for _, x in part], scorer)
          sink.pca(out, batch, valid)
          for i, (jk, _) in enumerate(part):
            window_scores[jk] = {kind: s[i] for kind, s in scores.items()}
      for j, (ex, boxes) in enumerate(zip(chunk, plans)):
        preds, objects = {}, {}
        for kind in self.kinds():  # 'global_copy': each window's CLS answer over its box, averaged
          ws = jnp.stack([window_scores[(j, k)][kind] for k in range(len(boxes))])
          probs = slide_average(ws, boxes, tuple(ex[batch_lib.IMAGE].shape[:2]))
          preds[kind] = upsample_argmax(probs, ex[batch_lib.SEGMENTATION].shape)
          objects[kind] = self._object_argmax(probs, ex[batch_lib.SEGMENTATION].shape, preds[kind])
        sink.add(ex, preds, None, objects)

  def _objects_only(self, scores):
    """Scores with the background class out of the running (the object-only prediction's arg-max is
    over the object classes); the scores themselves without a background class."""
    bg = self.cfg["background_index"]
    if bg is None:
      return scores
    return jnp.asarray(scores).at[..., int(bg)].set(-1e9)  # finite: bilinear weights of 0 stay 0

  def _object_argmax(self, scores, hw, pred):
    """The object-only (H, W) prediction: `upsample_argmax` with the background out of the running
    (`pred` itself when there is no background class)."""
    if self.cfg["background_index"] is None:
      return pred
    return upsample_argmax(self._objects_only(scores), hw)

  # ------------------------------------------------------------------ run
  def run(self, encoder) -> dict[str, float]:
    """Predicts every eval image, accumulates one confusion matrix per kind, returns mIoU etc."""
    self.pictures = {}
    names = self.seg_class_names()
    num_classes = len(names)
    class_emb, const, const_value = self._class_embeddings(encoder, names)
    emb, cmask, cval = jnp.asarray(class_emb), jnp.asarray(const), jnp.asarray(const_value)
    scorer: Callable = lambda values: patch_scores(values, emb, cmask, cval)
    sink = _Sink(self, num_classes)
    protocol = self.cfg["protocol"]
    if protocol == "whole":
      self._predict_whole(encoder, self.examples(), scorer, sink)
    else:
      self._predict_slide(encoder, self.examples(), scorer, sink)
    results = {}
    for kind, prefix in KINDS.items():
      if kind not in sink.cms:
        continue
      r = sink.cms[kind].compute()
      correct, total = sink.nonlargest[kind]
      results[self.key(prefix + "miou")] = evaluator.pct(r["miou"])
      results[self.key(prefix + "pixel_acc")] = evaluator.pct(r["pixel_acc"])
      results[self.key(prefix + "mean_acc")] = evaluator.pct(r["mean_acc"])
      results[self.key(prefix + "nonlargest_acc")] = evaluator.pct(correct / total if total else float("nan"))
      if kind == "values":
        self.last_iou = dict(zip(names, (float(x) for x in r["iou"])))
        self.last_confusion = sink.cms[kind].matrix
        results[self.key("miou_chance")] = evaluator.pct(
          metrics_lib.chance_miou_from_confusion(sink.cms[kind].matrix)
        )
        results[self.key("nonlargest_chance")] = 100.0 / num_classes
        results[self.key("nonlargest_share")] = evaluator.pct(
          total / sink.cms[kind].matrix.sum() if sink.cms[kind].matrix.sum() else float("nan")
        )
        results[self.key("num_examples")] = float(sink.count)
        results[self.key("num_classes")] = float(num_classes)
    self._add_instruments(results, sink)
    if sink.rows:
      self.pictures[f"{self.name}/overlay"] = pictures_lib.segmentation_figure(
        sink.rows,
        names,
        sorted(sink.shown_classes),
        num_classes,
        caption=caption_lines(results, self.name),
        looks=sink.looks,
      )
    return results

  def _add_instruments(self, results: dict, sink: "_Sink") -> None:
    """The object-only metrics, the shuffle nulls and margins, the location-blind references and the
    bootstrap intervals of every dense key (tipsito/evals/references.py), into `results` (percent).

    The keys `run` computed from the split's confusion matrices keep their values; they get intervals."""
    kinds = [k for k in KINDS if k in sink.cms]

    def metrics_fn(s):
      out = {}
      for kind in kinds:
        p = KINDS[kind]
        cm, ocm, null = s[kind + ":cm"], s[kind + ":ocm"], s[kind + ":null"]
        out[p + "miou"] = refs_lib.miou_of_summary(cm)
        out[p + "pixel_acc"] = refs_lib.acc_of_summary(cm)
        out[p + "mean_acc"] = refs_lib.mean_acc_of_summary(cm)
        out[p + "nonlargest_acc"] = refs_lib.ratio_of(s[kind + ":nl"])
        model = {
          "object_miou": refs_lib.miou_of_summary(ocm),
          "object_acc": refs_lib.acc_of_summary(ocm),
          "object_nonlargest_acc": refs_lib.ratio_of(s[kind + ":onl"]),
        }
        nulls = {
          "object_miou": refs_lib.miou_of_summary(null),
          "object_acc": refs_lib.acc_of_summary(null),
          "object_nonlargest_acc": refs_lib.ratio_of(s[kind + ":null_nl"]),
        }
        for m, v in model.items():
          out[p + m] = v
          out[p + "shuffle_null/" + m] = nulls[m]
          out[p + "margin/" + m] = v - nulls[m]
      for ref in REFERENCES:
        out[ref + "/miou"] = refs_lib.miou_of_summary(s[ref + ":cm"])
        out[ref + "/pixel_acc"] = refs_lib.acc_of_summary(s[ref + ":cm"])
        out[ref + "/nonlargest_acc"] = refs_lib.ratio_of(s[ref + ":nl"])
        out[ref + "/object_miou"] = refs_lib.miou_of_summary(s["object_ref:cm"])
        out[ref + "/object_acc"] = refs_lib.acc_of_summary(s["object_ref:cm"])
        out[ref + "/object_nonlargest_acc"] = refs_lib.ratio_of(s["object_ref:nl"])
      return out

    if not len(sink.per_image):
      return
    boot = refs_lib.bootstrap(sink.per_image, metrics_fn, int(self.cfg["bootstrap"]), refs_lib.SEED)
    for metric, (value, lo, hi) in boot.items():
      key = self.key(metric)
      if key not in results:
        results[key] = evaluator.pct(value)
      results[key + "_ci_lo"] = evaluator.pct(lo)
      results[key + "_ci_hi"] = evaluator.pct(hi)
    results[self.key("bootstrap_resamples")] = float(self.cfg["bootstrap"])


# The location-blind references scored beside the model (tipsito/evals/references.py).
REFERENCES = ("present_class", "present_class_per_object")


def caption_lines(results: Mapping[str, float], name: str) -> list[str]:
  """The overlay's caption: the object-only numbers of each kind with their intervals, the shuffle null
  and margin, and the references, one line each (what a reader needs to judge the picture's numbers)."""

  def get(metric):
    return results.get(f"{name}/{metric}", float("nan"))

  def ci(metric):
    return f"{get(metric):.1f} [{get(metric + '_ci_lo'):.1f}, {get(metric + '_ci_hi'):.1f}]"

  lines = []
  for kind, prefix in KINDS.items():
    if f"{name}/{prefix}object_miou" not in results:
      continue
    lines.append(
      f"{KIND_TITLES[kind]}: object mIoU {ci(prefix + 'object_miou')}, object acc {ci(prefix + 'object_acc')},"
      f" shuffle null {get(prefix + 'shuffle_null/object_acc'):.1f},"
      f" margin {ci(prefix + 'margin/object_acc')} (all-pixel mIoU {get(prefix + 'miou'):.1f})"
    )
  lines.append(
    "references (object mIoU / acc): "
    f"present class {get('present_class/object_miou'):.1f} / {get('present_class/object_acc'):.1f}; "
    f"all-pixel mIoU: present class {get('present_class/miou'):.1f}, per object "
    f"{get('present_class_per_object/miou'):.1f}, chance {get('miou_chance'):.1f}"
  )
  return lines


# The figure's column titles of each kind (`pictures.segmentation_row`).
KIND_TITLES = {"values": "value embeddings", "patches": "patch tokens", "global_copy": "global copy (CLS)"}


class _Sink:
  """Where predictions go: per kind a confusion matrix and non-largest counts; the example count; the
  rows of the overlay figure and the PCA pictures."""

  def __init__(self, ev: SegmentationEvaluator, num_classes: int):
    self.ev = ev
    self.num_classes = num_classes
    ignore = int(ev.cfg["ignore_index"])
    self.cms = {k: metrics_lib.ConfusionMatrix(num_classes, ignore) for k in ev.kinds()}
    self.nonlargest = {k: [0, 0] for k in ev.kinds()}
    bg = ev.cfg["background_index"]
    # A background scored by a constant (bg_threshold) is still background; None: label 0 was ignored.
    self.background = None if bg is None else int(bg)
    self.count = 0
    self.per_image = refs_lib.PerImage()  # the bootstrap's statistics (references.py)
    self.n_pics = int(ev.cfg["num_pictures"])
    self.rows: list[np.ndarray] = []
    self.looks = pictures_lib.class_looks(ev.seg_class_names(), self.background) if self.n_pics else None
    self.shown_classes: set[int] = set()

  def add(
    self, ex: dict, preds: dict[str, np.ndarray], patches: np.ndarray | None, objects: dict | None = None
  ) -> None:
    """One example's {kind: (H, W) prediction} at its label map's size, its (h, w, D) patch tokens
    (None: no PCA panel) and {kind: (H, W) object-only prediction} (None: `preds`)."""
    gt = ex[batch_lib.SEGMENTATION]
    ignore = int(self.ev.cfg["ignore_index"])
    c_n, bg = self.num_classes, self.background
    objects = objects or preds
    nl_rows = refs_lib.nonlargest_rows(gt, c_n, ignore, bg)
    n = refs_lib.class_counts(gt, c_n, ignore)

    def nl(cm):  # [correct, total] on the non-largest objects, from a confusion matrix's rows
      return np.array([np.diagonal(cm)[nl_rows].sum(), n[nl_rows].sum()])

    stats = {}
    for kind, pred in preds.items():
      cm = metrics_lib.confusion_matrix(pred, gt, c_n, ignore)
      self.cms[kind].matrix += cm
      c, t = metrics_lib.nonlargest_counts(pred, gt, c_n, ignore, bg)
      self.nonlargest[kind][0] += c
      self.nonlargest[kind][1] += t
      ocm = refs_lib.object_confusion(objects[kind], gt, c_n, ignore, bg)
      null = refs_lib.shuffle_null_confusion(objects[kind], gt, c_n, ignore, bg)
      stats.update(
        {
          kind + ":cm": refs_lib.summary(cm),
          kind + ":nl": np.array([c, t]),
          kind + ":ocm": refs_lib.summary(ocm),
          kind + ":onl": nl(ocm),
          kind + ":null": refs_lib.summary(null),
          kind + ":null_nl": nl(null),
        }
      )
    ref = refs_lib.reference_confusions(gt, c_n, ignore, bg)
    for name in REFERENCES:
      stats[name + ":cm"], stats[name + ":nl"] = refs_lib.summary(ref[name]), nl(ref[name])
    stats["object_ref:cm"], stats["object_ref:nl"] = refs_lib.summary(ref["object"]), nl(ref["object"])
    self.per_image.add(**stats)
    self.count += 1
    if len(self.rows) < self.n_pics:
      image = ex[batch_lib.IMAGE]
      h, w = gt.shape
      if image.shape[:2] != (h, w):
        image = np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BILINEAR))
      pca = None if patches is None else pictures_lib.pca_rgb(np.asarray(patches)[None])[0]
      titled = {KIND_TITLES[k]: p for k, p in preds.items()}
      self.rows.append(
        pictures_lib.segmentation_row(image, gt, titled, self.num_classes, pca, looks=self.looks)
      )
      for labels in [gt, *preds.values()]:
        self.shown_classes.update(int(v) for v in np.unique(labels) if v < self.num_classes or v == 255)

  def pca(self, out, batch, valid) -> None:
    """PCA pictures of the first encoded batch (`Evaluator._collect_pca`)."""
    if self.n_pics:
      self.ev._collect_pca(out, {batch_lib.IMAGE: batch, batch_lib.VALID: valid})  # pylint: disable=protected-access
