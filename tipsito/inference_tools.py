"""The image inputs and zero-shot classification of `tipsito.inference.Encoder` (preprocess, classify).

Why apart from inference.py: these are the user-facing conveniences around the jitted towers (files,
PIL images, single images, prompt ensembling), and they reuse the evaluation code's own pieces, so that
`enc.classify` and the `zeroshot` eval compute the same thing:
  * images are decoded by the training decoder and resized by the one deterministic eval resize
    (tipsito/data/transforms.py: open_image, fixed_size_image; 'center_crop' by default, as the evals);
  * class embeddings are the zero-shot eval's: prompts from tipsito/evals/templates.py, each embedded and
    L2-normalised, averaged over templates, renormalised; an image's CLS (`cls_index`) is L2-normalised
    and logits = cos / T with the model's temperature T.
Those pieces are imported when a function here first needs them, not with this module: `tipsito.load`
and `embed_images` on arrays import no eval or data module (tests/test_import_structure.py
`test_load_imports_no_eval_or_data_module`); decoding a file or classifying does.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np

TEXT_CHUNK = 64  # prompts per text call (fixed, so that one shape compiles; the last chunk is padded)


def _is_single(x: Any) -> bool:
  """One image: a path, bytes, a PIL image or an (H, W, C) array (not a batch or a list)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top

  if isinstance(x, (str, os.PathLike, bytes, bytearray, Image.Image)):
    return True
  return hasattr(x, 'ndim') and x.ndim in (2, 3)


def _decode(item: Any, size: int, resize: str) -> np.ndarray:
  """One image of any accepted kind -> (size, size, 3) uint8 through the eval decoder and resize."""
  from tipsito.data import transforms as T  # lazy: not under tipsito.load (docstring)

  value = item
  if isinstance(item, (str, os.PathLike)):
    from etils import epath  # pylint: disable=g-import-not-at-top

    path = epath.Path(os.path.expanduser(os.fspath(item)))
    if not path.is_file():
      raise FileNotFoundError(f'image file not found: {os.fspath(item)}')
    value = path.read_bytes()
  elif hasattr(item, 'ndim') and not isinstance(item, np.ndarray):  # jax / other array types
    value = np.asarray(item)
  try:
    return T.fixed_size_image(T.open_image(value), size, resize)
  except T.SkipExample as e:
    raise ValueError(
      f'cannot read image {item if isinstance(item, (str, os.PathLike)) else type(item)}: {e}'
    ) from None


def to_unit_batch(images: Any, size: int, resize: str = 'center_crop') -> np.ndarray:
  """Images (one or many; paths, bytes, PIL images or arrays) -> float32 (B, size, size, 3) in [0, 1],
  each decoded and resized by the eval resize."""
  if _is_single(images):
    images = [images]
  items = list(images)
  if not items:
    raise ValueError('no images given')
  out = np.stack([_decode(i, int(size), resize) for i in items])
  return out.astype(np.float32) / 255.0


def model_input(image_model, x: np.ndarray) -> np.ndarray:
  """[0, 1] images -> what the patch embedding sees: (x - mean) / std, centre zero-padded to whole
  patches (tipsito/models/vit.py: VisionTransformer.preprocess, the model's own first step)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return np.asarray(image_model.preprocess(jnp.asarray(x, jnp.float32)))


def class_embeddings(encoder, class_names: Sequence[str], templates: Sequence[str]) -> np.ndarray:
  """(C, D) class embeddings of the zero-shot protocol (tipsito/evals/evaluator.py: class_text_embeddings)."""
  from tipsito.evals import metrics  # lazy: not under tipsito.load (docstring)
  from tipsito.evals import templates as templates_lib  # lazy: not under tipsito.load (docstring)

  prompts = templates_lib.fill(templates, class_names)
  out = []
  for start in range(0, len(prompts), TEXT_CHUNK):
    chunk = prompts[start : start + TEXT_CHUNK]
    n = len(chunk)
    chunk = chunk + [chunk[-1]] * (TEXT_CHUNK - n)
    out.append(np.asarray(encoder.embed_texts(chunk), np.float32)[:n])
  emb = metrics.l2_normalize(np.concatenate(out, 0)).reshape(len(class_names), len(templates), -1)
  return np.asarray(metrics.l2_normalize(emb.mean(axis=1)))


def classify(
  encoder,
  images: Any,
  class_names: Sequence[str],
  templates=None,
  *,
  size: Optional[int] = None,
  cls_index: int = 0,
  project: Optional[bool] = None,
) -> np.ndarray:
  """Zero-shot class probabilities (B, C): softmax over classes of cos(CLS, class embedding) / T."""
  from tipsito.evals import metrics  # lazy: not under tipsito.load (docstring)
  from tipsito.evals import templates as templates_lib  # lazy: not under tipsito.load (docstring)

  if isinstance(class_names, str):
    raise TypeError('class_names must be a list of names, not one string')
  templates = templates_lib.get_templates(templates)
  out = encoder.embed_images(images, project=project, values=False, size=size)
  cls = np.asarray(out['cls'], np.float32)
  if cls_index >= cls.shape[1]:
    raise ValueError(f'cls_index {cls_index} but the model has {cls.shape[1]} CLS tokens')
  feats = np.asarray(metrics.l2_normalize(cls[:, cls_index]))
  emb = class_embeddings(encoder, class_names, templates)
  if feats.shape[1] != emb.shape[1]:
    raise ValueError(
      f'image dim {feats.shape[1]} != text dim {emb.shape[1]} (project=True for models '
      'with an image projection)'
    )
  logits = (feats.astype(np.float64) @ emb.T.astype(np.float64)) / float(encoder.temperature)
  logits -= logits.max(axis=-1, keepdims=True)
  probs = np.exp(logits)
  return (probs / probs.sum(axis=-1, keepdims=True)).astype(np.float32)
