"""Device mesh, regex parameter-sharding rules and global-batch assembly.

Why: the same train step must run on 1 CPU device, 8 fake CPU devices and a TPU pod. We describe placement
declaratively — a `Mesh` with axes (data, fsdp, model) sized from `config.mesh`, and an ordered list of
(regex, spec) rules matched against the '/'-joined path of every state leaf — and let XLA (GSPMD) insert the
collectives. The default rule is FSDP: shard the largest dimension divisible by the fsdp axis size, replicate
small leaves. The batch is sharded over ('data', 'fsdp') so every device holds a slice of the global batch and
losses written on the global batch stay exact.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tipsito.config.mesh import MESH_AXES, mesh_shape  # noqa: F401  (pure arithmetic on config.mesh)
from tipsito.models.activation_sharding import BATCH_AXES  # the towers constrain activations the same way

# Spec keywords usable in config.sharding.rules besides explicit tuples of axis names / None.
SPEC_KEYWORDS = ("fsdp", "replicate")


def path_str(path) -> str:
  """'/'-joined readable path of a pytree key path (dict keys, attributes, sequence indices)."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return "/".join(parts)


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, model) mesh; physical layout from mesh_utils (ICI-aware on TPU)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  try:
    arr = mesh_utils.create_device_mesh(shape, devices)
  except Exception:  # pylint: disable=broad-except  # CPU / odd topologies: plain reshape is fine.
    arr = np.asarray(devices).reshape(shape)
  return Mesh(arr, MESH_AXES)


def _fsdp_spec(shape: tuple[int, ...], mesh: Mesh, min_size: int) -> P:
  """Shards the largest dim divisible by the fsdp axis size; replicates small or indivisible leaves."""
  n = mesh.shape["fsdp"]
  if n == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
    return P()
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % n == 0:
      spec = [None] * len(shape)
      spec[dim] = "fsdp"
      return P(*spec)
  return P()


def _to_spec(rule_spec, shape, mesh: Mesh, min_size: int) -> P:
  if rule_spec == "fsdp":
    return _fsdp_spec(shape, mesh, min_size)
  if rule_spec == "replicate" or rule_spec is None:
    return P()
  spec = tuple(rule_spec)
  if len(spec) != len(shape):  # A rule written for matrices never breaks a vector with the same name.
    return _fsdp_spec(shape, mesh, min_size)
  for dim, ax in zip(shape, spec):
    axes = ax if isinstance(ax, (tuple, list)) else (ax,)
    size = int(np.prod([mesh.shape[a] for a in axes if a is not None]))
    if size > 1 and dim % size:
      return _fsdp_spec(shape, mesh, min_size)
  return P(*spec)


def tree_shardings(
  tree: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = (), *, min_size: int = 2**12
) -> Any:
  """NamedSharding for every leaf of `tree` (arrays or ShapeDtypeStructs) from ordered regex rules.

  rules: [(regex, spec)] matched with re.search on the leaf path; spec is 'fsdp', 'replicate' or a tuple of
  mesh axis names/None per dimension (e.g. (None, 'model') for tensor parallelism). The first match wins;
  unmatched leaves use 'fsdp'. Scalars are always replicated.
  """
  compiled = [(re.compile(r), s) for r, s in rules]

  def one(path, x):
    shape = tuple(getattr(x, "shape", ()))
    if not shape:
      return NamedSharding(mesh, P())
    name = path_str(path)
    for r, s in compiled:
      if r.search(name):
        return NamedSharding(mesh, _to_spec(s, shape, mesh, min_size))
    return NamedSharding(mesh, _fsdp_spec(shape, mesh, min_size))

  return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over ('data', 'fsdp'); all other dims replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  """Fully replicated sharding (scalars, metrics)."""
  return NamedSharding(mesh, P())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles per-host numpy batches into global jax.Arrays sharded over ('data', 'fsdp').

  Each process passes its own slice (leading dim = global batch / process count);
  `jax.make_array_from_process_local_data` does the rest, on 1 device or a pod alike.
  """
  sh = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sh, np.asarray(v)) for k, v in local_batch.items()}


def describe(shardings: Any, shapes: Any) -> list[tuple[str, tuple, str]]:
  """(path, shape, spec) rows for the parameter overview and `tipsito.info`."""
  rows = []
  flat_s = jax.tree_util.tree_flatten_with_path(shardings)[0]
  flat_x = jax.tree.leaves(shapes)
  for (path, s), x in zip(flat_s, flat_x):
    rows.append((path_str(path), tuple(x.shape), str(s.spec)))
  return rows
