"""The sweep: every (arm, seed) run of a study, resumable, with progress, results and plots.

Read top to bottom in `run_sweep`: plan and check every run (tipsito/studies/arms.py), say what is
finished, build the data once, run what is not finished, write results.json / results.md
(tipsito/studies/results.py) after every finished run and the plots (tipsito/studies/plots.py) at the end.

Resume: a run is finished when its `result.json` exists (written atomically after its final evals,
tipsito/studies/jobs.py); finished runs are never rerun. Any other run trains in its run directory
`W/<arm>/seed_<s>`, so the training loop resumes it from its latest checkpoint. Killing the sweep at any
moment and running the same command again therefore redoes at most the steps since each interrupted
run's last checkpoint.

Execution: `parallel=1` runs the jobs one after the other in this process (one import of JAX and
TensorFlow for the whole sweep; the training log goes to the console and to the run's `log.txt`).
`parallel=N` runs up to N jobs as subprocesses (`python -m tipsito.studies.job`), each logging to its
`log.txt`; they get SIGTERM when the sweep ends for any reason (even SIGKILL), and SIGTERM or Ctrl-C to
the sweep is passed on to them: each saves a checkpoint and stops, the sweep exits 75. A run whose
dependency (e.g. the distillation teacher of the same seed) is not finished waits for it, and is skipped
when that failed. In both modes the compiled programs are shared between runs through JAX's persistent
compilation cache in `W/jax_cache` (unless JAX_COMPILATION_CACHE_DIR is set).

With `parallel=1`, a SIGTERM that arrives while a run is in its final evals or export is taken by the
training loop's handler, which only acts between steps: that run finishes and the sweep goes on.
"""

from __future__ import annotations

import logging as py_logging
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable, Optional, Sequence

import tipsito
from tipsito import distributed
from tipsito.data import prepare as data_prepare
from tipsito.studies import arms as arms_lib
from tipsito.studies import jobs as job_lib
from tipsito.studies import plots as plots_lib
from tipsito.studies import provenance
from tipsito.studies import results as results_lib
from tipsito.train import checkpointing
from tipsito.train import workdir as workdir_lib

PREEMPTED_EXIT_CODE = 75  # = tipsito.train.checkpointing.PREEMPTED_EXIT_CODE (EX_TEMPFAIL): rerun to resume
PLOTS_DIR = "plots"


def _duration(seconds: float) -> str:
  s = int(round(max(0.0, seconds)))
  if s >= 3600:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _latest_step(run_dir: str) -> Optional[int]:
  return workdir_lib.latest_checkpoint_step(run_dir) if os.path.isdir(run_dir) else None


def _status(job: arms_lib.Job) -> str:
  if job_lib.is_finished(job.run_dir):
    return "finished"
  step = _latest_step(job.run_dir)
  return "new" if step is None else f"resumes at step {step}"


class Progress:
  """Console lines with the run counts and an ETA from the durations of finished runs."""

  def __init__(self, jobs: Sequence[arms_lib.Job], parallel: int, out: Callable[[str], None]):
    self.total = len(jobs)
    self.parallel = parallel
    self.out = out
    self.durations = [
      job_lib.read_json(os.path.join(j.run_dir, job_lib.RESULT_FILE))["seconds"]
      for j in jobs
      if job_lib.is_finished(j.run_dir)
    ]
    self.done = len(self.durations)
    self.running: dict[str, float] = {}  # run dir -> start time

  def eta(self) -> str:
    if not self.durations:
      return "ETA after the first run"
    mean = sum(self.durations) / len(self.durations)
    waiting = self.total - self.done - len(self.running)
    left = waiting * mean + sum(max(0.0, mean - (time.time() - t)) for t in self.running.values())
    return f"ETA {_duration(left / self.parallel)}"

  def started(self, job: arms_lib.Job) -> None:
    self.running[job.run_dir] = time.time()
    status = _status(job)
    self.out(f"[sweep] {job.label}: {'started' if status == 'new' else status.replace('resumes', 'resumed')}")

  def finished(self, job: arms_lib.Job, result: dict, metrics: Sequence[str]) -> None:
    self.running.pop(job.run_dir, None)
    self.done += 1
    self.durations.append(result["seconds"])
    shown = ", ".join(
      f"{m} {result['metrics'][m]:.4g}" for m in metrics if result["metrics"].get(m) is not None
    )
    self.out(
      f"[sweep] {job.label}: finished in {_duration(result['seconds'])} ({shown}) | "
      f"{self.done}/{self.total} runs done | {self.eta()}"
    )

  def failed(self, job: arms_lib.Job, why: str) -> None:
    self.running.pop(job.run_dir, None)
    self.out(f"[sweep] {job.label}: FAILED ({why}); log: {os.path.join(job.run_dir, job_lib.LOG_FILE)}")


