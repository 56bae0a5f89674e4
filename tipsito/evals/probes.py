"""Linear probes on frozen features: segmentation, depth and classification (TIPSv2 Tables 2, 4, 9-12).

Why probes: TIPSv2's image-only columns (linear-probe segmentation on PASCAL VOC / ADE20k, linear-probe
depth on NYUv2) measure what a linear readout of the frozen patch tokens can recover; no text, no
fine-tuning. The protocol here is dinov2's "linear" heads (its `BNHead`), kept small:

1. Frozen features, computed once per split and run: every image of the train split and of the eval
   split is resized to (image_size, image_size) (`resize='resize'`, no crop, so a prediction upsampled
   to the label map's size covers the whole map) and encoded once (`project=False`: backbone tokens).
2. Normalisation: each feature channel is standardised with the mean and standard deviation of the
   train split's features. This is the BatchNorm that dinov2 / TIPS put before the linear layer, in its
   inference form (population statistics; its affine part is absorbed by the linear layer).
3. A linear layer (weights zero initialised, the bias too except for depth: the mean train depth), trained with optax AdamW (`lr`, `weight_decay`;
   b1 0.9, b2 0.999), a linear warm-up over the first 10 % of `steps` then cosine decay to 0
   (`optax.warmup_cosine_decay_schedule`), `probe_batch_size` train images per step drawn with
   `jax.random` from `seed`. Everything is deterministic given the seed and the features.

The three probes:
- `linear_segmentation`: per-patch class logits (patch tokens), upsampled bilinearly (half-pixel
  centres, segmentation.py `resize_bilinear`) to the label map; loss = cross-entropy over the pixels
  that are not `ignore_index`. Scored at the ground truth's own resolution (the eval records' label
  maps, not resized): logits upsampled to (H, W), arg-max, one confusion matrix over the split. Metrics:
  miou, pixel_acc, mean_acc, miou_chance (percent), num_examples, num_train, num_classes; with
  `raw_pixel_probe` (True) the reference 'raw_pixel_probe/miou' (pixel_acc, mean_acc): the same probe
  trained on each patch cell's raw pixels (`raw_patches`, p x p x 3 values in [0, 1]) instead of the
  tokens, so a feature probe is read against what a linear map of the pixels alone recovers (issue 42).
- `linear_depth`: per-patch depth by **regression** in metres from the patch token **concatenated with
  the CLS token** (`cls_index`; dinov2's "lin. 1" / TIPS convention: [patch, cls] -> linear); the map is
  upsampled bilinearly to the depth map and the loss is the mean squared error over valid pixels (GT in
  (min_depth, max_depth)). Scored at the ground truth's resolution with predictions clipped to
  [min_depth, max_depth]: RMSE (metres, per image then averaged over images, as NYUv2 papers do) and
  delta1 (percent of valid pixels with max(pred / gt, gt / pred) < 1.25, per image then averaged). The
  reference 'row_reference_rmse' ('row_reference_delta1'): the best constant depth of each image row, fit
  on the train split (`row_profile`), scored the same way; on a ground plane whose depth is set by the
  row it is what a probe must beat before its features show more than the patch's position. dinov2
  instead predicts 256 depth bins; regression keeps the probe a plain linear map of the features.
- `linear_classification`: one logit vector from the CLS token (`cls_index`), cross-entropy; metrics
  top1 (percent), top1_chance (percent of the most frequent eval class), num_examples, num_train.

Every metric of the three probes (and each reference) has a bootstrap 95 % interval over the eval images
('<metric>_ci_lo', '<metric>_ci_hi'; `bootstrap` resamples, tipsito/evals/references.py); the probe
itself is trained once (the interval is the test-set sampling error, not the probe's training noise).

Data: a tipsito dataset (e.g. `shapes`, `scenes`: segmentation 0 = background, c + 1 = class c; depth
uint16 millimetres) or a dense benchmark read from its published layout under `data_dir` (None =
<tipsito data dir>/<name>; tipsito/data/dense_benchmarks.py: 'ade20k', 'voc2012', 'pascal_context',
'nyuv2'), whose class count, ignore rule and depth range are the benchmark's. The frozen features of
both splits are held in memory (float32; the train split's on the accelerator): cap them with
`max_train_examples` / `max_examples` at large scale.

Config keys (besides the common ones; every key, its default and range are declared in
tipsito/config/schema.py `EVAL_KEYS`, a dense benchmark's kind and splits are checked before training by
tipsito/evals/config_checks.py): train_split ('train'), max_train_examples (None),
steps (1000), lr (1e-3), weight_decay (1e-4), probe_batch_size (16), seed (0), resize ('resize');
segmentation: num_classes (None = the benchmark's, else the dataset's class names + 1 for background,
or their count with reduce_zero_label), ignore_index (255), reduce_zero_label (False); depth: depth_key
('depth'), depth_scale (1000: stored value / scale = metres), min_depth (1e-3), max_depth (10.0).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tipsito.data import batch as batch_lib
from tipsito.data import dense_benchmarks
from tipsito.data import eval_input
from tipsito.data import sources
from tipsito.evals import evaluator
from tipsito.evals import metrics as metrics_lib
from tipsito.evals import references as refs_lib
from tipsito.evals import segmentation

# --------------------------------------------------------------------------------------------
# The probe: normalisation + linear layer trained on frozen features
# --------------------------------------------------------------------------------------------


def feature_stats(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean and standard deviation (floored at 1e-6) over every axis but the last."""
  flat = features.reshape(-1, features.shape[-1]).astype(np.float64)
  mean = flat.mean(0)
  std = np.maximum(flat.std(0), 1e-6)
  return mean.astype(np.float32), std.astype(np.float32)


