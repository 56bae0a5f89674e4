"""The training loop: `train_and_evaluate(config, workdir)` (flax-examples style).

Why this shape: one loop for every recipe (recipes only change the loss), explicit periodic actions
(metric logging, progress/ETA, evals, checkpoints), automatic resume from the workdir, and an export at the
end. It reads top to bottom in `train_and_evaluate`: check and lock the workdir (one run per workdir:
tipsito/train/run_lock.py; a second launch stops there), build and restore (nothing is
written before the state is ready: an unreadable latest checkpoint is moved aside only once an older one
restored), write config.json, the steps, finish. Everything device-related (mesh, shardings, donation)
comes from `tipsito.train.step.build` (through tipsito/train/assembly.py, which loads a frozen teacher and
`config.init_from`); the workdir's config.json is tipsito/train/workdir.py, the data checks
tipsito/data/prepare.py, the export tipsito/train/exporting.py.

Failure paths: whatever stops the run, `_Resources` closes the TensorBoard writer, the data iterator
(grain worker processes and their shared memory) and the checkpoint manager (pending saves, Orbax's
threads and event loop) once, in that order, so the interpreter's shutdown has nothing left to tear
down; the error then ends with a note saying which checkpoint the same command resumes from. In a
multi-process run an error first waits for tipsito/distributed/peer_loss.py's verdict (a failed collective is how
a lost peer shows): a lost peer ends the process there with exit status 76 and one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any, Optional

import jax
import ml_collections as mlc
import numpy as np
from absl import logging
from clu import metric_writers

from tipsito import distributed
from tipsito.evals import config_checks as eval_checks
from tipsito.evals import registry as eval_registry
from tipsito.evals import runner as eval_runner
from tipsito.distributed import peer_loss
from tipsito.config import validation as config_validation
from tipsito import paths
from tipsito.data import pipeline
from tipsito.data import prepare as data_prepare
from tipsito.train import assembly
from tipsito.train import checkpointing
from tipsito.train import exporting
from tipsito.train import nonfinite
from tipsito.train import observability
from tipsito.train import resume_guard
from tipsito.train import run_lock
from tipsito.train import sharding as sharding_lib
from tipsito.train import step as step_lib
from tipsito.train import workdir as workdir_lib


@contextlib.contextmanager
def _storage_errors_named(operation: str, path: str):
  """An object-store outage inside (an error its client raised after its own retries) becomes one
  `paths.StorageUnavailable` naming `operation` and `path` (docs/training.md, "Object-store faults");
  every other error passes unchanged."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  # re-raised unless it is an outage
    if paths.is_url(path) and paths.is_storage_outage(e):
      raise paths.StorageUnavailable(operation, path, e) from None
    raise


def guard_resume(config: mlc.ConfigDict, workdir: str) -> list:
  """Refuses a resume whose config changes unsafe keys (resume_guard); returns config.json's history
  with the accepted changes of this resume appended. Runs before anything is written."""
  with _storage_errors_named(
    "reading the saved config (resume guard)", paths.join(workdir, workdir_lib.CONFIG_FILE)
  ):
    saved, history = workdir_lib.read_config_json(workdir)
  with _storage_errors_named("listing the checkpoints", paths.join(workdir, "checkpoints")):
    step = workdir_lib.latest_checkpoint_step(workdir)
  if saved is None or step is None:
    return history
  changes = resume_guard.check(saved, config, workdir)
  if changes:
    for k, (old, new) in changes.items():
      logging.warning(
        "Resume: config.%s changed %r -> %r (allowed: %s)",
        k,
        old,
        new,
        resume_guard.SAFE_NOTES.get(k, "does not affect the checkpoint"),
      )
    history = history + [resume_guard.history_entry(changes, step)]
  return history


