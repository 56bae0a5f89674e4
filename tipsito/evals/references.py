"""References a dense metric must beat, and bootstrap intervals over eval images (issue 42).

Why: on `scenes` a predictor that knows *which* classes an image holds but not *where* they are scores
as well as most trained models on mIoU (issue 42's table), so a dense number means nothing without
location-blind references on the same split, and a difference of a few points means nothing without its
sampling error. Everything here is pure numpy, per image, so the evaluators add one image's statistics
at a time and sum them (or resample them) over the split.

Conventions (tipsito's label maps): `background` is the scored background class (None: there is none),
`ignore` pixels and values outside [0, C) are never counted. "Object pixels" are the counted pixels that
are not background. Every reference is an **expected value** over its random draws (no seed): the expected
confusion matrix of one image, summed over the split, then mIoU of the sum (the ratio of expectations,
as `metrics.chance_miou_from_confusion`), so the references are exact, deterministic and checkable by
hand. The references of one image with object classes O (those with pixels), pixel counts n_g:

- `present_class`: every object pixel an independently drawn class among the classes present in the
  image, background included when it has pixels (P = O + {background}); background pixels as in the
  ground truth. E[CM[g, p]] = n_g / |P| for g in O, p in P.
- `present_class_per_object`: one class drawn among O for each object (perfect figure/ground; an
  object is a class region, since the objects of a `scenes` image have different classes).
  E[CM[g, p]] = n_g / |O| for g in O, p in O; background pixels as in the ground truth.
- `object_reference`: the same two on object pixels with the background not a candidate (the object-only
  metrics): both are then E[CM[g, p]] = n_g / |O|, one number under both names.
- `shuffle_null`: a model's own object-only prediction permuted over the object pixels of the same image
  (every permutation equally likely): pixel x of class g gets the prediction of a uniformly random object
  pixel, so E[CM[g, p]] = n_g m_p / N (m_p: object pixels predicted p, N: object pixels). It keeps the
  model's answers and their proportions and forgets only where they were; a model that copies one answer
  to every patch, or paints each object with a random present class, is at its null in expectation, and
  metric minus null (the localisation margin) is the part of the score that needs the answers in place.

Bootstrap (`bootstrap`): resample the eval images with replacement `resamples` times (default
`RESAMPLES` = 1000, numpy `default_rng(SEED)`, SEED = 0: fixed, so an interval is reproducible), sum
each resample's per-image statistics and recompute every metric from the sums; the interval is the 2.5th
and 97.5th percentile (a percentile interval). Metrics of one eval share the resamples, so a margin's
interval is paired with its metric and null.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from tipsito.evals import metrics

RESAMPLES = 1000
SEED = 0
LEVEL = 0.95


# ------------------------------------------------------------------------------------------------------
# Per-image statistics
# ------------------------------------------------------------------------------------------------------


def counted(gt, num_classes: int, ignore_index: int) -> np.ndarray:
  """bool map of the pixels a metric counts (not `ignore_index`, inside [0, C))."""
  g = np.asarray(gt).astype(np.int64)
  return (g != ignore_index) & (g >= 0) & (g < num_classes)


def object_pixels(gt, num_classes: int, ignore_index: int, background: int | None) -> np.ndarray:
  """bool map of the counted pixels that are not background."""
  keep = counted(gt, num_classes, ignore_index)
  if background is not None:
    keep &= np.asarray(gt).astype(np.int64) != int(background)
  return keep


def object_confusion(pred, gt, num_classes: int, ignore_index: int, background: int | None) -> np.ndarray:
  """(C, C) counts over object pixels only (rows: ground truth): the confusion of the object-only metrics."""
  pred = np.asarray(pred).astype(np.int64)
  gt = np.asarray(gt).astype(np.int64)
  if pred.shape != gt.shape:
    raise ValueError(f"pred {pred.shape} and gt {gt.shape} differ")
  keep = object_pixels(gt, num_classes, ignore_index, background)
  p, g = pred[keep], gt[keep]
  if p.size and (p.min() < 0 or p.max() >= num_classes):
    raise ValueError(f"predictions outside [0, {num_classes})")
  return np.bincount(g * num_classes + p, minlength=num_classes**2).reshape(num_classes, num_classes)


def class_counts(gt, num_classes: int, ignore_index: int) -> np.ndarray:
  """(C,) counted pixels per ground-truth class of one image."""
  g = np.asarray(gt).astype(np.int64)
  return np.bincount(g[counted(g, num_classes, ignore_index)], minlength=num_classes).astype(np.float64)


def reference_confusions(
  gt, num_classes: int, ignore_index: int, background: int | None
) -> dict[str, np.ndarray]:
  """The expected (C, C) confusion matrices of one image's location-blind references (module docstring):
  'present_class' and 'present_class_per_object' (all pixels), 'object' (object pixels, both rules)."""
  n = class_counts(gt, num_classes, ignore_index)
  objects = n > 0
  if background is not None:
    objects[int(background)] = False
  candidates = objects.copy()
  if background is not None and n[int(background)] > 0:
    candidates[int(background)] = True
  obj_rows = np.where(objects, n, 0.0)
  out = {}
  for name, cand in (("present_class", candidates), ("present_class_per_object", objects)):
    k = max(int(cand.sum()), 1)
    cm = np.outer(obj_rows, cand.astype(np.float64)) / k
    if background is not None:
      cm[int(background), int(background)] += n[int(background)]
    out[name] = cm
  out["object"] = np.outer(obj_rows, objects.astype(np.float64)) / max(int(objects.sum()), 1)
  return out


def shuffle_null_confusion(
  pred, gt, num_classes: int, ignore_index: int, background: int | None
) -> np.ndarray:
  """Expected (C, C) object-pixel confusion of `pred` permuted over the image's object pixels:
  outer(n, m) / N (module docstring); all zeros for an image without object pixels."""
  cm = object_confusion(pred, gt, num_classes, ignore_index, background).astype(np.float64)
  total = cm.sum()
  if total == 0:
    return cm
  return np.outer(cm.sum(axis=1), cm.sum(axis=0)) / total


def nonlargest_rows(gt, num_classes: int, ignore_index: int, background: int | None) -> np.ndarray:
  """(C,) bool: the object classes of one image other than its largest (`metrics.largest_object_class`):
  the rows of a confusion matrix whose pixels `metrics.nonlargest_mask` counts."""

  n = class_counts(gt, num_classes, ignore_index)
  rows = n > 0
  if background is not None:
    rows[int(background)] = False
  largest = metrics.largest_object_class(gt, num_classes, ignore_index, background)
  if largest is not None:
    rows[largest] = False
  return rows


# ------------------------------------------------------------------------------------------------------
# Metrics of summed statistics, vectorised over a leading resample axis
# ------------------------------------------------------------------------------------------------------


def _nanmean(x, axis=-1):
  with np.errstate(invalid="ignore", divide="ignore"):
    count = np.sum(~np.isnan(x), axis=axis)
    return np.where(count > 0, np.nansum(x, axis=axis) / np.maximum(count, 1), np.nan)


def summary(cm) -> np.ndarray:
  """(..., C, C) confusion matrices -> (..., 3, C): [true positives, GT counts, predicted counts] per
  class, all that mIoU and the accuracies need. Linear in the matrix, so per-image summaries sum (and
  resample) like the matrices, at 3C numbers instead of C^2."""
  m = np.asarray(cm, np.float64)
  return np.stack([np.diagonal(m, axis1=-2, axis2=-1), m.sum(-1), m.sum(-2)], axis=-2)


def miou_of_summary(s) -> np.ndarray:
  """mIoU of (..., 3, C) `summary`s: mean IoU over the classes present in GT or prediction."""
  s = np.asarray(s, np.float64)
  tp, gt, pred = s[..., 0, :], s[..., 1, :], s[..., 2, :]
  union = gt + pred - tp
  with np.errstate(invalid="ignore", divide="ignore"):
    iou = np.where(union > 0, tp / np.where(union > 0, union, 1.0), np.nan)
  return _nanmean(iou)


def acc_of_summary(s) -> np.ndarray:
  """Pixel accuracy of (..., 3, C) `summary`s (NaN when nothing is counted)."""
  s = np.asarray(s, np.float64)
  tp, total = s[..., 0, :].sum(-1), s[..., 1, :].sum(-1)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(total > 0, tp / np.where(total > 0, total, 1.0), np.nan)


def mean_acc_of_summary(s) -> np.ndarray:
  """Mean per-class accuracy of (..., 3, C) `summary`s over the classes with GT pixels."""
  s = np.asarray(s, np.float64)
  tp, gt = s[..., 0, :], s[..., 1, :]
  with np.errstate(invalid="ignore", divide="ignore"):
    return _nanmean(np.where(gt > 0, tp / np.where(gt > 0, gt, 1.0), np.nan))


def miou_of(cm) -> np.ndarray:
  """mIoU of (..., C, C) confusion matrices (`metrics.miou_from_confusion`, batched; fractional
  expected counts allowed)."""
  return miou_of_summary(summary(cm))


def acc_of(cm) -> np.ndarray:
  """Pixel accuracy of (..., C, C) confusion matrices."""
  return acc_of_summary(summary(cm))


def mean_acc_of(cm) -> np.ndarray:
  """Mean per-class accuracy of (..., C, C) confusion matrices."""
  return mean_acc_of_summary(summary(cm))


def ratio_of(pair) -> np.ndarray:
  """(..., 2) [correct, total] -> correct / total (NaN when total is 0)."""
  p = np.asarray(pair, np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(p[..., 1] > 0, p[..., 0] / np.where(p[..., 1] > 0, p[..., 1], 1.0), np.nan)


# ------------------------------------------------------------------------------------------------------
# Bootstrap over eval images
# ------------------------------------------------------------------------------------------------------


class PerImage:
  """Per-image statistics of one eval (name -> one array of a fixed shape per image).

  Why sparse above `DENSE_CELLS`: a 150-class benchmark's confusion matrix has 22,500 cells, almost all
  0 in one image; such statistics are stored as scipy CSR rows, so 2,000 images stay a few MB.
  """

  DENSE_CELLS = 4096

  def __init__(self):
    self._rows: dict[str, list] = {}
    self._shapes: dict[str, tuple[int, ...]] = {}

  def add(self, **stats) -> None:
    """One image's statistics (arrays of a fixed shape per name)."""
    for name, value in stats.items():
      v = np.asarray(value, np.float64)
      if self._shapes.setdefault(name, v.shape) != v.shape:
        raise ValueError(f"statistic {name!r}: shape {v.shape}, earlier {self._shapes[name]}")
      row = v.reshape(1, -1)
      if row.shape[1] > self.DENSE_CELLS:
        import scipy.sparse  # pylint: disable=g-import-not-at-top

        row = scipy.sparse.csr_matrix(row)
      self._rows.setdefault(name, []).append(row)

  def add_rows(self, **stats) -> None:
    """Every image's statistics at once: name -> (n, *shape) array (dense)."""
    for name, value in stats.items():
      v = np.asarray(value, np.float64)
      if self._shapes.setdefault(name, v.shape[1:]) != v.shape[1:]:
        raise ValueError(f"statistic {name!r}: shape {v.shape[1:]}, earlier {self._shapes[name]}")
      self._rows.setdefault(name, []).append(v.reshape(v.shape[0], -1))

  def __len__(self) -> int:
    return sum(r.shape[0] for r in next(iter(self._rows.values()), []))

  def matrices(self):
    """{name: (n, F) matrix (dense, or CSR above DENSE_CELLS)}, {name: per-image shape}."""
    import scipy.sparse  # pylint: disable=g-import-not-at-top

    mats = {}
    for k, rows in self._rows.items():
      dense = int(np.prod(self._shapes[k])) <= self.DENSE_CELLS
      mats[k] = np.concatenate(rows, 0) if dense else scipy.sparse.vstack(rows, format="csr")
    return mats, dict(self._shapes)


