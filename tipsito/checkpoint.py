"""Checkpoint formats: import of released TIPS .npz weights, and tipsito exports.

Why here: the exported inference checkpoint is the one artefact shared by
training (writes it at the end of a run), the export CLI (also writes it from
released TIPS weights) and inference/evals (read it with `tipsito.load`). One
writer and one reader keep the format in one place.

Export layout (FORMAT_VERSION 1):
  DIR/config.json   {'format_version', 'image': VisionTransformer kwargs,
                     'text': TextEncoder kwargs, 'temperature', 'pixel_mean',
                     'pixel_std', 'tokenizer': 'tokenizer.model' | null,
                     'image_proj': bool, 'extra': {...}}
  DIR/params/       Orbax (StandardCheckpointer) tree {'image','text'[,'image_proj']}
  DIR/tokenizer.model  copy of the SentencePiece model, when one was given.

TIPS import: the official Scenic checkpoints are flat `np.savez` files with
'/'-joined flax keys (tests/data/tips_model/). The architecture is inferred
from array shapes and the mapping is strict: every key must be used, none may
be missing, and shapes must match the inferred architecture; errors name the
key and the expected/actual shapes.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, Optional

import numpy as np

FORMAT_VERSION = 1
ALLOWED_EXPORT_KEYS = ('image', 'text', 'image_proj')
# Path components that identify training-only parameters.
_FORBIDDEN_LEAF_PARTS = ('mask_token', 'fusion', 'head')


class CheckpointFormatError(ValueError):
  """A checkpoint whose keys or shapes do not match what is expected."""


# --------------------------------------------------------------------------
# Official TIPS .npz import
# --------------------------------------------------------------------------

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


def _load_flat(path_or_dict) -> dict[str, np.ndarray]:
  """Reads a flat {key: array} from an .npz path or passes a mapping through."""
  if isinstance(path_or_dict, Mapping):
    return {k: np.asarray(v) for k, v in path_or_dict.items()}
  with np.load(os.fspath(path_or_dict), allow_pickle=False) as f:
    return {k: f[k] for k in f.files}


def _need(flat: Mapping[str, np.ndarray], key: str, what: str,
          ndim: int) -> tuple[int, ...]:
  """Shape of a key used to infer the architecture, or a clear error."""
  if key not in flat:
    raise CheckpointFormatError(
        f'missing key {key!r} (needed to infer {what}); '
        f'keys present: {len(flat)}')
  shape = tuple(flat[key].shape)
  if len(shape) != ndim:
    raise CheckpointFormatError(
        f'key {key!r} has shape {shape}, expected a {ndim}-d array ({what})')
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
  from tipsito.models import presets
  cands = [p['mlp_dim'] for p in presets.VIT_PRESETS.values()
           if p['width'] == width]
  cands += [4 * width, round(hidden * 3 / 2)]
  cands += list(range(hidden, 2 * hidden + 16))
  for m in cands:
    if presets.swiglu_hidden_dim(m) == hidden:
      return int(m)
  raise CheckpointFormatError(f'no mlp_dim gives SwiGLU hidden size {hidden}')


def infer_vision_config(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """VisionTransformer kwargs of an official TIPS vision checkpoint."""
  kshape = _need(flat, 'encoder/ToTokenSequence_0/embedding/kernel',
                 'patch size and width', 4)
  if kshape[0] != kshape[1] or kshape[2] != 3:
    raise CheckpointFormatError(
        f"key 'encoder/ToTokenSequence_0/embedding/kernel' has shape {kshape},"
        ' expected (p, p, 3, width)')
  patch, width = kshape[0], kshape[3]
  cls_shape = _need(flat, 'encoder/ToTokenSequence_0/cls', 'CLS count', 3)
  pos_shape = _need(flat, 'encoder/ToTokenSequence_0/posembed_input',
                    'posemb grid', 4)
  prefix = 'encoder/transformer/'
  ids = _block_ids(flat, prefix)
  if not ids:
    raise CheckpointFormatError(f'no {prefix}encoderblock_* keys found')
  depth = ids[-1] + 1
  b0 = f'{prefix}encoderblock_0/'
  q = _need(flat, b0 + 'MultiHeadDotProductAttention_0/query/kernel',
            'number of heads', 3)
  swiglu = any(k.startswith(b0 + 'FFNSwiGluFused_0/') for k in flat)
  if swiglu:
    hidden = _need(flat, b0 + 'FFNSwiGluFused_0/Dense_0/kernel', 'SwiGLU size',
                   2)[1]
    mlp_dim = _mlp_dim_for_swiglu(hidden, width)
  else:
    mlp_dim = _need(flat, b0 + 'MlpBlock_0/Dense_0/kernel', 'MLP size', 2)[1]
  grid = pos_shape[1] if pos_shape[1] == pos_shape[2] else list(pos_shape[1:3])
  return dict(patch_size=int(patch), width=int(width), depth=int(depth),
              num_heads=int(q[1]), mlp_dim=int(mlp_dim),
              ffn='swiglu' if swiglu else 'mlp',
              num_cls_tokens=int(cls_shape[1]), posemb_grid=grid,
              pixel_mean=[0.0, 0.0, 0.0], pixel_std=[1.0, 1.0, 1.0])


def infer_text_config(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """TextEncoder kwargs of an official TIPS text checkpoint."""
  vocab, width = _need(flat, 'token_emb/emb_var', 'vocabulary and width', 2)
  ids = _block_ids(flat, 'transformer/')
  if not ids:
    raise CheckpointFormatError('no transformer/encoderblock_* keys found')
  b0 = 'transformer/encoderblock_0/'
  q = _need(flat, b0 + 'MultiHeadDotProductAttention_0/query/kernel',
            'number of heads', 3)
  mlp_dim = _need(flat, b0 + 'MlpBlock_0/Dense_0/kernel', 'MLP size', 2)[1]
  return dict(flavour='tips', vocab_size=int(vocab), max_len=64,
              width=int(width), depth=int(ids[-1] + 1), num_heads=int(q[1]),
              mlp_dim=int(mlp_dim), out_dim=None)


def _official_to_tipsito(key: str, top: Mapping[str, str],
                         block_prefix: str) -> Optional[str]:
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


def _convert_strict(flat: Mapping[str, np.ndarray], expected: Mapping[str, tuple],
                    top: Mapping[str, str], block_prefix: str, what: str
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
          f'expected {expected[new]} for the inferred architecture')
    out[new] = arr.astype(np.float32)
  if unexpected:
    raise CheckpointFormatError(
        f'{what} checkpoint has unexpected keys (not used by the inferred '
        f'architecture): {", ".join(unexpected)}')
  missing = [k for k in expected if k not in out]
  if missing:
    off = {v: k for k, v in top.items()}

    def official_name(k):
      if k in off:
        return off[k]
      m = re.match(r'^block_(\d+)/(\w+)/(.*)$', k)
      if m:
        sub = [o for o, t in _BLOCK_MAP.items() if t == m.group(2)]
        return f'{block_prefix}encoderblock_{m.group(1)}/{"|".join(sub)}/' \
               f'{m.group(3)}'
      return k
    raise CheckpointFormatError(
        f'{what} checkpoint is missing keys: ' + ', '.join(
            f'{official_name(k)!r} (expected shape {expected[k]})'
            for k in missing))
  return traverse_util.unflatten_dict(out, sep='/')


def import_tips_vision(image_npz) -> tuple[dict[str, Any], dict[str, Any]]:
  """(VisionTransformer kwargs, params) from an official TIPS vision .npz."""
  import jax.numpy as jnp
  from tipsito.models.vit import VisionTransformer
  flat = _load_flat(image_npz)
  cfg = infer_vision_config(flat)
  p = cfg['patch_size']
  expected = _expected_flat(VisionTransformer(**cfg),
                            jnp.zeros((1, p, p, 3), jnp.float32))
  params = _convert_strict(flat, expected, _VISION_MAP, 'encoder/transformer/',
                           'vision')
  return cfg, params


def import_tips_text(text_npz) -> tuple[dict[str, Any], dict[str, Any], float]:
  """(TextEncoder kwargs, params, temperature) from an official text .npz."""
  import jax.numpy as jnp
  from tipsito.models.text import TextEncoder
  flat = _load_flat(text_npz)
  if _TEMPERATURE_KEY not in flat:
    raise CheckpointFormatError(
        f'text checkpoint is missing key {_TEMPERATURE_KEY!r} (expected shape '
        '())')
  temp = np.asarray(flat.pop(_TEMPERATURE_KEY))
  if temp.shape != ():
    raise CheckpointFormatError(
        f'text checkpoint key {_TEMPERATURE_KEY!r} has shape {temp.shape}, '
        'expected ()')
  cfg = infer_text_config(flat)
  expected = _expected_flat(TextEncoder(**cfg), jnp.zeros((1, 4), jnp.int32))
  params = _convert_strict(flat, expected, _TEXT_MAP, 'transformer/', 'text')
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
        'compares CLS and text embeddings directly')
  return icfg, tcfg, {'image': iparams, 'text': tparams}, temp


# --------------------------------------------------------------------------
# Export format (shared with training)
# --------------------------------------------------------------------------

def _jsonable(v: Any) -> Any:
  """Config values -> json (dtypes as names, tuples as lists)."""
  import jax.numpy as jnp
  if hasattr(v, 'to_dict') and callable(v.to_dict):  # ml_collections
    v = v.to_dict()
  if isinstance(v, Mapping):
    return {str(k): _jsonable(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [_jsonable(x) for x in v]
  if isinstance(v, (str, bool, int, float)) or v is None:
    return v
  if isinstance(v, (np.integer,)):
    return int(v)
  if isinstance(v, (np.floating,)):
    return float(v)
  try:
    return jnp.dtype(v).name
  except TypeError as e:
    raise TypeError(f'cannot store config value {v!r} in config.json') from e


def _check_export_tree(params: Mapping[str, Any]) -> None:
  """Refuses training-only parts: only image/text/image_proj, no mask token,
  no fusion, no heads (these are the rules that keep exports inference-only)."""
  from flax import traverse_util
  extra = [k for k in params if k not in ALLOWED_EXPORT_KEYS]
  if extra:
    raise ValueError(f'export refuses top-level keys {extra}; allowed: '
                     f'{list(ALLOWED_EXPORT_KEYS)} (fusion/heads are '
                     'training-only)')
  for key in ('image', 'text'):
    if key not in params:
      raise ValueError(f'export needs params[{key!r}]')
  flat = traverse_util.flatten_dict(dict(params), sep='/')
  for k in flat:
    parts = k.split('/')
    for bad in _FORBIDDEN_LEAF_PARTS:
      if any(bad in p.lower() for p in parts):
        raise ValueError(f'export refuses training-only leaf {k!r}')


def select_export_params(train_params: Mapping[str, Any]) -> dict:
  """Keeps only what an export may hold from a training param tree.

  {'image' (minus mask_token), 'text', ['image_proj']}; everything else
  (heads, fusion, logit scale/bias, distillation projection) is dropped.
  A convenience for the training-side exporter.
  """
  out = {'image': {k: v for k, v in train_params['image'].items()
                   if k != 'mask_token'},
         'text': train_params['text']}
  if 'image_proj' in train_params:
    out['image_proj'] = train_params['image_proj']
  return out


def _this_process_only():
  """Orbax options for host-local numpy trees: this process alone reads/writes, no cross-host barriers.

  Why: in a multi-host job the export is gathered to host memory and written by process 0 only
  (tipsito.train.loop.write_export), and every host may `tipsito.load` on its own.
  """
  import jax
  import orbax.checkpoint as ocp
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def write_export(output_dir, *, image_config: dict, text_config: dict,
                 params: dict, temperature: float,
                 tokenizer_path: Optional[str] = None, image_proj: bool = False,
                 extra: Optional[dict] = None) -> str:
  """Writes an inference checkpoint (config.json, Orbax params/, tokenizer).

  `params` = {'image': ViT params (no mask_token), 'text': text params,
  optionally 'image_proj': {'kernel': (D_i, E)}}. Training-only parts are
  refused (see `_check_export_tree`). Returns the absolute output path.
  """
  import jax
  import orbax.checkpoint as ocp
  _check_export_tree(params)
  if image_proj and 'image_proj' not in params:
    raise ValueError("image_proj=True but params has no 'image_proj'")
  if not image_proj and 'image_proj' in params:
    raise ValueError("params has 'image_proj' but image_proj=False")
  out = as_path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  pdir = out / 'params'
  if pdir.exists():
    pdir.rmtree()

  icfg = dict(_jsonable(image_config))
  icfg['use_mask_token'] = False
  icfg.pop('remat', None)
  tok_name = None
  if tokenizer_path:
    from etils import epath  # pylint: disable=g-import-not-at-top
    src = epath.Path(os.path.expanduser(os.fspath(tokenizer_path)))
    if not src.is_file():
      raise FileNotFoundError(f'tokenizer file not found: {tokenizer_path}')
    tok_name = 'tokenizer.model'
    (out / tok_name).write_bytes(src.read_bytes())
  cfg = {
      'format_version': FORMAT_VERSION,
      'image': _jsonable(icfg),
      'text': _jsonable(text_config),
      'temperature': float(temperature),
      'pixel_mean': _jsonable(icfg.get('pixel_mean', (0.0, 0.0, 0.0))),
      'pixel_std': _jsonable(icfg.get('pixel_std', (1.0, 1.0, 1.0))),
      'tokenizer': tok_name,
      'image_proj': bool(image_proj),
      'extra': _jsonable(extra or {}),
  }
  tree = jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=np.float32)
                                if np.asarray(x).dtype != np.float32
                                else np.asarray(x), dict(params))
  ckptr = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
  ckptr.save(pdir, tree)
  ckptr.wait_until_finished()
  (out / 'config.json').write_text(json.dumps(cfg, indent=2, sort_keys=True))
  return os.fspath(out)


def as_path(path):
  """epath.Path of a local path (made absolute, ~ expanded) or a URL such as gs://bucket/dir."""
  from tipsito import paths  # pylint: disable=g-import-not-at-top
  return paths.as_path(path)