def restore_or_init(setup: step_lib.Setup, ckpt: checkpointing.Checkpointer) -> tuple[Any, Any]:
  """(state, this process's data-iterator state or None): the latest readable checkpoint of the workdir
  if any, else config.init_from (params, and with `init_teacher='continue'` its teacher:
  tipsito/train/assembly.py `init_from`; a Tipsv2Model folder gives the towers), else init. Writes
  nothing (unreadable steps are only recorded, in `ckpt.unreadable`)."""
  abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
  if ckpt.latest_step() is not None:
    state, data_state = ckpt.restore(abstract, warn_skipped=False)  # quarantine_unreadable warns once
    logging.info("Resumed from %s at step %d", ckpt.directory, int(state.step))
    return state, data_state
  state = setup.init_state()
  if setup.config.init_from:
    state = assembly.init_from(setup, state)
  return state, None


class _Resources:
  """What a run opens and must close exactly once, in order, however it ends: the TensorBoard writer,
  the data iterator the loop opened (not one passed in), the checkpoint manager. Thread-safe: the
  peer-loss exit (another thread) closes the data iterator too."""

  def __init__(self, ckpt: checkpointing.Checkpointer):
    self.ckpt = ckpt
    self.writer = None
    self.data_iter = None
    self._lock = threading.Lock()
    self._closed: set = set()

  def _once(self, name: str, fn) -> None:
    with self._lock:
      if name in self._closed:
        return
      self._closed.add(name)
    if fn is not None:
      fn()

  def close_data(self) -> None:
    """Stops the loop's data iterator (grain worker processes, shared memory); idempotent."""
    self._once("data", getattr(self.data_iter, "close", None))

  def close(self) -> None:
    """Writer, data iterator, checkpoint manager: each once, each even if an earlier one fails."""
    try:
      self._once("writer", getattr(self.writer, "close", None))
    finally:
      try:
        self.close_data()
      finally:
        self._once("ckpt", self.ckpt.close)


def _resume_hint(workdir: str) -> str:
  """What the same command does next, from the committed checkpoints on disk now."""
  step = workdir_lib.latest_checkpoint_step(workdir)
  where = os.path.join(workdir, "checkpoints")
  if step is None:
    return f"run the same command again to start over (no checkpoint was committed in {where})"
  hosts = " on every host" if jax.process_count() > 1 else ""
  return f"run the same command again{hosts} to resume from step {step} ({os.path.join(where, str(step))})"


def _failed(e: BaseException, res: _Resources, workdir: str) -> None:
  """A fatal error: a lost peer ends the process here (exit 76); otherwise close everything once, in
  order, and end the error with what to do."""
  if jax.process_count() > 1 and isinstance(e, Exception):
    lost = peer_loss.wait_for_verdict()
    if lost:  # a peer disappeared: the data iterator closed, not the checkpoint manager (its barriers
      # would wait for the dead peer), one line, exit 76
      try:
        res.close_data()
      finally:
        peer_loss.exit_peer_lost(lost)
  try:
    res.close()
  except Exception as close_error:  # pylint: disable=broad-except  # the first error is the one to see
    logging.error("While stopping after %s: closing failed too: %r", type(e).__name__, close_error)
  if isinstance(e, checkpointing.NoReadableCheckpoint):
    return  # its message lists the steps and what to do
  try:
    e.add_note(f"tipsito: the run stopped; fix the cause above, then {_resume_hint(workdir)}.")
  except Exception:  # pylint: disable=broad-except
    pass


@dataclasses.dataclass
class _Run:
  """What the steps and the finish need, built once by `_build_run`."""

  config: mlc.ConfigDict
  workdir: str
  writer: Any
  setup: step_lib.Setup
  ckpt: checkpointing.Checkpointer
  train_step: Any
  frozen: dict
  evaluators: dict
  monitor: nonfinite.NonFiniteMonitor
  params_finite: Any
  lock: Optional[run_lock.RunLock] = None  # process 0's workdir lock (None elsewhere)


