"""`--format tips_npz`: the official TIPS Scenic `.npz` pair, the exact inverse of tipsito/tips_import.py.

Why: the official code (and anything built on it) reads flat `np.savez` files with '/'-joined flax keys
(tests/data/tips_model/ holds tiny files in that format). Writing them is the importer's tables read
backwards, so official `.npz` -> import -> export -> `.npz` gives the same arrays bit for bit (the
conformance weights are the test, tests/test_interop_tips_npz.py).

Output folder: `vision.npz` (keys `encoder/...`), `text.npz` (keys `token_emb/...`, `transformer/...`,
`text_encoder_norm/...` and the 0-d `temperature_contrastive`, T of logits = cos / T) and, when the model
has one, `tokenizer.model`. The format has no pixel statistics (the official code feeds [0, 1] pixels) and
no image projection, so only TIPS-style models with mean 0 / std 1 pixels can be written; anything else is
refused with the reason rather than written wrong.
"""

from __future__ import annotations

import io
import os
import re
from typing import Any, Mapping

import numpy as np

from tipsito import tips_import
from tipsito import export_format

VISION_FILE = 'vision.npz'
TEXT_FILE = 'text.npz'
TOKENIZER_FILE = 'tokenizer.model'

_BLOCK_RE = re.compile(r'^block_(\d+)/(\w+)/(.+)$')
# tipsito block part -> official block part (the FFN name depends on the FFN kind).
_BLOCK_PARTS = {'norm1': 'LayerNorm_0', 'norm2': 'LayerNorm_1', 'attn': 'MultiHeadDotProductAttention_0'}
_FFN_PART = {'mlp': 'MlpBlock_0', 'swiglu': 'FFNSwiGluFused_0'}


class NotRepresentableError(ValueError):
  """A model that a target format cannot hold exactly (the message says why and what to use instead)."""


def _flat(tree: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """'/'-joined {key: numpy array} of a nested param tree."""
  from flax import traverse_util  # pylint: disable=g-import-not-at-top

  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(dict(tree), sep='/').items()}


def check_tips_style(
  image_config: Mapping[str, Any], text_config: Mapping[str, Any], params: Mapping[str, Any], fmt: str
) -> None:
  """Refuses what the TIPS formats (official npz, HF Tipsv2) cannot represent, naming the reason."""
  if 'image_proj' in params:
    raise NotRepresentableError(
      f'--format {fmt}: this model has an image projection (a CLIP-style recipe: clip, siglip, ito); '
      f'{fmt} holds TIPS-style towers only (shared width, no projection). Use --format hf_clip or '
      'open_clip (or the tipsito export).'
    )
  if text_config['flavour'] != 'tips' or text_config['out_dim'] is not None:
    raise NotRepresentableError(
      f"--format {fmt}: the text tower is {text_config['flavour']!r} with out_dim "
      f"{text_config['out_dim']}; {fmt} holds the TIPS text tower (flavour 'tips', no projection)"
    )
  if int(image_config['width']) != int(text_config['width']):
    raise NotRepresentableError(
      f"--format {fmt}: image width {image_config['width']} != text width {text_config['width']}"
    )
  for tower, cfg in (('image', image_config), ('text', text_config)):
    if cfg['scan']:
      raise NotRepresentableError(
        f'--format {fmt}: the {tower} tower is scanned; exports are per-layer '
        '(tipsito/models/layer_stack.py: to_per_layer)'
      )


def to_official(
  image_config: Mapping[str, Any], params: Mapping[str, Any], temperature: float
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """(vision, text) flat official arrays of tipsito {'image', 'text'} params (no arithmetic: renames)."""
  top_v = {v: k for k, v in tips_import._VISION_MAP.items()}  # pylint: disable=protected-access
  top_t = {v: k for k, v in tips_import._TEXT_MAP.items()}  # pylint: disable=protected-access
  parts = dict(_BLOCK_PARTS, mlp=_FFN_PART[image_config['ffn']])
  text_parts = dict(_BLOCK_PARTS, mlp=_FFN_PART['mlp'])

  def rename(flat, top, block_prefix, block_parts, what):
    out = {}
    for key, arr in flat.items():
      m = _BLOCK_RE.match(key)
      if key in top:
        new = top[key]
      elif m and m.group(2) in block_parts:
        new = f'{block_prefix}encoderblock_{m.group(1)}/{block_parts[m.group(2)]}/{m.group(3)}'
      else:
        raise NotRepresentableError(f'{what} param {key!r} has no place in the official TIPS format')
      out[new] = arr
    return out

  vision = rename(_flat(params['image']), top_v, 'encoder/transformer/', parts, 'image')
  text = rename(_flat(params['text']), top_t, 'transformer/', text_parts, 'text')
  text[tips_import._TEMPERATURE_KEY] = np.asarray(temperature, np.float32)  # pylint: disable=protected-access
  return vision, text


def _save_npz(path, arrays: Mapping[str, np.ndarray]) -> None:
  """np.savez (the official files' writer) to a local or gs:// path."""
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  path.write_bytes(buf.getvalue())


def write_tips_npz(
  output_dir,
  *,
  image_config: Mapping[str, Any],
  text_config: Mapping[str, Any],
  params: Mapping[str, Any],
  temperature: float,
  tokenizer_path=None,
) -> str:
  """Writes `vision.npz` + `text.npz` (+ `tokenizer.model`) that tipsito/tips_import.py reads back to the
  same params, bit for bit (checked here before anything is written)."""
  check_tips_style(image_config, text_config, params, 'tips_npz')
  mean = [float(x) for x in image_config['pixel_mean']]
  std = [float(x) for x in image_config['pixel_std']]
  if mean != [0.0, 0.0, 0.0] or std != [1.0, 1.0, 1.0]:
    raise NotRepresentableError(
      f'--format tips_npz: this model normalises its pixels (mean {mean}, std {std}) but the official '
      'TIPS format has no pixel statistics (it feeds [0, 1] pixels), so its images would be read wrong. '
      'Use --format hf_tipsv2 (its preprocessor_config.json carries them) or the tipsito export.'
    )
  vision, text = to_official(image_config, params, temperature)
  _check_inverse(vision, text, params)
  out = export_format.as_path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  _save_npz(out / VISION_FILE, vision)
  _save_npz(out / TEXT_FILE, text)
  if tokenizer_path:
    from etils import epath  # pylint: disable=g-import-not-at-top

    (out / TOKENIZER_FILE).write_bytes(epath.Path(os.fspath(tokenizer_path)).read_bytes())
  return os.fspath(out)


def _check_inverse(
  vision: Mapping[str, np.ndarray], text: Mapping[str, np.ndarray], params: Mapping[str, Any]
) -> None:
  """The importer must give back exactly `params` (same keys, shapes, dtypes and bits)."""
  _, iparams = tips_import.import_tips_vision(dict(vision))
  _, tparams, _ = tips_import.import_tips_text(dict(text))
  for tower, got in (('image', iparams), ('text', tparams)):
    want, back = _flat(params[tower]), _flat(got)
    if sorted(want) != sorted(back):
      raise NotRepresentableError(
        f'--format tips_npz: the {tower} params do not come back from the official '
        f'format: {sorted(set(want) ^ set(back))}'
      )
    for k, w in want.items():
      if w.dtype != back[k].dtype or w.shape != back[k].shape or w.tobytes() != back[k].tobytes():
        raise NotRepresentableError(
          f'--format tips_npz: {tower} param {k!r} ({w.dtype} {w.shape}) does not '
          f'come back bit for bit ({back[k].dtype} {back[k].shape})'
        )
