"""Patch masks for masked image modelling (iBOT / TIPSv2), seeded per example.

Why a module of its own: the number of masked patches must be *exact* (round(ratio * N)) so that
the iBOT loss normaliser and the student's mask-token budget are identical for every image of a
batch and every run. Both generators below take a numpy Generator (the per-example RNG of the
pipeline), so the same seed and example index always give the same mask, independent of how many
workers produce the batch. Convention (contract): bool (gh, gw), True = masked.
"""

from __future__ import annotations

import math

import numpy as np

from tipsito.choices import MASK_TYPES

__all__ = ['num_masked', 'grid_size', 'random_mask', 'block_mask', 'make_mask', 'MASK_TYPES']


def grid_size(image_size: int, patch_size: int) -> int:
  """Patch-grid side for a square image; the ViT centre zero-pads non-multiples, hence ceil."""
  return -(-int(image_size) // int(patch_size))


def num_masked(gh: int, gw: int, ratio: float) -> int:
  """The exact number of masked patches for a (gh, gw) grid: round(ratio * N), clipped to [0, N]."""
  if not 0.0 <= ratio <= 1.0:
    raise ValueError(f'mask ratio must be in [0, 1], got {ratio}')
  n = gh * gw
  return int(min(n, max(0, round(ratio * n))))


def random_mask(rng: np.random.Generator, gh: int, gw: int, ratio: float) -> np.ndarray:
  """Uniformly random patches, exactly round(ratio*N) of them (MAE/iBOT 'rand' masking)."""
  n = gh * gw
  k = num_masked(gh, gw, ratio)
  mask = np.zeros(n, dtype=bool)
  if k:
    mask[rng.permutation(n)[:k]] = True
  return mask.reshape(gh, gw)


def block_mask(
  rng: np.random.Generator,
  gh: int,
  gw: int,
  ratio: float,
  *,
  min_num_patches: int = 4,
  min_aspect: float = 0.3,
  max_aspect: float | None = None,
  max_attempts: int = 10,
) -> np.ndarray:
  """BEiT/iBOT blockwise masking with an exact final count.

  Rectangles with a log-uniform aspect ratio and an area drawn in [min_num_patches, remaining]
  are placed until the target count is reached (BEiT's `MaskingGenerator`). BEiT may stop short
  when no block fits; we then top up with random unmasked patches that touch the masked region
  (falling back to any unmasked patch), so the count is always exactly round(ratio*N).
  """
  target = num_masked(gh, gw, ratio)
  mask = np.zeros((gh, gw), dtype=bool)
  if target == 0:
    return mask
  max_aspect = max_aspect or 1.0 / min_aspect
  log_aspect = (math.log(min_aspect), math.log(max_aspect))
  count = 0
  stalls = 0
  while count < target and stalls < 3:
    remaining = target - count
    lo = min(min_num_patches, remaining)
    delta = 0
    for _ in range(max_attempts):
      area = rng.uniform(lo, remaining)
      aspect = math.exp(rng.uniform(*log_aspect))
      h = int(round(math.sqrt(area * aspect)))
      w = int(round(math.sqrt(area / aspect)))
      if 0 < h < gh and 0 < w < gw:
        top = int(rng.integers(0, gh - h + 1))
        left = int(rng.integers(0, gw - w + 1))
        block = mask[top : top + h, left : left + w]
        new = h * w - int(block.sum())
        if 0 < new <= remaining:
          block[...] = True
          delta = new
          break
    if delta == 0:
      stalls += 1
    else:
      stalls = 0
      count += delta
  if count < target:  # top up, preferring the boundary of the existing blocks
    grow = np.zeros_like(mask)
    grow[1:] |= mask[:-1]
    grow[:-1] |= mask[1:]
    grow[:, 1:] |= mask[:, :-1]
    grow[:, :-1] |= mask[:, 1:]
    border = np.flatnonzero(grow & ~mask)
    rest = np.flatnonzero(~grow & ~mask)
    order = np.concatenate([rng.permutation(border), rng.permutation(rest)])
    flat = mask.reshape(-1)
    flat[order[: target - count]] = True
  return mask


def make_mask(rng: np.random.Generator, gh: int, gw: int, ratio: float, kind: str = 'random') -> np.ndarray:
  """Dispatch on `config.input.mask_type` ('random' | 'block')."""
  if kind == 'random':
    return random_mask(rng, gh, gw, ratio)
  if kind == 'block':
    return block_mask(rng, gh, gw, ratio)
  raise ValueError(f'unknown mask_type {kind!r}; expected one of {MASK_TYPES}')
