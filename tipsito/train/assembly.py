"""Assembling a run from what is on disk: a config's Setup with its frozen teacher loaded, a training
workdir's latest (or chosen) state, and the start of a new run from another one (`config.init_from`).

Why one module above tipsito/train/step.py: `step.build` is a pure builder (config, mesh, optional
teacher -> Setup; it reads no disk), so every read of a run from disk that a Setup depends on is here, and
the assembly flows one way: the loop and `evaluate` call this module (`export --workdir` reads only the
encoders' part of a checkpoint, tipsito/train/exporting.py `read_workdir`, and needs no Setup); it
calls the teacher loader (tipsito/train/teacher.py), the builder and the checkpoint reader
(tipsito/train/checkpointing.py); none of them calls back. Every read here is read-only: the workdir read
may belong to another run, or to one still training (an unreadable latest step is skipped with a warning,
never moved).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import Mesh

from tipsito import distributed
from tipsito import paths
from tipsito.config import init_source as init_source_lib
from tipsito.config import recipes as recipes_lib
from tipsito.config import validation as config_validation
from tipsito.interop import sources
from tipsito.models import kwargs as kwargs_lib
from tipsito.models import layer_stack
from tipsito.train import checkpointing
from tipsito.train import sharding as sharding_lib
from tipsito.train import step as step_lib
from tipsito.train import teacher as teacher_lib
from tipsito.train import workdir as workdir_lib


def build(config, mesh: Optional[Mesh] = None, *, vocab_size: Optional[int] = None) -> step_lib.Setup:
  """`step.build` of `config`, with its frozen distillation teacher loaded from `config.distill` when the
  recipe has one (tipsito/train/teacher.py `load_teacher`)."""
  mesh = mesh or sharding_lib.make_mesh(config.mesh)
  teacher = None
  if recipes_lib.get_recipe(config.recipe).teacher == "frozen":
    teacher = teacher_lib.load_teacher(config, mesh)
  return step_lib.build(config, mesh, vocab_size=vocab_size, teacher=teacher)


def restore_latest(
  workdir: str, *, what: str, mesh: Any = None, step: Optional[int] = None
) -> tuple[step_lib.Setup, Any]:
  """(Setup, TrainState) of a workdir's latest readable checkpoint (or of checkpoint `step`), the state
  built from the workdir's own config.json (evaluate, tests). `what` names the
  workdir's role in errors."""
  distributed.configure_jax()
  setup = build(workdir_lib.load_config(workdir), mesh)
  state = checkpointing.restore_latest_state(
    workdir, setup.state_shapes, setup.state_shardings, what=what, step=step
  )
  return setup, state


def _same(a: Any, b: Any) -> bool:
  """Config values compared as JSON would hold them (a grid 32 is [32, 32]; tuples are lists)."""

  def norm(v):
    if isinstance(v, (list, tuple)):
      return [norm(x) for x in v]
    return v

  if isinstance(a, int) and isinstance(b, (list, tuple)):
    a = [a] * len(b)
  if isinstance(b, int) and isinstance(a, (list, tuple)):
    b = [b] * len(a)
  return norm(a) == norm(b)


def check_init_from(config) -> Optional[init_source_lib.InitSource]:
  """The `config.init_from` source, detected and checked against the run before anything is written
  (tipsito/train/loop.py calls this right after validation): the kind must be one tipsito reads, and its
  towers must have the run's parameter structure (tipsito/models/kwargs.py PARAM_KEYS); errors name the
  key and both values, and the config that copies the source's architecture (configs/finetune.py). Reads config files and
  array headers only, except for Hugging Face folders, whose architecture is read with their weights."""
  if not config.init_from:
    return None
  try:
    src = init_source_lib.detect(config.init_from)
  except init_source_lib.InitSourceError as e:
    raise config_validation.ConfigError(str(e)) from None
  try:
    image, text = sources.towers_of(src)
  except (ValueError, OSError, KeyError) as e:  # the readers' format errors, named before any write
    raise config_validation.ConfigError(
      f"config.init_from={config.init_from!r} is {src.describe()}, but it cannot be read: {e}"
    ) from e
  run = {"image": step_lib.image_kwargs(config), "text": step_lib.text_kwargs(config)}
  for tower, got in (("image", image), ("text", text)):
    for k in kwargs_lib.PARAM_KEYS[tower]:
      if k not in got or got[k] is None or run[tower].get(k) is None:
        continue
      if not _same(got[k], run[tower][k]):
        raise config_validation.ConfigError(
          f"config.init_from={config.init_from!r} ({src.describe()}): its {tower} tower has {k}="
          f"{got[k]!r} but this run's config.model.{tower}.{k}={run[tower][k]!r}; set "
          f"--config.model.{tower}.{k}={got[k]!r}, or build the whole config from the source's "
          f"architecture with configs/finetune.py (from=PATH, docs/finetuning.md). Nothing was written"
        )
  return src


