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

from tipsito import export_format
from tipsito import inference_tools
from tipsito.models.kwargs import complete_tower_config, module_kwargs
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
    from tipsito.data.tokenizer import Tokenizer  # optional: only strings need it (the except below)
  except ImportError as e:
    return None, (
      f'cannot tokenize strings: tipsito.data.tokenizer is not available ({e}); pass int32 token ids instead'
    )
  text = TextEncoder(**_inference_kwargs(dict(text_cfg), TextEncoder))  # an older export: module defaults
  flavour = text.flavour
  tok = Tokenizer(path, max_len=int(text.max_len), flavour=flavour)
  vocab = text_cfg.get('vocab_size')
  if vocab is not None and tok.vocab_size > int(vocab):
    return None, (
      f'cannot tokenize strings: the {flavour!r} tokenizer has {tok.vocab_size} ids '
      f'but the text tower embeds {vocab}; pass int32 token ids instead'
    )
  return tok, None


@functools.lru_cache(maxsize=32)
def _jitted_image_fn(kwargs_json: str):
  """One jitted image function per architecture, shared by all Encoders.

  Training-time evals build a fresh Encoder (`from_params`) at every eval;
  caching by architecture means they do not recompile each time.
  """
  model = VisionTransformer(**_inference_kwargs(json.loads(kwargs_json), VisionTransformer))

  def fn(params, images, project, values):
    out = model.apply({'params': params['image']}, images, return_values=values)
    if project and 'image_proj' in params:
      k = params['image_proj']['kernel']
      out = {n: jnp.einsum('...d,de->...e', v, k.astype(v.dtype)) for n, v in out.items()}
    return out

  return model, jax.jit(fn, static_argnames=('project', 'values'))


@functools.lru_cache(maxsize=32)
def _jitted_text_fn(kwargs_json: str):
  """One jitted text function per architecture (see `_jitted_image_fn`). Only the pooled embedding is
  returned, so the tower runs with `pooled_only` (an OpenCLIP-style tower's last block computes the EOT
  row alone; tipsito/models/text.py)."""
  model = TextEncoder(**_inference_kwargs(json.loads(kwargs_json), TextEncoder))

  def fn(params, ids):
    return model.apply({'params': params['text']}, ids, pooled_only=True)['pooled']

  return model, jax.jit(fn)


def _key(cfg: dict, cls) -> str:
  """Hashable, canonical form of the module kwargs (dtypes by name)."""
  return json.dumps(export_format.jsonable(_inference_kwargs(cfg, cls)), sort_keys=True)


