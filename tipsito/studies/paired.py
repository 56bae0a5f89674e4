"""Paired statistics of a study: arms compared seed by seed, corrected for the number of comparisons.

Why paired: the arms of one seed share the data order (`config.input.shuffle_seed`) and the
initialisation seed, and their metrics correlate strongly across seeds (r = 0.85-0.99 on the probes of
the scenes studies, issue 42). The difference of two arms *within* a seed therefore varies much less than
either arm across seeds, and comparing means against the pooled spread (Cohen's d, kept in
`results.effect_size`) throws that away. Here the runs of an arm and of the arm it is compared with are
paired by seed; only the seeds both finished count.

What is computed, for the per-seed differences d_i = arm_i - other_i (i over the n shared seeds):

- mean difference and its 95 % interval, mean ± t_{0.975, n-1} · s_d / sqrt(n) (s_d: sample std of d_i);
- the paired t-test: t = mean / (s_d / sqrt(n)) with n - 1 degrees of freedom, two-sided p;
- d_z = mean / s_d, the standardised paired effect the power calculation needs;
- Benjamini-Hochberg adjusted p over a family of tests (`bh_adjust`): a comparison survives at level q
  when its adjusted p is <= q; the studies use q = 0.1 over the study's declared metrics x arms
  (`results.py` says which tests form the family);
- the seeds a decision would need at the observed effect (`seeds_needed`): the smallest n whose paired
  t-test at level alpha has power 0.8 against a true effect d_z, power(n) = P(|T'| > t_{1-alpha/2, n-1})
  with T' noncentral t (n - 1 degrees of freedom, noncentrality d_z sqrt(n)); its closed-form normal
  approximation is n = ((z_{1-alpha/2} + z_{0.8}) / |d_z|)^2 (`seeds_needed_normal`), which undercounts at
  the few seeds of a study (2 instead of 6 at d_z 3, alpha 0.004). alpha = q / m with m the tests of the
  family: the level Benjamini-Hochberg asks of the family's smallest p, so the count holds whatever the
  other tests do. The observed d_z of 3-5 seeds is itself uncertain: the count is a planning figure.

The t and normal distributions are scipy's (`scipy.stats`), which JAX itself requires (jax's
install_requires), so it is present wherever tipsito is; tests/test_paired.py checks them against
printed table values.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import stats as sp_stats

ALPHA = 0.05  # the intervals are 95 %
Q = 0.1  # the false-discovery rate of the studies' Benjamini-Hochberg correction
POWER = 0.8  # the power `seeds_needed` plans for


def _finite(x) -> bool:
  return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def t_quantile(p: float, df: int) -> float:
  """The p-quantile of Student's t with `df` degrees of freedom (t_{0.975, 2} = 4.303)."""
  return float(sp_stats.t.ppf(p, df))


def t_two_sided_p(t: float, df: int) -> float:
  """Two-sided p of a t statistic: P(|T| >= |t|) for T ~ t(df)."""
  return float(2.0 * sp_stats.t.sf(abs(t), df))


def z_quantile(p: float) -> float:
  """The p-quantile of the standard normal (z_{0.975} = 1.960, z_{0.8} = 0.842)."""
  return float(sp_stats.norm.ppf(p))


def paired(arm: Mapping[Any, float | None], other: Mapping[Any, float | None], alpha: float = ALPHA) -> dict:
  """Paired comparison of `arm` against `other` ({seed: value}); seeds missing or undefined (None,
  NaN) on either side are left out.

  Seeds may be ints or their strings (results.json's keys). Returns n (shared seeds), seeds, diffs (arm - other, per shared seed), mean_diff, sd_diff, ci_lo /
  ci_hi (the (1 - alpha) t-interval of the mean difference), t, df, p (two-sided paired t-test) and d_z
  (mean_diff / sd_diff). With fewer than two pairs, or no spread in the differences (e.g. a chance level
  or a state size, equal in every run), the undefined entries are None: such a comparison is no test.
  """
  seeds = sorted({int(s) for s in arm if _finite(arm[s])} & {int(s) for s in other if _finite(other[s])})
  arm, other = {int(s): v for s, v in arm.items()}, {int(s): v for s, v in other.items()}
  d = np.array([float(arm[s]) - float(other[s]) for s in seeds], dtype=np.float64)
  out: dict[str, Any] = {
    "n": len(seeds),
    "seeds": seeds,
    "diffs": [float(x) for x in d],
    "mean_diff": float(d.mean()) if len(d) else None,
    "sd_diff": None,
    "ci_lo": None,
    "ci_hi": None,
    "t": None,
    "df": None,
    "p": None,
    "d_z": None,
  }
  if len(d) < 2:
    return out
  sd = float(d.std(ddof=1))
  out["sd_diff"] = sd
  # Differences equal to rounding (e.g. two arms with the same config): no spread, no test.
  if sd <= 1e-12 * max(1.0, float(np.abs(d).max())):
    return out
  n = len(d)
  se = sd / math.sqrt(n)
  half = t_quantile(1.0 - alpha / 2.0, n - 1) * se
  t = out["mean_diff"] / se
  out.update(
    ci_lo=out["mean_diff"] - half,
    ci_hi=out["mean_diff"] + half,
    t=t,
    df=n - 1,
    p=t_two_sided_p(t, n - 1),
    d_z=out["mean_diff"] / sd,
  )
  return out


