"""`python -m tipsito.dense.pictures`: draw input, prediction and ground truth of a `tipsv2_dpt` folder.

    python -m tipsito.dense.pictures --model workdirs/dpt_depth/hf --out workdirs/dpt_depth/pictures.png

Why from the exported folder: the picture then shows what transformers will compute from the same folder
(tests/test_dense_dpt.py checks the parity), not an in-memory state. One row per eval image of `scenes`
(generated, tipsito/dense/data.py): the image, the prediction and the ground truth, depth on one colour
scale shared by prediction and truth (inverse depth, near = bright), segmentation in a fixed palette, normals as RGB of
(n + 1) / 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from tipsito.dense import data as data_lib
from tipsito.models import dpt as dpt_lib
from tipsito.dense import eval as eval_lib
from tipsito.dense import train as train_lib


def _depth_rgb(d: np.ndarray, lo: float, hi: float) -> np.ndarray:
  """Inverse depth on [1/hi, 1/lo] (near = bright; inverse depth spreads the near range the ground
  and the objects occupy) through a dark-blue -> teal -> yellow ramp."""
  inv = 1 / np.maximum(d, 1e-6)
  t = np.clip((inv - 1 / hi) / (1 / lo - 1 / hi), 0, 1)[..., None]
  stops = np.array([[20, 20, 90], [30, 150, 140], [250, 230, 40]], np.float64)
  rgb = np.where(
    t < 0.5, stops[0] + (stops[1] - stops[0]) * 2 * t, stops[1] + (stops[2] - stops[1]) * (2 * t - 1)
  )
  return rgb.astype(np.uint8)


def _palette(n: int) -> np.ndarray:
  rng = np.random.default_rng(0)
  p = rng.integers(40, 255, (max(n, 1), 3)).astype(np.uint8)
  p[0] = 0
  return p


def draw(
  model: str, out: str, task: Optional[str] = None, num: int = 4, image_size: int = 64, scale: int = 3
) -> str:
  """Writes the picture of `num` scenes test images; returns its path."""
  image_config, tower, r = train_lib.load_encoder(model)
  if r is None:
    raise SystemExit(
      f'--model {model}: not a tipsv2_dpt folder (write one with python -m tipsito.dense.train --export)'
    )
  cfg = r['dpt_config']
  task = task or next(iter(r['heads']))
  split = data_lib.scenes_split('test', num, image_size=image_size)
  blocks = train_lib.frozen_blocks(image_config, tower, split.images, cfg.stages(int(image_config['depth'])))
  pred = np.asarray(dpt_lib.predict(cfg, task, jax.tree_util.tree_map(jnp.asarray, r['heads'][task]), blocks))
  rows = []
  for i in range(num):
    hw = split.images.shape[1:3]
    if task == 'depth':
      p = np.asarray(eval_lib._up(jnp.asarray(pred[i])[None, ..., None], hw))[0, ..., 0]  # pylint: disable=protected-access
      gt = split.targets['depth'][i]
      lo, hi = float(gt.min()), float(gt.max())
      cells = [_depth_rgb(p, lo, hi), _depth_rgb(gt, lo, hi)]
    elif task == 'segmentation':
      p = np.asarray(eval_lib._up(jnp.asarray(pred[i])[None], hw))[0].argmax(-1)  # pylint: disable=protected-access
      pal = _palette(cfg.num_labels)
      cells = [pal[p], pal[np.clip(split.targets['segmentation'][i], 0, cfg.num_labels - 1)]]
    else:
      p = np.asarray(eval_lib._up(jnp.asarray(pred[i])[None], hw))[0]  # pylint: disable=protected-access
      p = p / np.maximum(np.linalg.norm(p, axis=-1, keepdims=True), 1e-6)
      gt = split.targets['normals'][i] * split.targets['normals_valid'][i][..., None]
      cells = [((p + 1) * 127.5).astype(np.uint8), ((gt + 1) * 127.5).astype(np.uint8)]
    gap = np.full((hw[0], 2, 3), 255, np.uint8)
    rows.append(np.concatenate([split.images[i], gap, cells[0], gap, cells[1]], 1))
  grid = np.concatenate(
    [np.concatenate([r_, np.full((2, r_.shape[1], 3), 255, np.uint8)], 0) for r_ in rows], 0
  )
  img = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
  img.save(out)
  return out


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m tipsito.dense.pictures', description=__doc__.split('\n')[0])
  p.add_argument('--model', required=True, help='a tipsv2_dpt folder')
  p.add_argument('--out', required=True, help='the PNG to write')
  p.add_argument('--task', default=None, choices=dpt_lib.TASKS, help='default: the folder\'s first head')
  p.add_argument('--num', type=int, default=4)
  p.add_argument('--image_size', type=int, default=64)
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  a = parser().parse_args(argv)
  print(draw(a.model, a.out, a.task, a.num, a.image_size))
  return 0


if __name__ == '__main__':
  sys.exit(main())
