"""Evaluation metrics, written to be checked by hand and to honour padding masks.

Why this module exists separately from the evaluators: every number tipsito reports goes through one of
these few functions, so they are small, pure (numpy in, numpy out; JAX only for the large similarity
matmuls) and unit-tested against hand-computed cases. Every function takes an optional validity mask
(the data pipeline pads the last batch and marks real examples with `_valid`), and padded rows/columns are
never counted, neither as queries nor as candidates.

Conventions: similarities are "higher is better"; accuracies and recalls are returned as fractions in
[0, 1] (the evaluators multiply by 100 for reporting).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

IGNORE_INDEX = 255


def _valid_or_ones(valid, n: int) -> np.ndarray:
  """Turns an optional mask into a bool array of length n (None = everything is real)."""
  if valid is None:
    return np.ones((n,), bool)
  valid = np.asarray(valid).astype(bool).reshape(-1)
  if valid.shape[0] != n:
    raise ValueError(f"valid mask has {valid.shape[0]} entries, expected {n}")
  return valid


def l2_normalize(x, axis: int = -1, eps: float = 1e-12):
  """x / max(||x||, eps); the same in numpy and JAX so that cosine similarities are plain dot products."""
  xp = jnp if isinstance(x, jax.Array) else np
  norm = xp.sqrt(xp.sum(x * x, axis=axis, keepdims=True))
  return x / xp.maximum(norm, eps)


# ------------------------------------------------------------------------------------------------------
# Classification
# ------------------------------------------------------------------------------------------------------


def topk_correct(scores, labels, ks: Sequence[int] = (1, 5), valid=None) -> dict[int, int]:
  """Number of valid rows whose true label is among the k highest scores, for each k.

  Ties are broken towards the lower class index (stable sort), so a constant score row is "wrong" unless
  the label is among the first k classes; this keeps results deterministic. k larger than the number of
  classes is clipped (then every valid row counts as correct).
  """
  scores = np.asarray(scores, np.float64)
  labels = np.asarray(labels).reshape(-1)
  n, c = scores.shape
  valid = _valid_or_ones(valid, n)
  order = np.argsort(-scores, axis=1, kind="stable")
  out = {}
  for k in ks:
    kk = min(int(k), c)
    hit = (order[:, :kk] == labels[:, None]).any(axis=1)
    out[int(k)] = int(np.sum(hit & valid))
  return out


def topk_accuracy(scores, labels, ks: Sequence[int] = (1, 5), valid=None) -> dict[int, float]:
  """Top-k accuracy over valid rows (fraction); NaN when there is no valid row."""
  n_valid = int(_valid_or_ones(valid, np.asarray(scores).shape[0]).sum())
  correct = topk_correct(scores, labels, ks, valid)
  return {k: (v / n_valid if n_valid else float("nan")) for k, v in correct.items()}


# ------------------------------------------------------------------------------------------------------
# Retrieval with several captions per image
# ------------------------------------------------------------------------------------------------------


def best_rank_of_positives(sim: np.ndarray, positive: np.ndarray, cand_valid: np.ndarray) -> np.ndarray:
  """For each query row, the 0-based rank of its best-ranked positive among valid candidates.

  rank = number of valid candidates scoring strictly higher than the best positive, plus the number of
  valid *negatives* tied with it that come before it in index order (stable tie-break, so ties do not
  inflate recall). Rows without a valid positive get rank = +inf (never a hit).
  """
  sim = np.asarray(sim, np.float64)
  pos = positive & cand_valid[None, :]
  neg_inf = -np.inf
  best = np.where(pos, sim, neg_inf).max(axis=1)
  # index of the first positive reaching `best` (for the tie rule)
  is_best = pos & (sim == best[:, None])
  first_best = np.where(is_best.any(axis=1), np.argmax(is_best, axis=1), sim.shape[1])
  cand = cand_valid[None, :] & ~pos
  higher = (sim > best[:, None]) & cand
  tied_before = (sim == best[:, None]) & cand & (np.arange(sim.shape[1])[None, :] < first_best[:, None])
  rank = (higher.sum(axis=1) + tied_before.sum(axis=1)).astype(np.float64)
  rank[~pos.any(axis=1)] = np.inf
  return rank


def retrieval_ranks(sim, text_to_image, image_valid=None, text_valid=None):
  """Best-positive ranks for image->text and text->image retrieval.

  Args:
    sim: (N_img, N_txt) similarities.
    text_to_image: (N_txt,) int, the image index each caption belongs to (several captions per image).
    image_valid, text_valid: optional masks; padded images/texts are neither queries nor candidates.

  Returns:
    (i2t_rank (N_img,), t2i_rank (N_txt,)) float arrays, +inf for padded queries or queries without a
    positive. An image's rank is that of its best-ranked caption (an image is a hit at k if *any* of its
    captions is in its top k); a caption's rank is that of its image.
  """
  sim = np.asarray(sim, np.float64)
  n_img, n_txt = sim.shape
  t2i = np.asarray(text_to_image).reshape(-1)
  iv = _valid_or_ones(image_valid, n_img)
  tv = _valid_or_ones(text_valid, n_txt)
  positive = t2i[None, :] == np.arange(n_img)[:, None]  # (N_img, N_txt)
  i2t = best_rank_of_positives(sim, positive, tv)
  t2i_rank = best_rank_of_positives(sim.T, positive.T, iv)
  i2t[~iv] = np.inf
  t2i_rank[~tv] = np.inf
  return i2t, t2i_rank


def recall_from_ranks(ranks, ks: Sequence[int] = (1, 5, 10), valid=None) -> dict[int, float]:
  """Recall@k = fraction of valid queries whose (0-based) rank < k."""
  ranks = np.asarray(ranks, np.float64).reshape(-1)
  valid = _valid_or_ones(valid, ranks.shape[0])
  n = int(valid.sum())
  return {int(k): (float(np.sum((ranks < k) & valid)) / n if n else float("nan")) for k in ks}


def retrieval_recall(
  sim, text_to_image, ks: Sequence[int] = (1, 5, 10), image_valid=None, text_valid=None
) -> dict[str, dict[int, float]]:
  """Recall@k in both directions: {'i2t': {k: r}, 't2i': {k: r}} (see retrieval_ranks for the rules)."""
  n_img, n_txt = np.asarray(sim).shape
  iv = _valid_or_ones(image_valid, n_img)
  tv = _valid_or_ones(text_valid, n_txt)
  i2t, t2i = retrieval_ranks(sim, text_to_image, iv, tv)
  return {"i2t": recall_from_ranks(i2t, ks, iv), "t2i": recall_from_ranks(t2i, ks, tv)}


# ------------------------------------------------------------------------------------------------------
# Segmentation
# ------------------------------------------------------------------------------------------------------


def confusion_matrix(pred, gt, num_classes: int, ignore_index: int = IGNORE_INDEX, valid=None) -> np.ndarray:
  """(C, C) int64 counts, rows = ground truth, columns = prediction, over non-ignored pixels.

  Pixels whose GT is `ignore_index` (or any value outside [0, C)) are skipped; `valid` is a per-image
  mask (B,) for padded batches, so padded images contribute nothing. Predictions outside [0, C) are an
  error (they would silently disappear otherwise).
  """
  pred = np.asarray(pred).astype(np.int64)
  gt = np.asarray(gt).astype(np.int64)
  if pred.shape != gt.shape:
    raise ValueError(f"pred {pred.shape} and gt {gt.shape} differ")
  keep = (gt != ignore_index) & (gt >= 0) & (gt < num_classes)
  if valid is not None:
    v = _valid_or_ones(valid, pred.shape[0])
    keep &= v.reshape((-1,) + (1,) * (pred.ndim - 1))
  p, g = pred[keep], gt[keep]
  if p.size and (p.min() < 0 or p.max() >= num_classes):
    raise ValueError(f"predictions outside [0, {num_classes})")
  return (
    np.bincount(g * num_classes + p, minlength=num_classes * num_classes)
    .reshape(num_classes, num_classes)
    .astype(np.int64)
  )


class ConfusionMatrix:
  """Accumulates a confusion matrix across batches (mIoU must be computed on the dataset totals).

  Averaging per-batch mIoU would weight small batches and classes absent from a batch wrongly.
  """

  def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX):
    self.num_classes = int(num_classes)
    self.ignore_index = int(ignore_index)
    self.matrix = np.zeros((self.num_classes, self.num_classes), np.int64)

  def update(self, pred, gt, valid=None) -> "ConfusionMatrix":
    """Adds one batch; returns self for chaining."""
    self.matrix += confusion_matrix(pred, gt, self.num_classes, self.ignore_index, valid)
    return self

  def compute(self) -> dict[str, float | np.ndarray]:
    """mIoU, per-class IoU, pixel accuracy (see miou_from_confusion)."""
    return miou_from_confusion(self.matrix)


def miou_from_confusion(matrix) -> dict:
  """IoU per class = TP / (TP + FP + FN); mIoU over classes present in GT *or* prediction.

  Classes absent from both (union 0) are excluded from the mean (their IoU is NaN), as mmseg does with
  nanmean. Returns {'miou', 'iou' (C,), 'pixel_acc', 'mean_acc'}.
  """
  m = np.asarray(matrix, np.float64)
  tp = np.diag(m)
  gt_count = m.sum(axis=1)
  pred_count = m.sum(axis=0)
  union = gt_count + pred_count - tp
  with np.errstate(invalid="ignore", divide="ignore"):
    iou = np.where(union > 0, tp / union, np.nan)
    class_acc = np.where(gt_count > 0, tp / gt_count, np.nan)
  total = m.sum()
  present = ~np.isnan(iou)
  return {
    "miou": float(np.mean(iou[present])) if present.any() else float("nan"),
    "iou": iou,
    "pixel_acc": float(tp.sum() / total) if total > 0 else float("nan"),
    "mean_acc": float(np.nanmean(class_acc)) if np.any(gt_count > 0) else float("nan"),
  }


def chance_miou_from_confusion(matrix) -> float:
  """Expected mIoU of a predictor that draws one of the C classes uniformly at random for every scored
  pixel: the level a segmentation mIoU must clear before it shows any patch-text alignment (with C = 22
  and one class holding a quarter of the pixels it is about 1.5%, not 1/C).

  Class c with a share p_c of the N scored pixels: E[TP_c] = p_c N / C and E[predicted c] = N / C, so
  IoU_c = (p_c / C) / (p_c + 1/C - p_c / C) = p_c / (1 + (C - 1) p_c) (ratio of the expectations, which
  the IoU of such a predictor approaches as N grows). Such a predictor predicts every class, so the
  mean runs over all C, as `miou_from_confusion` does. Depends on the ground truth only (the rows).
  """
  m = np.asarray(matrix, np.float64)
  c, gt_count = m.shape[0], m.sum(axis=1)
  if gt_count.sum() <= 0:
    return float("nan")
  share = gt_count / gt_count.sum()
  return float(np.mean(share / (1.0 + (c - 1) * share)))


def miou(pred, gt, num_classes: int, ignore_index: int = IGNORE_INDEX, valid=None) -> float:
  """mIoU of one set of predictions (convenience over ConfusionMatrix)."""
  return float(miou_from_confusion(confusion_matrix(pred, gt, num_classes, ignore_index, valid))["miou"])


def largest_object_class(
  gt, num_classes: int, ignore_index: int = IGNORE_INDEX, background_index: int | None = None
) -> int | None:
  """The class with the most pixels in one ground-truth map (ties: the lower index), or None.

  Background (`background_index`), `ignore_index` and values outside [0, C) are not objects; None when
  the map holds no object pixel. This is "the image's largest object" of the `scenes` record contract.
  """
  g = np.asarray(gt).astype(np.int64).reshape(-1)
  g = g[(g != ignore_index) & (g >= 0) & (g < num_classes)]
  if background_index is not None:
    g = g[g != int(background_index)]
  if g.size == 0:
    return None
  return int(np.argmax(np.bincount(g, minlength=num_classes)))  # argmax: first maximum = lower index


def nonlargest_mask(
  gt, num_classes: int, ignore_index: int = IGNORE_INDEX, background_index: int | None = None
) -> np.ndarray:
  """bool map of one image's pixels on objects that are not its largest (`largest_object_class`).

  Why: a model that copies one global answer to every patch paints the whole image with one class, so
  at best it is right on the largest object; on these pixels it is right only when it names a class that
  is not the largest, which then makes it wrong on the largest object. Accuracy here needs per-patch
  answers. Background, ignored and out-of-range pixels are never in the mask.
  """
  g = np.asarray(gt).astype(np.int64)
  largest = largest_object_class(g, num_classes, ignore_index, background_index)
  mask = (g != ignore_index) & (g >= 0) & (g < num_classes)
  if background_index is not None:
    mask &= g != int(background_index)
  if largest is None:
    return np.zeros(g.shape, bool)
  return mask & (g != largest)


def nonlargest_counts(
  pred, gt, num_classes: int, ignore_index: int = IGNORE_INDEX, background_index: int | None = None
) -> tuple[int, int]:
  """(correct, total) pixels of one image on its non-largest objects (`nonlargest_mask`).

  Accuracy = sum(correct) / sum(total) over a split (pixels pooled, as pixel accuracy).
  """
  pred = np.asarray(pred)
  gt = np.asarray(gt)
  if pred.shape != gt.shape:
    raise ValueError(f"pred {pred.shape} and gt {gt.shape} differ")
  mask = nonlargest_mask(gt, num_classes, ignore_index, background_index)
  return int(np.sum((pred.astype(np.int64) == gt.astype(np.int64)) & mask)), int(np.sum(mask))


# ------------------------------------------------------------------------------------------------------
# kNN classification (DINO's weighted k-NN)
# ------------------------------------------------------------------------------------------------------


def knn_votes(
  queries,
  bank,
  bank_labels,
  num_classes: int,
  k: int = 20,
  temperature: float = 0.07,
  bank_valid=None,
  chunk_size: int = 1024,
) -> np.ndarray:
  """Class votes of DINO's weighted kNN: sum over the k nearest bank entries of exp(sim / T) * onehot.

  Features are used as given (callers L2-normalise them so sim is the cosine). Padded bank entries get
  similarity -inf and therefore never enter the top-k (if fewer than k valid entries exist, the missing
  neighbours contribute exp(-inf) = 0). Queries are processed in fixed-size chunks with one jitted
  function, so memory stays O(chunk x bank).

  Returns (N_query, num_classes) float32 votes.
  """
  queries = np.asarray(queries, np.float32)
  bank = jnp.asarray(bank, jnp.float32)
  labels = np.asarray(bank_labels).reshape(-1).astype(np.int32)
  n_bank = bank.shape[0]
  bv = jnp.asarray(_valid_or_ones(bank_valid, n_bank))
  kk = int(min(k, n_bank))
  onehot = jax.nn.one_hot(jnp.asarray(labels), num_classes, dtype=jnp.float32)
  fn = _knn_chunk_fn(kk)
  out = []
  n = queries.shape[0]
  chunk = max(1, min(chunk_size, n))
  for start in range(0, n, chunk):
    q = queries[start : start + chunk]
    pad = chunk - q.shape[0]
    if pad:
      q = np.concatenate([q, np.zeros((pad, q.shape[1]), q.dtype)], axis=0)
    v = np.asarray(fn(jnp.asarray(q), bank, onehot, bv, jnp.float32(temperature)))
    out.append(v[: chunk - pad] if pad else v)
  return np.concatenate(out, axis=0) if out else np.zeros((0, num_classes), np.float32)


_KNN_FNS: dict[int, object] = {}


def _knn_chunk_fn(k: int):
  """One jitted chunk function per k (k must be static for lax.top_k)."""
  if k not in _KNN_FNS:

    def fn(q, bank, onehot, bank_valid, temperature):
      """Votes of one query chunk (see knn_votes)."""
      sim = q @ bank.T
      sim = jnp.where(bank_valid[None, :], sim, -jnp.inf)
      top_sim, top_idx = jax.lax.top_k(sim, k)
      weights = jnp.exp(top_sim / temperature)  # exp(-inf) = 0 for padded neighbours
      weights = jnp.where(jnp.isfinite(top_sim), weights, 0.0)
      return jnp.einsum("qk,qkc->qc", weights, onehot[top_idx])

    _KNN_FNS[k] = jax.jit(fn)
  return _KNN_FNS[k]


def knn_accuracy(
  queries,
  query_labels,
  bank,
  bank_labels,
  num_classes: int,
  k: int = 20,
  temperature: float = 0.07,
  ks: Sequence[int] = (1, 5),
  query_valid=None,
  bank_valid=None,
) -> dict[int, float]:
  """Top-k accuracy of weighted kNN votes over valid queries."""
  votes = knn_votes(queries, bank, bank_labels, num_classes, k, temperature, bank_valid)
  return topk_accuracy(votes, query_labels, ks, query_valid)
