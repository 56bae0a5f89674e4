"""Synthetic data: host batches (random uint8 images, token ids and iBOT masks with every field a config's
recipe and views need) and photo-like encoded records in the shared schema (`synthetic_source`).

Why a library module of its own: step time, FLOPs and memory are measured without any dataset on disk
(`python -m tipsito.bench.step_bench`, `python -m tipsito.plan`), decoding and conversion without images on
disk (`tipsito.data.pipeline_bench`, `tipsito.data.convert_bench`), and the tests build their batches the
same way; the command-line modules only call it.
"""

from __future__ import annotations

import io
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from tipsito.data import batch as batch_lib


def synthetic_batch(config, batch_size: Optional[int] = None, seed: int = 0, vocab_size: int = 100) -> dict:
  """A random host batch with every field the config's recipe/views need (bench, tests, info FLOPs): the
  fields and shapes of tipsito/data/batch.py's `BatchLayout`, images uniform uint8, token ids in
  [1, vocab_size) with a random length (zero-padded), masks with `config.input.mask_ratio` of the patches.

  Why: step time and FLOPs must be measurable without any dataset on disk.
  """
  rs = np.random.RandomState(seed)
  inp = config.input
  b = int(batch_size or inp.batch_size)
  shapes = batch_lib.BatchLayout.from_config(config).shapes(b)

  def text(length):
    ids = rs.randint(1, vocab_size, size=(b, length)).astype(np.int32)
    lens = rs.randint(2, length + 1, size=(b,))
    ids[np.arange(length)[None, :] >= lens[:, None]] = 0
    return ids

  def mask(gh):
    n = gh * gh
    k = int(round(float(inp.mask_ratio) * n))
    out = np.zeros((b, n), bool)
    for i in range(b):
      out[i, rs.permutation(n)[:k]] = True
    return out.reshape(b, gh, gh)

  batch = {}
  for name, (shape, dtype) in shapes.items():  # drawn in the layout's order (the same stream as before)
    if dtype == np.uint8:
      batch[name] = rs.randint(0, 256, size=shape, dtype=np.uint8)
    elif dtype == np.int32:
      batch[name] = text(shape[1])
    elif dtype == np.bool_:
      batch[name] = mask(shape[1])
    else:
      raise NotImplementedError(f"synthetic_batch: no random {dtype} field ({name!r}); add one here")
  return batch


def _photo_like(rng: np.random.Generator, h: int, w: int) -> Image.Image:
  """Smooth colour field + shapes: compresses and decodes like a photo, unlike white noise."""
  small = rng.integers(0, 256, (max(2, h // 32), max(2, w // 32), 3), dtype=np.uint8)
  img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
  draw = ImageDraw.Draw(img)
  for _ in range(6):
    x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
    x1, y1 = x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2))
    draw.ellipse((x0, y0, x1, y1), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
  noise = rng.normal(0, 6, (h, w, 3))
  arr = np.clip(np.asarray(img.filter(ImageFilter.GaussianBlur(1.0)), np.float32) + noise, 0, 255)
  return Image.fromarray(arr.astype(np.uint8))


def synthetic_source(num_images: int = 64, fmt: str = 'JPEG', size: int = 400, seed: int = 0) -> list[dict]:
  """Records in the shared schema with ~`size` px images (aspect 3:4..4:3) and three captions."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num_images):
    ar = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    h, w = int(round(size / np.sqrt(ar))), int(round(size * np.sqrt(ar)))
    buf = io.BytesIO()
    img = _photo_like(rng, h, w)
    img.save(buf, fmt, **({'quality': 90} if fmt == 'JPEG' else {}))
    out.append(
      {
        'image': buf.getvalue(),
        'alt_text': f'a photo number {i} of shapes',
        'caption_paligemma': f'several coloured ellipses on a smooth background {i}',
        'caption_gemini': f'an abstract picture with {i % 7 + 2} blobs',
        'id': str(i),
      }
    )
  return out
