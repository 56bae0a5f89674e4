"""A study config (configs/ablations.py) -> its arms -> one checked training config per (arm, seed).

Why all of it before anything runs: a typo in one arm's override, or an arm whose config does not
validate, must stop the sweep at once, naming the arm and the key, not after the other arms have trained
for hours. `plan` builds and validates the config of every (arm, seed) first.

An arm is a base config (a complete training config of `study.bases`) plus dotted-key overrides. Each
override key must already exist in the base (as `--config.key=value` on the command line). The seed sets
`config.seed` and `config.input.shuffle_seed`. A string value may contain '{workdir:ARM}', the run
directory of arm ARM for the same seed (e.g. `distill.teacher`); the arm then depends on ARM, which must
come earlier in the study.

A study also declares its **primary** comparison before any run: `primary = dict(metric=..., arm=...,
vs=..., direction='higher' | 'lower')` (optionally `note`), the one reading results.md's verdict is about
(tipsito/studies/results.py, tipsito/studies/paired.py). `check_primary` rejects a missing declaration, a
metric that is not one of the study's `metrics` or that no eval of the arms writes, an arm that is not
the study's, and any other direction, so that the claim is fixed before its numbers exist.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
from typing import Any, Mapping, Sequence

import ml_collections as mlc

from tipsito.config import validation as config_validation
from tipsito.data import prepare as data_prepare

PLACEHOLDER = re.compile(r"\{workdir:([^{}]*)\}")
ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_+-]*$")  # a directory name


class StudyError(ValueError):
  """The study config is wrong; the message names the arm (and seed) and the key."""


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm: `overrides` ({dotted key: value}) on the base config `study.bases[base]`."""

  name: str
  base: str
  overrides: Mapping[str, Any]
  note: str = ""
  depends_on: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Job:
  """One training run of a sweep: arm `arm` (number `index` of `num_arms`, from 1) with seed `seed`."""

  arm: Arm
  seed: int
  index: int
  num_arms: int
  run_dir: str
  config: mlc.ConfigDict

  @property
  def label(self) -> str:
    return f"arm {self.index}/{self.num_arms} {self.arm.name}, seed {self.seed}"


def run_dir(sweep_dir: str, arm: str, seed: int) -> str:
  """Where (arm, seed) trains: `<sweep_dir>/<arm>/seed_<seed>` (its workdir: checkpoints, events, ...)."""
  return os.path.join(os.path.abspath(sweep_dir), arm, f"seed_{int(seed)}")


def arms_of(study: mlc.ConfigDict) -> list[Arm]:
  """The study's arms in order; names, bases and dependencies checked (a dependency comes first)."""
  for key in ("study", "bases", "arms"):
    if key not in study:
      raise StudyError(f"the study config has no {key!r} (see configs/ablations.py)")
  out: list[Arm] = []
  for i, a in enumerate(study.arms):
    a = dict(a)
    name = a.pop("name", None)
    if not isinstance(name, str) or not ARM_NAME.match(name):
      raise StudyError(f"arm #{i + 1}: name {name!r} must be a directory name ([A-Za-z0-9_+-])")
    if name in [x.name for x in out]:
      raise StudyError(f"arm {name!r} is defined twice")
    base = a.pop("base", None)
    if base not in study.bases:
      raise StudyError(f"arm {name!r}: base {base!r} is not in the study's bases {sorted(study.bases)}")
    overrides = dict(a.pop("overrides", {}) or {})
    note = str(a.pop("note", "") or "")
    deps = list(a.pop("depends_on", ()) or ())
    if a:
      raise StudyError(
        f"arm {name!r}: unknown fields {sorted(a)}; valid: name, base, overrides, note, depends_on"
      )
    for value in overrides.values():
      if isinstance(value, str):
        deps += [d for d in PLACEHOLDER.findall(value) if d not in deps]
    for d in deps:
      if d not in [x.name for x in out]:
        where = "a later arm" if d in [dict(x).get("name") for x in study.arms] else "not an arm"
        raise StudyError(
          f"arm {name!r} depends on {d!r}, which is {where}; a dependency must be an "
          f"earlier arm of the study (arms: {[dict(x).get('name') for x in study.arms]})"
        )
    out.append(Arm(name=name, base=base, overrides=overrides, note=note, depends_on=tuple(deps)))
  if not out:
    raise StudyError(f"study {study.study!r} has no arms")
  return out


