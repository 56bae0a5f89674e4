"""The numbers of a sweep: one run's result (job.py writes it) and the study's results.json / results.md.

A run's `metrics` are its final eval metrics (`<eval>/<metric>`, as the training loop returns them), the
last logged value of every loss term (`loss/<term>`, from the run's TensorBoard events) and the size of
its train state (`state/...`, what `python -m tipsito.info` computes: tipsito/info.py). Its `curves`
hold every logged loss value per step. A resumed run reads the events of all its attempts; where two
attempts logged the same step (after the checkpoint the second resumed from) the later one counts.

results.json: every number per arm and seed, plus mean, sample std and n over the seeds, Cohen's d and
the paired statistics of every arm against the reference arm (tipsito/studies/paired.py: per-seed
differences, 95 % t-interval, paired t-test, Benjamini-Hochberg adjusted p within the study), the declared
primary comparison with its verdict, and the sweep's environment (packages, XLA flags, data
fingerprints; tipsito/studies/provenance.py). results.md: one table (rows = arms, columns = the study's
metrics, mean ± std (n), best mean per column in bold: the lowest for `loss/`, `ibot/ce_`, `state/` and
RMSE metrics, the highest otherwise), the primary's verdict, the arms' overrides and budget, the seeds,
the command, the wall time per arm and the paired table.

Everything after the per-seed values is a function of them (`add_statistics`), so `rerender` reads a
stored results.json again with today's statistics (`python -m tipsito.sweep --render_only`); a metric the
stored runs lack is reported absent.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from tipsito.studies import paired as paired_lib

# The logged training scalars a result keeps as curves (and their last value as a metric): the loss terms,
# and the masked / visible patch cross-entropy of TIPSv2 Fig. 2 (`ibot/ce_masked`, `ibot/ce_visible`),
# the mechanism the ibot and mask studies read.
LOSS_PREFIX = ("loss/", "ibot/ce_")
# Kept as curves too (not table columns): the collapse signals of self-distillation (teacher entropy against
# ln K, centre norm, CLS effective rank; tipsito/objective/collapse.py) and the teacher temperature, which a
# diagnosis of a loss stuck at ln K reads.
DIAGNOSTIC_PREFIX = ("collapse/", "teacher_temp")
# Eval scalars a result keeps as learning curves (`eval_curves`: every periodic eval of the run, Round III
# evaluates at four points), without their bootstrap bounds and counts.
EVAL_CURVE_SKIP_SUFFIX = ("_ci_lo", "_ci_hi", "bootstrap_resamples")
EVAL_CURVE_SKIP_PART = ("num_",)
LOWER_IS_BETTER = ("loss/", "ibot/ce_", "state/")
LOWER_IS_BETTER_SUFFIX = ("/rmse",)  # errors of an eval (the depth probe's RMSE)


def lower_is_better(metric: str) -> bool:
  """Whether a smaller value of `metric` is the better one (losses, state sizes, errors)."""
  return metric.startswith(LOWER_IS_BETTER) or metric.endswith(LOWER_IS_BETTER_SUFFIX)


# --- one run ------------------------------------------------------------------------------------------
def loss_curves(run_dir: str, keep=None) -> dict[str, list[list[float]]]:
  """{'loss/<term>': [[step, value], ...]} from the TensorBoard events of `run_dir` (all attempts; per
  step the value written last). A record cut off by a kill ends that file's reading. `keep` (a function
  of the tag) replaces the choice of tags (the loss terms and the patch cross-entropies)."""
  keep = keep or (lambda tag: tag.startswith(LOSS_PREFIX + DIAGNOSTIC_PREFIX))
  # pylint: disable-next=import-outside-toplevel
  from tensorboard.backend.event_processing import event_file_loader
  from tensorboard.util import tensor_util  # pylint: disable=import-outside-toplevel

  latest: dict[str, dict[int, tuple[float, float]]] = {}  # tag -> step -> (wall time, value)
  for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
    for event in event_file_loader.EventFileLoader(path).Load():
      for v in event.summary.value:
        if not keep(v.tag):
          continue
        value = float(tensor_util.make_ndarray(v.tensor)) if v.HasField("tensor") else float(v.simple_value)
        steps = latest.setdefault(v.tag, {})
        if event.step not in steps or event.wall_time >= steps[event.step][0]:
          steps[event.step] = (event.wall_time, value)
  return {tag: [[s, steps[s][1]] for s in sorted(steps)] for tag, steps in sorted(latest.items())}


def state_metrics(config) -> dict[str, float]:
  """Train-state size and parameter counts of `config` (tipsito/planning/costs.py's `compute_info`)."""
  # A --parallel / --dry_run sweep process imports this module and never calls this function.
  from tipsito.planning import costs  # lazy: builds the trainer's models

  i = costs.compute_info(config)
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


def eval_curves(run_dir: str, eval_names) -> dict[str, list[list[float]]]:
  """{'<eval>/<metric>': [[step, value], ...]}: every periodic and final eval of the run (the learning
  curve of each metric), without bootstrap bounds and counts."""

  def keep(tag: str) -> bool:
    name, _, rest = tag.partition("/")
    return (
      name in eval_names
      and bool(rest)
      and not tag.endswith(EVAL_CURVE_SKIP_SUFFIX)
      and not any(part.startswith(EVAL_CURVE_SKIP_PART) for part in rest.split("/"))
    )

  return loss_curves(run_dir, keep)


def run_result(config, run_dir: str, returned: Mapping[str, float]) -> dict[str, Any]:
  """A finished run's metrics and curves (`returned`: what train_and_evaluate returned)."""
  metrics = {k: _number(v) for k, v in returned.items() if k.split("/", 1)[0] in config.evals}
  curves = loss_curves(run_dir)
  metrics.update(
    {tag: points[-1][1] for tag, points in curves.items() if points and tag.startswith(LOSS_PREFIX)}
  )
  metrics.update(state_metrics(config))
  return {
    "metrics": dict(sorted(metrics.items())),
    "curves": curves,
    "eval_curves": eval_curves(run_dir, set(config.evals)),
    "steps": int(config.total_steps),
  }


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
  spread at all, rounding included (a state size stored as 0.0989 in one run and 0.0989 + 1e-17 in another
  has no spread; tipsito/studies/paired.py treats paired differences the same way)."""
  a = [x for x in arm_values if x is not None and math.isfinite(x)]
  r = [x for x in ref_values if x is not None and math.isfinite(x)]
  if len(a) < 2 or len(r) < 2:
    return None
  pooled = math.sqrt(
    ((len(a) - 1) * np.var(a, ddof=1) + (len(r) - 1) * np.var(r, ddof=1)) / (len(a) + len(r) - 2)
  )
  if pooled <= 1e-12 * max(1.0, float(np.abs(a).max()), float(np.abs(r).max())):
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
      cpu = m.get("processor") or {}  # runs before the processor was recorded have none
      cpu = f", CPU {cpu.get('model') or '?'} (flags {cpu.get('flags_sha256') or '?'})" if cpu else ""
      key = (
        f"{m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB, "
        f"{'/'.join(m.get('accelerator') or ['?'])} ({m.get('platform', '?')}){cpu}"
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


def _arm_numbers(arm_runs: Mapping[int, dict], ref_runs: Mapping[int, dict], names) -> dict[str, Any]:
  """An arm's summary (mean, std, n per metric) and Cohen's d against the reference arm, from its runs."""
  return {
    "summary": {m: _stats([r["metrics"].get(m) for r in arm_runs.values()]) for m in names},
    "effect_vs_reference": {
      m: effect_size(
        [r["metrics"].get(m) for r in arm_runs.values()],
        [r["metrics"].get(m) for r in ref_runs.values()],
      )
      for m in names
    },
  }


def summarize(
  study,
  arm_list,
  configs: Mapping[str, Any],
  runs: Mapping[str, Mapping[int, dict]],
  seeds: Sequence[int],
  command: str,
  environment: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """results.json's content. `configs`: one config per arm (its budget); `runs`: arm -> seed -> result
  of the finished runs; `environment`: the packages, XLA flags and dataset fingerprints of the sweep
  (tipsito/studies/provenance.py's `environment`)."""
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
      "self_distillation": self_distillation_setup(configs[arm.name]),
      "runs": {str(s): arm_runs[s] for s in sorted(arm_runs)},
      **_arm_numbers(arm_runs, ref_runs, names),
      "seconds": _stats([r["seconds"] for r in arm_runs.values()]),
    }
  summary = {
    "study": study.study,
    "claim": study.get("claim", ""),
    "metrics": list(study.get("metrics", ())),
    "seeds": [int(s) for s in seeds],
    "command": command,
    "reference_arm": ref_name,
    "provenance": provenance_summary(runs),
    "environment": dict(environment or {}),
    "primary_declared": "before the runs",
    "arms": arms_out,
  }
  if study.get("self_distillation_margin") is not None:
    summary["self_distillation_margin"] = float(study.self_distillation_margin)
  return add_statistics(summary, primary_of(study))


# The self-distillation cross-entropies the check reads (the last logged values), per loss term.
SELF_DISTILLATION_CE = {"dino": "loss/dino", "ibot": "ibot/ce_masked"}


def self_distillation_setup(config) -> dict[str, Any] | None:
  """The arm's DINO / iBOT weights and prototype count K (None: an arm without self-distillation)."""
  weights = {t: float(config.loss.get(t) or 0.0) for t in SELF_DISTILLATION_CE}
  if not any(weights.values()):
    return None
  return {"weights": weights, "num_prototypes": int(config.model.heads.num_prototypes)}


def self_distillation_check(summary: dict) -> dict[str, Any] | None:
  """Whether self-distillation trained (issue 46's rule, declared with the study as
  `self_distillation_margin`): for every arm with a DINO or iBOT term, the seed mean of its final DINO
  cross-entropy (`loss/dino`) and iBOT masked-token cross-entropy (`ibot/ce_masked`) must be at most
  ln K - margin. A uniform teacher gives exactly ln K whatever the student, so a value near ln K means the
  term is not training. None when the study declares no margin."""
  margin = summary.get("self_distillation_margin")
  if margin is None:
    return None
  arms = {}
  for name, a in summary["arms"].items():
    setup = a.get("self_distillation")
    if not setup:
      continue
    ln_k = math.log(setup["num_prototypes"])
    terms = {}
    for term, metric in SELF_DISTILLATION_CE.items():
      if not setup["weights"].get(term):
        continue
      st = a["summary"].get(metric) or {"mean": None, "std": None, "n": 0}
      passed = None if st["mean"] is None else bool(st["mean"] <= ln_k - margin)
      terms[term] = {
        "metric": metric,
        **st,
        "below_ln_k": None if st["mean"] is None else ln_k - st["mean"],
        "passed": passed,
      }
    arms[name] = {"ln_k": ln_k, "threshold": ln_k - margin, "terms": terms}
  # A term with no value is not applicable, not a failure: without masking (mask ratio 0) there are no
  # masked tokens, so `ibot/ce_masked` is never logged.
  verdicts = [t["passed"] for a in arms.values() for t in a["terms"].values() if t["passed"] is not None]
  return {
    "margin": margin,
    "arms": arms,
    "all_passed": bool(verdicts) and all(verdicts),
  }


def primary_of(study) -> dict[str, str] | None:
  """The study's declared primary comparison ({metric, arm, vs, direction}; tipsito/studies/arms.py
  checks it before any run), or None for a study config without one."""
  p = study.get("primary") if hasattr(study, "get") else None
  if not p:
    return None
  out = {k: str(p[k]) for k in ("metric", "arm", "vs", "direction")}
  if p.get("note"):
    out["note"] = str(p["note"])
  return out


def _values(summary: dict, arm: str, metric: str) -> dict[int, float | None]:
  runs = summary["arms"].get(arm, {}).get("runs", {})
  return {int(s): r["metrics"].get(metric) for s, r in runs.items()}


FAMILY = (
  "every declared metric of the study x every arm against the reference arm (paired t-tests with a "
  "defined p: at least two shared seeds and a spread in the differences), plus the primary comparison "
  "when it is not one of them"
)


def add_statistics(summary: dict, primary: Mapping[str, str] | None, q: float = paired_lib.Q) -> dict:
  """Adds to `summary` (results.json's content, in place; returned) the paired statistics
  (tipsito/studies/paired.py): per arm `paired_vs_reference` (metric -> the paired comparison against
  the reference arm with its Benjamini-Hochberg adjusted `p_bh`), `bh` (q, the family and its size) and
  `primary` (the declared comparison, its statistics, verdict and the seeds a decision would need).

  Works from the per-seed values in `summary["arms"][arm]["runs"]` alone, so a stored results.json can
  be re-read with it (`rerender`). A metric some results lack is reported absent (n = 0), not an error."""
  ref = summary.get("reference_arm")
  metrics = list(summary.get("metrics", ()))
  tests: list[tuple[str, str]] = []  # (arm, metric) of the family, in table order
  for name, a in summary["arms"].items():
    if name == ref:
      a["paired_vs_reference"] = {}
      continue
    a["paired_vs_reference"] = {
      m: paired_lib.paired(_values(summary, name, m), _values(summary, ref, m)) for m in metrics
    }
    tests += [(name, m) for m in metrics]
  family = [summary["arms"][a]["paired_vs_reference"][m] for a, m in tests]
  prim = None
  if primary:
    arm, vs, metric = primary["arm"], primary["vs"], primary["metric"]
    comp = paired_lib.paired(_values(summary, arm, metric), _values(summary, vs, metric))
    in_family = (vs == ref and arm != ref) or (arm == ref and vs != ref)
    prim = {
      **primary,
      "comparison": comp,
      "in_family": in_family,
      "cohen_d": effect_size(
        list(_values(summary, arm, metric).values()), list(_values(summary, vs, metric).values())
      ),
    }
    if not in_family:
      family.append(comp)
  adjusted = paired_lib.bh_adjust([c["p"] for c in family])
  for c, p_bh in zip(family, adjusted):
    c["p_bh"] = p_bh
  m = sum(p is not None for p in adjusted)
  summary["bh"] = {"q": q, "family": FAMILY, "family_size": m}
  if prim is not None:
    comp = prim["comparison"]
    p_bh = comp.get("p_bh")
    if prim["in_family"]:  # the same test as arm (or vs) against the reference: its adjusted p
      other = arm if vs == ref else vs
      p_bh = summary["arms"][other]["paired_vs_reference"][metric].get("p_bh")
      comp["p_bh"] = p_bh
    alpha = q / max(m, 1)
    prim.update(
      q=q,
      verdict=paired_lib.verdict(comp, p_bh, prim["direction"], q),
      alpha_for_seeds=alpha,
      power=paired_lib.POWER,
      seeds_needed=paired_lib.seeds_needed(comp["d_z"], alpha),
      seeds_needed_normal=paired_lib.seeds_needed_normal(comp["d_z"], alpha),
    )
  summary["primary"] = prim
  sd = self_distillation_check(summary)
  if sd is not None:
    summary["self_distillation_check"] = sd
  return summary


def rerender(stored: dict, study=None, command: str = "") -> dict:
  """A stored results.json recomputed from its per-seed values: the per-arm summaries and Cohen's d for
  every metric the runs have, the paired statistics, and the primary of `study` (its declared metrics and
  primary replace the stored ones; None keeps the stored). Nothing is rerun; the runs, budgets,
  provenance and the original command are kept, and `rendered_by` records `command`."""
  out = {k: v for k, v in stored.items() if k not in ("primary", "bh", "primary_declared")}
  if study is not None:
    out["metrics"] = list(study.get("metrics", ()))
  ref = out.get("reference_arm")
  ref_runs = {int(s): r for s, r in out["arms"].get(ref, {}).get("runs", {}).items()}
  for a in out["arms"].values():
    arm_runs = {int(s): r for s, r in a.get("runs", {}).items()}
    names = sorted({k for r in arm_runs.values() for k in r["metrics"]})
    a.update(_arm_numbers(arm_runs, ref_runs, names))
  out.setdefault("environment", {})
  if study is not None and study.get("self_distillation_margin") is not None:
    out["self_distillation_margin"] = float(study.self_distillation_margin)
  if command:
    out["rendered_by"] = command
  primary = primary_of(study) if study is not None else (stored.get("primary") or None)
  if primary:
    primary = {k: primary[k] for k in ("metric", "arm", "vs", "direction", "note") if primary.get(k)}
    before = stored.get("primary") or {}
    same = all(before.get(k) == primary.get(k) for k in ("metric", "arm", "vs", "direction"))
    out["primary_declared"] = stored.get("primary_declared", "before the runs") if same else "after the runs"
    absent = [primary[k] for k in ("arm", "vs") if primary[k] not in out["arms"]]
    if absent:
      raise ValueError(
        f"primary arms {absent} are not arms of the stored results (arms: {list(out['arms'])}); "
        "the study config must be the one that produced them"
      )
  return add_statistics(out, primary)


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


def _num(x: float | None, digits: int = 2) -> str:
  return "–" if x is None else f"{x:+.{digits}f}"


def _p(p: float | None) -> str:
  if p is None:
    return "–"
  return f"{p:.2g}" if p < 0.01 else f"{p:.3f}"


def _diff_ci(c: Mapping[str, Any]) -> str:
  """'+1.23 [-0.40, +2.86]' (the mean paired difference and its 95 % interval)."""
  if not c or c.get("n", 0) == 0:
    return "absent"
  if c.get("ci_lo") is None:
    return _fmt_signed(c["mean_diff"]) + " (no interval)"
  return f"{_fmt_signed(c['mean_diff'])} [{_fmt_signed(c['ci_lo'])}, {_fmt_signed(c['ci_hi'])}]"


def _fmt_signed(x: float) -> str:
  return ("+" if x >= 0 else "-") + _fmt(abs(x))


def primary_lines(summary: dict) -> list[str]:
  """results.md's primary-metric verdict: the declared comparison, its paired difference with the 95 %
  interval, p, BH-adjusted p and whether it reproduces, reverses or cannot tell (with the seeds a
  decision would need at the observed effect)."""
  prim = summary.get("primary")
  bh = summary.get("bh") or {}
  if not prim:
    return ["## Primary metric", "", "No primary metric was declared for this study.", ""]
  c = prim["comparison"]
  expect = "above" if prim["direction"] == "higher" else "below"
  lines = [
    "## Primary metric",
    "",
    (
      f"Declared in the study config before any run: `{prim['metric']}`, `{prim['arm']}` expected {expect} "
      f"`{prim['vs']}`."
      if summary.get("primary_declared", "before the runs") == "before the runs"
      else f"Declared after these runs ran (their statistics recomputed from the stored values, below): "
      f"`{prim['metric']}`, `{prim['arm']}` expected {expect} `{prim['vs']}`."
    ),
    "",
    "| primary | comparison | seeds paired | paired diff [95% CI] | d_z | Cohen's d | p (paired t) | "
    "BH-adjusted p | verdict |",
    "|---|---|---:|---:|---:|---:|---:|---:|---|",
    f"| `{prim['metric']}` | `{prim['arm']}` - `{prim['vs']}` | {c['n']} | {_diff_ci(c)} | "
    f"{_num(c.get('d_z'))} | {_num(prim.get('cohen_d'))} | {_p(c.get('p'))} | {_p(c.get('p_bh'))} | "
    f"**{prim['verdict']}** |",
    "",
  ]
  if prim.get("note"):
    lines += [f"Reading the verdict: {prim['note']}", ""]
  lines += [
    f"Verdict: *reproduces* when the BH-adjusted p is <= q = {prim['q']} with the difference in the "
    "expected direction, *reverses* when it is <= q the other way, *cannot tell* otherwise.",
    "",
  ]
  if prim["verdict"] == paired_lib.ABSENT:
    lines += [f"These results have no value of `{prim['metric']}` (an eval added after they ran).", ""]
  elif prim["verdict"] == paired_lib.CANNOT_TELL:
    n = prim.get("seeds_needed")
    lines += [
      (
        f"Cannot tell: a decision at the observed effect (d_z {abs(c['d_z']):.2f}) would need "
        f"{'1000 or more' if n >= 1000 else f'about {n}'} seeds: the smallest n with power >= {prim['power']} of the paired t-test at alpha = q / m = "
        f"{prim['q']} / {bh.get('family_size')} = {prim['alpha_for_seeds']:.3g} (P(|T'| > t_{{1-alpha/2, n-1}}), "
        "T' noncentral t with noncentrality d_z sqrt(n); the normal approximation "
        f"n = ((z_{{1-alpha/2}} + z_{{{prim['power']}}}) / d_z)^2 gives {prim.get('seeds_needed_normal')})."
      )
      if n
      else "Cannot tell: no spread-adjusted effect to plan for (fewer than two paired seeds or no difference).",
      "",
    ]
  return lines


def self_distillation_lines(summary: dict) -> list[str]:
  """results.md's check that self-distillation trained (see `self_distillation_check`)."""
  sd = summary.get("self_distillation_check")
  if not sd:
    return []
  if not sd["arms"]:  # e.g. the ITO family: CLIP losses only; "not every arm passes" would be false
    return [
      "## Does self-distillation train?",
      "",
      "No arm of this study has a DINO or iBOT term: nothing to check.",
      "",
    ]
  lines = [
    "## Does self-distillation train?",
    "",
    f"Declared before the runs: every self-distillation arm's final DINO cross-entropy (`loss/dino`) and "
    f"iBOT masked-token cross-entropy (`ibot/ce_masked`), mean over seeds, at most ln K - {sd['margin']:g} "
    "nats (a uniform teacher gives ln K whatever the student). "
    + (
      "**Every arm passes.**"
      + (
        " (`–`: the arm logs no value of that term, e.g. no masked-token CE without masking.)"
        if any(t["passed"] is None for a in sd["arms"].values() for t in a["terms"].values())
        else ""
      )
      if sd["all_passed"]
      else "**Not every arm passes**: read the dense claims "
      "of the failing arms as CLIP + whatever term trains."
    ),
    "",
    "| arm | term | final CE (mean ± std, n) | ln K | below ln K | threshold | passes |",
    "|---|---|---:|---:|---:|---:|---|",
  ]
  for name, a in sd["arms"].items():
    for t in a["terms"].values():
      ce = "–" if t["mean"] is None else _cell(t, False)
      below = "–" if t["below_ln_k"] is None else f"{t['below_ln_k']:.3f}"
      ok = {True: "yes", False: "**no**", None: "–"}[t["passed"]]
      lines.append(
        f"| {name} | `{t['metric']}` | {ce} | {a['ln_k']:.3f} | {below} | {a['threshold']:.3f} | {ok} |"
      )
  return lines + [""]


def paired_lines(summary: dict) -> list[str]:
  """results.md's paired table: every arm against the reference arm on every declared metric."""
  ref = summary.get("reference_arm")
  bh = summary.get("bh") or {}
  rows = [(n, a) for n, a in summary["arms"].items() if n != ref]
  if ref is None or not rows:
    return []
  lines = [
    "## Paired differences and effect sizes",
    "",
    f"Against `{ref}`, runs paired by seed: mean of the per-seed differences (arm - `{ref}`) with its 95% "
    "t-interval, d_z = mean / std of the differences, Cohen's d (difference of means / pooled std of the "
    "seeds, unpaired), the two-sided paired t-test's p and the Benjamini-Hochberg adjusted p over the "
    f"family of {bh.get('family_size', 0)} tests ({bh.get('family', FAMILY)}); **bold**: survives at "
    f"q = {bh.get('q', paired_lib.Q)}. `–`: no test (fewer than two shared seeds, or no spread: a chance "
    "level or a state size); `absent`: the runs have no value of the metric.",
    "",
    "| arm | metric | seeds | paired diff [95% CI] | d_z | Cohen's d | p | BH-adjusted p |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  q = bh.get("q", paired_lib.Q)
  for name, a in rows:
    for m in summary["metrics"]:
      c = a.get("paired_vs_reference", {}).get(m) or {"n": 0}
      p_bh = c.get("p_bh")
      cell = _p(p_bh)
      if p_bh is not None and p_bh <= q:
        cell = f"**{cell}**"
      lines.append(
        f"| {name} | `{m}` | {c['n']} | {_diff_ci(c)} | {_num(c.get('d_z'))} | "
        f"{_num(a.get('effect_vs_reference', {}).get(m))} | {_p(c.get('p'))} | {cell} |"
      )
  lines.append("")
  return lines


def environment_lines(env: Mapping[str, Any] | None) -> list[str]:
  """The packages, XLA flags and dataset fingerprints results.json records (or that it does not)."""
  if not env:
    return ["Environment: not recorded (these runs predate the record of packages, XLA flags and data).", ""]
  pk = ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items())
  data = "; ".join(
    f"{d.get('name')} ({', '.join(f'{s} {h[:12]}' for s, h in (d.get('splits') or {}).items())})"
    for d in env.get("datasets") or []
  )
  return [
    f"Environment: {pk or 'packages not recorded'}; XLA_FLAGS `{env.get('xla_flags') or ''}`; data: "
    f"{data or 'not recorded'} (sha256 of the built splits, results.json `environment`; docs/studies.md says of what).",
    "",
  ]


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
  lines += [""] + primary_lines(summary) + self_distillation_lines(summary)
  lines += [
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
  lines += paired_lines(summary)
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
  lines += environment_lines(summary.get("environment"))
  if summary.get("rendered_by"):
    lines += [f"Statistics recomputed from the stored per-seed values by: `{summary['rendered_by']}`", ""]
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