def _check_workdir(
  config: mlc.ConfigDict, workdir: str, *, check_data: bool
) -> tuple[mlc.ConfigDict, list, Optional[run_lock.RunLock]]:
  """Validates, resolves data folders, takes the workdir lock and runs every check that must fail before
  anything is written (dataset present, the tokenizer fits the text tower, the evals' splits and fields,
  no other run on the workdir, resume compatible). Returns
  (resolved config, config.json history to write, the lock: process 0's, None elsewhere)."""
  config_validation.validate(config, num_devices=jax.device_count(), process_count=jax.process_count())
  if config.init_from and workdir_lib.latest_checkpoint_step(workdir) is None:  # read only when used
    assembly.check_init_from(config)
  config = data_prepare.resolve_data_dirs(config, workdir)
  if check_data:
    data_prepare.check_data_available(config)
  data_prepare.check_tokenizer(config)
  eval_checks.check_evals_on_disk(config)
  lock = _lock_workdir(workdir)
  try:
    history = guard_resume(config, workdir)
  except BaseException:
    if lock is not None:
      lock.release()
    raise
  return config, history, lock


def _lock_workdir(workdir: str) -> Optional[run_lock.RunLock]:
  """Process 0 takes the workdir lock (tipsito/train/run_lock.py); every process learns the outcome, so
  a workdir in use stops the whole pod before anything is written, and the lock never stops the other
  hosts of a run that holds it."""
  lock, failure = None, None
  if jax.process_index() == 0:
    try:
      lock = run_lock.RunLock(workdir).acquire()
    except BaseException as e:  # pylint: disable=broad-except  # raised below, after the others know
      failure = e
  code = 0 if failure is None else 1 if isinstance(failure, run_lock.WorkdirBusy) else 2
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    code = int(multihost_utils.broadcast_one_to_all(np.asarray(code, np.int32)))
  if failure is not None:
    raise failure
  if code == 1:
    raise run_lock.WorkdirBusy(
      f"tipsito: the workdir {workdir} is in use by another training run (process 0's log names the "
      "holder). Nothing was written."
    )
  if code == 2:
    raise RuntimeError(f"process 0 could not take the workdir lock of {workdir} (see its log)")
  return lock


def _open_writer(config: mlc.ConfigDict, workdir: str):
  """The TensorBoard writer of the run, with its hyperparameters."""
  writer = observability.create_writer(workdir)
  writer.write_hparams(
    {
      "recipe": config.recipe,
      "batch_size": int(config.input.batch_size),
      "total_steps": int(config.total_steps),
    }
  )
  return writer


def _open_data(config: mlc.ConfigDict):
  """The grain pipeline of `config.data` / `config.input` for this process (built-in data built first)."""
  data_prepare.ensure_dataset(config)
  return pipeline.make_train_iterator(
    config, process_index=jax.process_index(), process_count=jax.process_count()
  )


def _open_checkpointer(config: mlc.ConfigDict, workdir: str) -> checkpointing.Checkpointer:
  """The run's checkpointer, with its SIGTERM handler armed."""
  ckpt = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    every_steps=int(config.ckpt.every_steps),
    keep=int(config.ckpt.keep),
    async_save=bool(config.ckpt.async_save),
  )
  ckpt.install_sigterm_handler()
  return ckpt


def _build_run(
  config: mlc.ConfigDict, workdir: str, writer, setup: step_lib.Setup, ckpt: checkpointing.Checkpointer
) -> _Run:
  """The jitted step, the evaluators and the guards around a restored state."""
  observability.log_parameter_summary(setup.state_shapes.params)
  evaluators = {}
  if len(config.evals):
    evaluators = eval_registry.make_evaluators(config)
  return _Run(
    config=config,
    workdir=workdir,
    writer=writer,
    setup=setup,
    ckpt=ckpt,
    train_step=step_lib.jit_train_step(setup),
    frozen=setup.frozen(),
    evaluators=evaluators,
    monitor=nonfinite.NonFiniteMonitor(int(config.nonfinite.max_consecutive)),
    params_finite=jax.jit(step_lib.all_finite),
  )


