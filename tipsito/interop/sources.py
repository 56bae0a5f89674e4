"""What `python -m tipsito.export` converts from, as one in-memory model every format writer takes.

Why: every format (tipsito's own export, `tips_npz`, `hf_tipsv2`, `hf_clip`, `open_clip`) is written from a training workdir at
its latest or a chosen step (`--workdir W [--step N]`), from an existing export or Hugging Face Tipsv2
folder (`--from E`), or from official TIPS `.npz` weights. Reading each source once into `Model` keeps the
writers independent of where the weights came from. A training workdir becomes a `Model` in
tipsito/train/exporting.py (`model_from_workdir`), since reading one needs the training code, which this
subpackage does not import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import zipfile
from typing import Any, Optional

import jax
import numpy as np
from absl import logging

from tipsito import export_format
from tipsito import tips_import
from tipsito.config import init_source
from tipsito.config import run_file
from tipsito.interop import clip
from tipsito.interop import hf_tipsv2
from tipsito.interop import tips_npz
from tipsito.models import kwargs as kwargs_lib


@dataclasses.dataclass
class Model:
  """Inference towers of one model: module kwargs, per-layer numpy params {'image', 'text'[,
  'image_proj']}, T of logits = cos / T, the SentencePiece file (or None), bookkeeping for the export."""

  image_config: dict
  text_config: dict
  params: dict
  temperature: float
  tokenizer_path: Optional[str] = None
  extra: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    """Both tower configs state every key of their module, whoever built the Model (the writers read
    them directly): tipsito/models/kwargs.py complete_tower_config, as the export reader does."""
    source = f"the model from {self.extra.get('from') or self.extra.get('source') or 'memory'}"
    self.image_config, _ = kwargs_lib.complete_tower_config(self.image_config, 'image', source)
    self.text_config, _ = kwargs_lib.complete_tower_config(self.text_config, 'text', source)

  @property
  def image_size(self) -> Optional[int]:
    """The resolution the model was trained or released at, when the source says so."""
    size = self.extra.get('image_size')
    return int(size) if size else None


def _numpy(tree: Any) -> Any:
  return jax.tree.map(np.asarray, tree)


def from_export(path) -> Model:
  """A tipsito export (tipsito/export_format.py)."""
  cfg, params = export_format.read_export(path)
  tok = os.fspath(export_format.as_path(path) / cfg['tokenizer']) if cfg['tokenizer'] else None
  extra = dict(cfg['extra'])
  extra['from'] = os.fspath(export_format.as_path(path))
  return Model(dict(cfg['image']), dict(cfg['text']), _numpy(params), float(cfg['temperature']), tok, extra)


def from_hf_tipsv2(path) -> Model:
  """A Hugging Face Tipsv2Model folder (tipsito/interop/hf_tipsv2.py: read_hf_tipsv2)."""
  r = hf_tipsv2.read_hf_tipsv2(path)
  for note in r['notes']:
    logging.warning('%s: %s', path, note)
  extra = {'source': 'hf_tipsv2', 'from': os.fspath(path), 'layout': r['layout']}
  if r['image_size']:
    extra['image_size'] = r['image_size']
  return Model(r['image_config'], r['text_config'], r['params'], r['temperature'], r['tokenizer_path'], extra)


def from_hf_clip(path) -> Model:
  """A Hugging Face CLIPModel folder (tipsito/interop/clip.py: read_hf_clip)."""
  r = clip.read_hf_clip(path)
  extra = {'source': 'hf_clip', 'from': os.fspath(path), 'image_size': r['image_size']}
  return Model(r['image_config'], r['text_config'], r['params'], r['temperature'], r['tokenizer_path'], extra)


def from_tips_npz(image_npz, text_npz, tokenizer: Optional[str] = None) -> Model:
  """Official TIPS weights (tipsito/tips_import.py)."""
  icfg, tcfg, params, temperature = tips_import.import_tips_npz(image_npz, text_npz)
  return Model(
    icfg,
    tcfg,
    params,
    temperature,
    tokenizer,
    {'source': 'tips_npz', 'tips_image_npz': str(image_npz), 'tips_text_npz': str(text_npz)},
  )


def load_source(path) -> Model:
  """`--from PATH`: a tipsito export or a Hugging Face Tipsv2 folder (a training workdir is `--workdir`)."""
  if hf_tipsv2.is_tipsv2_folder(path):
    return from_hf_tipsv2(path)
  if export_format.is_export(path):
    return from_export(path)
  raise export_format.NotAnExportError(
    export_format._not_an_export(export_format.as_path(path))  # pylint: disable=protected-access
    + ' (`--from` also takes a Hugging Face Tipsv2Model folder: config.json with model_type "tipsv2")'
  )


def _write_tipsito(model: Model, output) -> str:
  return export_format.write_export(
    output,
    image_config=model.image_config,
    text_config=model.text_config,
    params=model.params,
    temperature=model.temperature,
    tokenizer_path=model.tokenizer_path,
    image_proj='image_proj' in model.params,
    extra=model.extra,
  )


def _write_hf_tipsv2(model: Model, output) -> str:
  return hf_tipsv2.write_hf_tipsv2(output, **_towers(model), image_size=model.image_size)


def _write_tips_npz(model: Model, output) -> str:
  return tips_npz.write_tips_npz(output, **_towers(model))


def _write_hf_clip(model: Model, output) -> str:
  return clip.write_hf_clip(output, **_towers(model), extra=model.extra)


def _write_open_clip(model: Model, output) -> str:
  return clip.write_open_clip(output, **_towers(model), extra=model.extra)


def _towers(model: Model) -> dict:
  """The keyword arguments every writer takes: both towers' configs and params, T, the tokenizer."""
  return dict(
    image_config=model.image_config,
    text_config=model.text_config,
    params=model.params,
    temperature=model.temperature,
    tokenizer_path=model.tokenizer_path,
  )


