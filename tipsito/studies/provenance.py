"""Where and on what a study run ran: the commit, the machine and the accelerator, for its result.json.

Why: a study's number is only comparable with another if both ran the same code on a known machine; wall
times in particular mean nothing without the cores they had. Every finished run records this next to its
metrics (tipsito/studies/jobs.py), and results.json lists the commits and machines of all its runs
(tipsito/studies/results.py), so a table mixing two commits or two machine kinds says so.
"""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

import jax


def commit() -> dict[str, Any]:
  """The git commit of the tipsito source that runs, and whether its work tree had uncommitted changes
  (None where the package is not in a git checkout, e.g. an installed wheel)."""
  here = os.path.dirname(os.path.abspath(__file__))

  def git(*args):
    out = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=30, check=False)
    return out.stdout.strip() if out.returncode == 0 else None

  try:
    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    head = dirty = None
  return {"commit": head, "dirty": None if head is None or dirty is None else bool(dirty)}


def memory_gib() -> float | None:
  """Physical memory of this machine in GiB (POSIX sysconf; None where it is not available)."""
  try:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
  except (ValueError, OSError, AttributeError):
    return None


def machine() -> dict[str, Any]:
  """Cores, memory and accelerator of this process's machine (the accelerator as JAX sees it)."""
  devices = jax.local_devices()
  return {
    "host": platform.node(),
    "cores": os.cpu_count(),
    "memory_gib": memory_gib(),
    "platform": devices[0].platform if devices else None,
    "accelerator": sorted({d.device_kind for d in devices}) if devices else [],
    "local_devices": len(devices),
    "jax": jax.__version__,
    "python": platform.python_version(),
  }


# The commit of the code this process runs: taken when the module is first imported (the sweep and each
# job import it before training), since a checkout that moves on while a long sweep runs does not change
# the code already loaded.
_LOADED = commit()


def describe() -> dict[str, Any]:
  """The provenance of a run of this process: the commit its code was loaded from, and the machine."""
  return {**_LOADED, "machine": machine()}
