"""Inference API: `load(dir) -> Encoder` with jitted image and text embedding.

Why a small class: evals, notebooks and the export round trip all need the
same three things (embed images, embed texts, the contrastive temperature)
without knowing about training state, recipes or Orbax. The encoder holds
only the inference towers; training-time evals build one in memory with
`Encoder.from_params`.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from tipsito.models.kwargs import module_kwargs
from tipsito.models.text import TextEncoder
from tipsito.models.vit import VisionTransformer

_TRAIN_ONLY_KEYS = ('use_mask_token', 'remat', 'dropout', 'stochastic_depth')


def _inference_kwargs(cfg: dict, cls) -> dict:
  """Export config -> module kwargs (tipsito/models/kwargs.py) with the training-only switches off.

  Unknown keys are dropped so that exports carrying extra bookkeeping fields
  still load.
  """
  kw = module_kwargs(cfg, cls)
  fields = set(cls.__dataclass_fields__)
  for k in _TRAIN_ONLY_KEYS:
    if k in fields:
      kw[k] = False if k in ('use_mask_token', 'remat') else 0.0
  return kw


def _make_tokenizer(path: Optional[str], text_cfg: dict):
  """Builds tipsito.data.tokenizer.Tokenizer lazily (owned by the data code) for the text tower
  described by `text_cfg` (an export's config.json 'text'): its max_len and flavour ('clip' writes
  SOT/EOT, as in training).

  Returns (tokenizer or None, error message or None); the error is raised
  only when text strings are actually given. A tokenizer whose ids do not
  fit the tower's embedding table (e.g. SOT/EOT for an export written before
  the 'clip' flavour had them) is refused the same way.
  """
  try:
    from tipsito.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return None, (f'cannot tokenize strings: tipsito.data.tokenizer is not '
                  f'available ({e}); pass int32 token ids instead')
  flavour = text_cfg.get('flavour') or 'tips'
  tok = Tokenizer(path, max_len=int(text_cfg.get('max_len', 64)), flavour=flavour)
  vocab = text_cfg.get('vocab_size')
  if vocab is not None and tok.vocab_size > int(vocab):
    return None, (f'cannot tokenize strings: the {flavour!r} tokenizer has {tok.vocab_size} ids '
                  f'but the text tower embeds {vocab}; pass int32 token ids instead')
  return tok, None


@functools.lru_cache(maxsize=32)
def _jitted_image_fn(kwargs_json: str):
  """One jitted image function per architecture, shared by all Encoders.

  Training-time evals build a fresh Encoder (`from_params`) at every eval;
  caching by architecture means they do not recompile each time.
  """
  model = VisionTransformer(**_inference_kwargs(json.loads(kwargs_json),
                                             VisionTransformer))

  def fn(params, images, project, values):
    out = model.apply({'params': params['image']}, images,
                      return_values=values)
    if project and 'image_proj' in params:
      k = params['image_proj']['kernel']
      out = {n: jnp.einsum('...d,de->...e', v, k.astype(v.dtype))
             for n, v in out.items()}
    return out

  return model, jax.jit(fn, static_argnames=('project', 'values'))


@functools.lru_cache(maxsize=32)
def _jitted_text_fn(kwargs_json: str):
  """One jitted text function per architecture (see `_jitted_image_fn`)."""
  model = TextEncoder(**_inference_kwargs(json.loads(kwargs_json), TextEncoder))

  def fn(params, ids):
    return model.apply({'params': params['text']}, ids)['pooled']

  return model, jax.jit(fn)


def _key(cfg: dict, cls) -> str:
  """Hashable, canonical form of the module kwargs (dtypes by name)."""
  from tipsito.export_format import jsonable  # pylint: disable=g-import-not-at-top
  return json.dumps(jsonable(_inference_kwargs(cfg, cls)), sort_keys=True)


class Encoder:
  """Frozen image + text encoders of one exported model.

  Attributes: `temperature` (T of logits = cos / T), `tokenizer` (or None),
  `config` (the export's config dict), `params`.
  """

  def __init__(self, image_config: dict, text_config: dict, params: dict,
               temperature: float, tokenizer: Any = None,
               config: Optional[dict] = None, tokenizer_error: Optional[str]
               = None):
    self.image_config = dict(image_config)
    self.text_config = dict(text_config)
    # Device arrays once (Orbax restores numpy): no host->device copy per call.
    self.params = jax.tree_util.tree_map(
        lambda a: a if isinstance(a, jax.Array) else jax.device_put(a), params)
    self.temperature = float(temperature)
    self.tokenizer = tokenizer
    self._tokenizer_error = tokenizer_error
    self.config = config if config is not None else {
        'image': self.image_config, 'text': self.text_config,
        'temperature': self.temperature,
        'image_proj': 'image_proj' in params}
    self.image_model, self._embed_images = _jitted_image_fn(
        _key(self.image_config, VisionTransformer))
    self.text_model, self._embed_texts = _jitted_text_fn(
        _key(self.text_config, TextEncoder))

  @classmethod
  def from_params(cls, image_config: dict, text_config: dict, params: dict,
                  temperature: float, tokenizer: Any = None) -> 'Encoder':
    """In-memory encoder (training-time evals): no files involved."""
    return cls(image_config, text_config, params, temperature, tokenizer)

  def embed_images(self, images, project: bool = False, values: bool = True
                   ) -> dict[str, jax.Array]:
    """(B,H,W,3) uint8 or float [0,1] -> {'cls','patches'[,'values']}.

    Raw final-norm outputs (not L2-normalised). `project=True` applies the
    image projection when the export has one (CLIP/ITO), identity otherwise.
    Non-multiple sizes are centre zero-padded inside the model.
    """
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3:
      raise ValueError(f'images must be (B,H,W,3), got {images.shape}')
    return self._embed_images(self.params, images, project=project,
                              values=values)

  def tokenize(self, texts: Sequence[str]) -> np.ndarray:
    """list[str] -> int32 (B, max_len) with this model's tokenizer."""
    if self.tokenizer is None:
      raise ValueError(self._tokenizer_error or
                       'this encoder has no tokenizer: pass int32 token ids')
    return np.asarray(self.tokenizer.tokenize(list(texts)), np.int32)

  def embed_texts(self, texts: Union[Sequence[str], np.ndarray, jax.Array]
                  ) -> jax.Array:
    """Token ids (B,L) int32 or list[str] -> raw pooled text embedding (B,D)."""
    if isinstance(texts, str):
      texts = [texts]
    if isinstance(texts, (list, tuple)) and (not texts or
                                             isinstance(texts[0], str)):
      ids = self.tokenize(texts)
    else:
      ids = np.asarray(texts)
      if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f'token ids must be an int (B,L) array, got '
                         f'{ids.dtype} {ids.shape}')
    return self._embed_texts(self.params, jnp.asarray(ids, jnp.int32))


def load(path) -> Encoder:
  """Loads an exported checkpoint directory (tipsito.export_format.write_export)."""
  from tipsito import export_format  # pylint: disable=g-import-not-at-top
  cfg, params = export_format.read_export(path)
  tok, err = None, None
  if cfg.get('tokenizer'):
    tok_path = os.fspath(export_format.as_path(path) / cfg['tokenizer'])
    tok, err = _make_tokenizer(tok_path, cfg['text'])
  else:
    err = ('this export has no tokenizer (exported without --tokenizer): '
           'pass int32 token ids')
  return Encoder(cfg['image'], cfg['text'], params, cfg['temperature'],
                 tokenizer=tok, config=cfg, tokenizer_error=err)
