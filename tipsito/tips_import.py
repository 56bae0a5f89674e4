"""Strict importer of the official TIPS weights (Scenic `.npz` files) into tipsito module params.

Why separate from the export format (tipsito/export_format.py): this reads someone else's format and is
used by the export CLI (tipsito/export.py) and by distillation from official weights
(tipsito/train/teacher.py); the export format is tipsito's own and knows nothing about it.

The official checkpoints are flat `np.savez` files with '/'-joined flax keys (tests/data/tips_model/).
The architecture is inferred from array shapes and the mapping is strict: every key must be used, none may
be missing, and shapes must match the inferred architecture; errors name the key and the expected/actual
shapes.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

import numpy as np

from tipsito.config import presets
from tipsito.models import kwargs as kwargs_lib
from tipsito.models.text import TextEncoder
from tipsito.models.vit import VisionTransformer


class CheckpointFormatError(ValueError):
  """A checkpoint whose keys or shapes do not match what is expected."""


_BLOCK_RE = re.compile(r'^(?P<prefix>.*?)encoderblock_(?P<i>\d+)/(?P<rest>.*)$')

# official block sub-path -> tipsito block sub-path
_BLOCK_MAP = {
  'LayerNorm_0': 'norm1',
  'LayerNorm_1': 'norm2',
  'MultiHeadDotProductAttention_0': 'attn',
  'MlpBlock_0': 'mlp',
  'FFNSwiGluFused_0': 'mlp',
}
_VISION_MAP = {
  'encoder/ToTokenSequence_0/cls': 'cls',
  'encoder/ToTokenSequence_0/embedding/kernel': 'patch_embed/kernel',
  'encoder/ToTokenSequence_0/embedding/bias': 'patch_embed/bias',
  'encoder/ToTokenSequence_0/posembed_input': 'posemb',
  'encoder/encoder_norm/scale': 'norm/scale',
  'encoder/encoder_norm/bias': 'norm/bias',
}
_TEXT_MAP = {
  'token_emb/emb_var': 'token_emb/embedding',
  'text_encoder_norm/scale': 'norm/scale',
  'text_encoder_norm/bias': 'norm/bias',
}
_TEMPERATURE_KEY = 'temperature_contrastive'
# The names a text .npz may give its temperature: the released files use 'temperature_contrastive' (what
# the exporter writes); the upstream loader also accepts 'temperature' (its commit d0f55cb).
_TEMPERATURE_KEYS = (_TEMPERATURE_KEY, 'temperature')


def _load_flat(path_or_dict) -> dict[str, np.ndarray]:
  """Reads a flat {key: array} from an .npz path or passes a mapping through."""
  if isinstance(path_or_dict, Mapping):
    return {k: np.asarray(v) for k, v in path_or_dict.items()}
  with np.load(os.fspath(path_or_dict), allow_pickle=False) as f:
    return {k: f[k] for k in f.files}


def _need(flat: Mapping[str, np.ndarray], key: str, what: str, ndim: int) -> tuple[int, ...]:
  """Shape of a key used to infer the architecture, or a clear error."""
  if key not in flat:
    raise CheckpointFormatError(f'missing key {key!r} (needed to infer {what}); keys present: {len(flat)}')
  shape = tuple(flat[key].shape)
  if len(shape) != ndim:
    raise CheckpointFormatError(f'key {key!r} has shape {shape}, expected a {ndim}-d array ({what})')
  return shape


def _block_ids(flat: Mapping[str, Any], prefix: str) -> list[int]:
  """Sorted encoder block indices present under `prefix`."""
  ids = set()
  for k in flat:
    m = _BLOCK_RE.match(k)
    if m and m.group('prefix') == prefix:
      ids.add(int(m.group('i')))
  return sorted(ids)


def _mlp_dim_for_swiglu(hidden: int, width: int) -> int:
  """An mlp_dim whose SwiGLU hidden size is `hidden` (preset values first)."""
  cands = [p['mlp_dim'] for p in presets.VIT_PRESETS.values() if p['width'] == width]
  cands += [4 * width, round(hidden * 3 / 2)]
  cands += list(range(hidden, 2 * hidden + 16))
  for m in cands:
    if presets.swiglu_hidden_dim(m) == hidden:
      return int(m)
  raise CheckpointFormatError(f'no mlp_dim gives SwiGLU hidden size {hidden}')


def infer_vision_config(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """VisionTransformer kwargs of an official TIPS vision checkpoint."""
  kshape = _need(flat, 'encoder/ToTokenSequence_0/embedding/kernel', 'patch size and width', 4)
  if kshape[0] != kshape[1] or kshape[2] != 3:
    raise CheckpointFormatError(
      f"key 'encoder/ToTokenSequence_0/embedding/kernel' has shape {kshape}, expected (p, p, 3, width)"
    )
  patch, width = kshape[0], kshape[3]
  cls_shape = _need(flat, 'encoder/ToTokenSequence_0/cls', 'CLS count', 3)
  pos_shape = _need(flat, 'encoder/ToTokenSequence_0/posembed_input', 'posemb grid', 4)
  prefix = 'encoder/transformer/'
  ids = _block_ids(flat, prefix)
  if not ids:
    raise CheckpointFormatError(f'no {prefix}encoderblock_* keys found')
  depth = ids[-1] + 1
  b0 = f'{prefix}encoderblock_0/'
  q = _need(flat, b0 + 'MultiHeadDotProductAttention_0/query/kernel', 'number of heads', 3)
  swiglu = any(k.startswith(b0 + 'FFNSwiGluFused_0/') for k in flat)
  if swiglu:
    hidden = _need(flat, b0 + 'FFNSwiGluFused_0/Dense_0/kernel', 'SwiGLU size', 2)[1]
    mlp_dim = _mlp_dim_for_swiglu(hidden, width)
  else:
    mlp_dim = _need(flat, b0 + 'MlpBlock_0/Dense_0/kernel', 'MLP size', 2)[1]
  grid = pos_shape[1] if pos_shape[1] == pos_shape[2] else list(pos_shape[1:3])
  return dict(
    patch_size=int(patch),
    width=int(width),
    depth=int(depth),
    num_heads=int(q[1]),
    mlp_dim=int(mlp_dim),
    ffn='swiglu' if swiglu else 'mlp',
    num_cls_tokens=int(cls_shape[1]),
    posemb_grid=grid,
    pixel_mean=[0.0, 0.0, 0.0],
    pixel_std=[1.0, 1.0, 1.0],
  )


def infer_text_config(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """TextEncoder kwargs of an official TIPS text checkpoint."""
  vocab, width = _need(flat, 'token_emb/emb_var', 'vocabulary and width', 2)
  ids = _block_ids(flat, 'transformer/')
  if not ids:
    raise CheckpointFormatError('no transformer/encoderblock_* keys found')
  b0 = 'transformer/encoderblock_0/'
  q = _need(flat, b0 + 'MultiHeadDotProductAttention_0/query/kernel', 'number of heads', 3)
  mlp_dim = _need(flat, b0 + 'MlpBlock_0/Dense_0/kernel', 'MLP size', 2)[1]
  return dict(
    flavour='tips',
    vocab_size=int(vocab),
    max_len=64,
    width=int(width),
    depth=int(ids[-1] + 1),
    num_heads=int(q[1]),
    mlp_dim=int(mlp_dim),
    out_dim=None,
  )


def _official_to_tipsito(key: str, top: Mapping[str, str], block_prefix: str) -> Optional[str]:
  """Maps one official flat key to a tipsito flat key (None if unknown)."""
  if key in top:
    return top[key]
  m = _BLOCK_RE.match(key)
  if not m or m.group('prefix') != block_prefix:
    return None
  first, _, rest = m.group('rest').partition('/')
  if first not in _BLOCK_MAP or not rest:
    return None
  return f"block_{m.group('i')}/{_BLOCK_MAP[first]}/{rest}"


def _expected_flat(module, dummy_input) -> dict[str, tuple[int, ...]]:
  """Flat {key: shape} of a module's params via jax.eval_shape (no memory)."""
  import jax
  from flax import traverse_util

  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), dummy_input)
  flat = traverse_util.flatten_dict(shapes['params'], sep='/')
  return {k: tuple(v.shape) for k, v in flat.items()}