def _deps_finished(job: arms_lib.Job, sweep_dir: str) -> bool:
  return all(job_lib.is_finished(arms_lib.run_dir(sweep_dir, d, job.seed)) for d in job.arm.depends_on)


def _dep_failed(job: arms_lib.Job, given_up: set) -> bool:
  return any((d, job.seed) in given_up for d in job.arm.depends_on)


def _run_in_process(todo, sweep_dir, progress, on_finished) -> bool:
  """One job after the other, in this process (tipsito.studies.jobs.run). Returns whether a signal
  stopped the sweep."""
  from absl import logging  # pylint: disable=import-outside-toplevel

  for job in todo:
    if not _deps_finished(job, sweep_dir):  # arms come after their dependencies: one that failed
      progress.out(f"[sweep] {job.label}: skipped (depends on {list(job.arm.depends_on)}, not finished)")
      continue
    progress.started(job)
    handler = py_logging.FileHandler(os.path.join(job.run_dir, job_lib.LOG_FILE))
    handler.setFormatter(py_logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.get_absl_logger().addHandler(handler)
    try:
      result = job_lib.run(job.run_dir)
    except checkpointing.Preempted as e:
      progress.out(f"[sweep] {job.label}: stopped by SIGTERM ({e}); run the same command to resume")
      return True
    except Exception as e:  # pylint: disable=broad-except  # one failed arm must not stop the others
      logging.error("%s", traceback.format_exc())
      progress.failed(job, f"{type(e).__name__}: {e}")
      continue
    finally:
      logging.get_absl_logger().removeHandler(handler)
      handler.close()
      signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the loop's handler belongs to the finished run
    progress.finished(job, result, on_finished(job, result))
  return False


def _job_env(sweep_dir: str) -> dict:
  """The children import the same tipsito as the sweep, and share its compilation cache."""
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.abspath(tipsito.__file__)))
  env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(sweep_dir, "jax_cache"))
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env[job_lib.SWEEP_PID_ENV] = str(os.getpid())  # the job stops when this process ends
  return env


def _run_subprocesses(todo, sweep_dir, parallel, progress, on_finished) -> bool:
  """Up to `parallel` jobs at a time as `python -m tipsito.studies.job` subprocesses. Returns whether a
  signal (to the sweep or to a job) stopped the sweep."""
  given_up = set()  # (arm, seed) of the runs that failed or were skipped
  pending, running = list(todo), {}  # running: Popen -> job
  stop = []  # signals received (or 75: a job was stopped); no new runs start once set

  def on_signal(signum, frame):
    del frame
    if not stop:
      progress.out(f"[sweep] signal {signum}: the running jobs checkpoint and stop; rerun to resume")
    stop.append(signum)
    for p in running:
      p.send_signal(signal.SIGTERM)

  old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
  env = _job_env(sweep_dir)
  try:
    while pending or running:
      while not stop and len(running) < parallel:
        ready = [j for j in pending if _deps_finished(j, sweep_dir)]
        for j in [j for j in pending if _dep_failed(j, given_up)]:
          pending.remove(j)
          given_up.add((j.arm.name, j.seed))
          progress.out(f"[sweep] {j.label}: skipped (a dependency in {list(j.arm.depends_on)} failed)")
        if not ready:
          break
        job = ready[0]
        pending.remove(job)
        progress.started(job)
        with open(os.path.join(job.run_dir, job_lib.LOG_FILE), "ab") as log:
          p = subprocess.Popen(
            [sys.executable, "-m", "tipsito.studies.job", "--run_dir", job.run_dir],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
          )
        running[p] = job
      if stop and not running:
        break
      if not running and pending:  # only jobs whose dependencies can never finish are left
        for j in pending:
          progress.out(f"[sweep] {j.label}: skipped (depends on {list(j.arm.depends_on)}, not finished)")
        break
      time.sleep(0.2)
      for p in [p for p in running if p.poll() is not None]:
        job = running.pop(p)
        if p.returncode == 0 and job_lib.is_finished(job.run_dir):
          result = job_lib.read_json(os.path.join(job.run_dir, job_lib.RESULT_FILE))
          progress.finished(job, result, on_finished(job, result))
        elif p.returncode == PREEMPTED_EXIT_CODE:
          progress.running.pop(job.run_dir, None)
          progress.out(
            f"[sweep] {job.label}: stopped after a checkpoint (exit 75); no new runs start, rerun to resume"
          )
          stop.append(PREEMPTED_EXIT_CODE)
        else:
          progress.failed(job, f"exit code {p.returncode}")
          given_up.add((job.arm.name, job.seed))
  finally:
    for s, h in old.items():
      signal.signal(s, h)
  return bool(stop)


