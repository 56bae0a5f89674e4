"""PNG plots of a sweep's results.json (tipsito/studies/results.py): one bar chart per metric of the study
(mean per arm, error bar = sample std over seeds, one dot per seed) and the loss curves per arm (mean over
seeds per logged step, band = min..max over seeds), one panel per loss term.

Needs matplotlib, the `studies` extra of setup.py: `pip install -e ".[studies]"`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

MISSING = (
  "plots need matplotlib, which is not installed: pip install -e \".[studies]\" (setup.py's "
  "`studies` extra), or run the sweep with --noplots"
)


def check_available() -> None:
  """Fails with the install command when matplotlib is missing (the sweep calls this before running)."""
  try:
    import matplotlib  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise ImportError(MISSING) from None


def _pyplot():
  check_available()
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  return plt


def file_name(metric: str) -> str:
  return metric.replace("/", "_") + ".png"


def metric_plot(summary: dict[str, Any], metric: str, path: str) -> str:
  """Bars: the mean of `metric` per arm; error bars: sample std; dots: the seeds."""
  plt = _pyplot()
  names = list(summary["arms"])
  fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(names) + 1.5), 3.6))
  for i, name in enumerate(names):
    a = summary["arms"][name]
    st = a["summary"].get(metric)
    if not st or st["mean"] is None:
      continue
    ax.bar(i, st["mean"], yerr=st["std"] or 0.0, capsize=4, color="C0", alpha=0.7)
    vals = [r["metrics"][metric] for r in a["runs"].values() if r["metrics"].get(metric) is not None]
    ax.scatter([i] * len(vals), vals, color="k", s=10, zorder=3)
  ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
  ax.set_ylabel(f"{metric}\n(mean ± std over seeds)")
  ax.set_title(f"{summary['study']}: {metric}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def loss_plot(summary: dict[str, Any], path: str) -> str:
  """One panel per loss term (`loss/total` first), one line per arm: mean over seeds per step."""
  plt = _pyplot()
  tags = sorted(
    {t for a in summary["arms"].values() for r in a["runs"].values() for t in r["curves"]},
    key=lambda t: (t != "loss/total", t),
  )
  fig, axes = plt.subplots(1, max(1, len(tags)), figsize=(4.2 * max(1, len(tags)), 3.4), squeeze=False)
  for ax, tag in zip(axes[0], tags):
    for i, (name, a) in enumerate(summary["arms"].items()):
      curves = [
        dict((int(s), v) for s, v in r["curves"][tag]) for r in a["runs"].values() if tag in r["curves"]
      ]
      if not curves:
        continue
      steps = sorted(set.intersection(*(set(c) for c in curves)))
      values = np.array([[c[s] for s in steps] for c in curves])
      ax.plot(steps, values.mean(0), color=f"C{i % 10}", label=name)
      ax.fill_between(steps, values.min(0), values.max(0), color=f"C{i % 10}", alpha=0.2)
    ax.set_title(tag)
    ax.set_xlabel("step")
  axes[0][0].legend(fontsize="small")
  fig.suptitle(f"{summary['study']}: training losses (mean over seeds, band: min..max)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def eval_curve_plot(summary: dict[str, Any], metric: str, path: str) -> str | None:
  """The learning curve of `metric`: one line per arm, its mean over seeds at every eval step (band:
  min..max over seeds); None when no run has periodic evals of it."""
  series = {}
  for name, a in summary["arms"].items():
    curves = [
      dict((int(s), v) for s, v in r.get("eval_curves", {}).get(metric, []))
      for r in a["runs"].values()
      if r.get("eval_curves", {}).get(metric)
    ]
    if curves:
      steps = sorted(set.intersection(*(set(c) for c in curves)))
      if len(steps) > 1:
        series[name] = (steps, np.array([[c[s] for s in steps] for c in curves]))
  if not series:
    return None
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(5.2, 3.6))
  for i, (name, (steps, values)) in enumerate(series.items()):
    ax.plot(steps, values.mean(0), marker="o", color=f"C{i % 10}", label=name)
    ax.fill_between(steps, values.min(0), values.max(0), color=f"C{i % 10}", alpha=0.2)
  ax.set_xlabel("step")
  ax.set_ylabel(metric)
  ax.set_title(f"{summary['study']}: {metric} during training")
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def write_plots(summary: dict[str, Any], directory: str) -> list[str]:
  """Every plot of the study into `directory`; returns the paths."""
  os.makedirs(directory, exist_ok=True)
  # A metric no run has (an eval added after the runs) gets no empty plot: results.md reports it absent.
  present = [
    m
    for m in summary["metrics"]
    if any((a["summary"].get(m) or {}).get("mean") is not None for a in summary["arms"].values())
  ]
  out = [metric_plot(summary, m, os.path.join(directory, file_name(m))) for m in present]
  out.append(loss_plot(summary, os.path.join(directory, "loss_curves.png")))
  for m in present:
    curve = eval_curve_plot(summary, m, os.path.join(directory, "curve_" + file_name(m)))
    if curve:
      out.append(curve)
  return out