# `--format` -> its writer: one entry per format, in the order `--help` lists them.
WRITERS = {
  'tipsito': _write_tipsito,
  'hf_tipsv2': _write_hf_tipsv2,
  'tips_npz': _write_tips_npz,
  'hf_clip': _write_hf_clip,
  'open_clip': _write_open_clip,
}
FORMATS = tuple(WRITERS)


def write(model: Model, output, fmt: str) -> str:
  """Writes `model` in format `fmt` (FORMATS) to `output`; returns the output path."""
  if fmt not in WRITERS:
    raise ValueError(f'unknown --format {fmt!r}; valid: {list(FORMATS)}')
  return WRITERS[fmt](model, output)


def export_tips_npz(image_npz: str, text_npz: str, output: str, tokenizer: Optional[str] = None) -> str:
  """Imports released TIPS .npz weights and writes a tipsito export (`export --tips_image_npz`, format
  `tipsito`)."""
  icfg, tcfg, params, temperature = tips_import.import_tips_npz(image_npz, text_npz)
  return export_format.write_export(
    output,
    image_config=icfg,
    text_config=tcfg,
    params=params,
    temperature=temperature,
    tokenizer_path=tokenizer,
    extra={'source': 'tips_npz', 'tips_image_npz': str(image_npz), 'tips_text_npz': str(text_npz)},
  )


# --------------------------------------------------------------------------------------------------
# `config.init_from` of a kind that holds towers only (tipsito/config/init_source.py)
# --------------------------------------------------------------------------------------------------


def from_init_source(src) -> Model:
  """The towers of a towers-only `init_from` (`init_source.InitSource` of kind export, hf_tipsv2,
  hf_clip or tips_npz), read with the reader of its format; a workdir is read by
  tipsito/train/assembly.py."""
  if src.kind == 'export':
    return from_export(src.path)
  if src.kind == 'hf_tipsv2':
    return from_hf_tipsv2(src.path)
  if src.kind == 'hf_clip':
    return from_hf_clip(src.path)
  if src.kind == 'tips_npz':
    return from_tips_npz(src.image_npz, src.text_npz, init_source.tokenizer_of(src))
  raise ValueError(
    f'config.init_from={src.path!r} is {src.describe()}, which tipsito cannot read into training yet'
  )


def _npz_shapes(path) -> dict[str, Any]:
  """{key: an object with `.shape`} of an .npz file, read from the array headers only (no data), so that
  the architecture of multi-gigabyte official weights is known in milliseconds."""
  out = {}
  with zipfile.ZipFile(os.fspath(path)) as z:
    for name in z.namelist():
      if not name.endswith('.npy'):
        continue
      with z.open(name) as f:
        version = np.lib.format.read_magic(f)
        read = (
          np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, _, _ = read(f)
      out[name[: -len('.npy')]] = types.SimpleNamespace(shape=tuple(shape))
  return out


def towers_of(src) -> tuple[dict, dict]:
  """(image tower kwargs, text tower kwargs) of any `init_from` source, as the run's `config.model.image`
  / `config.model.text` state them; read from the JSON configs and the .npz array headers where the
  format has them (export, workdir, tips_npz), from the weights otherwise (Hugging Face folders)."""
  if src.kind == 'workdir':
    saved = run_file.init_run_config(src.path) or {}
    model = saved.get('model') or {}
    return dict(model.get('image') or {}), dict(model.get('text') or {})
  if src.kind == 'export':
    cfg = json.loads((export_format.as_path(src.path) / 'config.json').read_text())
    return dict(cfg['image']), dict(cfg['text'])
  if src.kind == 'tips_npz':
    image = tips_import.infer_vision_config(_npz_shapes(src.image_npz))
    return image, tips_import.infer_text_config(_npz_shapes(src.text_npz))
  m = from_init_source(src)
  return dict(m.image_config), dict(m.text_config)
