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
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import Mesh

from tipsito import distributed
from tipsito import paths
from tipsito.interop import hf_tipsv2
from tipsito.config import recipes as recipes_lib
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


def init_from(setup: step_lib.Setup, state: Any) -> Any:
  """`state` (freshly initialised for `setup`) started from `config.init_from`: a Hugging Face Tipsv2Model
  folder gives the towers; a tipsito run gives its params and, with `init_teacher='continue'`, its
  teacher (`init_from_run`)."""
  config = setup.config
  if hf_tipsv2.is_tipsv2_folder(config.init_from):  # a Hugging Face Tipsv2Model folder: towers only
    abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
    params = hf_tipsv2.init_train_params(config.init_from, state.params, abstract.params)
    state = state.replace(
      params=params,
      ema={k: params[k] for k in state.ema},
      opt_state=jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(params),
    )
    logging.info("Initialised params from %s (a Tipsv2Model folder: towers only)", config.init_from)
    return state
  state = init_from_run(setup, state)
  logging.info("Initialised params from %s (teacher: %s)", config.init_from, config.init_teacher)
  return state


def _init_checkpoint_dir(path):
  """The Orbax checkpoint folder of an `init_from` path: `<workdir>/checkpoints`, else the path itself
  (a checkpoints folder given directly), as `checkpointing.restore_params` reads it."""
  p = paths.as_path(path)
  return p / "checkpoints" if (p / "checkpoints").is_dir() else p


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
  ckpt_dir = _init_checkpoint_dir(path)
  restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), parts)
  args = ocp.args.Composite(
    state=ocp.args.PyTreeRestore(item=parts, restore_args=restore_args, partial_restore=True)
  )
  reader = checkpointing.local_reader(ckpt_dir)
  try:
    steps = checkpointing.same_on_every_process(sorted(int(s) for s in reader.all_steps()))
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
  ema = restored["ema"] if "ema" in restored else {k: params[k] for k in state.ema}
  centers = restored["centers"] if "centers" in restored else state.centers
  opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(params)
  return state.replace(params=params, ema=ema, centers=centers, opt_state=opt_state)
