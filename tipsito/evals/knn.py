"""k-NN classification on frozen CLS features (DINO's weighted kNN; TIPSv2 reports ImageNet kNN).

Why: it measures how well the image embedding alone separates classes, with no training and no text.
The train split's L2-normalised CLS features (`cls_index`, backbone features: `project=False` by default)
form the bank; each test feature votes with its k nearest bank entries weighted by exp(cos / T)
(k=20, T=0.07 as in DINO).

Config keys (besides the common ones; all declared in tipsito/config/schema.py `EVAL_KEYS`): `train_split` ('train'), `max_train_examples` (None),
`k` (20), `temperature` (0.07), `topk` ((1, 5)), `num_classes` (None = len(class_names) or max label+1).
Metrics: '<name>/top1', '<name>/top5' (percent), '<name>/num_examples', '<name>/num_train'; every
top-k with a bootstrap 95 % interval over the queries ('_ci_lo', '_ci_hi'; tipsito/evals/references.py).
"""

from __future__ import annotations

import numpy as np

from tipsito.data import batch as batch_lib
from tipsito.evals import evaluator
from tipsito.evals import metrics as metrics_lib
from tipsito.evals import references as refs_lib


class KnnEvaluator(evaluator.Evaluator):
  """Weighted kNN accuracy: train split as bank, eval split as queries."""

  TYPE = "knn"

  def _features(self, encoder, split: str, max_examples):
    """Normalised CLS features and labels of the valid examples of a split."""
    feats, labels = [], []
    for batch in self.batches(split, max_examples=max_examples, need_label=True):
      out = self.embed_images(encoder, batch[batch_lib.IMAGE])
      v = batch[batch_lib.VALID]
      feats.append(self.cls_features(out)[v])
      labels.append(batch[batch_lib.LABEL][v])
      if split == self.cfg["split"]:
        self._collect_pca(out, batch)
    if not feats:
      raise ValueError(f"eval {self.name!r}: split {split!r} is empty")
    return np.concatenate(feats, 0), np.concatenate(labels, 0)

  def run(self, encoder) -> dict[str, float]:
    """Builds the bank from the train split, classifies the eval split."""
    self.pictures = {}
    bank, bank_labels = self._features(encoder, self.cfg["train_split"], self.cfg["max_train_examples"])
    queries, query_labels = self._features(encoder, self.cfg["split"], self.cfg["max_examples"])
    num_classes = self.cfg["num_classes"]
    if not num_classes:
      try:
        num_classes = len(self.class_names())
      except ValueError:
        num_classes = int(max(bank_labels.max(), query_labels.max())) + 1
    ks = tuple(int(k) for k in self.cfg["topk"])
    votes = metrics_lib.knn_votes(
      queries,
      bank,
      bank_labels,
      int(num_classes),
      k=int(self.cfg["k"]),
      temperature=float(self.cfg["temperature"]),
    )
    acc = metrics_lib.topk_accuracy(votes, query_labels, ks)
    order = np.argsort(-np.asarray(votes, np.float64), axis=1, kind="stable")  # topk_correct's tie rule
    res = {}
    for k in ks:
      res[self.key(f"top{k}")] = evaluator.pct(acc[k])
      hit = (order[:, : min(k, order.shape[1])] == np.asarray(query_labels)[:, None]).any(axis=1)
      _, lo, hi = refs_lib.mean_interval(hit, int(self.cfg["bootstrap"]))
      res[self.key(f"top{k}_ci_lo")], res[self.key(f"top{k}_ci_hi")] = evaluator.pct(lo), evaluator.pct(hi)
    res[self.key("num_examples")] = float(len(queries))
    res[self.key("num_train")] = float(len(bank))
    return res
