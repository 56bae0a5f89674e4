"""Inputs of the dense heads: the `scenes` testbed generated in memory, NYUv2 and ADE20K read where they lie.

Why in memory: the heads train on frozen features computed once (tipsito/dense/train.py), so a split is a
few thousand small arrays; `scenes` examples are a pure function of (seed, split, index)
(tipsito/data/builders/scenes_gen.py), so generating them here gives exactly the records the TFDS build
of `python -m tipsito.train --config configs/demo.py` writes (same seed 0), without TFDS.

A split is a `DenseSplit`: `images` (N, S, S, 3) uint8 at the model's input size and, per task, the
targets at the same size for training (`depth` metres, 0 = no depth; `segmentation` class ids with
`ignore_index`; `normals` unit xyz with `normals_valid`), plus `native` targets at their own resolution
for scoring (NYUv2 / ADE20K images are resized for the model; their metrics are computed at the ground
truth's size, as the linear probes do, tipsito/evals/probes.py).

Surface normals of `scenes` come from its depth maps (the testbed has no normals of its own): each pixel
is back-projected with a pinhole camera of `NORMALS_FOV_DEG` horizontal field of view centred on the
image, P = d ((u - c) / f, (v - c) / f, 1); the normal is the normalised cross product of P's central
differences along x and y, oriented towards the camera (n_z < 0), in camera axes (x right, y down, z
forward). Pixels whose depth jumps by more than `NORMALS_MAX_JUMP` (relative) to a neighbour (object
borders) and the image border are not valid. With this camera the ground plane gets one smoothly varying
normal and each upright billboard object faces the camera (0, 0, -1).

Labels: scenes segmentation 0 = background, c + 1 = class c (13 classes scored, as its linear probe);
ADE20K 150 classes after `reduce_zero_label` (0 -> ignore); NYUv2 depth scored in (1 mm, 10 m).
"""

from __future__ import annotations

import dataclasses
import io
from typing import Optional

import numpy as np
from PIL import Image

from tipsito.data import dense_benchmarks
from tipsito.data.builders import scenes_gen

NORMALS_FOV_DEG = 60.0
NORMALS_MAX_JUMP = 0.05
DATASETS = ('scenes', 'nyuv2', 'ade20k', 'toy')
TOY_PATCH = 8  # the toy's cells: one colour per 8 x 8 cell, the patch of the tests' towers


@dataclasses.dataclass
class DenseSplit:
  """One split's images and targets (see the module docstring); `native` holds per-example GT arrays."""

  images: np.ndarray
  targets: dict
  native: dict
  num_classes: int = 0
  ignore_index: int = 255
  min_depth: float = 1e-3
  max_depth: float = 10.0

  def __len__(self) -> int:
    return len(self.images)


def normals_from_depth(depth: np.ndarray, fov_deg: float = NORMALS_FOV_DEG) -> tuple[np.ndarray, np.ndarray]:
  """(H, W) depth in metres -> ((H, W, 3) unit normals, (H, W) bool valid); see the module docstring."""
  h, w = depth.shape
  f = 0.5 * w / np.tan(np.deg2rad(fov_deg) / 2)
  v, u = np.mgrid[0:h, 0:w].astype(np.float64)
  d = depth.astype(np.float64)
  pts = np.stack([d * (u - (w - 1) / 2) / f, d * (v - (h - 1) / 2) / f, d], -1)
  dx = np.zeros_like(pts)
  dy = np.zeros_like(pts)
  dx[:, 1:-1] = pts[:, 2:] - pts[:, :-2]
  dy[1:-1] = pts[2:] - pts[:-2]
  n = np.cross(dx, dy)
  norm = np.linalg.norm(n, axis=-1, keepdims=True)
  n = n / np.maximum(norm, 1e-12)
  n = np.where(n[..., 2:3] > 0, -n, n)  # towards the camera
  valid = (norm[..., 0] > 0) & (d > 0)
  jump = np.zeros((h, w), bool)
  rel = lambda a, b: np.abs(a - b) / np.maximum(np.minimum(a, b), 1e-6) > NORMALS_MAX_JUMP
  jump[:, 1:-1] |= rel(d[:, 2:], d[:, 1:-1]) | rel(d[:, :-2], d[:, 1:-1])
  jump[1:-1] |= rel(d[2:], d[1:-1]) | rel(d[:-2], d[1:-1])
  border = np.zeros((h, w), bool)
  border[0], border[-1], border[:, 0], border[:, -1] = True, True, True, True
  return n.astype(np.float32), valid & ~jump & ~border


def scenes_split(split: str, n: int, image_size: int = 64, seed: int = 0, offset: int = 0) -> DenseSplit:
  """`n` scenes examples (indices offset .. offset + n - 1) with depth, segmentation and normals."""
  images, depth, seg, normals, nvalid = [], [], [], [], []
  for i in range(offset, offset + n):
    ex = scenes_gen.generate(i, split=split, image_size=image_size, seed=seed)
    d = ex['depth'].reshape(image_size, image_size).astype(np.float32) / 1000.0
    nm, nv = normals_from_depth(d)
    images.append(ex['image'])
    depth.append(d)
    seg.append(ex['segmentation'].reshape(image_size, image_size))
    normals.append(nm)
    nvalid.append(nv)
  targets = dict(
    depth=np.stack(depth),
    segmentation=np.stack(seg).astype(np.int32),
    normals=np.stack(normals),
    normals_valid=np.stack(nvalid),
  )
  native = {k: list(v) for k, v in targets.items()}
  native['image'] = images
  return DenseSplit(np.stack(images), targets, native, len(scenes_gen.CLASSES) + 1)