def init_from(setup: step_lib.Setup, state: Any) -> Any:
  """`state` (freshly initialised for `setup`) started from `config.init_from`, by kind
  (tipsito/config/init_source.py): a tipsito run gives its params and, with `init_teacher='continue'`,
  its teacher (`init_from_run`); every other kind (an export, a Hugging Face Tipsv2 or CLIP folder,
  official TIPS weights) gives the towers and the temperature (`init_towers`)."""
  config = setup.config
  src = init_source_lib.detect(config.init_from)
  if src.kind == "workdir":
    state = init_from_run(setup, state)
    logging.info("Initialised params from %s (teacher: %s)", config.init_from, config.init_teacher)
    return state
  return init_towers(setup, state, sources.from_init_source(src), src.describe())


def init_towers(setup: step_lib.Setup, state: Any, model: sources.Model, what: str) -> Any:
  """`state` with the towers of `model` (both, and `image_proj` when the run has one) and its
  temperature (`logit_scale` = ln(1/T)), bit for bit; every other part keeps its fresh initialisation:
  the DINO / iBOT heads, the mask token, the fusion Transformer, the EMA subset (a copy of the params,
  as at the start of pretraining) and the centres (zeros). One log line names those.

  Why fresh and not refused: no released TIPS / TIPSv2 file holds the training-only parts (the releases
  are inference towers), so continuing pretraining from them must start those parts, as TIPSv2's own
  stage 1 does; the towers carry what the release learned.
  """
  abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
  params, fresh = _towers_into_params(model, state.params, abstract.params, setup.config.init_from)
  # The EMA subset starts as the params (their own buffers: the step donates both).
  ema = {k: jax.tree.map(lambda x: x.copy(), params[k]) for k in state.ema}
  opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(params)
  if ema:
    fresh.append(f"EMA of {sorted(ema)} (a copy of the params)")
  if jax.tree.leaves(state.centers):
    fresh.append("DINO/iBOT centres (zeros)")
  logging.info(
    "Initialised the towers and the temperature from %s (bit for bit); these start fresh, since it holds "
    "no training-only parts: %s",
    what,
    ", ".join(fresh) or "nothing",
  )
  return state.replace(params=params, ema=ema, opt_state=opt_state)


def _towers_into_params(model: sources.Model, init_params, abstract_params, path) -> tuple[dict, list]:
  """(training params with `model`'s towers placed in, the names of the parts left at `init_params`).

  Every leaf of a loaded tower must exist in the run with the same shape, and every leaf of the run's
  tower must come from the model (but the mask token, training-only); scanned towers get the per-layer
  weights stacked (tipsito/models/layer_stack.py); arrays are placed with the run's shardings."""
  from flax import traverse_util  # pylint: disable=g-import-not-at-top  # flax at use, as jax here

  what = f"config.init_from={os.fspath(path)!r}"
  parts = [k for k in ("image", "text", "image_proj") if k in model.params]
  missing = [k for k in ("image", "text") if k in abstract_params and k not in model.params]
  if missing:
    raise ValueError(f"{what}: has no {missing} tower, which this run trains")
  extra = [k for k in parts if k not in abstract_params]
  if extra:
    raise ValueError(f"{what}: has {extra}, which this run has no place for (another recipe's towers)")
  scan = {k: layer_stack.is_stacked(abstract_params[k]) for k in ("image", "text") if k in abstract_params}
  loaded = layer_stack.to_layout({k: model.params[k] for k in parts}, scan)
  out = dict(init_params)
  fresh = []
  for part in parts:
    want = traverse_util.flatten_dict(dict(abstract_params[part]), sep="/")
    got = traverse_util.flatten_dict(dict(loaded[part]), sep="/")
    keep = traverse_util.flatten_dict(dict(init_params[part]), sep="/")
    new = {}
    for key, aval in want.items():
      if key not in got:
        if key == "mask_token":  # training-only, never in inference weights: the run's own init
          new[key] = keep[key]
          fresh.append(f"{part}/mask_token")
          continue
        raise ValueError(f"{what}: {part}/{key} is not in it (the run has another architecture)")
      arr = np.asarray(got[key])
      if tuple(arr.shape) != tuple(aval.shape):
        raise ValueError(
          f"{what}: {part}/{key} has shape {tuple(arr.shape)} there, {tuple(aval.shape)} in this run"
        )
      new[key] = _place(arr.astype(aval.dtype), aval.sharding)
    unused = sorted(set(got) - set(want))
    if unused:
      raise ValueError(
        f"{what}: {part} tensors {unused[:5]} have no place in this run (another architecture)"
      )
    out[part] = traverse_util.unflatten_dict(new, sep="/")
  if "logit_scale" in abstract_params:
    aval = abstract_params["logit_scale"]
    out["logit_scale"] = _place(
      np.full(aval.shape, np.log(1.0 / model.temperature), aval.dtype), aval.sharding
    )
  fresh += sorted(k for k in init_params if k not in parts and k not in ("logit_scale",))
  return out, fresh