def _convert_strict(
  flat: Mapping[str, np.ndarray],
  expected: Mapping[str, tuple],
  top: Mapping[str, str],
  block_prefix: str,
  what: str,
) -> dict[str, Any]:
  """Renames official keys to tipsito keys; every key used, none missing."""
  from flax import traverse_util

  inv: dict[str, str] = {}
  out: dict[str, np.ndarray] = {}
  unexpected = []
  for key in sorted(flat):
    new = _official_to_tipsito(key, top, block_prefix)
    if new is None or new not in expected:
      unexpected.append(f'{key!r} shape {tuple(flat[key].shape)}')
      continue
    inv[new] = key
    arr = np.asarray(flat[key])
    if tuple(arr.shape) != expected[new]:
      raise CheckpointFormatError(
        f'{what} checkpoint key {key!r} has shape {tuple(arr.shape)}, '
        f'expected {expected[new]} for the inferred architecture'
      )
    out[new] = arr.astype(np.float32)
  if unexpected:
    raise CheckpointFormatError(
      f'{what} checkpoint has unexpected keys (not used by the inferred '
      f'architecture): {", ".join(unexpected)}'
    )
  missing = [k for k in expected if k not in out]
  if missing:
    off = {v: k for k, v in top.items()}

    def official_name(k):
      if k in off:
        return off[k]
      m = re.match(r'^block_(\d+)/(\w+)/(.*)$', k)
      if m:
        sub = [o for o, t in _BLOCK_MAP.items() if t == m.group(2)]
        return f'{block_prefix}encoderblock_{m.group(1)}/{"|".join(sub)}/{m.group(3)}'
      return k

    raise CheckpointFormatError(
      f'{what} checkpoint is missing keys: '
      + ', '.join(f'{official_name(k)!r} (expected shape {expected[k]})' for k in missing)
    )
  return traverse_util.unflatten_dict(out, sep='/')