def collect(
  study, seeds: Sequence[int], sweep_dir: str, command: str, environment: dict | None = None
) -> dict:
  """results.json's content from the finished runs of every arm of the study (for `seeds`);
  `environment`: provenance.environment of the sweep (packages, XLA flags, dataset fingerprints)."""
  arm_list = arms_lib.arms_of(study)
  configs = {a.name: arms_lib.arm_config(study, a, seeds[0], sweep_dir) for a in arm_list}
  runs = {}
  for a in arm_list:
    for s in seeds:
      d = arms_lib.run_dir(sweep_dir, a.name, s)
      if job_lib.is_finished(d):
        runs.setdefault(a.name, {})[int(s)] = job_lib.read_json(os.path.join(d, job_lib.RESULT_FILE))
  return results_lib.summarize(study, arm_list, configs, runs, seeds, command, environment)


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
  keys = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k), new.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
      keys += _changed_keys(a, b, f"{prefix}{k}.")
    elif a != b:
      keys.append(prefix + k)
  return keys


def run_sweep(
  study,
  *,
  seeds: Sequence[int],
  workdir: str,
  parallel: int = 1,
  only: Sequence[str] | None = None,
  dry_run: bool = False,
  plots: bool = True,
  command: str = "",
  out: Callable[[str], None] = print,
) -> int:
  """Runs (or, with `dry_run`, lists) the study's unfinished runs; returns the exit status: 0 when every
  run is finished, 1 when one failed or was skipped, 75 when stopped by a signal (rerun to resume).

  Raises StudyError (tipsito/studies/arms.py) before anything runs when an arm's config is wrong, and
  ImportError when `plots` and matplotlib is missing.
  """
  sweep_dir = os.path.abspath(workdir)
  if parallel < 1:
    raise ValueError(f"--parallel={parallel}: must be >= 1")
  jobs = arms_lib.plan(study, seeds, sweep_dir, only)  # every config checked before anything runs
  if plots and not dry_run:
    plots_lib.check_available()
  out(
    f"[sweep] study {study.study}: {len({j.arm.name for j in jobs})} arms x {len(seeds)} seeds = "
    f"{len(jobs)} runs in {sweep_dir}"
  )
  for job in jobs:
    overrides = ", ".join(f"{k}={v!r}" for k, v in job.arm.overrides.items()) or "base config"
    out(f"[sweep] {job.label}: {_status(job)} | {job.arm.base} ({job.config.recipe}): {overrides}")
  if dry_run:
    return 0

  todo = []
  for job in jobs:
    path = os.path.join(job.run_dir, job_lib.JOB_FILE)
    new = job_lib.config_to_json(job.config)
    if job_lib.is_finished(job.run_dir):
      changed = _changed_keys(job_lib.read_json(path)["config"], new) if os.path.isfile(path) else []
      if changed:
        out(
          f"[sweep] warning: {job.label} finished with a different config ({', '.join(changed[:5])}); "
          f"its result is kept: delete {job.run_dir} to rerun it"
        )
      continue
    job_lib.write_job(job.run_dir, study=study.study, arm=job.arm.name, seed=job.seed, config=job.config)
    todo.append(job)
  _build_datasets(todo)
  # Once per sweep, the data built: package versions, XLA flags and the built splits' fingerprints.
  environment = provenance.environment([j.config for j in jobs])

  def on_finished(job, result):
    results_lib.write(collect(study, seeds, sweep_dir, command, environment), sweep_dir)
    return list(study.get("metrics", ()))

  progress = Progress(jobs, parallel, out)
  t0 = time.time()
  if parallel == 1:
    _configure_in_process(sweep_dir)
    stopped = _run_in_process(todo, sweep_dir, progress, on_finished)
  else:
    stopped = _run_subprocesses(todo, sweep_dir, parallel, progress, on_finished)

  summary = collect(study, seeds, sweep_dir, command, environment)
  js, md = results_lib.write(summary, sweep_dir)
  written = [js, md]
  if plots:
    written += plots_lib.write_plots(summary, os.path.join(sweep_dir, PLOTS_DIR))
  unfinished = [j for j in jobs if not job_lib.is_finished(j.run_dir)]
  out(
    f"[sweep] {len(jobs) - len(unfinished)}/{len(jobs)} runs finished ({_duration(time.time() - t0)} "
    f"this time); wrote {', '.join(os.path.relpath(p, sweep_dir) for p in written)}"
  )
  if stopped:
    return PREEMPTED_EXIT_CODE
  if unfinished:
    out(f"[sweep] unfinished: {', '.join(j.label for j in unfinished)}; the same command reruns them")
    return 1
  return 0


