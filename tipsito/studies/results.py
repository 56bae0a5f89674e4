"""The numbers of a sweep: one run's result (job.py writes it) and the study's results.json / results.md.

A run's `metrics` are its final eval metrics (`<eval>/<metric>`, as the training loop returns them), the
last logged value of every loss term (`loss/<term>`, from the run's TensorBoard events) and the size of
its train state (`state/...`, what `python -m tipsito.info` computes: tipsito/info.py). Its `curves`
hold every logged loss value per step. A resumed run reads the events of all its attempts; where two
attempts logged the same step (after the checkpoint the second resumed from) the later one counts.

results.json: every number per arm and seed, plus mean, sample std and n over the seeds. results.md:
one table (rows = arms, columns = the study's metrics, mean ± std (n), best mean per column in bold:
the lowest for `loss/`, `ibot/ce_`, `state/` and RMSE metrics, the highest otherwise), the arms' overrides and budget, the
seeds, the command and the wall time per arm.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

# The logged training scalars a result keeps as curves (and their last value as a metric): the loss terms,
# and the masked / visible patch cross-entropy of TIPSv2 Fig. 2 (`ibot/ce_masked`, `ibot/ce_visible`),
# the mechanism the ibot and mask studies read.
LOSS_PREFIX = ("loss/", "ibot/ce_")
LOWER_IS_BETTER = ("loss/", "ibot/ce_", "state/")
LOWER_IS_BETTER_SUFFIX = ("/rmse",)  # errors of an eval (the depth probe's RMSE)


def lower_is_better(metric: str) -> bool:
  """Whether a smaller value of `metric` is the better one (losses, state sizes, errors)."""
  return metric.startswith(LOWER_IS_BETTER) or metric.endswith(LOWER_IS_BETTER_SUFFIX)


# --- one run ------------------------------------------------------------------------------------------
def loss_curves(run_dir: str) -> dict[str, list[list[float]]]:
  """{'loss/<term>': [[step, value], ...]} from the TensorBoard events of `run_dir` (all attempts; per
  step the value written last). A record cut off by a kill ends that file's reading."""
  # pylint: disable-next=import-outside-toplevel
  from tensorboard.backend.event_processing import event_file_loader
  from tensorboard.util import tensor_util  # pylint: disable=import-outside-toplevel

  latest: dict[str, dict[int, tuple[float, float]]] = {}  # tag -> step -> (wall time, value)
  for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
    for event in event_file_loader.EventFileLoader(path).Load():
      for v in event.summary.value:
        if not v.tag.startswith(LOSS_PREFIX):
          continue
        value = float(tensor_util.make_ndarray(v.tensor)) if v.HasField("tensor") else float(v.simple_value)
        steps = latest.setdefault(v.tag, {})
        if event.step not in steps or event.wall_time >= steps[event.step][0]:
          steps[event.step] = (event.wall_time, value)
  return {tag: [[s, steps[s][1]] for s in sorted(steps)] for tag, steps in sorted(latest.items())}


def state_metrics(config) -> dict[str, float]:
  """Train-state size and parameter counts of `config` (tipsito/config_info.py's `compute_info`)."""
  # A --parallel / --dry_run sweep process imports this module and never calls this function.
  from tipsito import config_info  # lazy: builds the trainer's models

  i = config_info.compute_info(config)
  return {
    "state/train_state_MiB": i["train_state_bytes"] / 2**20,
    "state/params_M": i["student_params"] / 1e6,
    "state/ema_params_M": i["ema_params"] / 1e6,
    "state/optimizer_state_M": i["optimizer_state_params"] / 1e6,
  }


def _number(x) -> float | None:
  """NaN / inf -> None: JSON has no NaN, and an undefined metric must not count as a value."""
  x = float(x)
  return x if math.isfinite(x) else None


def run_result(config, run_dir: str, returned: Mapping[str, float]) -> dict[str, Any]:
  """A finished run's metrics and curves (`returned`: what train_and_evaluate returned)."""
  metrics = {k: _number(v) for k, v in returned.items() if k.split("/", 1)[0] in config.evals}
  curves = loss_curves(run_dir)
  metrics.update({tag: points[-1][1] for tag, points in curves.items() if points})
  metrics.update(state_metrics(config))
  return {"metrics": dict(sorted(metrics.items())), "curves": curves, "steps": int(config.total_steps)}


# --- the study ----------------------------------------------------------------------------------------
def _stats(values: Sequence[float]) -> dict[str, Any]:
  v = [x for x in values if x is not None and math.isfinite(x)]
  return {
    "mean": float(np.mean(v)) if v else None,
    "std": float(np.std(v, ddof=1)) if len(v) > 1 else None,
    "n": len(v),
  }