def resample_weights(n: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
  """(resamples, n) counts: how often each image is drawn in each resample (n draws with replacement)."""
  rng = np.random.default_rng(seed)
  return rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)


def bootstrap(
  per_image: PerImage,
  metrics_fn: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]],
  resamples: int = RESAMPLES,
  seed: int = SEED,
  level: float = LEVEL,
  max_cells: float = 2e7,
) -> dict[str, tuple[float, float, float]]:
  """{metric: (value, lo, hi)}: `metrics_fn` of the split's summed statistics and its percentile interval.

  `metrics_fn` takes {name: (R, *shape) summed statistics} and returns {metric: (R,) values} (R = 1 for
  the value itself). With `resamples` 0 the interval is (NaN, NaN). Resamples are processed in chunks of
  at most `max_cells` summed cells (memory).
  """
  mats, shapes = per_image.matrices()
  n = len(per_image)

  def evaluate(weights):
    sums = {k: np.asarray(weights @ m).reshape((weights.shape[0],) + shapes[k]) for k, m in mats.items()}
    return {k: np.asarray(v, np.float64).reshape(-1) for k, v in metrics_fn(sums).items()}

  value = {k: float(v[0]) for k, v in evaluate(np.ones((1, n))).items()}
  if not resamples or n == 0:
    return {k: (v, float("nan"), float("nan")) for k, v in value.items()}
  weights = resample_weights(n, int(resamples), int(seed))
  cells = max(1, sum(int(np.prod(s)) for s in shapes.values()))
  step = max(1, int(max_cells // cells))
  draws: dict[str, list] = {}
  for start in range(0, weights.shape[0], step):
    for k, v in evaluate(weights[start : start + step]).items():
      draws.setdefault(k, []).append(v)
  tail = 100.0 * (1.0 - level) / 2.0
  out = {}
  for k, v in value.items():
    d = np.concatenate(draws[k])
    d = d[~np.isnan(d)]
    lo, hi = np.percentile(d, [tail, 100.0 - tail]) if d.size else (np.nan, np.nan)
    out[k] = (v, float(lo), float(hi))
  return out


def mean_interval(values, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL):
  """(mean, lo, hi) of per-image values (accuracy: 0/1 per image; RMSE: one value per image)."""
  v = np.asarray(values, np.float64).reshape(-1)
  if v.size == 0:
    return float("nan"), float("nan"), float("nan")
  per = PerImage()
  per.add_rows(x=np.stack([v, np.ones_like(v)], 1))
  return bootstrap(per, lambda s: {"m": ratio_of(s["x"])}, resamples, seed, level)["m"]


def with_intervals(results: dict, key: str, triple, scale: float = 1.0) -> None:
  """results[key], results[key + '_ci_lo'], results[key + '_ci_hi'] from (value, lo, hi) x scale."""
  v, lo, hi = triple
  results[key] = float(v) * scale
  results[key + "_ci_lo"] = float(lo) * scale
  results[key + "_ci_hi"] = float(hi) * scale