class NotAnExportError(FileNotFoundError):
  """`tipsito.load` / the export reader was given something that is not an export; says what to do."""


def _not_an_export(path) -> str:
  """Why `path` is not an export and what to pass instead (training workdirs are the usual mix-up)."""
  p = os.fspath(path)
  workdir = path.parent if path.name == 'checkpoints' else path
  is_workdir = (workdir / 'checkpoints').is_dir()
  if not is_workdir and (workdir / 'config.json').is_file():
    try:
      is_workdir = 'recipe' in json.loads((workdir / 'config.json').read_text())
    except ValueError:
      pass
  if is_workdir:
    w = os.fspath(workdir)
    hint = (f"{p} is a training workdir, not an export. "
            f"Export its latest checkpoint with `python -m tipsito.export --workdir {w} --output E` "
            f"and load E")
    if (workdir / 'export' / 'config.json').is_file():
      hint += f", or load the export the finished run wrote: tipsito.load({os.fspath(workdir / 'export')!r})"
    return hint + " (`python -m tipsito.evaluate --checkpoint` also accepts the workdir itself)."
  if not path.exists():
    return f"{p} does not exist (expected a tipsito export: config.json + params/)"
  return (f"{p} is not a tipsito export (no config.json with a format_version next to params/); exports "
          "are written by training (W/export), `python -m tipsito.export`, or tipsito.checkpoint.write_export")


