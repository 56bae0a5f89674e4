"""Zero-shot classification (CLIP protocol, as TIPS reports ImageNet zero-shot).

Why this protocol: it measures global image-text alignment without training anything. Each class is
represented by its name inserted into prompt templates; the prompts are embedded, L2-normalised,
averaged over templates and renormalised (CLIP's prompt ensembling). An image is classified by the cosine
between its L2-normalised CLS embedding (`cls_index`) and the class embeddings.

Config keys (besides the common ones; all declared in tipsito/config/schema.py `EVAL_KEYS`): `topk` ((1, 5)); `templates` defaults to the dataset's
list (templates.DEFAULT_TEMPLATES) or CLIP's 80 ImageNet templates; `present_class` (False): also read
each image's label map (`segmentation_key`; tipsito's convention 0 = background, c + 1 = class c) for
the "present class" reference below (the `scenes` suite sets it).
Metrics: '<name>/top1', '<name>/top5' (percent), '<name>/num_examples', '<name>/chance' (100 / C) and,
with `present_class`, '<name>/present_class': the expected top-1 of a predictor that names a uniformly
random class among those present in the image (1 / |present| when the label is present, else 0, averaged
over images). On a multi-object image where the label is one of the objects (scenes: the largest), this
is the level of a model that recognises the objects but not which one the label asks for (issue 42).
Every top-k and the reference carry a bootstrap 95 % interval over the eval images ('_ci_lo', '_ci_hi';
`bootstrap` resamples, tipsito/evals/references.py).
"""

from __future__ import annotations

import numpy as np

from tipsito.data import batch as batch_lib
from tipsito.evals import evaluator
from tipsito.evals import metrics as metrics_lib
from tipsito.evals import references as refs_lib


class ZeroShotEvaluator(evaluator.Evaluator):
  """Top-k zero-shot accuracy from class-name prompts."""

  TYPE = "zeroshot"

  def __init__(self, name: str, cfg=None, **kwargs):
    super().__init__(name, cfg, **kwargs)
    self.NEEDS_MASKS = bool(self.cfg["present_class"])  # the label maps are read only for the reference

  def run(self, encoder) -> dict[str, float]:
    """Embeds class prompts once, then scores every eval image; padding is never counted."""
    self.pictures = {}
    names = self.class_names()
    class_emb = self.class_text_embeddings(encoder, names, self.templates("imagenet80"))  # (C, D)
    ks = tuple(int(k) for k in self.cfg["topk"])
    correct = {k: 0 for k in ks}
    hits = {k: [] for k in ks}  # per image 0/1, for the intervals
    present = []  # per image: the present-class reference's expected top-1
    n = 0
    use_masks = bool(self.cfg["present_class"])
    for batch in self.batches(need_label=True, need_mask=use_masks):
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
      order = np.argsort(-np.asarray(scores, np.float64), axis=1, kind="stable")  # topk_correct's ties
      for k in ks:
        hit = (order[:, : min(k, order.shape[1])] == batch[batch_lib.LABEL][:, None]).any(axis=1)
        hits[k].extend(float(h) for h in hit[np.asarray(valid, bool)])
      for i in np.flatnonzero(valid) if use_masks else ():
        present.append(
          present_class_top1(batch[batch_lib.SEGMENTATION][i], int(batch[batch_lib.LABEL][i]), len(names))
        )
      n += int(valid.sum())
      self._collect_pca(out, batch)
    res = {self.key(f"top{k}"): (100.0 * correct[k] / n if n else float("nan")) for k in ks}
    resamples = int(self.cfg["bootstrap"])
    for k in ks:
      _, lo, hi = refs_lib.mean_interval(hits[k], resamples)
      res[self.key(f"top{k}_ci_lo")], res[self.key(f"top{k}_ci_hi")] = 100.0 * lo, 100.0 * hi
    res[self.key("num_examples")] = float(n)
    res[self.key("chance")] = 100.0 / len(names)
    if use_masks:
      refs_lib.with_intervals(
        res, self.key("present_class"), refs_lib.mean_interval(present, resamples), 100.0
      )
    return res


def present_class_top1(label_map: np.ndarray, label: int, num_classes: int) -> float:
  """Expected top-1 of naming a uniformly random class present in one image: 1 / |present| when `label`
  is present, else 0. Present: the values c + 1 of the label map (0 = background, >= C + 1 and 255 are
  not classes), tipsito's label-map convention."""
  values = np.unique(np.asarray(label_map).astype(np.int64))
  classes = {int(v) - 1 for v in values if 1 <= v <= num_classes}
  return 1.0 / len(classes) if label in classes else 0.0


def zeroshot_scores(image_features: np.ndarray, class_embeddings: np.ndarray) -> np.ndarray:
  """Cosine scores (N, C) of image features vs class embeddings (both normalised here)."""
  return (
    metrics_lib.l2_normalize(np.asarray(image_features, np.float32))
    @ metrics_lib.l2_normalize(np.asarray(class_embeddings, np.float32)).T
  )
