"""The sweep runner (tipsito/sweep.py, tipsito/studies/) on the tiny `smoke` study of configs/ablations.py.

Why: a study of seven claims x arms x seeds runs for days and will be interrupted. Killed (SIGKILL) after
its first arm finished and while the second arm trains, then rerun, the sweep must rerun nothing that
finished, resume the interrupted run from its checkpoint, and end with exactly the numbers of a sweep that
was never interrupted (bitwise: a CPU run is deterministic, and resume is exact, tests/test_train_resume.py).
The uninterrupted sweep runs its jobs in its own process (--parallel 1), the rerun as subprocesses
(--parallel 2), so the equality also covers both ways of running a job. A wrong override key must fail
before anything runs, naming the arm and the key.
"""

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# 2 arms x 2 seeds, 8 steps of batch 8 at 32 px, a checkpoint every 2 steps, zero-shot eval on 16 images.
ARGS = (
  "study=smoke,steps=8,batch=8,size=32,train_images=48,test_images=16,evals=zeroshot,log_every=1,ckpt_every=2"
)
FIRST, SECOND = "augment_ito", "augment_none"


def _sweep(workdir, *extra):
  return [
    sys.executable,
    "-m",
    "tipsito.sweep",
    "--config",
    f"{ROOT}/configs/ablations.py:{ARGS}",
    "--seeds",
    "2",
    "--workdir",
    str(workdir),
    *extra,
  ]


def _run_dir(workdir, arm, seed):
  return pathlib.Path(workdir) / arm / f"seed_{seed}"