def bh_adjust(pvalues: Sequence[float | None]) -> list[float | None]:
  """Benjamini-Hochberg adjusted p, in the order given; None (no test) stays None and is not counted.

  For the m defined p sorted ascending, p_(1) <= ... <= p_(m): adj_(k) = min_{j >= k} min(1, m p_(j) / j).
  A test survives at false-discovery rate q when its adjusted p is <= q (the step-up rule)."""
  idx = [i for i, p in enumerate(pvalues) if p is not None]
  m = len(idx)
  out: list[float | None] = [None] * len(pvalues)
  if not m:
    return out
  order = sorted(idx, key=lambda i: pvalues[i])
  running = 1.0
  for rank in range(m, 0, -1):  # from the largest p down: the running minimum of m p / rank
    i = order[rank - 1]
    running = min(running, m * float(pvalues[i]) / rank)
    out[i] = min(1.0, running)
  return out


def seeds_needed_normal(d_z: float | None, alpha: float, power: float = POWER) -> int | None:
  """The closed-form count: ceil(((z_{1-alpha/2} + z_{power}) / |d_z|)^2), the normal approximation of
  the paired t-test's power (too few seeds at small n, where t's tails are heavier). None when there is no
  effect to detect (d_z 0 or undefined)."""
  if d_z is None or not math.isfinite(d_z) or d_z == 0:
    return None
  return max(2, math.ceil(((z_quantile(1.0 - alpha / 2.0) + z_quantile(power)) / abs(d_z)) ** 2))


def t_power(n: int, d_z: float, alpha: float) -> float:
  """Power of the two-sided paired t-test with n pairs at level alpha for a true effect d_z:
  P(|T'| > t_{1-alpha/2, n-1}) with T' noncentral t, n - 1 degrees of freedom, noncentrality d_z sqrt(n)."""
  df, nc = n - 1, d_z * math.sqrt(n)
  crit = t_quantile(1.0 - alpha / 2.0, df)
  return float(sp_stats.nct.sf(crit, df, nc) + sp_stats.nct.cdf(-crit, df, nc))


def seeds_needed(d_z: float | None, alpha: float, power: float = POWER, max_seeds: int = 1000) -> int | None:
  """Seeds (pairs) the two-sided paired t-test at level `alpha` needs to detect an effect of size `d_z`
  with probability `power`: the smallest n >= 2 with `t_power(n, d_z, alpha) >= power`, searched upwards
  from the normal approximation's count minus a few (which it never exceeds by more). d_z 0.5 at alpha
  0.05 and power 0.8: 34 pairs (32 by the normal approximation). `max_seeds` when even that many are not
  enough (an effect near 0); None when there is no effect to detect."""
  start = seeds_needed_normal(d_z, alpha, power)
  if start is None:
    return None
  n = min(max(2, start - 3), max_seeds)
  while n > 2 and t_power(n - 1, abs(d_z), alpha) >= power:
    n -= 1
  while t_power(n, abs(d_z), alpha) < power and n < max_seeds:
    n += 1
  return n


REPRODUCES, REVERSES, CANNOT_TELL, ABSENT = "reproduces", "reverses", "cannot tell", "absent"


def verdict(comparison: Mapping[str, Any] | None, p_adj: float | None, direction: str, q: float = Q) -> str:
  """The primary's verdict: "reproduces" when its BH-adjusted p is <= q with the mean difference in the
  expected `direction` ('higher': the arm above the other; 'lower': below), "reverses" when it survives
  the other way, "cannot tell" otherwise, "absent" when the results have no value of the metric."""
  if not comparison or comparison.get("n", 0) == 0:
    return ABSENT
  if p_adj is None or p_adj > q or not comparison.get("mean_diff"):
    return CANNOT_TELL
  up = comparison["mean_diff"] > 0
  return REPRODUCES if up == (direction == "higher") else REVERSES
