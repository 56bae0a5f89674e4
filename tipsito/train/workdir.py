"""A training workdir on disk: its `config.json` (the resolved config plus the accepted resume changes) and
what it holds (`checkpoints/`).

Why its own module: the loop writes `config.json`; export, evaluate, the resume guard and workdir teachers
(tipsito/train/teacher.py) read it back. One reader and one writer keep the file's layout in one place,
and none of those readers needs the loop; `restore_latest` is their one way back to a workdir's state.
A new run started from another run's checkpoint (`config.init_from`, the high-resolution stage 2) reads
it through `init_from_run` (and validation checks it against `init_run_config`).
"""
from __future__ import annotations

import json
from typing import Any, Optional

import jax
import ml_collections as mlc

from tipsito import paths
from tipsito.train import resume_guard

CONFIG_FILE = "config.json"
# `config.init_teacher`: what a run started with `config.init_from` does with the init run's teacher.
INIT_TEACHER = ("continue", "reset")


def is_training_workdir(path: Optional[str]) -> bool:
  """A tipsito training workdir: config.json + checkpoints/ (an export has config.json + params/)."""
  if not path:
    return False
  p = paths.as_path(path)  # local or gs://
  return (p / CONFIG_FILE).is_file() and (p / "checkpoints").is_dir()


def save_config(config: mlc.ConfigDict, workdir: str, history: list | None = None) -> None:
  """Writes `<workdir>/config.json` (export, evaluate and humans read it), with the history of accepted
  resume changes under `resume_guard.HISTORY_KEY`. Process 0 only."""
  if jax.process_index() == 0:
    d = paths.as_path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    out = json.loads(config.to_json_best_effort())
    if history:
      out[resume_guard.HISTORY_KEY] = history
    (d / CONFIG_FILE).write_text(json.dumps(out, indent=2, sort_keys=True))


def read_config_json(workdir: str) -> tuple[Optional[dict], list]:
  """(saved training config as a dict, accepted-change history) of a workdir; (None, []) if none."""
  f = paths.as_path(workdir) / CONFIG_FILE
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
  """Highest finalized Orbax step under `<workdir>/checkpoints` (None when there is none: nothing to
  resume). Read without opening a CheckpointManager, so nothing is created in the workdir."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  d = paths.as_path(workdir) / "checkpoints"
  steps = ocp.utils.checkpoint_steps(d) if d.is_dir() else []
  return max(steps) if steps else None


def restore_latest(workdir: str, *, what: str, mesh: Any = None, step: Optional[int] = None
                   ) -> tuple[Any, Any]:
  """(Setup, TrainState) of a workdir's latest checkpoint (or of checkpoint `step`), the state built from
  the workdir's own config.json (export, evaluate, workdir teachers). `what` names the workdir's role in
  errors."""
  from tipsito import distributed  # pylint: disable=import-outside-toplevel
  from tipsito.train import checkpointing  # pylint: disable=import-outside-toplevel
  from tipsito.train import step as step_lib  # pylint: disable=import-outside-toplevel
  distributed.configure_jax()
  setup = step_lib.build(load_config(workdir), mesh)
  state = checkpointing.restore_latest_state(workdir, setup.state_shapes, setup.state_shardings, what=what,
                                             step=step)
  return setup, state


def _init_checkpoint_dir(path):
  """The Orbax checkpoint folder of an `init_from` path: `<workdir>/checkpoints`, else the path itself
  (a checkpoints folder given directly), as `checkpointing.restore_params` reads it."""
  p = paths.as_path(path)
  return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def init_run_config(path: Optional[str]) -> Optional[dict]:
  """The saved config.json of the run an `init_from` path points at (the workdir, its `checkpoints/`
  folder or a step folder in it), or None when there is none to read."""
  if not path:
    return None
  p = paths.as_path(path)
  for d in (p, p.parent, p.parent.parent):
    if (d / CONFIG_FILE).is_file():
      saved, _ = read_config_json(str(d))
      return saved
  return None


def init_from_run(setup: Any, state: Any) -> Any:
  """`state` (freshly initialised for `setup`) with the latest checkpoint of `config.init_from` in it.

  Always: the student params (fresh optimizer state and schedule, step 0). `config.init_teacher`:
  'continue' (default) also restores the teacher, i.e. the EMA subset (`state.ema`: EMA heads, and the EMA
  image encoder with full EMA) and the DINO/iBOT centres, bit for bit: the high-resolution stage adapts
  the model of stage 1 (TIPSv2 §4 "a high-resolution adaptation stage"), whose teacher heads and centres
  have tracked the student for 90k steps, while a reset teacher starts as a copy of the student heads
  with zero centres. Validation (tipsito/config/validation.py) refuses an EMA mode other than the init
  run's (its config.json) before anything is written. 'reset': the EMA subset copied from the restored
  params and zero centres (tipsito's behaviour before `init_teacher`).
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from tipsito.train import checkpointing  # pylint: disable=import-outside-toplevel
  config = setup.config
  path = config.init_from
  abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
  parts = {"params": abstract.params}
  if config.init_teacher == "continue":
    parts.update({k: getattr(abstract, k) for k in ("ema", "centers") if jax.tree.leaves(getattr(abstract, k))})
  ckpt_dir = _init_checkpoint_dir(path)
  mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(read_only=True))
  try:
    step = mngr.latest_step()
    if step is None:
      raise FileNotFoundError(f"config.init_from={path!r}: no checkpoint found in {ckpt_dir}")
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), parts)
    try:
      restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=parts, restore_args=restore_args, partial_restore=True)))["state"]
    except Exception as e:  # pylint: disable=broad-except  # name the key that decides what is restored
      if config.init_teacher != "continue":
        raise
      raise ValueError(
          f"config.init_from={path!r} (step {step}): cannot continue its teacher ({sorted(parts)} do not "
          f"match this run's: {type(e).__name__}: {str(e)[:300]}). Use the init run's config.ema.mode "
          f"and model.heads, or --config.init_teacher=reset to start a new teacher from its params") from e
  finally:
    mngr.close()
  params = restored["params"]
  ema = restored["ema"] if "ema" in restored else {k: params[k] for k in state.ema}
  centers = restored["centers"] if "centers" in restored else state.centers
  opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(params)
  return state.replace(params=params, ema=ema, centers=centers, opt_state=opt_state)
