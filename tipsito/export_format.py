"""The export format: the one artefact training writes and inference reads (writer and reader).

Why here: the exported inference checkpoint is shared by training (writes it at the end of a run), the
export CLI (tipsito/export.py, also from released TIPS weights) and inference/evals (read it with
`tipsito.load`). One writer and one reader keep the format in one place.

Export layout (FORMAT_VERSION 1):
  DIR/config.json   {'format_version', 'image': VisionTransformer kwargs,
                     'text': TextEncoder kwargs, 'temperature', 'pixel_mean',
                     'pixel_std', 'tokenizer': 'tokenizer.model' | null,
                     'image_proj': bool, 'extra': {...}}
  DIR/params/       Orbax (StandardCheckpointer) tree {'image','text'[,'image_proj']}
  DIR/tokenizer.model  copy of the SentencePiece model, when one was given.
The tower kwargs state the structure in full (TIPS or OpenCLIP: `activation`, `ln_eps`, `patch_bias`,
`cls_posemb`, `pre_norm`; text `flavour`, `activation`, `ln_eps`; tipsito/config/presets.py), so
`tipsito.load` rebuilds the same towers; the text `flavour` also selects the tokenization ('clip':
SOT/EOT on top of the SentencePiece ids, tipsito/data/tokenizer.py), as in training.

An export written by an older tipsito may lack tower keys that did not exist then: `upgrade_config`, run by
`read_export`, fills them once with the tower modules' defaults (the TIPS structure;
tipsito/models/kwargs.py: complete_tower_config, which `write_export` applies too, so an export written
today states every key) and logs which, so every reader (`tipsito.load`, the interop writers, the
evaluators, the distillation teacher) reads the keys directly. What has no default (a key fixing the
parameter shapes, the temperature) is refused with the file and key.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import numpy as np
from absl import logging

from tipsito import paths

FORMAT_VERSION = 1
ALLOWED_EXPORT_KEYS = ('image', 'text', 'image_proj')
# Path components that identify training-only parameters.
_FORBIDDEN_LEAF_PARTS = ('mask_token', 'fusion', 'head')


def jsonable(v: Any) -> Any:
  """Config values -> json (dtypes as names, tuples as lists)."""
  import jax.numpy as jnp

  if hasattr(v, 'to_dict') and callable(v.to_dict):  # ml_collections
    v = v.to_dict()
  if isinstance(v, Mapping):
    return {str(k): jsonable(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [jsonable(x) for x in v]
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
    raise ValueError(
      f'export refuses top-level keys {extra}; allowed: '
      f'{list(ALLOWED_EXPORT_KEYS)} (fusion/heads are '
      'training-only)'
    )
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
  The training-side exporter (tipsito/train/exporting.py: export_params) gathers this subset.
  """
  out = {
    'image': {k: v for k, v in train_params['image'].items() if k != 'mask_token'},
    'text': train_params['text'],
  }
  if 'image_proj' in train_params:
    out['image_proj'] = train_params['image_proj']
  return out


def _this_process_only():
  """Orbax options for host-local numpy trees: this process alone reads/writes, no cross-host barriers.

  Why: in a multi-host job the export is gathered to host memory and written by process 0 only
  (tipsito/train/exporting.py: write_training_export), and every host may `tipsito.load` on its own.
  """
  import jax
  import orbax.checkpoint as ocp

  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def write_export(
  output_dir,
  *,
  image_config: dict,
  text_config: dict,
  params: dict,
  temperature: float,
  tokenizer_path: Optional[str] = None,
  image_proj: bool = False,
  extra: Optional[dict] = None,
) -> str:
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

  from tipsito.models import kwargs as kwargs_lib  # lazy: JAX/Flax at use, as jax and orbax here

  icfg, _ = kwargs_lib.complete_tower_config(jsonable(image_config), 'image', 'write_export image_config')
  tcfg, _ = kwargs_lib.complete_tower_config(jsonable(text_config), 'text', 'write_export text_config')
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
    'image': jsonable(icfg),
    'text': tcfg,
    'temperature': float(temperature),
    'pixel_mean': icfg['pixel_mean'],
    'pixel_std': icfg['pixel_std'],
    'tokenizer': tok_name,
    'image_proj': bool(image_proj),
    'extra': jsonable(extra or {}),
  }
  tree = jax.tree_util.tree_map(
    lambda x: np.asarray(x, dtype=np.float32) if np.asarray(x).dtype != np.float32 else np.asarray(x),
    dict(params),
  )
  ckptr = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
  ckptr.save(pdir, tree)
  ckptr.wait_until_finished()
  (out / 'config.json').write_text(json.dumps(cfg, indent=2, sort_keys=True))
  return os.fspath(out)