def _place(arr: np.ndarray, sharding) -> Any:
  """A global jax.Array of host array `arr` with `sharding` (each process fills its addressable shards)."""
  if sharding is None:
    return jax.device_put(arr)
  return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def _init_checkpoint_dir(path):
  """The Orbax checkpoint folder of an `init_from` path: `<workdir>/checkpoints`, else the path itself
  (a checkpoints folder given directly), as `checkpointing.restore_params` reads it."""
  p = paths.as_path(path)
  return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def _init_step_folder(path) -> Optional[int]:
  """The step of an `init_from` that names one step folder (`W/checkpoints/N`), else None: that step is
  then the only one read (as `checkpointing.restore_params` reads a step folder)."""
  p = paths.as_path(path)
  return int(p.name) if p.name.isdigit() and (p / "state").is_dir() else None


def init_from_run(setup: step_lib.Setup, state: Any) -> Any:
  """`state` (freshly initialised for `setup`) with the latest readable checkpoint of `config.init_from`.

  Always: the student params (fresh optimizer state and schedule, step 0). `config.init_teacher`:
  'continue' (default) also restores the teacher, i.e. the EMA subset (`state.ema`: EMA heads, and the EMA
  image encoder with full EMA) and the DINO/iBOT centres, bit for bit: the high-resolution stage adapts
  the model of stage 1 (TIPSv2 §4 "a high-resolution adaptation stage"), whose teacher heads and centres
  have tracked the student for 90k steps, while a reset teacher starts as a copy of the student heads
  with zero centres. Validation (tipsito/config/validation.py) refuses an EMA mode other than the init
  run's (its config.json) before anything is written. 'reset': the EMA subset copied from the restored
  params and zero centres (tipsito's behaviour before `init_teacher`).

  Read-only, as a resume reads its own workdir: when the init run's latest step cannot be restored, the
  previous readable one is used (logged), and nothing in the other run's directory is moved or written.
  """
  config = setup.config
  path = config.init_from
  abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
  parts = {"params": abstract.params}
  if config.init_teacher == "continue":
    parts.update(
      {k: getattr(abstract, k) for k in ("ema", "centers") if jax.tree.leaves(getattr(abstract, k))}
    )
  only = _init_step_folder(path)
  ckpt_dir = paths.as_path(path).parent if only is not None else _init_checkpoint_dir(path)
  restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), parts)
  args = ocp.args.Composite(
    state=ocp.args.PyTreeRestore(item=parts, restore_args=restore_args, partial_restore=True)
  )
  reader = checkpointing.local_reader(ckpt_dir)
  try:
    steps = [only] if only is not None else sorted(int(s) for s in reader.all_steps())
    steps = checkpointing.same_on_every_process(steps)
    if not steps:
      raise FileNotFoundError(f"config.init_from={path!r}: no checkpoint found in {ckpt_dir}")
    try:
      _, restored, _ = checkpointing.restore_first_readable(
        steps,
        lambda s: reader.restore(s, args=args)["state"],
        directory=os.fspath(ckpt_dir),
        what=f"config.init_from={path!r}",
        read_only=True,
      )
    except checkpointing.NoReadableCheckpoint as e:  # name the key that decides what is restored
      if config.init_teacher != "continue":
        raise
      raise ValueError(
        f"config.init_from={path!r} (steps {steps}): cannot continue its teacher ({sorted(parts)} could "
        f"not be restored into this run's: {str(e)[:300]}). Use the init run's config.ema.mode and "
        "model.heads, or --config.init_teacher=reset to start a new teacher from its params"
      ) from e
  finally:
    reader.close()
  params = restored["params"]
  ema = (
    restored["ema"]
    if "ema" in restored
    else {k: jax.tree.map(lambda x: x.copy(), params[k]) for k in state.ema}
  )
  centers = restored["centers"] if "centers" in restored else state.centers
  opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(params)
  return state.replace(params=params, ema=ema, centers=centers, opt_state=opt_state)
