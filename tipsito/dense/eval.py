"""Losses and evaluation protocols of the DPT heads: depth RMSE / delta1, mIoU, normals angular error.

Why these protocols: they are the numbers users compare against (TIPSv2 / dinov2 tables):
- Depth (NYUv2): the prediction is upsampled bilinearly to the ground truth's size and clipped to
  (min_depth, max_depth); on pixels with GT in that range: RMSE in metres and delta1 = % of pixels with
  max(p / g, g / p) < 1.25, per image then averaged over images (as tipsito/evals/probes.py). `eigen_crop`
  scores only the Eigen et al. crop, rows 45:471 and columns 41:601 of the 480 x 640 NYUv2 frame (scaled to
  other sizes), the crop of the BTS / dinov2 depth evaluations.
- Segmentation (ADE20K): mIoU over the classes present in GT or prediction, from one confusion matrix of
  the split at the GT's resolution, pixels equal to `ignore_index` not scored. Single scale: the image
  resized to the model's square input, logits upsampled to the GT. Sliding window (`slide`, mmseg's
  'slide' test mode): the image resized so its short side is the window, square windows with a stride of
  2/3 of the window, logits of overlapping windows averaged, then upsampled to the GT.
- Normals: the angle between the unit prediction and the GT normal on valid pixels, pooled over the
  split: mean and median in degrees and the % of pixels within 11.25, 22.5 and 30 degrees.

Losses (what tipsito/dense/train.py minimises):
- depth: the scale-invariant log loss (SigLoss of AdaBins / BinsFormer, the loss dinov2's DPT and linear
  depth heads are trained with in its evaluation code, weight 1): g = log p - log d over valid pixels,
  L = sqrt(Var(g) + 0.15 mean(g)^2). transformers' `Tipsv2DptForDepthEstimation` ships no loss (it raises
  on labels), so this is our choice, made to match the protocol TIPS follows; the gradient term that some
  dinov2 configs add (weight 0.5) and the SigLoss warm-up are left out.
- normals: mean (1 - cos) between the normalised prediction and the GT on valid pixels (the angular
  error's smooth surrogate).
- segmentation: cross-entropy of the logits upsampled (bilinear, half-pixel centres) to the labels, over
  pixels that are not `ignore_index` (what `Tipsv2DptForSemanticSegmentation` computes with labels).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import optax

from tipsito.models import dpt as dpt_lib

EIGEN_CROP = (45, 471, 41, 601)  # rows, cols of a 480 x 640 frame


def _up(x, hw):
  """(B, h, w, C) -> (B, H, W, C), torch's bilinear with half-pixel centres (dpt.resize)."""
  return x if x.shape[1:3] == tuple(hw) else dpt_lib.resize(x, tuple(hw), align_corners=False)


def depth_loss(pred, gt, min_depth: float, max_depth: float):
  """SigLoss: sqrt(Var(g) + 0.15 mean(g)^2), g = log(pred) - log(gt) on pixels with GT in range."""
  p = _up(pred[..., None], gt.shape[1:3])[..., 0]
  valid = (gt > min_depth) & (gt < max_depth)
  n = jnp.maximum(jnp.sum(valid), 1)
  g = jnp.where(valid, jnp.log(jnp.maximum(p, 1e-6)) - jnp.log(jnp.where(valid, gt, 1.0)), 0.0)
  mean = jnp.sum(g) / n
  var = jnp.sum(jnp.where(valid, (g - mean) ** 2, 0.0)) / n
  return jnp.sqrt(var + 0.15 * mean**2 + 1e-12)


def normals_loss(pred, gt, valid):
  """Mean (1 - cos(pred, gt)) over valid pixels; pred unnormalised (B, h, w, 3) upsampled to gt."""
  p = _up(pred, gt.shape[1:3])
  p = p / jnp.maximum(jnp.linalg.norm(p, axis=-1, keepdims=True), 1e-6)
  cos = jnp.sum(p * gt, -1)
  return jnp.sum((1 - cos) * valid) / jnp.maximum(jnp.sum(valid), 1)


def segmentation_loss(logits, labels, ignore_index: int):
  """Mean cross-entropy over pixels that are not ignore_index, logits upsampled to the labels."""
  z = _up(logits, labels.shape[1:3])
  valid = labels != ignore_index
  ce = optax.softmax_cross_entropy_with_integer_labels(z, jnp.where(valid, labels, 0))
  return jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1)


def eigen_mask(hw: tuple[int, int]) -> np.ndarray:
  """The Eigen crop of a (H, W) frame, scaled from the 480 x 640 original."""
  h, w = hw
  r0, r1, c0, c1 = EIGEN_CROP
  m = np.zeros((h, w), bool)
  m[round(r0 * h / 480) : round(r1 * h / 480), round(c0 * w / 640) : round(c1 * w / 640)] = True
  return m