def apply_probe(params, features):
  """(..., D) frozen features -> (..., K) outputs: ((x - mean) / std) @ W + b."""
  x = (features - params["mean"]) / params["std"]
  return jnp.einsum("...d,dk->...k", x, params["w"]) + params["b"]


def upsample_maps(maps, out_hw: tuple[int, int]):
  """(B, h, w, K) -> (B, H, W, K), bilinear with half-pixel centres (segmentation.resize_bilinear)."""
  return jax.vmap(lambda m: segmentation.resize_bilinear(m, out_hw))(maps)


def segmentation_loss(logits, labels, ignore_index: int):
  """Mean cross-entropy over the scored pixels.

  logits (B, h, w, C) are upsampled to labels (B, H, W); L = -mean_{p: y_p != ignore} log softmax(z_p)[y_p].
  """
  z = upsample_maps(logits, labels.shape[1:3])
  valid = labels != ignore_index
  y = jnp.where(valid, labels, 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(z, y)
  return jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1)


def depth_loss(pred, depth, min_depth: float, max_depth: float):
  """Mean squared error in metres over valid pixels.

  pred (B, h, w, 1) is upsampled to depth (B, H, W); L = mean_{p: min < d_p < max} (pred_p - d_p)^2.
  """
  z = upsample_maps(pred, depth.shape[1:3])[..., 0]
  valid = (depth > min_depth) & (depth < max_depth)
  return jnp.sum(jnp.square(z - depth) * valid) / jnp.maximum(jnp.sum(valid), 1)


