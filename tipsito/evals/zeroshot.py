"""Zero-shot classification (CLIP protocol, as TIPS reports ImageNet zero-shot).

Why this protocol: it measures global image-text alignment without training anything. Each class is
represented by its name inserted into prompt templates; the prompts are embedded, L2-normalised,
averaged over templates and renormalised (CLIP's prompt ensembling). An image is classified by the cosine
between its L2-normalised CLS embedding (`cls_index`) and the class embeddings.

Config keys (besides evaluator.COMMON_DEFAULTS): `topk` ((1, 5)); `templates` defaults to the dataset's
list (templates.DEFAULT_TEMPLATES) or CLIP's 80 ImageNet templates.
Metrics: '<name>/top1', '<name>/top5' (percent), '<name>/num_examples'.
"""

from __future__ import annotations

import numpy as np

from tipsito.data import batch as batch_lib
from tipsito.evals import evaluator
from tipsito.evals import metrics as metrics_lib


class ZeroShotEvaluator(evaluator.Evaluator):
  """Top-k zero-shot accuracy from class-name prompts."""

  TYPE = "zeroshot"
  DEFAULTS = dict(topk=(1, 5))

  def run(self, encoder) -> dict[str, float]:
    """Embeds class prompts once, then scores every eval image; padding is never counted."""
    self.pictures = {}
    names = self.class_names()
    class_emb = self.class_text_embeddings(encoder, names, self.templates("imagenet80"))  # (C, D)
    ks = tuple(int(k) for k in self.cfg["topk"])
    correct = {k: 0 for k in ks}
    n = 0
    for batch in self.batches(need_label=True):
      out = self.embed_images(encoder, batch[batch_lib.IMAGE])
      feats = self.cls_features(out)
      if feats.shape[1] != class_emb.shape[1]:
        raise ValueError(
          f"eval {self.name!r}: image dim {feats.shape[1]} != text dim {class_emb.shape[1]}"
          " (set project=True for encoders with an image projection)"
        )
      scores = feats @ class_emb.T
      valid = batch[batch_lib.VALID]
      for k, v in metrics_lib.topk_correct(scores, batch[batch_lib.LABEL], ks, valid).items():
        correct[k] += v
      n += int(valid.sum())
      self._collect_pca(out, batch)
    res = {self.key(f"top{k}"): (100.0 * correct[k] / n if n else float("nan")) for k in ks}
    res[self.key("num_examples")] = float(n)
    res[self.key("chance")] = 100.0 / len(names)
    return res


def zeroshot_scores(image_features: np.ndarray, class_embeddings: np.ndarray) -> np.ndarray:
  """Cosine scores (N, C) of image features vs class embeddings (both normalised here)."""
  return (
    metrics_lib.l2_normalize(np.asarray(image_features, np.float32))
    @ metrics_lib.l2_normalize(np.asarray(class_embeddings, np.float32)).T
  )