class Encoder:
  """Frozen image + text encoders of one exported model.

  Attributes: `temperature` (T of logits = cos / T), `tokenizer` (or None),
  `config` (the export's config dict), `params`, `image_config` / `text_config` (the towers' configs,
  every key of their module stated: tipsito/models/kwargs.py complete_tower_config).
  """

  def __init__(
    self,
    image_config: dict,
    text_config: dict,
    params: dict,
    temperature: float,
    tokenizer: Any = None,
    config: Optional[dict] = None,
    tokenizer_error: Optional[str] = None,
  ):
    self.image_config, _ = complete_tower_config(image_config, 'image', 'Encoder image_config')
    self.text_config, _ = complete_tower_config(text_config, 'text', 'Encoder text_config')
    # Device arrays once (Orbax restores numpy): no host->device copy per call.
    self.params = jax.tree_util.tree_map(
      lambda a: a if isinstance(a, jax.Array) else jax.device_put(a), params
    )
    self.temperature = float(temperature)
    self.tokenizer = tokenizer
    self._tokenizer_error = tokenizer_error
    self.config = (
      config
      if config is not None
      else {
        'image': self.image_config,
        'text': self.text_config,
        'temperature': self.temperature,
        'image_proj': 'image_proj' in params,
      }
    )
    self.image_model, self._embed_images = _jitted_image_fn(_key(self.image_config, VisionTransformer))
    self.text_model, self._embed_texts = _jitted_text_fn(_key(self.text_config, TextEncoder))

  @classmethod
  def from_params(
    cls, image_config: dict, text_config: dict, params: dict, temperature: float, tokenizer: Any = None
  ) -> 'Encoder':
    """In-memory encoder (training-time evals): no files involved."""
    return cls(image_config, text_config, params, temperature, tokenizer)

  @property
  def default_project(self) -> bool:
    """What `project=None` means: the embedding the model was trained with (CLIP/ITO exports: projected
    by `image_proj`; TIPS-style exports: the raw CLS/patch features)."""
    return bool(self.config.get('image_proj', 'image_proj' in self.params))

  @property
  def image_size(self) -> int:
    """Default side for images given as files or PIL images: the training resolution the export records
    (`extra.image_size`), else the position-embedding grid x patch (no posemb resize)."""
    size = (self.config.get('extra') or {}).get('image_size')
    if size:
      return int(size)
    g = self.image_model.posemb_grid  # the config's (an older export's filled: export_format.upgrade_config)
    g = g if isinstance(g, int) else int(g[0])
    return g * int(self.image_model.patch_size)

  def _image_batch(self, images, size: Optional[int]):
    """Arrays (B,H,W,3) / one (H,W,3) as given (uint8 or [0,1] floats); files, bytes, PIL images, lists,
    or any input with `size`: decoded and resized (tipsito/inference_tools.py: to_unit_batch)."""
    if size is None and hasattr(images, 'ndim') and images.ndim in (3, 4):
      x = jnp.asarray(images)
      return x[None] if x.ndim == 3 else x
    return jnp.asarray(inference_tools.to_unit_batch(images, size or self.image_size))

  def preprocess(
    self, images, size: Optional[int] = None, *, resize: str = 'center_crop', normalize: bool = False
  ) -> np.ndarray:
    """Images (paths, bytes, PIL images or arrays; one or a list) -> float32 (B, size, size, 3) in [0,1],
    decoded and resized as the evals do (`resize`: 'center_crop' | 'resize'); `size` defaults to
    `image_size`. This is what `embed_images`/`classify` take (the model applies its pixel statistics
    and padding itself). `normalize=True` returns instead what the patch embedding sees: the model's
    pixel statistics applied and centre zero-padded to whole patches, e.g. `pixel_values` for
    transformers' Tipsv2Model after `.transpose(0, 3, 1, 2)`.
    """
    x = inference_tools.to_unit_batch(images, size or self.image_size, resize)
    return inference_tools.model_input(self.image_model, x) if normalize else x

  def classify(
    self,
    images,
    class_names: Sequence[str],
    templates=None,
    *,
    size: Optional[int] = None,
    cls_index: int = 0,
    project: Optional[bool] = None,
  ) -> np.ndarray:
    """Zero-shot probabilities (B, C) over `class_names`: the `zeroshot` eval's protocol (prompts from
    `templates`, a template-set name or list; default CLIP's 80 ImageNet templates, as the eval), logits
    = cos(CLS `cls_index`, class embedding) / temperature. Images as for `embed_images`."""
    return inference_tools.classify(
      self, images, class_names, templates, size=size, cls_index=cls_index, project=project
    )

  def embed_images(
    self, images, project: Optional[bool] = None, values: bool = True, size: Optional[int] = None
  ) -> dict[str, jax.Array]:
    """(B,H,W,3) uint8 or float [0,1] -> {'cls','patches'[,'values']}.

    Raw final-norm outputs (not L2-normalised). `project=True` applies the
    image projection when the export has one (CLIP/ITO), identity otherwise;
    None (default) is `default_project`, what the model was trained with.
    Non-multiple sizes are centre zero-padded inside the model. One (H,W,3)
    image, files, PIL images and lists are accepted too (see `preprocess`;
    `size` resizes any input).
    """
    if project is None:
      project = self.default_project
    images = self._image_batch(images, size)
    if images.ndim != 4 or images.shape[-1] != 3:
      raise ValueError(f'images must be (B,H,W,3), got {images.shape}')
    return self._embed_images(self.params, images, project=bool(project), values=values)

  def tokenize(self, texts: Sequence[str]) -> np.ndarray:
    """list[str] -> int32 (B, max_len) with this model's tokenizer."""
    if self.tokenizer is None:
      raise ValueError(self._tokenizer_error or 'this encoder has no tokenizer: pass int32 token ids')
    return np.asarray(self.tokenizer.tokenize(list(texts)), np.int32)

  def embed_texts(self, texts: Union[Sequence[str], np.ndarray, jax.Array]) -> jax.Array:
    """Token ids (B,L) int32 or list[str] -> raw pooled text embedding (B,D)."""
    if isinstance(texts, str):
      texts = [texts]
    if isinstance(texts, (list, tuple)) and (not texts or isinstance(texts[0], str)):
      ids = self.tokenize(texts)
    else:
      ids = np.asarray(texts)
      if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f'token ids must be an int (B,L) array, got {ids.dtype} {ids.shape}')
    return self._embed_texts(self.params, jnp.asarray(ids, jnp.int32))


def load(path) -> Encoder:
  """Loads an exported checkpoint directory (tipsito.export_format.write_export)."""
  cfg, params = export_format.read_export(path)
  tok, err = None, None
  if cfg['tokenizer']:
    tok_path = os.fspath(export_format.as_path(path) / cfg['tokenizer'])
    tok, err = _make_tokenizer(tok_path, cfg['text'])
  else:
    err = 'this export has no tokenizer (exported without --tokenizer): pass int32 token ids'
  return Encoder(
    cfg['image'], cfg['text'], params, cfg['temperature'], tokenizer=tok, config=cfg, tokenizer_error=err
  )