def effect_size(arm_values, ref_values) -> float | None:
  """(mean_arm - mean_ref) / pooled std: Cohen's d of an arm against the study's reference arm.

  pooled std = sqrt(((n_a - 1) s_a^2 + (n_r - 1) s_r^2) / (n_a + n_r - 2)), the sample stds of both arms'
  seeds. Why: a difference means something only against the spread between seeds; |d| < 1 is within about
  one std, which at 3-5 seeds cannot be told from noise. None without two seeds on each side or with no
  spread at all."""
  a = [x for x in arm_values if x is not None and math.isfinite(x)]
  r = [x for x in ref_values if x is not None and math.isfinite(x)]
  if len(a) < 2 or len(r) < 2:
    return None
  pooled = math.sqrt(
    ((len(a) - 1) * np.var(a, ddof=1) + (len(r) - 1) * np.var(r, ddof=1)) / (len(a) + len(r) - 2)
  )
  if pooled == 0:
    return None
  return float((np.mean(a) - np.mean(r)) / pooled)


def provenance_summary(runs: Mapping[str, Mapping[int, dict]]) -> dict[str, Any]:
  """The commits and machines the finished runs ran on (tipsito/studies/provenance.py), with how many
  runs each, and how many runs were resumed (their wall time is that of the last attempt only)."""
  commits: dict[str, int] = {}
  machines: dict[str, int] = {}
  resumed = 0
  for arm_runs in runs.values():
    for r in arm_runs.values():
      p = r.get("provenance") or {}
      c = p.get("commit") or "unknown"
      c = c + ("+dirty" if p.get("dirty") else "")
      commits[c] = commits.get(c, 0) + 1
      m = p.get("machine") or {}
      key = (
        f"{m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB, "
        f"{'/'.join(m.get('accelerator') or ['?'])} ({m.get('platform', '?')})"
        if m
        else "unknown"
      )
      machines[key] = machines.get(key, 0) + 1
      resumed += bool(r.get("resumed") or r.get("resumed_from_step") is not None)
  return {"commits": commits, "machines": machines, "resumed_runs": resumed}


def budget(config) -> dict[str, Any]:
  """What a run costs: steps, global batch, crop size, image tower."""
  im = config.model.image
  return {
    "steps": int(config.total_steps),
    "batch": int(config.input.batch_size),
    "image_size": int(config.input.global_size),
    "image_tower": f"width {im.width}, depth {im.depth}, heads {im.num_heads}, patch {im.patch_size}",
  }


def summarize(
  study,
  arm_list,
  configs: Mapping[str, Any],
  runs: Mapping[str, Mapping[int, dict]],
  seeds: Sequence[int],
  command: str,
) -> dict[str, Any]:
  """results.json's content. `configs`: one config per arm (its budget); `runs`: arm -> seed -> result
  of the finished runs."""
  arms_out = {}
  ref_name = arm_list[0].name if arm_list else None
  ref_runs = {int(s): r for s, r in runs.get(ref_name, {}).items()} if ref_name else {}
  for arm in arm_list:
    arm_runs = {int(s): r for s, r in runs.get(arm.name, {}).items()}
    names = sorted({k for r in arm_runs.values() for k in r["metrics"]})
    arms_out[arm.name] = {
      "base": arm.base,
      "recipe": configs[arm.name].recipe,
      "note": arm.note,
      "overrides": dict(arm.overrides),
      "depends_on": list(arm.depends_on),
      "budget": budget(configs[arm.name]),
      "runs": {str(s): arm_runs[s] for s in sorted(arm_runs)},
      "summary": {m: _stats([r["metrics"].get(m) for r in arm_runs.values()]) for m in names},
      "effect_vs_reference": {
        m: effect_size(
          [r["metrics"].get(m) for r in arm_runs.values()],
          [r["metrics"].get(m) for r in ref_runs.values()],
        )
        for m in names
      },
      "seconds": _stats([r["seconds"] for r in arm_runs.values()]),
    }
  return {
    "study": study.study,
    "claim": study.get("claim", ""),
    "metrics": list(study.get("metrics", ())),
    "seeds": [int(s) for s in seeds],
    "command": command,
    "reference_arm": ref_name,
    "provenance": provenance_summary(runs),
    "arms": arms_out,
  }


def best_arms(summary: dict, metric: str) -> set[str]:
  """Arms with the best mean of `metric` (ties: all of them)."""
  means = {
    a: d["summary"][metric]["mean"]
    for a, d in summary["arms"].items()
    if metric in d["summary"] and d["summary"][metric]["mean"] is not None
  }
  if not means:
    return set()
  pick = min if lower_is_better(metric) else max
  best = pick(means.values())
  return {a for a, m in means.items() if m == best}


