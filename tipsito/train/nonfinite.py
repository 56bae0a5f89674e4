"""Host side of the non-finite guard: counts skipped steps and stops the run after too many in a row.

Why: the jitted step (`tipsito/train/step.py`) already refuses to apply a step whose loss, gradient or
update is not finite (the state stays as it was, so params and checkpoints stay finite) and reports it as
the metric `train/nonfinite`. A run whose every step is refused makes no progress, though, so after
`config.nonfinite.max_consecutive` refused steps in a row it must stop with the step and the non-finite
terms named. The flag of step i is read while step i+1 runs (one step behind), so checking every step
costs no device idle time.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import numpy as np
from absl import logging

FLAG = "train/nonfinite"  # per-step 0/1 metric of the jitted step
TOTAL = "train/nonfinite_steps"  # running count over this process' steps, logged with the losses


class NonFiniteError(FloatingPointError):
  """Too many consecutive steps with a non-finite loss, gradient or update."""


class NonFiniteMonitor:
  """Feed it every step's metrics (`push`); it raises NonFiniteError after `max_consecutive` in a row."""

  def __init__(self, max_consecutive: int):
    self.max_consecutive = int(max_consecutive)
    self.total = 0
    self.consecutive = 0
    self._pending: Optional[tuple[int, Any]] = None

  def push(self, step: int, metrics: dict) -> None:
    """Records step `step`'s (device) metrics and checks the previous step's."""
    pending, self._pending = self._pending, (step, metrics)
    if pending is not None:
      self._check(*pending)

  def flush(self) -> None:
    """Checks the last pushed step (end of the loop)."""
    pending, self._pending = self._pending, None
    if pending is not None:
      self._check(*pending)

  def _check(self, step: int, metrics: dict) -> None:
    if FLAG not in metrics or not int(jax.device_get(metrics[FLAG])):
      self.consecutive = 0
      return
    self.total += 1
    self.consecutive += 1
    bad = nonfinite_terms(metrics)
    logging.warning(
      "Step %d skipped: non-finite %s (state left unchanged; %d in a row, %d in total)",
      step,
      ", ".join(bad) or "values",
      self.consecutive,
      self.total,
    )
    if self.consecutive >= self.max_consecutive:
      raise NonFiniteError(
        f"Stopping at step {step}: {self.consecutive} consecutive steps with a non-finite loss, gradient "
        f"or update (config.nonfinite.max_consecutive={self.max_consecutive}); non-finite at step "
        f"{step}: {', '.join(bad) or 'the update'}. Those steps were skipped (params, optimizer state, "
        "EMA and centres unchanged), so every checkpoint holds finite params. Resume from the latest "
        "checkpoint with a lower config.optim.lr, gradient clipping (config.optim.clip_norm) or "
        "bfloat16 -> float32 (config.model.*.dtype)."
      )


def nonfinite_terms(metrics: dict) -> list[str]:
  """'name=value' of every non-finite scalar metric (loss terms, grad_norm, update_norm)."""
  host = jax.device_get({k: v for k, v in metrics.items() if np.ndim(v) == 0})
  return [f"{k}={float(v)}" for k, v in sorted(host.items()) if not math.isfinite(float(v))]
