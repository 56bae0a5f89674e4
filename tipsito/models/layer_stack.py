"""Converting tower params between per-layer blocks and one scanned stack.

Why: a tower with `scan=True` (tipsito.models.vit / text) keeps its blocks as
one `nn.scan` whose params sit under `blocks/...` with a leading depth axis,
so XLA compiles one block instead of `depth` (a ViT-g/14 step compiles in
minutes). Everything that leaves or enters training in a fixed format stays
per-layer (`block_{i}/...`): the export (tipsito.export_format.write_export), the
TIPS .npz import, inference. These functions are the only bridge, and they
are exact (pure reshuffles, no arithmetic), tested both ways in
tests/test_models_scan.py.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import numpy as np

STACK_KEY = 'blocks'
_BLOCK_RE = re.compile(r'^block_(\d+)$')
# Top-level parts of the training model whose params may be scanned.
TOWERS = ('image', 'text')


def is_stacked(tower: Mapping[str, Any]) -> bool:
  """True when a tower's params hold a scanned `blocks` stack."""
  return STACK_KEY in tower


def block_ids(tower: Mapping[str, Any]) -> list[int]:
  """Sorted layer indices of the per-layer `block_{i}` entries of a tower."""
  return sorted(int(m.group(1)) for k in tower if (m := _BLOCK_RE.match(k)))


def stack_tower(tower: Mapping[str, Any]) -> dict:
  """{block_0..block_{n-1}, rest} -> {'blocks': leaves stacked on axis 0, rest}.

  Leaves are stacked with the array library they come in (numpy or jax).
  """
  ids = block_ids(tower)
  if not ids:
    if is_stacked(tower):
      return dict(tower)
    raise ValueError(f'no block_{{i}} params to stack (keys: {sorted(tower)})')
  if ids != list(range(len(ids))):
    raise ValueError(f'block indices are not 0..{len(ids) - 1}: {ids}')
  layers = [tower[f'block_{i}'] for i in ids]
  ref = jax.tree_util.tree_structure(layers[0])
  for i, t in enumerate(layers):
    if jax.tree_util.tree_structure(t) != ref:
      raise ValueError(f'block_{i} has a different param structure from block_0; cannot stack')
  xp = np if isinstance(jax.tree.leaves(layers[0])[0], np.ndarray) else jax.numpy
  out = {k: v for k, v in tower.items() if not _BLOCK_RE.match(k)}
  out[STACK_KEY] = jax.tree.map(lambda *xs: xp.stack(xs), *layers)
  return out


def unstack_tower(tower: Mapping[str, Any]) -> dict:
  """{'blocks': stacked, rest} -> {block_0..block_{n-1}, rest} (inverse of stack_tower)."""
  if not is_stacked(tower):
    return dict(tower)
  stacked = tower[STACK_KEY]
  depth = {int(np.shape(x)[0]) for x in jax.tree.leaves(stacked)}
  if len(depth) != 1:
    raise ValueError(f'stacked blocks with different leading sizes {depth}')
  n = depth.pop()
  out = {k: v for k, v in tower.items() if k != STACK_KEY}
  for i in range(n):
    out[f'block_{i}'] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return out


def to_per_layer(params: Mapping[str, Any]) -> dict:
  """Whole training/export param tree with every scanned tower unstacked."""
  return {k: unstack_tower(v) if k in TOWERS and isinstance(v, Mapping) else v for k, v in params.items()}


def to_layout(params: Mapping[str, Any], scan: Mapping[str, bool]) -> dict:
  """Param tree with each tower in the layout its model wants.

  `scan` maps a tower name ('image', 'text') to its config's `scan` flag; a
  tower already in that layout is returned as is. Used to load per-layer
  weights (an export, converted TIPS weights) into a scanned model and back.
  """
  out = dict(params)
  for k in TOWERS:
    if k in out and isinstance(out[k], Mapping):
      out[k] = stack_tower(out[k]) if scan.get(k) else unstack_tower(out[k])
  return out
