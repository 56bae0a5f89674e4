"""TIPSv2 distillation, stage 2 (high resolution): a distilled student gets the same 448 + 6 x 140 stage as
the pretrained models (`tipsv2_g14_hires.py`), initialised from the stage-1 distillation workdir
(`init=DIR` or --config.init_from=DIR), still distilled from the frozen teacher at 448.

Args: student (B | L | So400m), init (stage-1 distillation workdir), teacher (teacher workdir or export),
steps, batch.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("tipsito_configs_common",
                                               os.path.join(os.path.dirname(__file__), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  """Stage-2 distillation config (params from stage 1, fresh optimizer/schedule)."""
  a = common.parse_arg(arg, student="B", init="", teacher="", steps=9000, batch=4096)
  common.check_choice("student", a.student, ("B", "L", "So400m"))
  spec = importlib.util.spec_from_file_location("tipsv2_distill", os.path.join(os.path.dirname(__file__),
                                                                              "tipsv2_distill.py"))
  stage1 = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(stage1)
  c = stage1.get_config(f"student={a.student},teacher={a.teacher},steps={a.steps},batch={a.batch}")
  c.input.update(dict(global_size=448, local_size=140))
  c.optim.update(dict(lr=2e-4, warmup_steps=500))
  c.loss_opts.teacher_temp_warmup_steps = 0
  c.init_from = a.init or None
  return c