DIRECTIONS = ("higher", "lower")
PRIMARY_KEYS = ("metric", "arm", "vs", "direction")
# Metrics that come from the training logs and the state size, not from an eval (tipsito/studies/results.py).
NON_EVAL_PREFIXES = ("loss/", "ibot/", "state/")


def check_primary(
  study: mlc.ConfigDict, arm_names: Sequence[str], evals: Sequence[str] | None = None
) -> dict:
  """The study's declared primary comparison, checked; returns {metric, arm, vs, direction}.

  evals: the eval names of the arms' configs (`config.evals`); when given, the metric's `<eval>/` must be
  one of them (or a training-log / state metric), so that a typo in the eval name fails here and not
  as an absent column after hours of training."""
  p = study.get("primary")
  example = "primary=dict(metric='segmentation/miou', arm='ibot_pp', vs='ibot', direction='higher')"
  if not p:
    raise StudyError(
      f"study {study.study!r} declares no primary comparison; add to its study in configs/ablations.py "
      f"e.g. {example}"
    )
  p = dict(p)
  missing = [k for k in PRIMARY_KEYS if not p.get(k)]
  unknown = sorted(set(p) - set(PRIMARY_KEYS) - {"note"})
  if missing or unknown:
    raise StudyError(
      f"study {study.study!r}: primary {p}: missing {missing}, unknown {unknown}; expected keys "
      f"{list(PRIMARY_KEYS)} (and optionally note), e.g. {example}"
    )
  metrics = list(study.get("metrics", ()))
  if p["metric"] not in metrics:
    close = difflib.get_close_matches(p["metric"], metrics, n=1)
    raise StudyError(
      f"study {study.study!r}: primary metric {p['metric']!r} is not one of the study's metrics "
      f"{metrics}{f'; did you mean {close[0]!r}?' if close else ''}"
    )
  if evals is not None and not p["metric"].startswith(NON_EVAL_PREFIXES):
    if p["metric"].split("/", 1)[0] not in evals:
      raise StudyError(
        f"study {study.study!r}: primary metric {p['metric']!r}: no eval {p['metric'].split('/', 1)[0]!r} "
        f"in the arms' configs (evals: {sorted(evals)}; or a metric starting with {list(NON_EVAL_PREFIXES)})"
      )
  for k in ("arm", "vs"):
    if p[k] not in arm_names:
      raise StudyError(
        f"study {study.study!r}: primary {k}={p[k]!r} is not an arm of the study (arms: {list(arm_names)})"
      )
  if p["arm"] == p["vs"]:
    raise StudyError(f"study {study.study!r}: primary compares arm {p['arm']!r} with itself")
  if p["direction"] not in DIRECTIONS:
    raise StudyError(
      f"study {study.study!r}: primary direction={p['direction']!r}; valid: {list(DIRECTIONS)} "
      f"(the expected sign of {p['arm']} - {p['vs']})"
    )
  return {k: str(p[k]) for k in PRIMARY_KEYS}


def _resolve(value: Any, sweep_dir: str, seed: int) -> Any:
  """'{workdir:ARM}' -> the run directory of ARM for `seed`."""
  if isinstance(value, str):
    return PLACEHOLDER.sub(lambda m: run_dir(sweep_dir, m.group(1), seed), value)
  return value


