"""The training loop: `train_and_evaluate(config, workdir)` (flax-examples style).

Why this shape: one loop for every recipe (recipes only change the loss), explicit periodic actions
(metric logging, progress/ETA, evals, checkpoints), automatic resume from the workdir, and an export at the
end. Everything device-related (mesh, shardings, donation) comes from `tipsito.train.step.build`.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from absl import logging
from clu import metric_writers

from tipsito.config import validation as config_validation
from tipsito import paths
from tipsito.models import layer_stack
from tipsito.train import checkpointing
from tipsito.train import nonfinite
from tipsito.train import observability
from tipsito.train import resume_guard
from tipsito.train import sharding as sharding_lib
from tipsito.train import step as step_lib

EXPORT_KEYS = ("image", "text", "image_proj")


def configure_jax() -> None:
  """Global JAX settings every run needs (partitionable threefry: same randomness on any mesh)."""
  jax.config.update("jax_threefry_partitionable", True)


def resolve_data_dirs(config: mlc.ConfigDict, workdir: str) -> mlc.ConfigDict:
  """`data.data_dir=None` with `data.build_if_missing` means `<workdir>/data` (demo: no setup at all);
  evals without their own data_dir then read the same folder. Returns a copy."""
  config = mlc.ConfigDict(config.to_dict())
  if config.data.get("build_if_missing") and not config.data.data_dir:
    config.data.data_dir = paths.join(workdir, "data")
    for ev in config.evals.values():
      if isinstance(ev, mlc.ConfigDict) and not ev.get("data_dir"):
        ev.data_dir = config.data.data_dir
  return config


def check_data_available(config: mlc.ConfigDict) -> None:
  """Fails before anything is written when the training dataset is not prepared, naming where it was
  looked for and the convert command that builds it (datasets built on first use are skipped)."""
  d = config.data
  if d.get("build_if_missing"):
    return
  from tipsito.data import sources  # pylint: disable=import-outside-toplevel
  data_dir = d.data_dir or sources.default_data_dir()
  try:
    sources.resolve_dataset_dir(d.name, data_dir)
  except (FileNotFoundError, ValueError) as e:
    raise FileNotFoundError(f"config.data.name={d.name!r}, config.data.data_dir={d.data_dir!r}: {e}. "
                            "Nothing was written.") from None


def ensure_dataset(config: mlc.ConfigDict) -> None:
  """Builds a built-in dataset (e.g. procedural `shapes`) into data.data_dir when it is missing."""
  d = config.data
  if not d.get("build_if_missing"):
    return
  from tipsito.data import convert  # pylint: disable=import-outside-toplevel
  kw = dict(d.get("build_options", {}) or {})
  if jax.process_index() == 0:
    convert.convert(d.name, d.data_dir, verbose=True, **kw)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices("dataset_built")


def temperature_of(params: dict) -> float:
  """T of logits = cos / T for the export: 1 / exp(logit_scale) (TIPS convention). A replicated scalar:
  readable on every process."""
  if "logit_scale" not in params:
    return 1.0
  return float(1.0 / np.exp(np.asarray(jax.device_get(params["logit_scale"]), np.float64)))


def export_params(params: dict) -> dict:
  """The inference subset of the student params as host numpy arrays, on every process.

  Encoders (+ image projection), no mask token: heads, fusion, distill projection, temperature/bias
  leaves, optimizer state and EMA never get here. Only this subset is gathered: FSDP shards living on
  other hosts' devices come over with `multihost_utils.process_allgather` (a collective: every process
  must call this), so evals and the export work on a pod as on one device.
  """
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  out = {k: params[k] for k in EXPORT_KEYS if k in params}
  out["image"] = {k: v for k, v in out["image"].items() if k != "mask_token"}
  out = jax.tree.map(np.asarray, multihost_utils.process_allgather(out, tiled=True))
  return layer_stack.to_per_layer(out)  # exports are per-layer (scanned towers unstacked)


def export_configs(setup: step_lib.Setup) -> tuple[dict, dict]:
  """(image_config, text_config) of the exported encoders, as plain JSON-friendly dicts."""
  img = dict(setup.model.image_cfg)
  img["use_mask_token"] = False
  img["remat"] = False
  txt = dict(setup.model.text_cfg)
  txt["remat"] = False
  for d in (img, txt):
    if "scan" in d:
      d["scan"] = False  # export_params unstacks scanned towers
  for d in (img, txt):
    for k in ("dtype", "param_dtype"):
      if k in d:
        d[k] = "float32"
  return img, txt


def tokenizer_path(config) -> str:
  """The SentencePiece file to ship with the export (the demo model when config.tokenizer is None)."""
  if config.tokenizer:
    return os.path.expanduser(config.tokenizer)
  from tipsito.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
  return tok_lib.DEFAULT_TOKENIZER


def write_export(setup: step_lib.Setup, params: dict, output: str, *, step: int) -> str:
  """Exports the encoders of `params` with tipsito.checkpoint.write_export.

  Call on every process: the params are gathered collectively, process 0 writes the export once, and
  the others wait for it (so `tipsito.load(output)` works on any host when this returns).
  """
  from tipsito import checkpoint  # pylint: disable=import-outside-toplevel
  img, txt = export_configs(setup)
  p = export_params(params)
  temperature = temperature_of(params)
  if jax.process_index() == 0:
    output = checkpoint.write_export(
        output, image_config=img, text_config=txt, params=p, temperature=temperature,
        tokenizer_path=tokenizer_path(setup.config), image_proj="image_proj" in p,
        extra={"source": "tipsito-train", "recipe": setup.config.recipe, "step": int(step)})
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices("export_written")
  return output


def make_encoder(setup: step_lib.Setup, params: dict):
  """In-memory inference Encoder of the current params (training-time evals)."""
  from tipsito import inference  # pylint: disable=import-outside-toplevel
  from tipsito.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
  img, txt = export_configs(setup)
  tok = tok_lib.Tokenizer(setup.config.tokenizer, max_len=int(setup.config.max_len))
  return inference.Encoder.from_params(img, txt, export_params(params), temperature_of(params), tok)


def save_config(config: mlc.ConfigDict, workdir: str, history: list | None = None) -> None:
  """Writes `<workdir>/config.json` (export_from_workdir, evaluate and humans read it), with the history
  of accepted resume changes under `resume_guard.HISTORY_KEY`."""
  if jax.process_index() == 0:
    d = paths.as_path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    out = json.loads(config.to_json_best_effort())
    if history:
      out[resume_guard.HISTORY_KEY] = history
    (d / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True))


def read_config_json(workdir: str) -> tuple[Optional[dict], list]:
  """(saved training config as a dict, accepted-change history) of a workdir; (None, []) if none."""
  f = paths.as_path(workdir) / "config.json"
  if not f.is_file():
    return None, []
  saved = json.loads(f.read_text())
  return saved, list(saved.pop(resume_guard.HISTORY_KEY, []) or [])


def load_config(workdir: str) -> mlc.ConfigDict:
  """Reads back `<workdir>/config.json` (tuples come back as lists; the code accepts both)."""
  saved, _ = read_config_json(workdir)
  w = paths.resolve(workdir)
  if saved is None:
    raise FileNotFoundError(f"{w} is not a training workdir (no config.json): pass the --workdir of a "
                            "training run (it holds config.json and checkpoints/)")
  if "format_version" in saved:
    raise ValueError(f"{w} is an export, not a training workdir: it is already exported. Load it with "
                     f"tipsito.load({w!r}) or evaluate it with `python -m tipsito.evaluate --checkpoint {w}`; "
                     "`export --workdir` needs a training workdir (config.json + checkpoints/)")
  return mlc.ConfigDict(saved)


def latest_checkpoint_step(workdir: str) -> Optional[int]:
  """Highest step folder under `<workdir>/checkpoints` (None when there is none: nothing to resume)."""
  d = paths.as_path(workdir) / "checkpoints"
  steps = [int(p.name) for p in d.iterdir() if p.name.isdigit()] if d.is_dir() else []
  return max(steps) if steps else None


def guard_resume(config: mlc.ConfigDict, workdir: str) -> list:
  """Refuses a resume whose config changes unsafe keys (resume_guard); returns config.json's history
  with the accepted changes of this resume appended. Runs before anything is written."""
  saved, history = read_config_json(workdir)
  step = latest_checkpoint_step(workdir)
  if saved is None or step is None:
    return history
  changes = resume_guard.check(saved, config, workdir)
  if changes:
    for k, (old, new) in changes.items():
      logging.warning("Resume: config.%s changed %r -> %r (allowed: does not affect the checkpoint)",
                      k, old, new)
    history = history + [resume_guard.history_entry(changes, step)]
  return history


def restore_or_init(setup: step_lib.Setup, ckpt: checkpointing.Checkpointer, data_iter) -> Any:
  """Latest checkpoint of the workdir if any (state + data iterator), else config.init_from, else init."""
  abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
  if ckpt.latest_step() is not None:
    state, data_state = ckpt.restore(abstract)
    if data_state is not None and data_iter is not None:
      data_iter.set_state(data_state)
    logging.info("Resumed from %s at step %d", ckpt.directory, int(state.step))
    return state
  state = setup.init_state()
  if setup.config.init_from:
    params = checkpointing.restore_params(setup.config.init_from, abstract.params)
    state = state.replace(params=params, ema={k: params[k] for k in state.ema},
                          opt_state=jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(params))
    logging.info("Initialised params from %s", setup.config.init_from)
  return state


def _scalars(metrics: dict) -> dict:
  return {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}


def train_and_evaluate(config: mlc.ConfigDict, workdir: str, *, data_iter=None,
                       max_steps: Optional[int] = None) -> dict:
  """Trains `config` in `workdir` (resuming if it has checkpoints); returns the last logged metrics.

  Args:
    config: experiment config (validated here, before anything compiles).
    workdir: output folder: config.json, checkpoints/, TensorBoard events, export/, pictures/.
    data_iter: optional host-batch iterator with get_state/set_state (tests); default: the grain
      pipeline of `config.data` / `config.input`.
    max_steps: stop after this step even if total_steps is larger (the schedule still uses
      total_steps) — used to simulate a preemption in tests.
  """
  configure_jax()
  workdir = paths.resolve(workdir)
  config_validation.validate(config, num_devices=jax.device_count(), process_count=jax.process_count())
  config = resolve_data_dirs(config, workdir)
  # Checks that must fail before anything is written to the workdir.
  if data_iter is None:
    check_data_available(config)
  history = guard_resume(config, workdir)
  save_config(config, workdir, history)
  observability.quiet_library_logs()
  writer = observability.create_writer(workdir)
  writer.write_hparams({"recipe": config.recipe, "batch_size": int(config.input.batch_size),
                        "total_steps": int(config.total_steps)})

  owns_iter = data_iter is None
  if owns_iter:
    ensure_dataset(config)
    from tipsito.data import pipeline  # pylint: disable=import-outside-toplevel
    data_iter = pipeline.make_train_iterator(config, process_index=jax.process_index(),
                                             process_count=jax.process_count())

  setup = step_lib.build(config)
  logging.info("Recipe %s: %s", setup.recipe.name, setup.recipe.doc)
  logging.info("Mesh %s; loss weights %s; EMA %s", dict(setup.mesh.shape), setup.ctx.weights,
               setup.ctx.ema_keys)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"),
                                    every_steps=int(config.ckpt.every_steps), keep=int(config.ckpt.keep),
                                    async_save=bool(config.ckpt.async_save))
  ckpt.install_sigterm_handler()
  t_init = time.time()
  state = restore_or_init(setup, ckpt, data_iter)
  logging.info("Train state ready at step %d in %.1fs", int(jax.device_get(state.step)), time.time() - t_init)
  observability.log_parameter_summary(setup.state_shapes.params)
  train_step = step_lib.jit_train_step(setup)
  frozen = setup.frozen()
  monitor = nonfinite.NonFiniteMonitor(int(config.nonfinite.max_consecutive))
  params_finite = jax.jit(step_lib.all_finite)

  evaluators = {}
  if len(config.evals):
    from tipsito import evals  # pylint: disable=import-outside-toplevel
    evaluators = evals.make_evaluators(config)

  total = int(config.total_steps)
  last = total if max_steps is None else min(total, int(max_steps))
  start = int(jax.device_get(state.step))
  perf = observability.StepMonitor(config, writer=writer, workdir=workdir, start_step=start)
  log_every = int(config.log_every_steps)
  metrics_acc: list[dict] = []
  last_metrics: dict = {}
  preempted = False
  t0 = time.time()
  step = start
  with metric_writers.ensure_flushes(writer):
    while step < last:
      with perf.data_wait():
        batch = sharding_lib.global_batch(
            {k: v for k, v in next(data_iter).items() if not k.startswith("_")}, setup.mesh)
      if step == start:
        t_first = time.time()
      state, metrics = train_step(state, batch, frozen)
      step += 1
      monitor.push(step, metrics)
      if step == start + 1:
        jax.block_until_ready(metrics)
        logging.info("First step (incl. compilation) took %.1fs", time.time() - t_first)
        perf.first_step(train_step, (state, batch, frozen), step)
      metrics_acc.append(metrics)
      perf.after_step(step, metrics)
      if step % log_every == 0 or step == last:
        summed = jax.device_get(metrics_acc)
        last_metrics = {k: float(np.mean([m[k] for m in summed])) for k in summed[-1]}
        last_metrics[nonfinite.TOTAL] = float(monitor.total)
        stats = getattr(data_iter, "stats", None)
        if isinstance(stats, dict):
          last_metrics.update({f"data/{k}": float(v) for k, v in stats.items()
                               if isinstance(v, (int, float, np.number))})
        perf.write(step, last_metrics)
        metrics_acc = []
      if evaluators and step < last:
        _run_evals(setup, state, evaluators, step, writer, workdir, is_last=False)
      preempted = ckpt.reached_preemption(step)  # the same step on every process
      if ckpt.should_save(step) or step == last or preempted:
        monitor.flush()
        if not bool(params_finite(state.params)):
          raise nonfinite.NonFiniteError(f"Step {step}: the params are not finite; refusing to write a "
                                         "checkpoint from them (the latest checkpoint is kept)")
        ckpt.save(step, state, data_iter.get_state(), force=True)
      if preempted:
        logging.warning("Stopping at step %d after SIGTERM (checkpoint saved).", step)
        break
    monitor.flush()
    perf.close()
    ckpt.wait()
    if owns_iter and hasattr(data_iter, "close"):
      data_iter.close()  # stops grain worker processes before the final evals need the CPU
    if step >= total and not preempted:
      if evaluators:
        last_metrics.update(_run_evals(setup, state, evaluators, step, writer, workdir, is_last=True))
      if config.export.enabled:
        out = config.export.dir or os.path.join(workdir, "export")
        write_export(setup, state.params, out, step=step)
        logging.info("Exported encoders to %s", out)
  ckpt.close()
  logging.info("Done: steps %d -> %d in %.1fs", start, step, time.time() - t0)
  if preempted:
    raise checkpointing.Preempted(step)
  return last_metrics


def _run_evals(setup, state, evaluators, step, writer, workdir, *, is_last):
  """Periodic / final evaluation hook on an in-memory Encoder of the current student encoders."""
  from tipsito import evals  # pylint: disable=import-outside-toplevel
  due = [e for e in evaluators.values() if e.should_run(step, is_last=is_last)]
  if not due:
    return {}
  enc = make_encoder(setup, state.params)  # on every process: evals shard their batches over processes
  return evals.run_evaluators(due, enc, step=step, writer=writer,
                              picture_dir=os.path.join(workdir, "pictures"), log=logging.info)


def export_from_workdir(workdir: str, output: str) -> str:
  """Exports the latest checkpoint of a training workdir (encoders + tokenizer + config only)."""
  configure_jax()
  config = load_config(workdir)
  setup = step_lib.build(config)
  state = checkpointing.restore_latest_state(workdir, setup.state_shapes, setup.state_shardings,
                                             what=f"--workdir {workdir}")
  return write_export(setup, state.params, output, step=int(state.step))
