"""The studies' paired statistics (tipsito/studies/paired.py, results.py) and `python -m tipsito.sweep
--render_only`.

Why: a study's verdict ("reproduces", "reverses", "cannot tell") rests on a paired t-test, its interval,
a Benjamini-Hochberg correction and a power calculation; each is checked here against values computed by
hand (closed forms of the t distribution at 1 and 2 degrees of freedom, printed table quantiles), and the
Round II numbers the issue quotes (issue 42) against the stored results.json files. The render-only mode
is run as a program on a tiny fake study, so that the command docs/results.md prints is tested.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tipsito.studies import paired
from tipsito.studies import results as results_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCENES = ROOT / "docs" / "results" / "scenes"


def test_t_and_normal_quantiles_match_the_printed_tables():
  # Student's t table (two-sided 95 %) and the normal quantiles the power calculation uses.
  for df, t in ((1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)):
    assert paired.t_quantile(0.975, df) == pytest.approx(t, abs=5e-4), df
  assert paired.z_quantile(0.975) == pytest.approx(1.95996, abs=1e-5)
  assert paired.z_quantile(0.8) == pytest.approx(0.84162, abs=1e-5)
  # Closed forms: df 1 is Cauchy, P(T > t) = 1/2 - atan(t)/pi; df 2: P(T > t) = (1 - t/sqrt(t^2 + 2)) / 2.
  for t in (0.3, 1.0, 3.4641016):
    assert paired.t_two_sided_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-9)
    assert paired.t_two_sided_p(-t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)


def test_paired_difference_interval_and_test_by_hand():
  # Differences 1, 2, 3 (seed 3 only in one arm, seed 4 undefined in one: both left out): mean 2, sd 1,
  # se 1/sqrt(3), t = 2 sqrt(3) on 2 df, p = 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12/14), interval
  # 2 -+ 4.302653 / sqrt(3).
  arm = {"0": 3.0, "1": 5.0, "2": 7.0, "3": 9.0, "4": None}
  other = {0: 2.0, 1: 3.0, 2: 4.0, 4: 1.0}
  c = paired.paired(arm, other)
  assert c["n"] == 3 and c["seeds"] == [0, 1, 2] and c["diffs"] == [1.0, 2.0, 3.0]
  assert c["mean_diff"] == pytest.approx(2.0) and c["sd_diff"] == pytest.approx(1.0)
  assert c["t"] == pytest.approx(2 * math.sqrt(3)) and c["df"] == 2
  assert c["p"] == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
  half = 4.302653 / math.sqrt(3)
  assert (c["ci_lo"], c["ci_hi"]) == (pytest.approx(2 - half, abs=1e-5), pytest.approx(2 + half, abs=1e-5))
  assert c["d_z"] == pytest.approx(2.0)
  # No spread (a chance level, a state size) or one pair: no test, not a crash.
  same = paired.paired({0: 2.91, 1: 2.91}, {0: 2.91, 1: 2.91})
  assert same["n"] == 2 and same["mean_diff"] == 0 and same["p"] is None and same["ci_lo"] is None
  one = paired.paired({0: 1.0}, {0: 0.0})
  assert one["n"] == 1 and one["p"] is None and one["d_z"] is None
  assert paired.paired({0: 1.0}, {})["n"] == 0


def test_benjamini_hochberg_by_hand():
  # m = 4 defined p (None is no test): sorted 0.01, 0.03, 0.04, 0.20 -> m p / rank = 0.04, 0.06, 0.0533,
  # 0.20 -> running minimum from the top: 0.04, 0.0533, 0.0533, 0.20.
  adj = paired.bh_adjust([0.01, 0.04, 0.03, 0.20, None])
  assert adj[:4] == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.20]) and adj[4] is None
  assert paired.bh_adjust([0.9, 0.95]) == pytest.approx([0.95, 0.95])
  assert paired.bh_adjust([]) == [] and paired.bh_adjust([None]) == [None]


def test_seeds_needed_and_verdicts():
  # Normal approximation: n = ((1.959964 + 0.841621) / 0.5)^2 = 31.40 -> 32; (2.8016 / 2)^2 = 1.96 -> 2.
  assert paired.seeds_needed_normal(0.5, 0.05) == 32 and paired.seeds_needed_normal(-0.5, 0.05) == 32
  assert paired.seeds_needed_normal(2.0, 0.05) == 2
  # The paired t-test's own power (noncentral t): the published sample sizes for a paired / one-sample
  # t-test at alpha 0.05, power 0.8 (Cohen 1988; G*Power): d_z 0.5 -> 34, 0.8 -> 15, 1.0 -> 10.
  for d_z, n in ((0.5, 34), (-0.8, 15), (1.0, 10)):
    assert paired.seeds_needed(d_z, 0.05) == n, d_z
    assert paired.t_power(n, abs(d_z), 0.05) >= 0.8 > paired.t_power(n - 1, abs(d_z), 0.05)
  assert paired.t_power(10, 0.0, 0.05) == pytest.approx(0.05)  # no effect: power = alpha
  assert paired.seeds_needed(0.0, 0.05) is None and paired.seeds_needed(None, 0.05) is None
  assert paired.seeds_needed(0.01, 0.05) == 1000  # capped: "1000 or more" in results.md
  up, down = {"n": 3, "mean_diff": 1.0}, {"n": 3, "mean_diff": -1.0}
  assert paired.verdict(up, 0.05, "higher") == "reproduces"
  assert paired.verdict(down, 0.05, "higher") == "reverses"
  assert paired.verdict(down, 0.05, "lower") == "reproduces"
  assert paired.verdict(up, 0.11, "higher") == "cannot tell"
  assert paired.verdict(up, None, "higher") == "cannot tell"
  assert paired.verdict({"n": 0}, None, "higher") == "absent"


def _stored(study):
  return json.loads((SCENES / study / "results.json").read_text())


def _seed_values(res, arm, metric):
  return {s: r["metrics"].get(metric) for s, r in res["arms"][arm]["runs"].items()}


def test_round_two_numbers_the_issue_quotes():
  """Issue 42: ibot study, iBOT++ vs iBOT on value-embedding mIoU: d 0.40, paired p 0.28; mask study: mask
  0 above 0.75 on value mIoU on 3/3 seeds, paired p 0.034. Recomputed from the stored per-seed values."""
  ibot = results_lib.rerender(
    _stored("ibot"),
    {
      "metrics": ["segmentation/miou", "segmentation/margin/object_miou"],
      "primary": dict(metric="segmentation/miou", arm="ibot_pp", vs="ibot", direction="higher"),
    },
  )
  p = ibot["primary"]
  assert p["comparison"]["n"] == 5 and p["comparison"]["p"] == pytest.approx(0.2837, abs=5e-4)
  assert p["cohen_d"] == pytest.approx(0.40, abs=0.005)
  assert p["verdict"] == "cannot tell" and p["seeds_needed"] > 5
  # A metric Round II never measured is reported absent, not an error, and is no test of the family.
  absent = ibot["arms"]["ibot_pp"]["paired_vs_reference"]["segmentation/margin/object_miou"]
  assert absent["n"] == 0 and absent["p"] is None
  assert ibot["bh"]["family_size"] == 3 * 1 + 1  # 3 arms x the one measured metric, + the primary
  mask = _stored("mask")
  c = paired.paired(*(_seed_values(mask, a, "segmentation/miou") for a in ("mask_00", "mask_75")))
  assert c["n"] == 3 and all(d > 0 for d in c["diffs"]) and c["p"] == pytest.approx(0.034, abs=5e-4)


def _fake_smoke_results(path):
  """A results.json of the smoke study (configs/ablations.py) with three seeds and hand-made numbers:
  zero-shot of augment_ito - augment_none = 1, 2, 3 per seed; loss/total equal in both arms."""
  arms = {}
  for name, top1 in (("augment_ito", (3.0, 5.0, 7.0)), ("augment_none", (2.0, 3.0, 4.0))):
    runs = {
      str(s): {
        "metrics": {"zeroshot/top1": v, "loss/total": 2.5},
        "curves": {"loss/total": [[1, 3.0], [2, 2.5]]},
        "seconds": 10.0,
        "provenance": {},
      }
      for s, v in enumerate(top1)
    }
    budget = {"steps": 2, "batch": 8, "image_size": 32, "image_tower": "tiny"}
    arms[name] = dict(
      base="clip", recipe="clip", note="", overrides={}, depends_on=[], budget=budget, runs=runs
    )
    arms[name]["seconds"] = {"mean": 10.0, "std": 0.0, "n": 3}
  path.mkdir(parents=True, exist_ok=True)
  (path / "results.json").write_text(
    json.dumps(
      dict(
        study="smoke",
        claim="c",
        metrics=["zeroshot/top1"],
        seeds=[0, 1, 2],
        command="python -m x",
        reference_arm="augment_ito",
        arms=arms,
      )
    )
  )


def _render(workdir, arg="study=smoke"):
  """The render-only command as docs/results.md prints it (a subprocess: the CLI itself)."""
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
  cmd = [sys.executable, "-m", "tipsito.sweep", "--config", f"{ROOT}/configs/ablations.py:{arg}"]
  cmd += ["--workdir", str(workdir), "--render_only", "--noplots"]
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_render_only_writes_the_paired_statistics_and_the_verdict(tmp_path):
  """`python -m tipsito.sweep --render_only` on a stored results.json: paired intervals, BH-adjusted p and
  the primary's verdict land in results.json and results.md, with the hand-computed values; a wrong
  primary fails naming the key, before anything is written."""
  w = tmp_path / "smoke"
  _fake_smoke_results(w)
  r = _render(w)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  res = json.loads((w / "results.json").read_text())
  # The smoke study's primary: zeroshot/top1, augment_ito above augment_none (configs/ablations.py).
  p = res["primary"]
  assert (p["metric"], p["arm"], p["vs"], p["direction"]) == (
    "zeroshot/top1",
    "augment_ito",
    "augment_none",
    "higher",
  )
  c = p["comparison"]
  assert c["diffs"] == [1.0, 2.0, 3.0] and c["p"] == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
  # Family: augment_none vs the reference augment_ito on zeroshot/top1 (the primary, reversed: the same
  # test) and loss/total (no spread: no test) -> one test, so the BH-adjusted p is the p itself.
  assert res["bh"]["family_size"] == 1 and c["p_bh"] == pytest.approx(c["p"])
  # p = 1 - sqrt(12/14) = 0.074 <= q = 0.1, in the declared direction.
  assert p["verdict"] == "reproduces"
  md = (w / "results.md").read_text()
  assert "| `zeroshot/top1` | `augment_ito` - `augment_none` | 3 | +2.00 [-0.484, +4.48] |" in md
  assert "Statistics recomputed from the stored per-seed values by: `python -m tipsito.sweep" in md
  # The stored results declared no primary: results.md says it was declared after they ran.
  assert res["primary_declared"] == "after the runs" and "Declared after these runs ran" in md
  ref = res["arms"]["augment_none"]["paired_vs_reference"]["zeroshot/top1"]
  assert ref["mean_diff"] == pytest.approx(-2.0) and ref["p_bh"] == pytest.approx(c["p"])

  # Wrong input fails naming the key, before anything is written (in this process: the CLI maps
  # StudyError to exit status 2, tipsito/sweep.py).
  from tipsito.studies import arms, runner  # pylint: disable=import-outside-toplevel

  before = (w / "results.json").read_bytes()
  with pytest.raises(
    arms.StudyError, match=r"primary metric 'zeroshot/top5' is not one of the study's metrics"
  ):
    runner.render_only(
      _ablations().get_config("study=smoke,primary=zeroshot/top5"), workdir=str(w), plots=False
    )
  assert (w / "results.json").read_bytes() == before
  with pytest.raises(arms.StudyError, match=r"no results.json in --workdir"):
    runner.render_only(_ablations().get_config("study=smoke"), workdir=str(tmp_path / "nothing"), plots=False)
  with pytest.raises(arms.StudyError, match=r"holds study 'smoke', the config is study 'ema'"):
    runner.render_only(_ablations().get_config("study=ema"), workdir=str(w), plots=False)


def _ablations():
  import importlib.util  # pylint: disable=import-outside-toplevel

  spec = importlib.util.spec_from_file_location("ablations_for_paired", ROOT / "configs" / "ablations.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("study", ["ibot", "distill", "mask", "captions", "ema", "tipsito", "ito"])
def test_stored_round_two_statistics_are_what_the_render_command_gives(study):
  """docs/results/scenes/<study>/results.json holds the statistics its render command (docs/results.md)
  computes from its stored per-seed values today: a change of the statistics or of a study's declared
  primary that is not re-rendered into the docs fails here."""
  stored = _stored(study)
  arg = f"round=2,study={study}" + ("" if study == "ito" else ",primary=segmentation/miou")
  again = results_lib.rerender(stored, _ablations().get_config(arg), stored["rendered_by"])
  assert again["primary"] == stored["primary"] and again["bh"] == stored["bh"]
  for name, a in again["arms"].items():
    assert a["paired_vs_reference"] == stored["arms"][name]["paired_vs_reference"], name
