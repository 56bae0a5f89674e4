"""TIPSv2 stage 2 (high-resolution adaptation): global 448 + local 140, 9k steps at batch 4096,
initialised from the stage-1 workdir (`init=DIR` or --config.init_from=DIR).

Args: variant, init (stage-1 workdir), steps, batch.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("tipsito_configs_common",
                                               os.path.join(os.path.dirname(__file__), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  """Stage-2 TIPSv2 config (params from stage 1, fresh optimizer/schedule)."""
  a = common.parse_arg(arg, variant="g/14", init="", steps=9000, batch=4096)
  common.check_choice("variant", a.variant, ("g/14", "So400m/14", "L/14", "B/14", "S/14"))
  spec = importlib.util.spec_from_file_location("tipsv2_g14", os.path.join(os.path.dirname(__file__),
                                                                          "tipsv2_g14.py"))
  stage1 = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(stage1)
  c = stage1.get_config(f"variant={a.variant},steps={a.steps},batch={a.batch}")
  c.input.update(dict(global_size=448, local_size=140))
  c.optim.update(dict(lr=2e-4, warmup_steps=500))
  c.loss_opts.teacher_temp_warmup_steps = 0
  c.init_from = a.init or None
  return c