def classification_loss(logits, labels):
  """Mean cross-entropy: L = -mean_i log softmax(z_i)[y_i]."""
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def probe_optimizer(steps: int, lr: float, weight_decay: float) -> optax.GradientTransformation:
  """AdamW with 10 % linear warm-up then cosine decay to 0 (the schedule of every probe)."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0, peak_value=lr, warmup_steps=max(1, steps // 10), decay_steps=max(2, steps), end_value=0.0
  )
  return optax.adamw(schedule, weight_decay=weight_decay)


def train_probe(
  features: np.ndarray,
  targets: np.ndarray,
  out_dim: int,
  loss_fn: Callable,
  *,
  steps: int,
  lr: float,
  weight_decay: float,
  batch_size: int,
  seed: int,
  bias_init: float = 0.0,
) -> dict[str, jax.Array]:
  """Trains the normalised linear layer on frozen `features` (N, ..., D) against `targets` (N, ...).

  `loss_fn(outputs, targets_batch)` is one of the losses above (bound to its options). Returns params
  {'mean', 'std', 'w', 'b'} for `apply_probe`. `bias_init` starts the bias there instead of 0: the depth
  probe starts at the mean train depth, the least-squares bias of a zero weight, since a regression in
  metres from 0 would spend its whole schedule moving the bias (AdamW moves a parameter by about `lr` a
  step: 1e-3 x 1,000 steps = 1 m). Minibatches of `batch_size` rows are drawn without
  replacement within a step from `jax.random.key(seed)`; the result depends only on the inputs.
  """
  n, d = features.shape[0], features.shape[-1]
  if n == 0:
    raise ValueError("no training examples for the probe")
  mean, std = feature_stats(features)
  frozen = {"mean": jnp.asarray(mean), "std": jnp.asarray(std)}
  trainable = {
    "w": jnp.zeros((d, out_dim), jnp.float32),
    "b": jnp.full((out_dim,), float(bias_init), jnp.float32),
  }
  tx = probe_optimizer(int(steps), float(lr), float(weight_decay))
  feats = jnp.asarray(features, jnp.float32)
  tgts = jnp.asarray(targets)
  bs = min(int(batch_size), n)

  @jax.jit
  def step(carry, key, feats, tgts):
    params, opt_state = carry
    idx = jax.random.choice(key, n, (bs,), replace=False)

    def loss(p):
      return loss_fn(apply_probe({**frozen, **p}, feats[idx]), tgts[idx])

    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  keys = jax.random.split(jax.random.key(int(seed)), int(steps))
  carry = (trainable, tx.init(trainable))
  for i in range(int(steps)):
    carry, _ = step(carry, keys[i], feats, tgts)
  return {**frozen, **carry[0]}


def raw_patches(images: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
  """(B, H, W, 3) uint8 images -> (B, gh, gw, p_h * p_w * 3) float32 raw pixels in [0, 1] of each cell
  of a (gh, gw) grid (cells of H // gh x W // gw pixels; a remainder at the bottom/right is dropped).

  Why: the raw-pixel probe (issue 42) reads exactly these features, so a feature probe must beat what a
  linear map of the patch's own pixels recovers on a testbed whose classes are local colour x pattern."""
  x = np.asarray(images, np.float32) / 255.0
  b, h, w, c = x.shape
  gh, gw = int(grid[0]), int(grid[1])
  ph, pw = h // gh, w // gw
  x = x[:, : gh * ph, : gw * pw].reshape(b, gh, ph, gw, pw, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, gh, gw, ph * pw * c)


def row_profile(depths: np.ndarray, min_depth: float, max_depth: float) -> np.ndarray:
  """(H,) the best constant depth of each image row over a split's (N, H, W) maps: the mean of the
  row's valid depths (least squares), NaN rows (no valid pixel) filled from the nearest valid row."""
  d = np.asarray(depths, np.float64)
  valid = (d > min_depth) & (d < max_depth)
  total = np.where(valid, d, 0.0).sum(axis=(0, 2))
  count = valid.sum(axis=(0, 2))
  prof = np.where(count > 0, total / np.maximum(count, 1), np.nan)
  good = np.flatnonzero(count > 0)
  if good.size == 0:
    return np.full(d.shape[1], 0.5 * (min_depth + max_depth))
  return np.interp(np.arange(prof.size), good, prof[good])


def row_reference_map(profile: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
  """(H, W) depth map of a row profile fit at another height, resampled linearly at row centres."""
  n = profile.size
  src = (np.arange(n) + 0.5) / n
  dst = (np.arange(int(hw[0])) + 0.5) / int(hw[0])
  return np.repeat(np.interp(dst, src, profile)[:, None], int(hw[1]), axis=1)


def confusion_intervals(per_image: list[np.ndarray], resamples: int) -> dict[str, tuple[float, float, float]]:
  """{'miou', 'pixel_acc', 'mean_acc': (value, lo, hi)} of per-image (C, C) confusion matrices."""
  per = refs_lib.PerImage()
  for cm in per_image:
    per.add(cm=refs_lib.summary(cm))
  return refs_lib.bootstrap(
    per,
    lambda s: {
      "miou": refs_lib.miou_of_summary(s["cm"]),
      "pixel_acc": refs_lib.acc_of_summary(s["cm"]),
      "mean_acc": refs_lib.mean_acc_of_summary(s["cm"]),
    },
    resamples,
  )


def with_cls(patches: np.ndarray, cls: np.ndarray) -> np.ndarray:
  """(B, h, w, D) patch tokens and (B, D) CLS -> (B, h, w, 2D) [patch, cls] per patch (dinov2 'lin. 1')."""
  tiled = np.broadcast_to(cls[:, None, None, :], patches.shape[:3] + cls.shape[-1:])
  return np.concatenate([patches, tiled], axis=-1)


# --------------------------------------------------------------------------------------------
# Metrics at the ground truth's resolution
# --------------------------------------------------------------------------------------------


def depth_metrics(pred: np.ndarray, gt: np.ndarray, min_depth: float, max_depth: float) -> dict[str, float]:
  """RMSE (metres) and delta1 (fraction) of one image over its valid pixels; pred clipped to the range."""
  valid = (gt > min_depth) & (gt < max_depth)
  if not valid.any():
    return {}
  p = np.clip(pred[valid].astype(np.float64), min_depth, max_depth)
  g = gt[valid].astype(np.float64)
  ratio = np.maximum(p / g, g / p)
  return {"rmse": float(np.sqrt(np.mean((p - g) ** 2))), "delta1": float(np.mean(ratio < 1.25))}


# --------------------------------------------------------------------------------------------
# Evaluators
# --------------------------------------------------------------------------------------------


class _ProbeEvaluator(evaluator.Evaluator):
  """Shared by the three probes: sources (tipsito datasets or dense benchmarks), frozen features."""

  def __init__(self, name: str, cfg=None, **kwargs):
    super().__init__(name, cfg, **kwargs)
    self.bench = dense_benchmarks.benchmark(self.cfg["dataset"]) if self._source_fn is None else None

  def source(self, split: str | None = None):
    """Dense benchmarks are read from their layout under data_dir; other datasets as every eval."""
    if self.bench is None:
      return super().source(split)
    split = split or self.cfg["split"]
    if split not in self._sources:
      root = self.cfg["data_dir"] or os.path.join(sources.default_data_dir(), self.bench.name)
      self._sources[split] = (dense_benchmarks.open_split(self.bench.name, split, root), None)
    return self._sources[split][0]

  def probe_options(self) -> dict[str, Any]:
    """The training options of `train_probe` from the config."""
    c = self.cfg
    return dict(
      steps=int(c["steps"]),
      lr=float(c["lr"]),
      weight_decay=float(c["weight_decay"]),
      batch_size=int(c["probe_batch_size"]),
      seed=int(c["seed"]),
    )

  def frozen_features(self, encoder, split: str, max_examples, select: Callable, **need) -> Iterator:
    """(features, batch with only valid rows) per batch of a split, features = select(encoder output)."""
    collect = split == self.cfg["split"]
    for batch in self.batches(split, max_examples=max_examples, **need):
      out = self.embed_images(encoder, batch[batch_lib.IMAGE])
      if collect:
        self._collect_pca(out, batch)
      v = batch[batch_lib.VALID]
      yield select(out)[v], {k: val[v] for k, val in batch.items() if isinstance(val, np.ndarray)}

  def gather(
    self, encoder, split: str, max_examples, select: Callable, target_key: str, pixels=False, **need
  ):
    """All frozen features and targets of a split, concatenated; with `pixels`, also the images' raw
    patches on the features' grid (`raw_patches`), the raw-pixel probe's features."""
    feats, targets, raw = [], [], []
    for f, b in self.frozen_features(encoder, split, max_examples, select, **need):
      feats.append(f)
      targets.append(b[target_key])
      if pixels:
        raw.append(raw_patches(b[batch_lib.IMAGE], f.shape[1:3]))
    if not feats:
      raise ValueError(f"eval {self.name!r}: split {split!r} is empty")
    out = np.concatenate(feats, 0), np.concatenate(targets, 0)
    return out + (np.concatenate(raw, 0),) if pixels else out

  def native_records(self) -> Iterator:
    """The eval split's records in the order of its batches (for ground truth at its own size)."""
    return eval_input.iterate_source(self.source(self.cfg["split"]), self.cfg["max_examples"])

  def cls_token(self, out) -> np.ndarray:
    """The configured CLS token (cls_index), raw (the probe normalises), (B, D)."""
    cls = out["cls"]
    idx = int(self.cfg["cls_index"])
    if idx >= cls.shape[1]:
      raise ValueError(f"eval {self.name!r}: cls_index {idx} but the encoder has {cls.shape[1]} CLS tokens")
    return cls[:, idx]


class LinearSegmentationEvaluator(_ProbeEvaluator):
  """Linear probe on frozen patch tokens -> per-pixel classes, mIoU at the label map's resolution."""

  TYPE = "linear_segmentation"
  NEEDS_MASKS = True

  def mask_spec(self) -> eval_input.MaskSpec:
    """The record's label map with the benchmark's (or the config's) ignore rule."""
    bench = self.bench
    return eval_input.MaskSpec(
      source="segmentation",
      key=self.cfg["segmentation_key"],
      reduce_zero_label=bench.reduce_zero_label if bench else bool(self.cfg["reduce_zero_label"]),
      ignore_index=bench.ignore_index if bench else int(self.cfg["ignore_index"]),
    )

  def num_classes(self) -> int:
    """Config > benchmark > dataset class names (+1 background unless reduce_zero_label)."""
    if self.cfg["num_classes"]:
      return int(self.cfg["num_classes"])
    if self.bench is not None:
      return self.bench.num_classes
    names = self.class_names()
    return len(names) + (0 if self.cfg["reduce_zero_label"] else 1)

  def run(self, encoder) -> dict[str, float]:
    """Encodes both splits once, trains the probe, scores the eval split at the GT's resolution."""
    self.pictures = {}
    spec = self.mask_spec()
    num_classes = self.num_classes()
    raw = bool(self.cfg["raw_pixel_probe"])
    train = self.gather(
      encoder,
      self.cfg["train_split"],
      self.cfg["max_train_examples"],
      lambda o: o["patches"],
      batch_lib.SEGMENTATION,
      pixels=raw,
      need_mask=True,
    )
    train_x, train_y = train[:2]
    bad = (train_y != spec.ignore_index) & (train_y >= num_classes)
    if bad.any():
      raise ValueError(
        f"eval {self.name!r}: label {int(train_y[bad].max())} >= num_classes {num_classes} "
        "(set num_classes, or reduce_zero_label for datasets whose 0 is 'other')"
      )
    loss = functools.partial(segmentation_loss, ignore_index=spec.ignore_index)
    labels = train_y.astype(np.int32)
    params = train_probe(train_x, labels, num_classes, loss, **self.probe_options())
    evals = self.gather(
      encoder,
      self.cfg["split"],
      self.cfg["max_examples"],
      lambda o: o["patches"],
      batch_lib.VALID,
      pixels=raw,
    )
    eval_x = evals[0]
    probes = {"": (params, eval_x)}
    if raw:  # the reference: the same probe on the patches' raw pixels
      probes["raw_pixel_probe/"] = (
        train_probe(train[2], labels, num_classes, loss, **self.probe_options()),
        evals[2],
      )
    predict = jax.jit(apply_probe)
    confs = {p: metrics_lib.ConfusionMatrix(num_classes, spec.ignore_index) for p in probes}
    per_image = {p: [] for p in probes}
    for i, record in enumerate(self.native_records()):
      gt = eval_input.ground_truth_mask(record, None, (0, 0), spec)
      for prefix, (p, x) in probes.items():
        pred = segmentation.upsample_argmax(predict(p, x[i]), gt.shape)
        cm = metrics_lib.confusion_matrix(pred, gt, num_classes, spec.ignore_index)
        confs[prefix].matrix += cm
        per_image[prefix].append(cm)
    out = {}
    for prefix, conf in confs.items():
      res = conf.compute()
      boot = confusion_intervals(per_image[prefix], int(self.cfg["bootstrap"]))
      for m in ("miou", "pixel_acc", "mean_acc"):
        refs_lib.with_intervals(out, self.key(prefix + m), (res[m],) + boot[m][1:], 100.0)
    conf = confs[""]
    out.update(
      {
        self.key("miou_chance"): evaluator.pct(metrics_lib.chance_miou_from_confusion(conf.matrix)),
        self.key("num_examples"): float(len(eval_x)),
        self.key("num_train"): float(len(train_x)),
        self.key("num_classes"): float(num_classes),
      }
    )
    return out


class LinearDepthEvaluator(_ProbeEvaluator):
  """Linear regression of depth from frozen [patch, CLS] tokens; RMSE and delta1 at the GT's resolution."""

  TYPE = "linear_depth"

  def depth_spec(self) -> eval_input.DepthSpec:
    """Where the depth map is and its unit."""
    return eval_input.DepthSpec(key=self.cfg["depth_key"], scale=float(self.cfg["depth_scale"]))

  def depth_range(self) -> tuple[float, float]:
    """(min, max) valid depth in metres: the benchmark's, else the config's."""
    if self.bench is not None:
      return self.bench.min_depth, self.bench.max_depth
    return float(self.cfg["min_depth"]), float(self.cfg["max_depth"])

  def input_fields(self, *, need_label=False, need_mask=False, need_captions=False, need_depth=False):
    """The common fields plus the depth map when asked for."""
    fields = super().input_fields(need_label=need_label, need_mask=need_mask, need_captions=need_captions)
    if need_depth:
      fields = eval_input.dataclasses.replace(fields, depth=self.depth_spec())
    return fields

  def source(self, split: str | None = None):
    """The split's records with their depth field.

    tipsito's record reader (tipsito/data/sources.py) parses only the fields training uses, so for a
    tipsito dataset without the depth field in its records (e.g. `scenes`) the split is reopened through
    TFDS with every field (images and maps as their encoded PNG bytes).
    """
    src = super().source(split)
    info = getattr(src, "info", None)
    if self.bench is None and getattr(info, "dataset_dir", None) and len(src):
      if eval_input.get_field(src[0], self.cfg["depth_key"]) is None:
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

        if self.cfg["depth_key"] not in info.fields:
          raise KeyError(
            f"eval {self.name!r}: dataset {self.cfg['dataset']!r} has no depth field "
            f"{self.cfg['depth_key']!r} (fields: {list(info.fields)}); set depth_key"
          )
        split = split or self.cfg["split"]
        builder = tfds.builder_from_directory(info.dataset_dir)
        images = [k for k, f in builder.info.features.items() if isinstance(f, tfds.features.Image)]
        # Encoded bytes for every image feature: eval_input decodes them (TFDS' PIL path refuses uint16).
        decoded = builder.as_data_source(
          split=split, decoders={k: tfds.decode.SkipDecoding() for k in images}
        )
        self._sources[split] = (decoded, self._sources[split][1])
        return decoded
    return src

  def select(self, out) -> np.ndarray:
    """[patch, CLS] per patch."""
    return with_cls(out["patches"], self.cls_token(out))

  def run(self, encoder) -> dict[str, float]:
    """Encodes both splits once, trains the regression, scores the eval split at the GT's resolution."""
    self.pictures = {}
    lo, hi = self.depth_range()
    train_x, train_y = self.gather(
      encoder,
      self.cfg["train_split"],
      self.cfg["max_train_examples"],
      self.select,
      batch_lib.DEPTH,
      need_depth=True,
    )
    loss = functools.partial(depth_loss, min_depth=lo, max_depth=hi)
    valid = train_y[(train_y > lo) & (train_y < hi)]
    start = float(valid.mean()) if valid.size else 0.5 * (lo + hi)
    params = train_probe(
      train_x, train_y.astype(np.float32), 1, loss, bias_init=start, **self.probe_options()
    )
    eval_x, _ = self.gather(
      encoder, self.cfg["split"], self.cfg["max_examples"], self.select, batch_lib.VALID
    )
    predict = jax.jit(apply_probe)
    profile = row_profile(train_y, lo, hi)  # the row reference: fit on train, as the probe
    per_image, per_row = [], []
    spec = self.depth_spec()
    for i, record in enumerate(self.native_records()):
      gt = eval_input.ground_truth_depth(record, spec)
      up = np.asarray(segmentation.resize_bilinear(predict(params, eval_x[i]), gt.shape))[..., 0]
      m = depth_metrics(up, gt, lo, hi)
      if m:
        per_image.append(m)
        per_row.append(depth_metrics(row_reference_map(profile, gt.shape), gt, lo, hi))
    resamples = int(self.cfg["bootstrap"])
    out = {}
    for prefix, rows in (("", per_image), ("row_reference_", per_row)):
      rmse = refs_lib.mean_interval([m["rmse"] for m in rows], resamples)
      delta1 = refs_lib.mean_interval([m["delta1"] for m in rows], resamples)
      refs_lib.with_intervals(out, self.key(prefix + "rmse"), rmse)
      refs_lib.with_intervals(out, self.key(prefix + "delta1"), delta1, 100.0)
    out[self.key("num_examples")] = float(len(per_image))
    out[self.key("num_train")] = float(len(train_x))
    return out


class LinearClassificationEvaluator(_ProbeEvaluator):
  """Linear classifier on the frozen CLS token (beside kNN); top-1."""

  TYPE = "linear_classification"

  def run(self, encoder) -> dict[str, float]:
    """Encodes both splits once, trains the classifier, scores top-1 on the eval split."""
    self.pictures = {}
    train_x, train_y = self.gather(
      encoder,
      self.cfg["train_split"],
      self.cfg["max_train_examples"],
      self.cls_token,
      batch_lib.LABEL,
      need_label=True,
    )
    eval_x, eval_y = self.gather(
      encoder, self.cfg["split"], self.cfg["max_examples"], self.cls_token, batch_lib.LABEL, need_label=True
    )
    num_classes = self.cfg["num_classes"]
    if not num_classes:
      try:
        num_classes = len(self.class_names())
      except ValueError:
        num_classes = int(max(train_y.max(), eval_y.max())) + 1
    params = train_probe(
      train_x, train_y.astype(np.int32), int(num_classes), classification_loss, **self.probe_options()
    )
    pred = np.argmax(np.asarray(jax.jit(apply_probe)(params, jnp.asarray(eval_x))), -1)
    counts = np.bincount(eval_y, minlength=int(num_classes))
    _, lo, hi = refs_lib.mean_interval(pred == eval_y, int(self.cfg["bootstrap"]))
    return {
      self.key("top1"): evaluator.pct(float(np.mean(pred == eval_y))),
      self.key("top1_ci_lo"): evaluator.pct(lo),
      self.key("top1_ci_hi"): evaluator.pct(hi),
      self.key("top1_chance"): evaluator.pct(float(counts.max() / max(1, len(eval_y)))),
      self.key("num_examples"): float(len(eval_x)),
      self.key("num_train"): float(len(train_x)),
    }
