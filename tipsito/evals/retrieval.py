"""Image-text retrieval: recall@k in both directions with several captions per image.

Why this protocol: it is how TIPS/TIPSv2 report global image-text alignment (Flickr30K, COCO, DOCCI,
R@1). The gallery is the whole eval split: every image with *all* of its captions (alt-text plus every
'caption_*' field for tipsito datasets, or the configured `caption_keys`, e.g. 'captions/text' for
TFDS coco_captions). Image->text: an image is a hit at k if any of its captions is among its k most
similar texts. Text->image: a caption is a hit if its own image is among its k most similar images.

Config keys (besides the common ones; all declared in tipsito/config/schema.py `EVAL_KEYS`): `ks` ((1, 5, 10)), `caption_keys` (None = all),
`max_captions_per_image` (None = all), `chunk_size` (1024 query rows per similarity block).
Metrics: '<name>/i2t_r1', ..., '<name>/t2i_r10' (percent), '<name>/num_images', '<name>/num_texts';
every recall with a bootstrap 95 % interval over the images ('_ci_lo', '_ci_hi'; a resampled image
brings its captions; tipsito/evals/references.py).
"""

from __future__ import annotations

import numpy as np

from tipsito.data import batch as batch_lib
from tipsito.evals import evaluator
from tipsito.evals import metrics as metrics_lib
from tipsito.evals import references as refs_lib


class RetrievalEvaluator(evaluator.Evaluator):
  """Bidirectional recall@k over the whole split (all captions of every image)."""

  TYPE = "retrieval"

  def run(self, encoder) -> dict[str, float]:
    """Embeds all images and captions, then ranks in blocks (memory O(chunk x gallery))."""
    self.pictures = {}
    img_feats, texts, text_to_image = [], [], []
    n_img = 0
    max_caps = self.cfg["max_captions_per_image"]
    for batch in self.batches(need_captions=True):
      out = self.embed_images(encoder, batch[batch_lib.IMAGE])
      feats = self.cls_features(out)
      valid = batch[batch_lib.VALID]
      img_feats.append(feats[valid])
      for caps in (c for c, v in zip(batch[batch_lib.CAPTIONS], valid) if v):
        if max_caps:
          caps = caps[: int(max_caps)]
        texts.extend(caps)
        text_to_image.extend([n_img] * len(caps))
        n_img += 1
      self._collect_pca(out, batch)
    if n_img == 0 or not texts:
      raise ValueError(f"eval {self.name!r}: no images or captions to retrieve")
    image_emb = np.concatenate(img_feats, 0)
    text_emb = self.embed_texts(encoder, texts)
    ks = tuple(int(k) for k in self.cfg["ks"])
    t2i_map = np.asarray(text_to_image)
    i2t_ranks, t2i_ranks = retrieval_ranks_chunked(image_emb, text_emb, t2i_map, int(self.cfg["chunk_size"]))
    recalls = {
      "i2t": metrics_lib.recall_from_ranks(i2t_ranks, ks),
      "t2i": metrics_lib.recall_from_ranks(t2i_ranks, ks),
    }
    # Per image: its i2t hit and its captions' t2i hits at each k, and [1, its caption count]; resampled
    # by image (an image brings its captions).
    per = refs_lib.PerImage()
    hits = {
      "i2t": np.stack([i2t_ranks < k for k in ks], 1).astype(np.float64),
      "t2i": np.stack([np.bincount(t2i_map, t2i_ranks < k, minlength=n_img) for k in ks], 1),
      "n": np.stack([np.ones(n_img), np.bincount(t2i_map, minlength=n_img)], 1).astype(np.float64),
    }
    per.add_rows(**hits)

    def fn(s):
      out = {}
      for j, k in enumerate(ks):
        out[f"i2t_r{k}"] = s["i2t"][:, j] / s["n"][:, 0]
        out[f"t2i_r{k}"] = s["t2i"][:, j] / s["n"][:, 1]
      return out

    boot = refs_lib.bootstrap(per, fn, int(self.cfg["bootstrap"]))
    res = {}
    for direction in ("i2t", "t2i"):
      for k in ks:
        res[self.key(f"{direction}_r{k}")] = 100.0 * recalls[direction][k]
        _, lo, hi = boot[f"{direction}_r{k}"]
        res[self.key(f"{direction}_r{k}_ci_lo")], res[self.key(f"{direction}_r{k}_ci_hi")] = (
          100.0 * lo,
          100.0 * hi,
        )
    res[self.key("num_images")] = float(n_img)
    res[self.key("num_texts")] = float(len(texts))
    return res


def retrieval_ranks_chunked(
  image_emb: np.ndarray, text_emb: np.ndarray, text_to_image: np.ndarray, chunk_size: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
  """(i2t ranks (N_img,), t2i ranks (N_txt,)) of `metrics.retrieval_ranks`, computed in row blocks."""
  image_emb = np.asarray(image_emb, np.float32)
  text_emb = np.asarray(text_emb, np.float32)
  t2i = np.asarray(text_to_image).reshape(-1)
  n_img, n_txt = image_emb.shape[0], text_emb.shape[0]
  ones_t, ones_i = np.ones(n_txt, bool), np.ones(n_img, bool)
  i2t_ranks, t2i_ranks = [], []
  for s in range(0, n_img, chunk_size):
    rows = np.arange(s, min(n_img, s + chunk_size))
    sim = image_emb[rows] @ text_emb.T
    pos = t2i[None, :] == rows[:, None]
    i2t_ranks.append(metrics_lib.best_rank_of_positives(sim, pos, ones_t))
  for s in range(0, n_txt, chunk_size):
    rows = np.arange(s, min(n_txt, s + chunk_size))
    sim = text_emb[rows] @ image_emb.T
    pos = np.arange(n_img)[None, :] == t2i[rows][:, None]
    t2i_ranks.append(metrics_lib.best_rank_of_positives(sim, pos, ones_i))
  return np.concatenate(i2t_ranks), np.concatenate(t2i_ranks)


def retrieval_recall_chunked(
  image_emb: np.ndarray,
  text_emb: np.ndarray,
  text_to_image: np.ndarray,
  ks=(1, 5, 10),
  chunk_size: int = 1024,
) -> dict[str, dict[int, float]]:
  """Same result as metrics.retrieval_recall(image_emb @ text_emb.T, ...), computed in row blocks.

  Only real (unpadded) images and texts are passed here, so no masks are needed.
  """
  i2t, t2i = retrieval_ranks_chunked(image_emb, text_emb, text_to_image, chunk_size)
  return {"i2t": metrics_lib.recall_from_ranks(i2t, ks), "t2i": metrics_lib.recall_from_ranks(t2i, ks)}
