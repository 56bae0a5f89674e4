"""Parameter counts and architecture of the real variants (no memory used).

Why: the presets must be the official TIPS architectures (so released weights
load) and reproduce TIPSv2 Table 16. Everything goes through jax.eval_shape,
so g/14 (1.1B) costs nothing.
"""

import functools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from tipsito import tips_import
from tipsito.models import TextEncoder, VisionTransformer, text_config, vit_config

# TIPSv2 Table 16 (g/14 image: the official tree has 1.136B, the table rounds
# to 1.1B); text with 12 layers, So400m with 27.
TABLE16_IMAGE = {'B/14': 86.3e6, 'L/14': 304.0e6, 'So400m/14': 413.3e6, 'g/14': 1.136e9}
TABLE16_TEXT = {'B/14': 109.6e6, 'L/14': 183.9e6, 'So400m/14': 448.3e6, 'g/14': 389.1e6}


def _shapes(module, x):
  tree = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)['params']
  return {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(tree, sep='/').items()}


def _count(shapes):
  return int(sum(np.prod(s) for s in shapes.values()))


@functools.lru_cache(maxsize=None)
def image_shapes(variant):
  cfg = vit_config(variant, num_cls_tokens=2)
  p = cfg['patch_size']
  return _shapes(VisionTransformer(**cfg), jnp.zeros((1, p, p, 3)))


@functools.lru_cache(maxsize=None)
def text_shapes(variant):
  return _shapes(TextEncoder(**text_config(variant)), jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize('variant', list(TABLE16_IMAGE))
def test_table16_counts(variant):
  n_img = _count(image_shapes(variant))
  n_txt = _count(text_shapes(variant))
  assert abs(n_img / TABLE16_IMAGE[variant] - 1) < 0.005, n_img
  assert abs(n_txt / TABLE16_TEXT[variant] - 1) < 0.005, n_txt


@pytest.fixture(scope='module')
def official_trees(conformance_dir):
  with open(conformance_dir / 'tips_model' / 'official_param_trees.json') as f:
    return json.load(f)['trees']


def _expand(tree):
  """Official json tree (per-block template) -> flat {key: shape object}."""
  flat = {k: tuple(v) for k, v in tree['non_block_params'].items()}
  for i in range(tree['num_blocks']):
    for k, v in tree['per_block_params'].items():
      flat[k.replace('{i}', str(i))] = tuple(v)
  return {k: types.SimpleNamespace(shape=v) for k, v in flat.items()}


@pytest.mark.parametrize('variant', list(TABLE16_IMAGE))
def test_presets_match_official_trees(official_trees, variant):
  """Official B/L/So400m/g trees map 1:1 onto tipsito's presets."""
  vflat = _expand(official_trees[f'vision {variant}'])
  cfg = tips_import.infer_vision_config(vflat)
  for k in ('width', 'depth', 'num_heads', 'mlp_dim', 'ffn', 'patch_size'):
    assert cfg[k] == vit_config(variant)[k], k
  ours = image_shapes(variant)
  mapped = {
    tips_import._official_to_tipsito(k, tips_import._VISION_MAP, 'encoder/transformer/'): v.shape
    for k, v in vflat.items()
  }
  assert mapped == ours
  assert _count(ours) == official_trees[f'vision {variant}']['num_params']

  tflat = _expand(official_trees[f'text {variant}'])
  del tflat['temperature_contrastive']
  tcfg = tips_import.infer_text_config(tflat)
  ours_t = text_shapes(variant)
  if variant == 'So400m/14':
    # Official code builds 12 text layers; Table 16 (and our preset) says 27.
    assert tcfg['depth'] == 12 and text_config(variant)['depth'] == 27
  else:
    mapped = {
      tips_import._official_to_tipsito(k, tips_import._TEXT_MAP, 'transformer/'): v.shape
      for k, v in tflat.items()
    }
    assert mapped == ours_t
    assert _count(ours_t) + 1 == official_trees[f'text {variant}']['num_params']
  for k in ('width', 'num_heads', 'mlp_dim'):
    assert tcfg[k] == text_config(variant)[k], k
