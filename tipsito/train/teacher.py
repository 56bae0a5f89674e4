"""The frozen distillation teacher (recipe `distill`): where it comes from.

Why its own module: a teacher is loaded from one of four sources (a tipsito training workdir, an export,
a Hugging Face Tipsv2Model folder, official TIPS weights), each with its own reader, before the student is
built; the train step only sees the frozen tree `frozen_tree(teacher)`. What the step gets of a teacher
(`Teacher`, `frozen_tree`, `check_teacher_heads`) is tipsito/train/step.py, whose pure `build` takes one;
this loader sits above it (a workdir teacher is a pretraining run, rebuilt with `step.build` and restored
read-only with `checkpointing.restore_latest_state`), and tipsito/train/assembly.py calls it.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import Mesh

from tipsito import distributed
from tipsito import inference
from tipsito import models
from tipsito import tips_import
from tipsito.interop import hf_tipsv2
from tipsito.models.kwargs import module_kwargs
from tipsito.config import presets
from tipsito.config import recipes as recipes_lib
from tipsito.train import checkpointing
from tipsito.train import step as step_lib
from tipsito.train import workdir as workdir_lib
from tipsito.train.step import Teacher, check_teacher_heads, frozen_tree

__all__ = ["Teacher", "abstract_teacher", "load_teacher", "check_teacher_heads", "frozen_tree"]


def abstract_teacher(config, variant: str = "g/14") -> Teacher:
  """A distillation teacher described by its shapes and config, without weights: the image tower of
  the `variant` preset (TIPSv2's teachers are g/14) as `load_teacher` builds a teacher (two CLS tokens,
  no mask token, the official release's 32 x 32 position grid, the student's dtype and scan), its params
  `jax.ShapeDtypeStruct`s from `jax.eval_shape` at the student's global crop.

  Why one: the planner (tipsito/planning/pod.py), `python -m tipsito.info` (tipsito/planning/costs.py) and
  anything else that needs only the shapes of a distillation run (the state layout, the memory of the compiled
  step) describe the teacher the same way, and none of them reads a teacher from disk.
  """
  image_cfg = presets.vit_config(
    variant,
    num_cls_tokens=2,
    posemb_grid=32,
    use_mask_token=False,
    dtype=str(config.model.image.dtype),
    scan=bool(config.model.image.scan),
  )
  module = models.VisionTransformer(**module_kwargs(image_cfg))
  s = int(config.input.global_size)
  params = jax.eval_shape(
    lambda k: module.init(k, jnp.zeros((1, s, s, 3), jnp.uint8)), jax.random.PRNGKey(0)
  )["params"]
  return Teacher(module, image_cfg, params, source=f"abstract {variant} teacher (shapes only, no weights)")


def load_teacher(config, mesh: Optional[Mesh] = None) -> Teacher:
  """Loads the frozen distillation teacher.

  `config.distill.teacher` a training workdir (config.json + checkpoints/): the latest checkpoint's teacher
  as it was trained, i.e. the image encoder the teacher features came from (the EMA encoder with full EMA,
  the student encoder with head-only EMA) and its EMA DINO/iBOT heads (the frozen teacher replaces the
  self-distillation teacher, heads included). An export directory, a local Hugging Face Tipsv2Model
  folder or official TIPS .npz weights (`distill.teacher_image_npz`) hold encoders only: the teacher heads
  are then the EMA of the student heads (our inference; logged), as in head-only EMA pretraining.
  """
  d = config.distill
  heads, heads_cfg = None, None
  if d.teacher_image_npz:
    image_cfg, params = _npz_teacher(d.teacher_image_npz, d.teacher_text_npz)
    source = f"official TIPS weights {d.teacher_image_npz}"
  elif workdir_lib.is_training_workdir(d.teacher):
    image_cfg, params, heads, heads_cfg = _workdir_teacher(d.teacher, mesh)
    source = f"training workdir {d.teacher}"
  elif _is_tipsv2_folder(d.teacher):
    r = hf_tipsv2.read_hf_tipsv2(d.teacher)
    image_cfg, params = r["image_config"], r["params"]
    source = f"Hugging Face Tipsv2 folder {d.teacher}"
  else:
    image_cfg, params = _encoder_image_parts(inference.load(d.teacher))
    source = f"export {d.teacher}"
  image_cfg = dict(image_cfg)
  image_cfg["use_mask_token"] = False
  image_cfg["remat"] = False
  image_params = params["image"] if "image" in params else params
  image_params = {k: v for k, v in image_params.items() if k != "mask_token"}
  if heads is None:
    logging.warning(
      "Distillation teacher (%s) has no DINO/iBOT heads: the teacher heads are the EMA of "
      "the student heads (our inference, see README 'Distillation').",
      source,
    )
  else:
    logging.info("Distillation teacher (%s): its own EMA DINO/iBOT heads give the targets.", source)
  return Teacher(
    models.VisionTransformer(**module_kwargs(image_cfg)),
    image_cfg,
    image_params,
    text_params=params.get("text"),
    heads=heads,
    heads_config=heads_cfg,
    source=source,
  )


def _is_tipsv2_folder(path) -> bool:
  """A Hugging Face Tipsv2Model folder (tipsito/interop/hf_tipsv2.py)."""
  return hf_tipsv2.is_tipsv2_folder(path)


def _npz_teacher(image_npz: str, text_npz: Optional[str]) -> tuple[dict, dict]:
  """(image config, params) of official TIPS weights; {'image', 'text'} params when the text file is
  given too (distill.init_text can start the student's text tower from it)."""
  if text_npz:
    image_cfg, _, params, _ = tips_import.import_tips_npz(image_npz, text_npz)
    return image_cfg, params
  return tips_import.import_tips_vision(image_npz)


def _workdir_teacher(workdir: str, mesh: Optional[Mesh]) -> tuple[dict, dict, dict, dict]:
  """(image config, {'image', 'text'} params, teacher heads, heads config) of a training workdir's latest
  checkpoint, rebuilt from its own config.json."""
  tcfg = workdir_lib.load_config(workdir)
  if recipes_lib.get_recipe(tcfg.recipe).teacher == "frozen":
    raise ValueError(f"config.distill.teacher={workdir!r} is a distillation run; use a pretraining workdir")
  distributed.configure_jax()
  setup = step_lib.build(tcfg, mesh)  # a pretraining run: no teacher of its own
  state = checkpointing.restore_latest_state(
    workdir, setup.state_shapes, setup.state_shardings, what=f"config.distill.teacher={workdir!r}"
  )
  params, ema = state.params, state.ema
  teacher_view = {"image": ema.get("image", params["image"])}
  if "text" in params:
    teacher_view["text"] = params["text"]
  heads = {k: ema.get(k, params[k]) for k in ("dino_head", "ibot_head") if k in params}
  return dict(step_lib.image_kwargs(tcfg)), teacher_view, (heads or None), dict(tcfg.model.heads)


def _encoder_image_parts(enc) -> tuple[dict, dict]:
  """(image config, {'image': params}) of a tipsito.inference.Encoder (`tipsito.load` of an export, whose
  config states every key: tipsito/export_format.py upgrade_config)."""
  return dict(enc.image_config), enc.params
