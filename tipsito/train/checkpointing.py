"""Orbax checkpoint manager for the train state plus the data-iterator state.

Why: TPU jobs are preempted; a resumed run must continue exactly where it stopped — same parameters,
optimiser state, EMA teacher, centres, RNG *and* the same next batch. The TrainState is one pytree saved as
an Orbax StandardSave item (sharded, async); the per-host grain iterator state is saved next to it as a
JSON item named `data_<process_index>`. Saves happen every `ckpt.every_steps`, on SIGTERM (preemption
notice) and at the end; restore picks the latest complete (atomically committed) step.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import signal
import threading
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from tipsito import paths


def _encode_data_state(state: Any) -> Any:
  """grain iterator states are dicts or bytes; bytes become base64 so they fit a JSON item."""
  if isinstance(state, (bytes, bytearray)):
    return {"__bytes__": base64.b64encode(bytes(state)).decode("ascii")}
  return json.loads(json.dumps(state))


def _decode_data_state(obj: Any) -> Any:
  if isinstance(obj, dict) and set(obj) == {"__bytes__"}:
    return base64.b64decode(obj["__bytes__"])
  return obj


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` for (TrainState, data iterator state)."""

  def __init__(self, directory: str, *, every_steps: int, keep: int, async_save: bool = True):
    self.directory = paths.resolve(directory)  # local or gs://
    self.every_steps = int(every_steps)
    self._data_item = f"data_{jax.process_index()}"
    options = ocp.CheckpointManagerOptions(
        max_to_keep=int(keep), save_interval_steps=1, create=True,
        enable_async_checkpointing=bool(async_save))
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._preempted = threading.Event()

  # --- preemption -----------------------------------------------------------------------------------
  def install_sigterm_handler(self) -> None:
    """SIGTERM (TPU maintenance/preemption, `kill`) sets a flag; the loop saves and exits cleanly."""
    if threading.current_thread() is not threading.main_thread():
      return

    def handler(signum, frame):
      del frame
      logging.warning("Signal %d received: will checkpoint and stop after this step.", signum)
      self._preempted.set()

    signal.signal(signal.SIGTERM, handler)

  @property
  def preempted(self) -> bool:
    """True once SIGTERM arrived (or the JAX preemption sync point was reached on TPU)."""
    if self._preempted.is_set():
      return True
    return False

  # --- save / restore -------------------------------------------------------------------------------
  def latest_step(self) -> Optional[int]:
    """Latest complete checkpoint step, None if the directory has none."""
    return self.manager.latest_step()

  def should_save(self, step: int) -> bool:
    """Periodic save every `every_steps` steps."""
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state: Any, data_state: Any = None, *, force: bool = False) -> bool:
    """Saves (async when configured). Returns whether a save was started."""
    items = {"state": ocp.args.StandardSave(state)}
    if data_state is not None:
      items[self._data_item] = ocp.args.JsonSave(_encode_data_state(data_state))
    return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, abstract_state: Any, step: Optional[int] = None, *, with_data: bool = True):
    """(state, data_state or None) at `step` (default latest); `abstract_state` carries the shardings."""
    step = self.latest_step() if step is None else step
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    available = set()
    try:
      available = set(self.manager.item_metadata(step).keys())
    except Exception:  # pylint: disable=broad-except  # older layouts: just try.
      available = {self._data_item}
    if with_data and self._data_item in available:
      items[self._data_item] = ocp.args.JsonRestore()
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    data = out.get(self._data_item) if with_data and self._data_item in items else None
    return out["state"], (None if data is None else _decode_data_state(data))

  def wait(self) -> None:
    """Blocks until pending async saves are committed."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits and releases the manager's resources."""
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_with_shardings(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings (restored arrays land directly where they belong)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def restore_params(path: str, abstract_params: Any) -> Any:
  """Params only, from another run's workdir/checkpoint dir (stage-2 init via `config.init_from`).

  Accepts a workdir (uses `<workdir>/checkpoints`, latest step), a checkpoint dir, or a step dir.
  """
  path = paths.resolve(path)
  ckpt_dir = paths.join(path, "checkpoints") if paths.as_path(path).joinpath("checkpoints").is_dir() else path
  mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(read_only=True))
  step = mngr.latest_step()
  if step is None:
    raise FileNotFoundError(f"config.init_from={path!r}: no checkpoint found in {ckpt_dir}")
  # Restore just the params subtree via a partial restore of the state item.
  restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item={"params": abstract_params},
      restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), {"params": abstract_params}),
      partial_restore=True)))
  mngr.close()
  return restored["state"]["params"]
