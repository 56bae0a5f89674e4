"""Shared by the DPT tests (tests/test_dense_dpt.py, tests/test_dense_eval.py, tests/test_dense_train.py):
the tiny tower and head shapes, and random parameters drawn from shapes alone.

Why shapes alone: every test redraws every leaf (`randomise`), so the modules' own initialisers are never
needed; `jax.eval_shape` traces the init without running it. Running it was the slowest part of these
tests (measured on a loaded 2-core machine: 50 s for the tower's init, 170 s for one DPT head's, eager or
jitted alike: the head's init runs its whole forward op by op, or compiles it). No torch here: the
modules that need no transformers run without it.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tipsito.models import dpt

TOWER = dict(patch_size=8, width=32, depth=4, num_heads=2, mlp_dim=128, num_cls_tokens=2, posemb_grid=4)
CFG = dpt.DPTConfig(
  layers=(1, 2, 3, 4),
  neck_hidden_sizes=(8, 16, 24, 32),
  fusion_hidden_size=16,
  num_depth_bins=32,
  num_labels=5,
)


def randomise(tree, seed):
  """Every leaf redrawn (biases and LayerNorms included), so no tensor is trivially zero or one: kernels
  N(0, 1 / fan_in) so that activations stay O(1) through the ~20 layers, vectors N(0, 0.3^2). Leaves may
  be arrays or ShapeDtypeStructs (only their shapes are read)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  rng = np.random.default_rng(seed)
  new = []
  for x in leaves:
    shape = tuple(x.shape)
    scale = 0.3 if len(shape) <= 1 else 1.0 / np.sqrt(np.prod(shape[:-1]))
    new.append(np.asarray(rng.normal(0, scale, shape), np.float32))
  return jax.tree_util.tree_unflatten(treedef, new)


def random_tower(vit, images, seed):
  """Random params of the VisionTransformer `vit` for inputs shaped like `images` (`randomise`)."""
  shapes = jax.eval_shape(vit.init, jax.random.PRNGKey(0), jnp.asarray(images))["params"]
  return randomise(shapes, seed)


def random_head(cfg, task, blocks, seed):
  """Random params of a DPT head of `task` for blocks shaped like `blocks` (`randomise`)."""
  return randomise(jax.eval_shape(lambda b: dpt.init_head(cfg, task, b), blocks), seed)