def depth_metrics(
  preds: Sequence[np.ndarray], gts: Sequence[np.ndarray], min_depth: float, max_depth: float, eigen_crop=False
) -> dict:
  """rmse (m) and delta1 (%) per image, averaged; preds (h, w) upsampled to each GT (H, W)."""
  rmse, d1 = [], []
  for p, g in zip(preds, gts):
    p = np.asarray(_up(jnp.asarray(p)[None, ..., None], g.shape))[0, ..., 0]
    valid = (g > min_depth) & (g < max_depth)
    if eigen_crop:
      valid &= eigen_mask(g.shape)
    if not valid.any():
      continue
    pv = np.clip(p[valid].astype(np.float64), min_depth, max_depth)
    gv = g[valid].astype(np.float64)
    rmse.append(np.sqrt(np.mean((pv - gv) ** 2)))
    d1.append(np.mean(np.maximum(pv / gv, gv / pv) < 1.25))
  nan = float('nan')
  return dict(
    rmse=float(np.mean(rmse)) if rmse else nan,
    delta1=100 * float(np.mean(d1)) if d1 else nan,
    num_examples=float(len(rmse)),
  )


def confusion(pred: np.ndarray, gt: np.ndarray, num_classes: int, ignore_index: int) -> np.ndarray:
  """(C, C) counts of (gt, pred) over pixels not ignored."""
  keep = (gt != ignore_index) & (gt >= 0) & (gt < num_classes)
  return np.bincount(
    gt[keep].astype(np.int64) * num_classes + pred[keep].astype(np.int64), minlength=num_classes**2
  ).reshape(num_classes, num_classes)


def miou(conf: np.ndarray) -> dict:
  """mIoU (%) over classes present in GT or prediction, and pixel accuracy (%)."""
  tp = np.diag(conf).astype(np.float64)
  union = conf.sum(0) + conf.sum(1) - tp
  present = union > 0
  return dict(
    miou=100 * float(np.mean(tp[present] / union[present])) if present.any() else float('nan'),
    pixel_acc=100 * float(tp.sum() / max(conf.sum(), 1)),
  )


def segmentation_metrics(
  logits: Sequence[np.ndarray], gts: Sequence[np.ndarray], num_classes, ignore_index
) -> dict:
  """mIoU of (h, w, C) logits upsampled to each GT (H, W)."""
  conf = np.zeros((num_classes, num_classes), np.int64)
  for z, g in zip(logits, gts):
    up = np.asarray(_up(jnp.asarray(z)[None], g.shape))[0]
    conf += confusion(up.argmax(-1), g, num_classes, ignore_index)
  return dict(miou(conf), num_examples=float(len(gts)))


def normals_metrics(
  preds: Sequence[np.ndarray], gts: Sequence[np.ndarray], valids: Sequence[np.ndarray]
) -> dict:
  """Angular error (degrees) pooled over the split's valid pixels: mean, median, % within 11.25/22.5/30."""
  errs = []
  for p, g, v in zip(preds, gts, valids):
    p = np.asarray(_up(jnp.asarray(p)[None], g.shape[:2]))[0]
    p = p / np.maximum(np.linalg.norm(p, axis=-1, keepdims=True), 1e-6)
    cos = np.clip(np.sum(p * g, -1), -1, 1)
    errs.append(np.degrees(np.arccos(cos[v])))
  e = np.concatenate(errs) if errs else np.zeros(0)
  if not e.size:
    return dict(mean_angle=float('nan'), median_angle=float('nan'), num_examples=0.0)
  out = dict(mean_angle=float(e.mean()), median_angle=float(np.median(e)), num_examples=float(len(preds)))
  for t in (11.25, 22.5, 30.0):
    out[f'within_{t:g}'] = 100 * float(np.mean(e < t))
  return out


def slide_logits(
  image: np.ndarray, window: int, patch: int, fn: Callable[[np.ndarray], np.ndarray], num_classes: int
) -> np.ndarray:
  """Sliding-window logits of one (H, W, 3) uint8 image: resized (bilinear) so its short side is
  `window` (long side rounded to whole patches), square windows at stride 2 window / 3 (the last one
  flush with the edge), `fn` (B, window, window, 3) -> (B, h, w, C) logits per window, upsampled to the
  window and averaged where windows overlap. Returns (H', W', C) at the resized image's size."""
  from PIL import Image  # pylint: disable=g-import-not-at-top

  h, w = image.shape[:2]
  s = window / min(h, w)
  nh, nw = max(window, round(h * s / patch) * patch), max(window, round(w * s / patch) * patch)
  img = np.asarray(Image.fromarray(image).resize((nw, nh), Image.BILINEAR))
  stride = max(patch, (2 * window // 3) // patch * patch)

  def starts(n):
    s_ = list(range(0, n - window + 1, stride))
    return s_ if s_[-1] == n - window else s_ + [n - window]

  acc = np.zeros((nh, nw, num_classes), np.float32)
  cnt = np.zeros((nh, nw, 1), np.float32)
  for y in starts(nh):
    for x in starts(nw):
      z = np.asarray(fn(img[None, y : y + window, x : x + window]))
      z = np.asarray(_up(jnp.asarray(z), (window, window)))[0]
      acc[y : y + window, x : x + window] += z
      cnt[y : y + window, x : x + window] += 1
  return acc / cnt


def batched(fn, n: int, batch: int):
  """Apply fn(i0, i1) over [0, n) in chunks and concatenate (numpy)."""
  return np.concatenate([np.asarray(fn(i, min(n, i + batch))) for i in range(0, n, batch)], 0)