def train_and_evaluate(
  config: mlc.ConfigDict, workdir: str, *, data_iter=None, max_steps: Optional[int] = None
) -> dict:
  """Trains `config` in `workdir` (resuming if it has checkpoints); returns the last logged metrics.

  Args:
    config: experiment config (validated here, before anything compiles).
    workdir: output folder: config.json, checkpoints/, TensorBoard events, export/, pictures/.
    data_iter: optional host-batch iterator with get_state/set_state (tests); default: the grain
      pipeline of `config.data` / `config.input`.
    max_steps: stop after this step even if total_steps is larger (the schedule still uses
      total_steps) — used to simulate a preemption in tests.
  """
  distributed.configure_jax()
  # Before anything opens a checkpoint: Orbax logs INFO lines when its CheckpointManager is created.
  observability.quiet_library_logs()
  workdir = paths.resolve(workdir)
  owns_iter = data_iter is None
  config, history, lock = _check_workdir(config, workdir, check_data=owns_iter)
  try:
    return _train_locked(config, workdir, history, lock, data_iter=data_iter, max_steps=max_steps)
  finally:
    if lock is not None:
      lock.release()


def _train_locked(
  config: mlc.ConfigDict,
  workdir: str,
  history: list,
  lock: Optional[run_lock.RunLock],
  *,
  data_iter,
  max_steps: Optional[int],
) -> dict:
  """`train_and_evaluate` once the workdir is checked and locked: build, restore, train, finish."""
  owns_iter = data_iter is None
  setup = assembly.build(config)
  logging.info("Recipe %s: %s", setup.recipe.name, setup.recipe.doc)
  logging.info(
    "Mesh %s; loss weights %s; EMA %s", dict(setup.mesh.shape), setup.ctx.weights, setup.ctx.ema_keys
  )
  res = _Resources(_open_checkpointer(config, workdir))
  peer_loss.add_cleanup(res.close_data)
  peer_loss.set_resume_hint(lambda: _resume_hint(workdir))
  try:
    t_init = time.time()
    state, data_state = restore_or_init(setup, res.ckpt)  # nothing written yet
    res.ckpt.quarantine_unreadable()  # unreadable newer steps moved aside, on every process
    logging.info(
      "Train state ready at step %d in %.1fs", int(jax.device_get(state.step)), time.time() - t_init
    )
    with _storage_errors_named("writing the run's config", paths.join(workdir, workdir_lib.CONFIG_FILE)):
      workdir_lib.save_config(config, workdir, history)
    res.writer = writer = _open_writer(config, workdir)
    if owns_iter:
      res.data_iter = data_iter = _open_data(config)
    if data_state is not None:
      data_iter.set_state(data_state)
    run = _build_run(config, workdir, writer, setup, res.ckpt)
    run.lock = lock

    total = int(config.total_steps)
    last = total if max_steps is None else min(total, int(max_steps))
    start = int(jax.device_get(state.step))
    t0 = time.time()
    with metric_writers.ensure_flushes(writer):
      state, step, last_metrics, preempted = _train_steps(run, state, data_iter, start=start, last=last)
      run.ckpt.wait()
      res.close_data()  # stops grain worker processes before the final evals need the CPU
      if step >= total and not preempted:
        last_metrics.update(_finish(run, state, step))
    res.close()
  except (Exception, KeyboardInterrupt) as e:
    _failed(e, res, workdir)
    raise
  finally:
    res.close()
    peer_loss.remove_cleanup(res.close_data)
    peer_loss.set_resume_hint(None)
  logging.info("Done: steps %d -> %d in %.1fs", start, step, time.time() - t0)
  if preempted:
    raise checkpointing.Preempted(step)
  return last_metrics


