"""DINO / iBOT projection heads (DINOv2 layout).

Why weight normalisation with a fixed gain: DINOv2's last layer is
`weight_norm(Linear(bottleneck, K, bias=False))` with the gain frozen to 1, so
each prototype is a unit direction and the logits are cosines between the
L2-normalised bottleneck feature and the prototypes. We store the unnormalised
direction `v` (bottleneck, K) and normalise per prototype at every call, which
is exactly that parametrisation (and keeps optimiser updates on `v`).
Training-only: heads are never exported.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tipsito.models import layers

Dtype = Any


class DINOHead(nn.Module):
  """MLP (GELU) -> bottleneck -> L2 normalise -> weight-normalised prototypes.

  Used for both DINO (CLS tokens) and iBOT (patch tokens); operates on the
  last axis so any leading shape works. Logits are returned in float32 because
  the losses divide them by small temperatures (0.04-0.1).
  """

  num_prototypes: int = 32768
  hidden_dim: int = 2048
  bottleneck_dim: int = 256
  num_layers: int = 3
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kw = dict(
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=nn.initializers.truncated_normal(0.02),
      bias_init=nn.initializers.zeros,
    )
    x = x.astype(self.dtype)
    if self.num_layers == 1:
      x = nn.Dense(self.bottleneck_dim, name='Dense_0', **kw)(x)
    else:
      for i in range(self.num_layers - 1):
        x = nn.Dense(self.hidden_dim, name=f'Dense_{i}', **kw)(x)
        x = layers.gelu_exact(x)  # exact erf GELU (dinov2's nn.GELU), lean backward (layers.py)
      x = nn.Dense(self.bottleneck_dim, name=f'Dense_{self.num_layers - 1}', **kw)(x)
    x = layers.l2_normalize(x.astype(jnp.float32), eps=1e-24)
    v = self.param(
      'last_layer',
      nn.initializers.truncated_normal(0.02),
      (self.bottleneck_dim, self.num_prototypes),
      self.param_dtype,
    )
    w = layers.l2_normalize(v.astype(jnp.float32), axis=0, eps=1e-24)
    return jnp.dot(x.astype(self.dtype), w.astype(self.dtype), preferred_element_type=jnp.float32)