def apply_override(config: mlc.ConfigDict, key: str, value: Any, *, arm: str) -> None:
  """Sets existing key `key` ('a.b.c') of `config` to `value`; an unknown key fails naming the arm, the
  key and the closest valid key."""
  node, parts = config, key.split(".")
  for i, part in enumerate(parts):
    where = ".".join(parts[:i])
    if not isinstance(node, mlc.ConfigDict) or part not in node:
      keys = list(node.keys()) if isinstance(node, mlc.ConfigDict) else []
      close = difflib.get_close_matches(part, keys, n=1)
      hint = f"; did you mean {'.'.join(parts[:i] + close)}?" if close else ""
      raise StudyError(
        f"arm {arm!r}: override {key!r}: {part!r} is not a key of config"
        f"{'.' + where if where else ''} (valid: {sorted(keys)}){hint}"
      )
    if i < len(parts) - 1:
      node = node[part]
  try:
    node[parts[-1]] = value
  except (TypeError, ValueError) as e:
    raise StudyError(f"arm {arm!r}: override {key}={value!r}: {e}") from None


def arm_config(study: mlc.ConfigDict, arm: Arm, seed: int, sweep_dir: str) -> mlc.ConfigDict:
  """The complete training config of (arm, seed): base + overrides + seed, data folders resolved (built-in
  datasets are built once into `<sweep_dir>/data`, shared by every run)."""
  config = copy.deepcopy(study.bases[arm.base])  # ConfigDict(c) would share c's field references
  for key, value in arm.overrides.items():
    apply_override(config, key, _resolve(value, sweep_dir, seed), arm=arm.name)
  config.seed = int(seed)
  config.input.shuffle_seed = int(seed)
  return data_prepare.resolve_data_dirs(config, os.path.abspath(sweep_dir))


def plan(
  study: mlc.ConfigDict, seeds: Sequence[int], sweep_dir: str, only: Sequence[str] | None = None
) -> list[Job]:
  """Every (arm, seed) job of the sweep, arm by arm, each config built and validated.

  only: run just these arms (and the arms they depend on). Raises StudyError naming the arm, the seed
  and the wrong key or value.
  """
  arms = arms_of(study)
  names = [a.name for a in arms]
  check_primary(study, names)  # the cheap checks first; the metric's eval once the configs exist
  wanted = set(names)
  if only:
    unknown = [n for n in only if n not in names]
    if unknown:
      raise StudyError(f"--only {unknown}: not arms of study {study.study!r} (arms: {names})")
    wanted = set(only)
    for a in reversed(arms):  # dependencies come earlier: one backwards pass collects them all
      if a.name in wanted:
        wanted.update(a.depends_on)
  jobs = []
  for i, arm in enumerate(arms):
    if arm.name not in wanted:
      continue
    for seed in seeds:
      config = arm_config(study, arm, seed, sweep_dir)
      try:
        config_validation.validate(config)
      except config_validation.ConfigError as e:
        raise StudyError(f"arm {arm.name!r} (seed {seed}): {e}") from None
      jobs.append(
        Job(
          arm=arm,
          seed=int(seed),
          index=i + 1,
          num_arms=len(arms),
          run_dir=run_dir(sweep_dir, arm.name, seed),
          config=config,
        )
      )
  evals = set.intersection(*(set(j.config.evals.keys()) for j in jobs)) if jobs else None
  check_primary(study, names, evals)
  _check_builds(jobs)
  return jobs


def _check_builds(jobs: Sequence[Job]) -> None:
  """Runs that build the same dataset into the same folder must build it the same way."""
  seen: dict[tuple, tuple[str, Any]] = {}
  for job in jobs:
    d = job.config.data
    if not d.get("build_if_missing"):
      continue
    key = (d.name, d.data_dir)
    opts = d.get("build_options")
    opts = opts.to_dict() if isinstance(opts, mlc.ConfigDict) else opts
    if key in seen and seen[key][1] != opts:
      raise StudyError(
        f"arms {seen[key][0]!r} and {job.arm.name!r} build dataset {d.name!r} into "
        f"{d.data_dir} with different data.build_options ({seen[key][1]} vs {opts})"
      )
    seen.setdefault(key, (job.arm.name, opts))
