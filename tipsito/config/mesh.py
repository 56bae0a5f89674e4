"""`config.mesh` {data, fsdp, model} -> the mesh shape for a number of devices.

Why in config/: validation checks the mesh against the devices before anything is built, and the config
layer does not import the training code; tipsito/train/sharding.py builds the mesh from this shape.
"""

from __future__ import annotations

import numpy as np

MESH_AXES = ("data", "fsdp", "model")


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int]:
  """Resolves `config.mesh` {data, fsdp, model} (one of them may be -1 = all remaining devices)."""
  sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"config.mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
        f"config.mesh={dict(zip(MESH_AXES, sizes))}: {num_devices} devices not divisible by {known}"
      )
    sizes[sizes.index(-1)] = num_devices // known
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(
      f"config.mesh={dict(zip(MESH_AXES, sizes))} uses {int(np.prod(sizes))} devices but "
      f"{num_devices} are available; set one axis to -1"
    )
  return tuple(sizes)