def import_tips_vision(image_npz) -> tuple[dict[str, Any], dict[str, Any]]:
  """(VisionTransformer kwargs, params) from an official TIPS vision .npz; the kwargs state every key of
  the module (tipsito/models/kwargs.py: complete_tower_config), as an export's config does."""
  import jax.numpy as jnp

  flat = _load_flat(image_npz)
  cfg = infer_vision_config(flat)
  p = cfg['patch_size']
  expected = _expected_flat(VisionTransformer(**cfg), jnp.zeros((1, p, p, 3), jnp.float32))
  params = _convert_strict(flat, expected, _VISION_MAP, 'encoder/transformer/', 'vision')
  cfg, _ = kwargs_lib.complete_tower_config(cfg, 'image', 'official TIPS vision weights')
  return cfg, params


def _pop_temperature(flat: dict[str, Any]) -> np.ndarray:
  """Removes and returns the 0-d temperature stored under either of `_TEMPERATURE_KEYS`."""
  found = [k for k in _TEMPERATURE_KEYS if k in flat]
  if not found:
    raise CheckpointFormatError(
      f'text checkpoint is missing its temperature: one of keys {list(_TEMPERATURE_KEYS)} (shape ())'
    )
  values = {k: np.asarray(flat.pop(k)) for k in found}
  for k, v in values.items():
    if v.shape != ():
      raise CheckpointFormatError(f'text checkpoint key {k!r} has shape {v.shape}, expected ()')
  if len(values) > 1 and len({float(v) for v in values.values()}) > 1:
    raise CheckpointFormatError(
      f'text checkpoint has two different temperatures: { ({k: float(v) for k, v in values.items()}) }'
    )
  return values[found[0]]


def import_tips_text(text_npz) -> tuple[dict[str, Any], dict[str, Any], float]:
  """(TextEncoder kwargs, params, temperature) from an official text .npz; the kwargs state every key
  of the module, as `import_tips_vision`'s."""
  import jax.numpy as jnp

  flat = _load_flat(text_npz)
  temp = _pop_temperature(flat)
  cfg = infer_text_config(flat)
  expected = _expected_flat(TextEncoder(**cfg), jnp.zeros((1, 4), jnp.int32))
  params = _convert_strict(flat, expected, _TEXT_MAP, 'transformer/', 'text')
  cfg, _ = kwargs_lib.complete_tower_config(cfg, 'text', 'official TIPS text weights')
  return cfg, params, float(temp)


def import_tips_npz(image_npz, text_npz):
  """Imports a released TIPS model (vision .npz + text .npz).

  Returns (image_config dict, text_config dict,
  params {'image': ..., 'text': ...}, temperature float).
  """
  icfg, iparams = import_tips_vision(image_npz)
  tcfg, tparams, temp = import_tips_text(text_npz)
  if icfg['width'] != tcfg['width']:
    raise CheckpointFormatError(
      f"image width {icfg['width']} != text width {tcfg['width']}: TIPS "
      'compares CLS and text embeddings directly'
    )
  return icfg, tcfg, {'image': iparams, 'text': tparams}, temp