def _fmt(x: float) -> str:
  return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def _cell(stats: dict | None, bold: bool) -> str:
  if not stats or stats["mean"] is None:
    return "–"
  s = _fmt(stats["mean"]) + (f" ± {_fmt(stats['std'])}" if stats["std"] is not None else "")
  return (f"**{s}**" if bold else s) + f" ({stats['n']})"


def _duration(seconds: float | None) -> str:
  if seconds is None:
    return "–"
  s = int(round(seconds))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def markdown(summary: dict) -> str:
  """results.md: the study's table and what was run."""
  metrics = summary["metrics"]
  seeds = ", ".join(str(s) for s in summary["seeds"])
  lines = [
    f"# Study `{summary['study']}`",
    "",
    f"Claim: {summary['claim']}",
    "",
    f"Command: `{summary['command']}`",
    "",
    f"Seeds: {seeds} (each sets `config.seed` and `config.input.shuffle_seed`). Cells: mean ± "
    "sample std over the finished seeds (their number in brackets); best mean per column in bold "
    "(lowest for `loss/`, `ibot/ce_`, `state/` and RMSE, highest otherwise). `loss/` is the last logged training "
    "loss, the others are the final evals (%) and `python -m tipsito.info`'s sizes.",
    "",
  ]
  best = {m: best_arms(summary, m) for m in metrics}
  lines += [
    "| arm | " + " | ".join(f"`{m}`" for m in metrics) + " | wall time per run |",
    "|---|" + "---:|" * len(metrics) + "---:|",
  ]
  for name, a in summary["arms"].items():
    cells = [_cell(a["summary"].get(m), name in best[m]) for m in metrics]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {_duration(a['seconds']['mean'])} |")
  lines += [
    "",
    "## Arms",
    "",
    "| arm | base (recipe) | overrides | note | steps | batch | image px | image tower | params (M) |",
    "|---|---|---|---|---:|---:|---:|---|---:|",
  ]
  for name, a in summary["arms"].items():
    over = ", ".join(f"`{k}={v!r}`" for k, v in a["overrides"].items()) or "–"
    params = a["summary"].get("state/params_M", {}).get("mean")
    b = a["budget"]
    lines.append(
      f"| {name} | {a['base']} ({a['recipe']}) | {over} | {a['note'] or '–'} | {b['steps']} | "
      f"{b['batch']} | {b['image_size']} | {b['image_tower']} | "
      f"{'–' if params is None else f'{params:.3f}'} |"
    )
  lines += [
    "",
    "Wall time per run: the attempt that finished it (a resumed run counts only its last "
    "part, marked by `resumed_from_step` in results.json); total per arm: "
    + ", ".join(
      f"{n} {_duration(sum(r['seconds'] for r in a['runs'].values()))}" for n, a in summary["arms"].items()
    )
    + ".",
    "",
  ]
  ref = summary.get("reference_arm")
  if ref is not None:
    lines += [
      "## Effect sizes",
      "",
      f"Against `{ref}`: difference of means / pooled std of the seeds (Cohen's d; `–` with fewer than "
      "two seeds a side). |d| below about 1 cannot be told from seed noise at 3-5 seeds.",
      "",
      "| arm | " + " | ".join(f"`{m}`" for m in metrics) + " |",
      "|---|" + "---:|" * len(metrics),
    ]
    for name, a in summary["arms"].items():
      eff = a.get("effect_vs_reference", {})
      cells = ["–" if eff.get(m) is None else f"{eff[m]:+.2f}" for m in metrics]
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
  prov = summary.get("provenance")
  if prov:
    lines += [
      "Ran on: "
      + "; ".join(f"commit {c} ({n} runs)" for c, n in prov["commits"].items())
      + ". Machines: "
      + "; ".join(f"{m} ({n} runs)" for m, n in prov["machines"].items())
      + f". Resumed runs: {prov['resumed_runs']}.",
      "",
    ]
  return "\n".join(lines)


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes JSON to `path` through a temporary file and a rename: readers see all of it or nothing."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1)  # insertion order: the arms stay in study order
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write(summary: dict, sweep_dir: str) -> tuple[str, str]:
  """Writes `<sweep_dir>/results.json` and `results.md` (atomically); returns their paths."""
  js, md = os.path.join(sweep_dir, "results.json"), os.path.join(sweep_dir, "results.md")
  write_json_atomic(js, summary)
  tmp = f"{md}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(markdown(summary))
  os.replace(tmp, md)
  return js, md