def _train_steps(run: _Run, state, data_iter, *, start: int, last: int) -> tuple[Any, int, dict, bool]:
  """Steps `start` -> `last`: one jitted step each, then the periodic actions (log, evals, checkpoint).
  Stops early, after saving, when SIGTERM reached any process. Returns (state, step, last logged
  metrics, preempted)."""
  perf = observability.StepMonitor(run.config, writer=run.writer, workdir=run.workdir, start_step=start)
  log_every = int(run.config.log_every_steps)
  metrics_acc: list[dict] = []
  last_metrics: dict = {}
  preempted = False
  step = start
  while step < last:
    with perf.data_wait():
      batch = sharding_lib.global_batch(_host_batch(next(data_iter)), run.setup.mesh)
    if step == start:
      t_first = time.time()
    state, metrics = run.train_step(state, batch, run.frozen)
    step += 1
    run.monitor.push(step, metrics)
    if step == start + 1:
      jax.block_until_ready(metrics)
      logging.info("First step (incl. compilation) took %.1fs", time.time() - t_first)
      perf.first_step(run.train_step, (state, batch, run.frozen), step)
    metrics_acc.append(metrics)
    perf.after_step(step, metrics)
    if step % log_every == 0 or step == last:
      last_metrics = _mean_metrics(metrics_acc, run.monitor, data_iter)
      perf.write(step, last_metrics)
      metrics_acc = []
    if run.evaluators and step < last:
      _run_evals(run, state, step, is_last=False)
    preempted = run.ckpt.reached_preemption(step)  # the same step on every process
    if run.ckpt.should_save(step) or step == last or preempted:
      _save(run, state, step, data_iter)
    if preempted:
      logging.warning("Stopping at step %d after SIGTERM (checkpoint saved).", step)
      break
  run.monitor.flush()
  perf.close()
  return state, step, last_metrics, preempted


def _host_batch(raw: dict) -> dict:
  """The batch fields the step takes, each in memory of its own: arrays that view another buffer (grain's
  shared-memory blocks) are copied. Why: a device transfer can hold its source array until it runs, and
  one queued behind a collective that never completes (a lost peer) would keep the block from being
  unlinked when the process ends (measured: the resource tracker's "leaked shared_memory" warning after
  a lost-peer exit without the copy)."""
  return {
    k: (np.array(v) if isinstance(v, np.ndarray) and not v.flags.owndata else v)
    for k, v in raw.items()
    if not k.startswith("_")
  }


def _mean_metrics(metrics_acc: list[dict], monitor: nonfinite.NonFiniteMonitor, data_iter) -> dict:
  """Means of the step metrics since the last log, the non-finite count and the data iterator's stats."""
  summed = jax.device_get(metrics_acc)
  out = {k: float(np.mean([m[k] for m in summed])) for k in summed[-1]}
  out[nonfinite.TOTAL] = float(monitor.total)
  stats = getattr(data_iter, "stats", None)
  if isinstance(stats, dict):
    out.update({f"data/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float, np.number))})
  return out


def _save(run: _Run, state, step: int, data_iter) -> None:
  """Checkpoints the state and the data iterator; never from non-finite params."""
  run.monitor.flush()
  if run.lock is not None:
    run.lock.check()  # another launch took the workdir over: write nothing more into it
  if not bool(run.params_finite(state.params)):
    raise nonfinite.NonFiniteError(
      f"Step {step}: the params are not finite; refusing to write a "
      "checkpoint from them (the latest checkpoint is kept)"
    )
  run.ckpt.save(step, state, data_iter.get_state(), force=True)


def _finish(run: _Run, state, step: int) -> dict:
  """At total_steps: the final evals (their metrics are returned) and the export."""
  metrics = {}
  if run.evaluators:
    metrics = _run_evals(run, state, step, is_last=True)
  if run.config.export.enabled:
    out = run.config.export.dir or os.path.join(run.workdir, "export")
    exporting.write_training_export(run.setup, state.params, out, step=step)
    logging.info("Exported encoders to %s", out)
  return metrics


def _run_evals(run: _Run, state, step: int, *, is_last: bool) -> dict:
  """Periodic / final evaluation hook on an in-memory Encoder of the current student encoders."""
  due = [e for e in run.evaluators.values() if e.should_run(step, is_last=is_last)]
  if not due:
    return {}
  enc = exporting.training_encoder(run.setup, state.params)  # every process: evals shard over processes
  return eval_runner.run_evaluators(
    due,
    enc,
    step=step,
    writer=run.writer,
    picture_dir=os.path.join(run.workdir, "pictures"),
    log=logging.info,
  )