def as_path(path):
  """epath.Path of a local path (made absolute, ~ expanded) or a URL such as gs://bucket/dir."""
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
    hint = (
      f"{p} is a training workdir, not an export. "
      f"Export its latest checkpoint with `python -m tipsito.export --workdir {w} --output E` "
      f"and load E"
    )
    if (workdir / 'export' / 'config.json').is_file():
      hint += f", or load the export the finished run wrote: tipsito.load({os.fspath(workdir / 'export')!r})"
    return hint + " (`python -m tipsito.evaluate --checkpoint` also accepts the workdir itself)."
  if not path.exists():
    return f"{p} does not exist (expected a tipsito export: config.json + params/)"
  return (
    f"{p} is not a tipsito export (no config.json with a format_version next to params/); exports "
    "are written by training (W/export), `python -m tipsito.export`, or tipsito.export_format.write_export"
  )


class ExportConfigError(ValueError):
  """An export's config.json lacks what cannot be filled with a default (says which file and key)."""


# Top-level keys of config.json that an older export may lack, and their values then. 'image_proj' is
# filled from the params by `read_export`.
_TOP_DEFAULTS = {'tokenizer': None, 'extra': {}}
_TOP_REQUIRED = ('image', 'text', 'temperature')


def upgrade_config(cfg: dict, source: str) -> dict:
  """An export's config.json as this tipsito writes it: the tower keys an older export lacks filled with
  the tower modules' defaults (tipsito/models/kwargs.py: complete_tower_config), the top-level pixel
  statistics with the image tower's, `tokenizer` None and `extra` {}. Logs one line naming the filled
  keys (nothing when none is); raises ExportConfigError naming `source` and the key for what has no
  default. `cfg` itself is not changed."""
  from tipsito.models import kwargs as kwargs_lib  # lazy: JAX/Flax at use, as jax and orbax here

  missing = [k for k in _TOP_REQUIRED if k not in cfg]
  if missing:
    raise ExportConfigError(
      f'{source}: no {missing} (every export states them; write the export again with '
      '`python -m tipsito.export`)'
    )
  out = dict(cfg)
  filled = []
  for tower in ('image', 'text'):
    try:
      out[tower], keys = kwargs_lib.complete_tower_config(cfg[tower], tower, source)
    except kwargs_lib.TowerConfigError as e:
      raise ExportConfigError(str(e)) from None
    filled += [f'{tower}.{k}' for k in keys]
  for k in ('pixel_mean', 'pixel_std'):
    if k not in out:
      out[k] = out['image'][k]
      filled.append(k)
  for k, v in _TOP_DEFAULTS.items():
    if k not in out:
      out[k] = v
      filled.append(k)
  if filled:
    logging.info(
      '%s: written by an older tipsito; filled %s with the defaults (the tower modules\' in tipsito/models/)',
      source,
      ', '.join(filled),
    )
  return out


def read_export(path) -> tuple[dict, dict]:
  """Reads (config dict, params tree of numpy/jax arrays) of an export (local or gs://); the config is
  upgraded to this tipsito's (`upgrade_config`), so it states every key."""
  import orbax.checkpoint as ocp

  path = as_path(path)
  cfg_path = path / 'config.json'
  if not cfg_path.is_file():
    raise NotAnExportError(_not_an_export(path))
  cfg = json.loads(cfg_path.read_text())
  if 'format_version' not in cfg:
    raise NotAnExportError(_not_an_export(path))
  if cfg.get('format_version') != FORMAT_VERSION:
    raise ValueError(
      f"{os.fspath(path)}: unsupported export format_version "
      f"{cfg.get('format_version')} (this tipsito reads version {FORMAT_VERSION}; "
      "re-export with this version's `python -m tipsito.export`)"
    )
  if not (path / 'params').is_dir():
    raise NotAnExportError(
      f"{os.fspath(path)}: config.json but no params/ folder (an interrupted export? write it again)"
    )
  cfg = upgrade_config(cfg, os.fspath(cfg_path))
  ckptr = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
  params = ckptr.restore(path / 'params')
  if 'image_proj' not in cfg:
    cfg['image_proj'] = 'image_proj' in params
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