def _p(p: float | None) -> str:
  return "–" if p is None else f"{p:.3g}"


def render_only(
  study, *, workdir: str, plots: bool = True, command: str = "", out: Callable[[str], None] = print
) -> int:
  """Rewrites `W/results.json`'s statistics and `W/results.md` (and, with `plots`, `W/plots/`) from the
  per-seed values stored in `W/results.json`, with `study`'s metrics and declared primary; runs nothing.

  Why: the statistics (paired intervals, Benjamini-Hochberg, the primary's verdict) are a function of the
  stored numbers, so a study that ran before they existed (Round II, docs/results/scenes/) is read with
  them by one command anyone can rerun. Raises StudyError when results.json is missing or the primary
  does not fit it (before anything is written)."""
  sweep_dir = os.path.abspath(workdir)
  path = os.path.join(sweep_dir, "results.json")
  if not os.path.isfile(path):
    raise arms_lib.StudyError(
      f"--render_only: no results.json in --workdir {sweep_dir}; run the sweep first (without --render_only)"
    )
  stored = job_lib.read_json(path)
  if stored.get("study") != study.study:
    raise arms_lib.StudyError(
      f"--render_only: {path} holds study {stored.get('study')!r}, the config is study {study.study!r}"
    )
  primary = arms_lib.check_primary(study, list(stored.get("arms", {})))
  if plots:
    plots_lib.check_available()
  summary = results_lib.rerender(stored, study, command)
  js, md = results_lib.write(summary, sweep_dir)
  written = [js, md] + (plots_lib.write_plots(summary, os.path.join(sweep_dir, PLOTS_DIR)) if plots else [])
  p = summary["primary"]
  c = p["comparison"]
  shown = (
    "absent"
    if not c["n"]
    else f"diff {c['mean_diff']:+.3g}, p {_p(c['p'])}, BH-adjusted p {_p(c.get('p_bh'))}"
  )
  out(
    f"[sweep] study {study.study}: statistics recomputed from {path}; primary {primary['metric']} "
    f"{primary['arm']} - {primary['vs']}: {shown}: {p['verdict']}; wrote "
    f"{', '.join(os.path.relpath(x, sweep_dir) for x in written)}"
  )
  return 0


def _configure_in_process(sweep_dir: str) -> None:
  """JAX settings of the training programs, and the compilation cache shared by the runs."""
  import jax  # pylint: disable=import-outside-toplevel

  distributed.configure_jax()
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.join(sweep_dir, "jax_cache"))


def _build_datasets(jobs: Sequence[arms_lib.Job]) -> None:
  """Built-in datasets (e.g. `shapes`) are built once, into the sweep's data folder, before any run."""
  done = set()
  for job in jobs:
    d = job.config.data
    if d.get("build_if_missing") and (d.name, d.data_dir) not in done:
      data_prepare.ensure_dataset(job.config)
      done.add((d.name, d.data_dir))
