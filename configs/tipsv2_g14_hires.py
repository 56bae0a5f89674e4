"""TIPSv2 stage 2 (high-resolution adaptation): global 448 + local 140, 9k steps at batch 4096,
initialised from the stage-1 workdir (`init=DIR` or --config.init_from=DIR).

Args: variant, init (stage-1 workdir), steps, batch.
"""
from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """Stage-2 TIPSv2 config (params from stage 1, fresh optimizer/schedule)."""
  a = args.parse_arg(arg, variant="g/14", init="", steps=9000, batch=4096)
  c = paper.tipsv2(a.variant, ema="head", total_steps=a.steps, batch_size=a.batch)
  return paper.high_resolution_stage(c, init=a.init)