def toy_split(split: str, n: int, image_size: int = 32) -> DenseSplit:
  """A separable toy (tests, sanity checks): every TOY_PATCH cell is red or blue at random (seeded by the
  split), with a little pixel noise; class 1 = red, 0 = blue; depth 2 m (red) or 6 m (blue); normals
  (0, 0, -1) (red) or (0, -0.6, -0.8) (blue). Chance: 50% pixel accuracy."""
  rng = np.random.default_rng({'train': 0, 'test': 1}.get(split, 2))
  g = image_size // TOY_PATCH
  red = rng.random((n, g, g)) < 0.5
  red = np.repeat(np.repeat(red, TOY_PATCH, 1), TOY_PATCH, 2)
  colour = np.where(red[..., None], np.array([220, 30, 30]), np.array([30, 30, 220]))
  images = np.clip(colour + rng.normal(0, 10, colour.shape), 0, 255).astype(np.uint8)
  normals = np.where(red[..., None], np.array([0, 0, -1.0]), np.array([0, -0.6, -0.8])).astype(np.float32)
  targets = dict(
    depth=np.where(red, 2.0, 6.0).astype(np.float32),
    segmentation=red.astype(np.int32),
    normals=normals,
    normals_valid=np.ones(red.shape, bool),
  )
  native = {k: list(v) for k, v in targets.items()}
  native['image'] = list(images)
  return DenseSplit(images, targets, native, num_classes=2)


def _decode(data: bytes) -> np.ndarray:
  return np.asarray(Image.open(io.BytesIO(data)))


def _resize(a: np.ndarray, size: int, resample) -> np.ndarray:
  mode = 'F' if a.dtype.kind == 'f' else None
  img = Image.fromarray(a, mode=mode) if mode else Image.fromarray(a)
  return np.asarray(img.resize((size, size), resample))


def benchmark_split(
  name: str, split: str, root: Optional[str], image_size: int, max_examples: Optional[int] = None
) -> DenseSplit:
  """NYUv2 (depth) or ADE20K (segmentation) from its published layout (tipsito/data/dense_benchmarks.py),
  images resized to image_size x image_size (bilinear), training targets resized (nearest)."""
  if name not in ('nyuv2', 'ade20k'):
    raise ValueError(f'dense data {name!r}: a benchmark is one of nyuv2, ade20k')
  bench = dense_benchmarks.benchmark(name)
  records = dense_benchmarks.open_split(name, split, root)
  n = len(records) if max_examples is None else min(len(records), int(max_examples))
  images, train_t, native, native_images = [], [], [], []
  for i in range(n):
    r = records[i]
    img = _decode(r['image'])
    if img.ndim == 2:
      img = np.repeat(img[..., None], 3, -1)
    img = np.ascontiguousarray(img[..., :3])
    images.append(_resize(img, image_size, Image.BILINEAR))
    if name == 'ade20k':
      native_images.append(img)  # the sliding-window protocol reads the image at its own size
    if name == 'nyuv2':
      gt = _decode(r['depth']).astype(np.float32) / 1000.0
    else:
      lab = _decode(r['segmentation']).astype(np.int32)
      gt = np.where(lab == 0, bench.ignore_index, lab - 1) if bench.reduce_zero_label else lab
      gt = gt.astype(np.int32)
    native.append(gt)
    train_t.append(_resize(gt.astype(np.float32), image_size, Image.NEAREST))
  key = 'depth' if name == 'nyuv2' else 'segmentation'
  t = np.stack(train_t) if train_t else np.zeros((0, image_size, image_size), np.float32)
  t = t if key == 'depth' else t.astype(np.int32)
  return DenseSplit(
    np.stack(images),
    {key: t},
    {key: native, 'image': native_images},
    num_classes=bench.num_classes or 0,
    ignore_index=bench.ignore_index,
    min_depth=bench.min_depth or 1e-3,
    max_depth=bench.max_depth or 10.0,
  )


def load_split(
  name: str,
  split: str,
  *,
  image_size: int,
  max_examples: int,
  data_dir: Optional[str] = None,
  offset: int = 0,
) -> DenseSplit:
  """A split of `DATASETS` (scenes: generated; nyuv2 / ade20k: read from `data_dir`)."""
  if name == 'scenes':
    return scenes_split(split, max_examples, image_size=image_size, offset=offset)
  if name == 'toy':
    return toy_split(split, max_examples, image_size=image_size)
  if name in DATASETS:
    return benchmark_split(name, split, data_dir, image_size, max_examples)
  raise ValueError(f'--data {name!r}: one of {DATASETS}')