def read_export(path) -> tuple[dict, dict]:
  """Reads (config dict, params tree of numpy/jax arrays) of an export (local or gs://)."""
  import orbax.checkpoint as ocp
  path = as_path(path)
  cfg_path = path / 'config.json'
  if not cfg_path.is_file():
    raise NotAnExportError(_not_an_export(path))
  cfg = json.loads(cfg_path.read_text())
  if 'format_version' not in cfg:
    raise NotAnExportError(_not_an_export(path))
  if cfg.get('format_version') != FORMAT_VERSION:
    raise ValueError(f"{os.fspath(path)}: unsupported export format_version "
                     f"{cfg.get('format_version')} (this tipsito reads version {FORMAT_VERSION}; "
                     "re-export with this version's `python -m tipsito.export`)")
  if not (path / 'params').is_dir():
    raise NotAnExportError(f"{os.fspath(path)}: config.json but no params/ folder (an interrupted export? "
                           "write it again)")
  ckptr = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
  params = ckptr.restore(path / 'params')
  return cfg, params


def is_export(path) -> bool:
  """Whether `path` holds an export (config.json with a format_version, and params/)."""
  path = as_path(path)
  cfg = path / 'config.json'
  if not (cfg.is_file() and (path / 'params').is_dir()):
    return False
  try:
    return 'format_version' in json.loads(cfg.read_text())
  except ValueError:
    return False