def _latest_step(run_dir):
  from tipsito.train import workdir as workdir_lib

  return workdir_lib.latest_checkpoint_step(str(run_dir)) if run_dir.is_dir() else None


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("sweep")
  # One compilation cache for all three sweeps (the first compiles, the others load the same programs).
  env = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "JAX_PLATFORMS": "cpu",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax_cache"),
  }
  w1, w2 = tmp / "uninterrupted", tmp / "killed"
  t0 = time.time()
  r = subprocess.run(_sweep(w1), env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

  # Killed: SIGKILL once both seeds of the first arm are finished and the second arm's seed 0 has a
  # checkpoint but no result yet.
  first = [_run_dir(w2, FIRST, s) / "result.json" for s in (0, 1)]
  mid = _run_dir(w2, SECOND, 0)
  with open(tmp / "killed.log", "w") as log:
    p = subprocess.Popen(_sweep(w2), env=env, stdout=log, stderr=subprocess.STDOUT)
    while p.poll() is None and time.time() - t0 < 900:
      if all(f.exists() for f in first) and _latest_step(mid) and not (mid / "result.json").exists():
        p.send_signal(signal.SIGKILL)
        break
      time.sleep(0.02)
    p.wait()
  assert p.returncode == -signal.SIGKILL, (tmp / "killed.log").read_text()[-3000:]
  assert not (mid / "result.json").exists() and not (_run_dir(w2, SECOND, 1) / "result.json").exists()
  killed = {
    "step": _latest_step(mid),
    "first": {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in first},
    "first_logs": {f: (f.parent / "log.txt").stat().st_size for f in first},
  }

  rerun = subprocess.run(_sweep(w2, "--parallel", "2"), env=env, capture_output=True, text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
  return dict(w1=w1, w2=w2, killed=killed, rerun=rerun.stdout, seconds=time.time() - t0)


def _results(workdir):
  return json.loads((pathlib.Path(workdir) / "results.json").read_text())


def test_rerun_runs_only_the_unfinished_runs(sweeps):
  w2, killed = sweeps["w2"], sweeps["killed"]
  # The finished arm was not run again: result files untouched, nothing added to its logs.
  for f, (mtime, content) in killed["first"].items():
    assert f.stat().st_mtime_ns == mtime and f.read_bytes() == content
  for f, size in killed["first_logs"].items():
    assert (f.parent / "log.txt").stat().st_size == size
  ran = re.findall(r"\] (arm \d/\d \S+, seed \d): (started|resumed at step \d+)", sweeps["rerun"])
  assert sorted(ran) == [
    (f"arm 2/2 {SECOND}, seed 0", f"resumed at step {killed['step']}"),
    (f"arm 2/2 {SECOND}, seed 1", "started"),
  ], sweeps["rerun"]
  # The half-finished run resumed from the checkpoint it had when it was killed.
  assert 0 < killed["step"] <= 8
  res = json.loads((_run_dir(w2, SECOND, 0) / "result.json").read_text())
  assert res["resumed_from_step"] == killed["step"]
  assert re.search(
    rf"Resumed from \S+ at step {killed['step']}\b", (_run_dir(w2, SECOND, 0) / "log.txt").read_text()
  )
  assert json.loads((_run_dir(w2, SECOND, 1) / "result.json").read_text())["resumed_from_step"] is None
  # Progress: arm i/n, seed, run counts and an ETA from the finished runs' durations.
  assert re.search(
    r"arm 2/2 augment_none, seed \d: finished in \S+ \(zeroshot/top1 [\d.]+, loss/total [\d.]+\)"
    r" \| 4/4 runs done \| ETA 0s",
    sweeps["rerun"],
  ), sweeps["rerun"]


def test_results_equal_the_uninterrupted_sweep(sweeps):
  a, b = _results(sweeps["w1"]), _results(sweeps["w2"])
  assert list(a["arms"]) == list(b["arms"]) == [FIRST, SECOND]
  for arm in a["arms"]:
    ra, rb = a["arms"][arm]["runs"], b["arms"][arm]["runs"]
    assert sorted(ra) == sorted(rb) == ["0", "1"]
    for seed in ra:
      # Every number, bitwise: final eval metrics, last losses, state sizes and every logged loss.
      assert ra[seed]["metrics"] == rb[seed]["metrics"], (arm, seed)
      assert ra[seed]["curves"] == rb[seed]["curves"], (arm, seed)
      assert [s for s, _ in rb[seed]["curves"]["loss/total"]] == list(range(1, 9))
      assert set(ra[seed]["metrics"]) >= {"zeroshot/top1", "loss/total", "state/train_state_MiB"}
    assert a["arms"][arm]["summary"] == b["arms"][arm]["summary"]
  # The two arms differ (otherwise the equality would say little).
  assert a["arms"][FIRST]["runs"]["0"]["curves"] != a["arms"][SECOND]["runs"]["0"]["curves"]


def test_results_md_and_plots(sweeps):
  w1 = sweeps["w1"]
  res = _results(w1)
  md = (w1 / "results.md").read_text()
  table = md.split("## Arms")[0]  # the results table; the arms table follows
  assert "| arm | `zeroshot/top1` | `loss/total` | wall time per run |" in table
  rows = {
    line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
    for line in table.splitlines()
    if line.startswith((f"| {FIRST} |", f"| {SECOND} |"))
  }
  assert set(rows) == {FIRST, SECOND}
  for col, metric, pick in ((0, "zeroshot/top1", max), (1, "loss/total", min)):
    means = {arm: res["arms"][arm]["summary"][metric]["mean"] for arm in rows}
    best = pick(means.values())
    for arm, cells in rows.items():
      assert cells[col].startswith("**") == (means[arm] == best), (metric, arm, cells[col], means)
      assert cells[col].endswith("(2)")  # two seeds
  assert res["command"].startswith("python -m tipsito.sweep --config ") and res["command"] in md
  for name in ("zeroshot_top1.png", "loss_total.png", "loss_curves.png"):
    assert (w1 / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_record_provenance_and_effect_sizes(sweeps):
  """Every run names its commit and machine and whether it resumed; the effect sizes are Cohen's d of the
  seeds against the first arm, recomputed here from the runs."""
  from tipsito.studies import provenance  # pylint: disable=import-outside-toplevel
  from tipsito.studies import results as results_lib  # pylint: disable=import-outside-toplevel

  res = _results(sweeps["w2"])
  for arm in res["arms"].values():
    for r in arm["runs"].values():
      p = r["provenance"]
      assert p["machine"]["cores"] == os.cpu_count() and p["machine"]["platform"] == "cpu"
      assert p["machine"]["memory_gib"] > 0
      assert p["machine"]["processor"] == provenance.processor()  # XLA:CPU rounds per processor
      assert p["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", p["commit"])
      assert r["resumed"] == (r["resumed_from_step"] is not None)
  assert res["provenance"]["resumed_runs"] == 1  # the run killed halfway
  assert sum(res["provenance"]["machines"].values()) == 4
  assert res["reference_arm"] == FIRST
  m = "zeroshot/top1"

  def values(arm):
    return [r["metrics"][m] for r in res["arms"][arm]["runs"].values()]

  a, b = values(SECOND), values(FIRST)
  pooled = ((np.var(a, ddof=1) + np.var(b, ddof=1)) / 2) ** 0.5  # two seeds each
  if pooled > 0:
    assert res["arms"][SECOND]["effect_vs_reference"][m] == pytest.approx((np.mean(a) - np.mean(b)) / pooled)
  md = (sweeps["w2"] / "results.md").read_text()
  assert (
    "## Paired differences and effect sizes" in md and "Ran on: commit " in md and "Resumed runs: 1." in md
  )
  # Known values: means 3 and 1, both stds 1 -> d = 2; one seed -> undefined.
  assert results_lib.effect_size([2.0, 3.0, 4.0], [0.0, 1.0, 2.0]) == pytest.approx(2.0)
  assert results_lib.effect_size([2.0], [0.0, 1.0]) is None
  # A state size equal in every run up to float rounding has no spread: no d (it was 7e15 in ema's table).
  a = 0.0989
  assert results_lib.effect_size([a, a, a + 1.7e-17 * 3], [0.183, 0.183, 0.183]) is None
  assert results_lib.effect_size([a, a, a], [0.183, 0.183, 0.183 + 1e-9]) < -1e8  # a real, if tiny, spread


def test_results_record_paired_statistics_primary_and_environment(sweeps):
  """The sweep writes the paired comparison against the reference arm, the BH-adjusted p and the declared
  primary's verdict (recomputed here from the runs), and the environment: package versions, XLA flags
  and the sha256 of the built data's examples per split (recomputed here from the records)."""
  import hashlib  # pylint: disable=import-outside-toplevel

  from tipsito.data import sources  # pylint: disable=import-outside-toplevel
  from tipsito.studies import paired  # pylint: disable=import-outside-toplevel

  res = _results(sweeps["w1"])
  m = "zeroshot/top1"
  a = {s: r["metrics"][m] for s, r in res["arms"][SECOND]["runs"].items()}
  b = {s: r["metrics"][m] for s, r in res["arms"][FIRST]["runs"].items()}
  c = res["arms"][SECOND]["paired_vs_reference"][m]
  assert c["diffs"] == [a["0"] - b["0"], a["1"] - b["1"]] and c["n"] == 2
  if c["p"] is not None:  # two seeds: t on 1 df, P(|T| > t) = 1 - 2 atan(|t|) / pi
    assert c["p"] == pytest.approx(1 - 2 * np.arctan(abs(c["t"])) / np.pi)
  prim = res["primary"]
  assert (prim["metric"], prim["arm"], prim["vs"]) == (m, FIRST, SECOND)  # configs/ablations.py's smoke
  assert prim["comparison"]["diffs"] == [-d for d in c["diffs"]]
  assert prim["verdict"] == paired.verdict(prim["comparison"], prim["comparison"]["p_bh"], "higher")
  assert res["bh"]["q"] == 0.1
  md = (sweeps["w1"] / "results.md").read_text()
  assert f"| `{m}` | `{FIRST}` - `{SECOND}` | 2 |" in md and f"**{prim['verdict']}**" in md
  env = res["environment"]
  assert set(env["packages"]) >= {"jax", "flax", "optax", "numpy", "tensorflow-datasets"}
  assert env["packages"]["jax"] == __import__("jax").__version__ and "xla_flags" in env
  (data,) = env["datasets"]  # training and eval read the one built `shapes`
  assert data["name"] == "shapes" and set(data["splits"]) == {"train", "test"}
  from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=import-outside-toplevel
  from tensorflow.core.example import example_pb2  # pylint: disable=import-outside-toplevel

  d = sources.resolve_dataset_dir("shapes", data["data_dir"])
  for split, digest in data["splits"].items():  # per file: its name, then each example made deterministic
    h = hashlib.sha256()
    for f in sorted(x for x in os.listdir(d) if x.startswith(f"shapes-{split}.")):
      h.update(f.encode() + b"\0")
      reader = ArrayRecordReader(str(pathlib.Path(d) / f))
      for raw in reader.read(0, reader.num_records()):
        rec = example_pb2.Example.FromString(raw).SerializeToString(deterministic=True)
        h.update(len(rec).to_bytes(8, "little") + rec)
      reader.close()
    assert digest == h.hexdigest(), split
  assert "Environment: jax " in md and "data: shapes (test " in md


def test_primary_must_be_declared_before_anything_runs(tmp_path):
  """A study without a primary, or with one naming an unknown metric, arm, eval or direction, fails before
  anything runs, naming the key."""
  from tipsito.studies import arms, runner

  cases = (
    (None, r"study 'smoke' declares no primary comparison"),
    (dict(metric="zeroshot/top1", arm=FIRST, vs=SECOND), r"missing \['direction'\]"),
    (
      dict(metric="zeroshot/top1", arm=FIRST, vs="nope", direction="higher"),
      r"primary vs='nope' is not an arm",
    ),
    (dict(metric="zeroshot/top1", arm=FIRST, vs=SECOND, direction="up"), r"direction='up'; valid"),
    (dict(metric="zeroshot/top5", arm=FIRST, vs=SECOND, direction="higher"), r"did you mean 'zeroshot/top1'"),
  )
  for primary, error in cases:
    study = _study()
    study.primary = primary
    with pytest.raises(arms.StudyError, match=error):
      runner.run_sweep(study, seeds=[0], workdir=str(tmp_path / "w"), plots=False)
  study = _study()  # a declared metric whose eval the arms do not run (evals=zeroshot)
  study.metrics = study.metrics + ("knn/top1",)
  study.primary.metric = "knn/top1"
  with pytest.raises(arms.StudyError, match=r"primary metric 'knn/top1': no eval 'knn' in the arms' configs"):
    runner.run_sweep(study, seeds=[0], workdir=str(tmp_path / "w"), plots=False)
  assert not (tmp_path / "w").exists()


def _ablations():
  spec = importlib.util.spec_from_file_location("ablations_for_test", ROOT / "configs" / "ablations.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _study():
  return _ablations().get_config(ARGS)


def test_every_study_plans(tmp_path):
  """Each study of configs/ablations.py: a claim, metrics, and every arm's config valid for every seed."""
  from tipsito.studies import arms

  mod = _ablations()
  assert set(mod.STUDIES) == {
    "smoke",
    "ito",
    "ibot",
    "mask",
    "distill",
    "ema",
    "captions",
    "tipsito",
    "optimizer",
    "weighting",
    "dev_lr",
    "sd_diagnosis",
  }
  for name in mod.STUDIES:
    study = mod.get_config(f"study={name}")
    assert study.claim and study.metrics, name
    jobs = arms.plan(study, [0, 1], str(tmp_path))
    assert len(jobs) == 2 * len(study.arms) >= 4, name
    for job in jobs:
      assert (job.config.seed, job.config.input.shuffle_seed) == (job.seed, job.seed)
      assert job.config.data.data_dir == str(tmp_path / "data")  # built once, shared by the runs
  distill = arms.plan(mod.get_config("study=distill"), [1], str(tmp_path))
  assert {j.arm.name: j.config.distill.teacher for j in distill if j.arm.name != "teacher"} == {
    "student_mask0": str(tmp_path / "teacher" / "seed_1"),
    "student_mask75": str(tmp_path / "teacher" / "seed_1"),
    "student_mask0_init_teacher": str(tmp_path / "teacher" / "seed_1"),
  }
  ema = {j.arm.name: j.config.ema.mode for j in arms.plan(mod.get_config("study=ema"), [0], str(tmp_path))}
  assert ema == {"ema_head": "head", "ema_full": "full"}


def test_width_and_depth_scale_both_towers_of_every_arm(tmp_path):
  """`width` / `depth` (the lever for a larger budget, docs/results.md) reach both towers of every arm of
  every study, and each such config is valid; a width that is not whole heads fails, naming the arg."""
  from tipsito.studies import arms

  mod = _ablations()
  for name in set(mod.STUDIES) - {"weighting"}:  # the weighting study is configs/demo.py itself
    for job in arms.plan(mod.get_config(f"study={name},width=128,depth=3"), [0], str(tmp_path)):
      shapes = [
        (t.width, t.depth, t.num_heads, t.mlp_dim) for t in (job.config.model.image, job.config.model.text)
      ]
      assert shapes == [(128, 3, 8, 256)] * 2, (name, job.arm.name)
  with pytest.raises(ValueError, match=r"config arg width=72 must be 0 .* or a multiple of 16"):
    mod.get_config("study=ibot,width=72")


def test_optim_and_pixels_args_set_every_arm_but_the_optimizer_studys(tmp_path):
  """On scenes Round II ran the paper's optimizer and pixel statistics (Adafactor, TIPS pixels) and Round III
  runs the dev sweep's choice with CLIP pixels, unless the args say otherwise; on openclipart the first round's AdamW and CLIP pixels (its commands still run
  what they ran); the `optimizer` and `weighting` studies, which set both themselves, refuse them."""
  from tipsito.config import presets
  from tipsito.studies import arms

  mod = _ablations()
  cases = (
    ("study=ibot", "adamw", presets.CLIP_PIXEL_MEAN),  # Round III: the dev sweep's choice (ROUND3_OPTIM)
    ("round=2,study=ibot", "adafactor", presets.TIPS_PIXEL_MEAN),
    ("study=ibot,optim=adamw,pixels=clip", "adamw", presets.CLIP_PIXEL_MEAN),
    ("study=ibot,data=openclipart", "adamw", presets.CLIP_PIXEL_MEAN),
    ("study=ibot,data=openclipart,optim=adafactor,pixels=tips", "adafactor", presets.TIPS_PIXEL_MEAN),
  )
  for arg, optim, mean in cases:
    for job in arms.plan(mod.get_config(arg), [0], str(tmp_path)):
      assert job.config.optim.name == optim, (arg, job.arm.name)
      assert tuple(job.config.model.image.pixel_mean) == tuple(mean), (arg, job.arm.name)
  for study in ("optimizer", "weighting", "sd_diagnosis"):
    with pytest.raises(ValueError, match=f"the {study} study sets both itself"):
      mod.get_config(f"study={study},optim=adafactor")


def _check_views(name, job):
  c = job.config
  if job.arm.name == "ibot_pp_global_crop_032":
    assert tuple(c.input.global_crop_scale) == (0.32, 1.0)
  elif "multicrop" in c.input.views:
    assert tuple(c.input.global_crop_scale) == (1.0, 1.0), (name, job.arm.name)
  else:
    assert tuple(c.input.global_crop_scale) == (0.5, 1.0), (name, job.arm.name)
  if "two_views" in c.input.views:
    assert tuple(c.input.view2_crop_scale) == (0.5, 1.0)


def test_paper_studies_train_on_scenes_and_judge_on_its_test_split(tmp_path):
  """The paper studies train on scenes' train split with the scenes tokenizer, every eval (the probes
  included) reads its held-out test split, the columns are the paper's, and the views are the papers'
  (TIPS global view = the whole image, ITO's 0.5-1.0), not the demo's."""
  from tipsito.studies import arms

  mod = _ablations()
  for name in set(mod.STUDIES) - {"smoke", "optimizer", "weighting", "dev_lr", "sd_diagnosis"}:
    study = mod.get_config(f"study={name}")
    assert set(mod.SCENES_DENSE) <= set(study.metrics), name
    for job in arms.plan(study, [0], str(tmp_path)):
      c = job.config
      assert (c.data.name, c.data.split) == ("scenes", "train"), (name, job.arm.name)
      assert c.tokenizer.endswith("scenes_sp.model")
      assert {ev.dataset for ev in c.evals.values()} == {"scenes"}
      assert {ev.split for ev in c.evals.values()} == {"test"}, (name, job.arm.name)
      assert {ev.type for ev in c.evals.values()} == set(mod.EVAL_TYPES)
      _check_views(name, job)
  assert set(mod.MECHANISM) <= set(mod.get_config("study=ibot").metrics)
  weighting = arms.plan(mod.get_config("study=weighting"), [0], str(tmp_path))
  assert {j.arm.name: (j.config.loss_opts.view_weighting, j.config.loss.fusion) for j in weighting} == {
    "mean_lambda2": ("mean", 2.0),
    "mean_fusion4": ("mean", 4.0),
    "sum": ("sum", 2.0),
  }


def test_first_round_studies_still_run_on_openclipart(tmp_path):
  """data=openclipart: the first round's studies (docs/results.md), on openclipart's train split, judged on
  its held-out test split."""
  from tipsito.studies import arms

  mod = _ablations()
  for name in set(mod.STUDIES) - {"smoke", "weighting", "mask", "dev_lr", "sd_diagnosis"}:
    for job in arms.plan(mod.get_config(f"study={name},data=openclipart"), [0], str(tmp_path)):
      c = job.config
      assert (c.data.name, c.data.split) == ("openclipart", "train"), (name, job.arm.name)
      assert {ev.dataset for ev in c.evals.values()} == {"openclipart"}
      assert {ev.split for ev in c.evals.values()} == {"test"}, (name, job.arm.name)
      _check_views(name, job)


def test_wrong_override_fails_before_anything_runs(tmp_path):
  from tipsito.studies import arms, runner

  study = _study()
  # The wrong key is in the last arm: the first arm must not have started either.
  study.arms = study.arms + (dict(name="typo", base="clip", overrides={"loss.clipp": 2.0}),)
  with pytest.raises(arms.StudyError, match=r"arm 'typo': override 'loss\.clipp'.*did you mean loss\.clip\?"):
    runner.run_sweep(study, seeds=[0, 1], workdir=str(tmp_path / "w"), plots=False)
  study.arms = study.arms[:-1] + (dict(name="bad_value", base="clip", overrides={"input.views": "three"}),)
  with pytest.raises(arms.StudyError, match=r"arm 'bad_value' \(seed 0\): config\.input\.views='three'"):
    runner.run_sweep(study, seeds=[0, 1], workdir=str(tmp_path / "w"), plots=False)
  assert not (tmp_path / "w").exists()


def test_plots_need_the_studies_extra(tmp_path, monkeypatch):
  """Without matplotlib the sweep stops before anything runs, naming the extra that installs it."""
  from tipsito.studies import runner

  monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
  with pytest.raises(ImportError, match=r'pip install -e "\.\[studies\]"'):
    runner.run_sweep(_study(), seeds=[0], workdir=str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_dependency_placeholder_resolves_per_seed(tmp_path):
  """'{workdir:ARM}' (the distillation teacher) is ARM's run directory of the same seed."""
  from tipsito.studies import arms

  study = _study()
  student = dict(name="student", base="clip", overrides={"init_from": "{workdir:augment_ito}"})
  study.arms = study.arms + (student,)
  jobs = arms.plan(study, [0, 1], str(tmp_path), only=["student"])
  assert [(j.arm.name, j.seed) for j in jobs] == [(FIRST, 0), (FIRST, 1), ("student", 0), ("student", 1)]
  assert [j.config.init_from for j in jobs[2:]] == [str(tmp_path / FIRST / f"seed_{s}") for s in (0, 1)]
  assert jobs[2].arm.depends_on == (FIRST,)
  study.arms = (study.arms[-1],) + study.arms[:-1]
  with pytest.raises(arms.StudyError, match=r"arm 'student' depends on 'augment_ito', which is a later arm"):
    arms.plan(study, [0], str(tmp_path))


def test_best_arm_of_an_error_is_the_lowest():
  """Bold marks the lowest mean of losses, patch cross-entropies, state sizes and errors (the depth probe's
  RMSE), the highest otherwise."""
  from tipsito.studies import results as results_lib  # pylint: disable=import-outside-toplevel

  def summary(metric, a, b):
    return {"arms": {"a": {"summary": {metric: {"mean": a}}}, "b": {"summary": {metric: {"mean": b}}}}}

  assert results_lib.best_arms(summary("linear_depth/rmse", 1.4, 1.5), "linear_depth/rmse") == {"a"}
  assert results_lib.best_arms(summary("ibot/ce_visible", 2.0, 1.0), "ibot/ce_visible") == {"b"}
  assert results_lib.best_arms(
    summary("linear_segmentation/miou", 40.0, 45.0), "linear_segmentation/miou"
  ) == {"b"}


def test_processor_is_read_from_cpuinfo(tmp_path, monkeypatch):
  """The processor record: the first `model name` and a digest of the sorted `flags` of /proc/cpuinfo, so
  two processors with different instruction sets (which XLA:CPU compiles for) read differently."""
  from tipsito.studies import provenance  # pylint: disable=import-outside-toplevel

  real_open = open

  def cpuinfo(text):
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    monkeypatch.setattr(
      "builtins.open", lambda p, *a, **k: real_open(f if p == "/proc/cpuinfo" else p, *a, **k)
    )
    return provenance.processor()

  a = cpuinfo(
    "processor : 0\nmodel name : CPU X\nflags : sse avx2 fma\n\nmodel name : CPU Y\nflags : avx512f\n"
  )
  assert a["model"] == "CPU X" and len(a["flags_sha256"]) == 12
  assert cpuinfo("model name : CPU X\nflags : fma avx2 sse\n") == a  # the flags' order does not matter
  assert cpuinfo("model name : CPU X\nflags : sse avx2 fma avx512f\n")["flags_sha256"] != a["flags_sha256"]


def test_dataset_fingerprint_reads_examples_not_bytes(tmp_path):
  """Two builds of the same examples whose feature maps were serialised in different orders (what two
  `scenes` builds are) have one fingerprint; another value, another order of the examples or another file
  name do not. Break check: hashing the files' bytes makes the first assertion fail."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel

  from tipsito.studies import provenance  # pylint: disable=import-outside-toplevel

  def one(key, value):
    f = tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))
    return tf.train.Example(features=tf.train.Features(feature={key: f})).SerializeToString()

  def build(name, records):
    d = tmp_path / name
    d.mkdir()
    w = ArrayRecordWriter(str(d / "toy-train.array_record-00000-of-00001"), "group_size:1")
    for r in records:
      w.write(r)
    w.close()
    return provenance.dataset_fingerprint(str(d))

  # Concatenated messages merge: the same Example {a: 1, b: 2}, its map written in two orders.
  ab, ba, ab3 = one("a", 1) + one("b", 2), one("b", 2) + one("a", 1), one("a", 1) + one("b", 3)
  assert ab != ba and tf.train.Example.FromString(ab) == tf.train.Example.FromString(ba)
  first = build("one", [ab, one("c", 5)])
  assert build("two", [ba, one("c", 5)]) == first
  assert build("three", [ab3, one("c", 5)]) != first
  assert build("four", [one("c", 5), ab]) != first
