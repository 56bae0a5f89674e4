"""Batch-sharding constraints on activations inside the towers.

Why: with FSDP the weights are split over the 'fsdp' mesh axis *and* the batch is split over
('data', 'fsdp'). In `x @ W` both operands are then sharded on the same axis, and GSPMD, left to itself,
may resolve the conflict by gathering the activations (the whole batch on every chip) instead of the
weights: the compiled TPU program of `configs/ito_b16.py` needed over 1 TiB of temporaries per chip that
way (`python -m tipsito.plan`). Pinning the residual stream of every block to the batch sharding makes the
compiler all-gather the (small) weights instead, as FSDP intends. The constraint applies only while a mesh
with the batch axes is set (`jax.set_mesh`, as the train step, the evals and `plan` do); a plain
`model.apply` outside a mesh is unchanged.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

# Mesh axes the global batch is split over (the mesh itself is built in tipsito/train/sharding.py).
BATCH_AXES = ("data", "fsdp")


def constrain_batch(x: jax.Array) -> jax.Array:
  """`x` with its leading (batch) dimension pinned to BATCH_AXES of the current mesh, if there is one.

  Leaves `x` alone when no mesh is set, when the mesh has no batch axes, or when the leading dimension
  does not divide over them (e.g. a batch of one while tracing shapes).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
    return x
  n = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if n == 1 or x.ndim == 0 or x.shape[0] % n:
    return x
  return jax.lax.with_sharding_constraint(x, P(BATCH_AXES))


def constrain_microbatches(x: jax.Array) -> jax.Array:
  """`x` of shape (K, B/K, ...) (K micro-batches, tipsito/objective/accumulate.py) with its second
  dimension pinned to BATCH_AXES, so every micro-batch stays split over all the batch devices; same
  conditions as `constrain_batch`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
    return x
  n = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if n == 1 or x.ndim < 2 or x.shape[1] % n:
    return x
  return jax.lax.with_sharding_constraint(x, P(None, BATCH_AXES))
