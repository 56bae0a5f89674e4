"""Running evaluators: merged metrics, scalar summaries and pictures (the training-loop hook).

Why separate from the evaluators: this is the only eval code that writes (TensorBoard scalars and
images through a clu metric writer, PNG files); the evaluators only compute.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import time

import numpy as np

from tipsito.evals import pictures as pictures_lib
from tipsito.evals.evaluator import Evaluator


def with_intervals_folded(results: Mapping[str, float], digits: int = 2) -> list[tuple[str, str]]:
  """[(key, 'value' or 'value [lo, hi]')] in `results` order: each '<key>_ci_lo' / '<key>_ci_hi' pair
  (tipsito/evals/references.py) folded into its metric's text, so a printed line reads like a table
  cell; an interval without its metric stays a key of its own."""
  out = []
  for k, v in results.items():
    if k.endswith(("_ci_lo", "_ci_hi")) and k[:-6] in results:
      continue
    text = "nan" if v != v else f"{v:.{digits}f}"
    lo, hi = results.get(k + "_ci_lo"), results.get(k + "_ci_hi")
    if lo is not None and hi is not None and lo == lo and hi == hi:
      text += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    out.append((k, text))
  return out


def run_all(
  evaluators: Mapping[str, Evaluator] | Sequence[Evaluator],
  encoder,
  *,
  step: int = 0,
  only_due: bool = False,
  is_last: bool = False,
  log: Callable[[str], None] | None = None,
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """Runs evaluators (only those due at `step` when `only_due`); returns (merged metrics, merged pictures).

  Computes only: the training loop (`run_evaluators`) and `tipsito.evaluate` each write the results their
  own way.
  """
  evs = list(evaluators.values()) if isinstance(evaluators, Mapping) else list(evaluators)
  results: dict[str, float] = {}
  pics: dict[str, np.ndarray] = {}
  for ev in evs:
    if only_due and not ev.should_run(step, is_last=is_last):
      continue
    t0 = time.time()
    res = ev.run(encoder)
    results.update(res)
    pics.update(ev.pictures)
    if log is not None:
      log(
        f"eval {ev.name} @ step {step}: "
        + ", ".join(f"{k.split('/', 1)[-1]}={t}" for k, t in with_intervals_folded(res))
        + f" ({time.time() - t0:.1f}s)"
      )
  return results, pics


def run_evaluators(
  evaluators: Mapping[str, Evaluator] | Sequence[Evaluator],
  encoder,
  *,
  step: int = 0,
  writer=None,
  picture_dir: str | None = None,
  only_due: bool = False,
  is_last: bool = False,
  log: Callable[[str], None] | None = None,
) -> dict[str, float]:
  """Runs evaluators, merges their metrics, and writes scalars/pictures (the training-loop hook).

  writer: a clu metric writer (write_scalars / write_images), optional.
  picture_dir: PNG output folder for pictures, optional.
  only_due: run only evaluators whose `should_run(step, is_last=is_last)` is True.
  """
  results, pics = run_all(evaluators, encoder, step=step, only_due=only_due, is_last=is_last, log=log)
  if writer is not None and results:
    writer.write_scalars(step, {k: v for k, v in results.items() if np.isfinite(v)})
  if pics:
    import jax  # pylint: disable=g-import-not-at-top

    # Every process computes the same pictures; only process 0 writes PNGs (shared file systems).
    pictures_lib.write_pictures(
      pics, step=step, writer=writer, directory=picture_dir if jax.process_index() == 0 else None
    )
  if writer is not None:
    try:
      writer.flush()
    except Exception:  # pylint: disable=broad-except
      pass
  return results
