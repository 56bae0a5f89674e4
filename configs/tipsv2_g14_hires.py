"""TIPSv2 stage 2 (high-resolution adaptation): global 448 + local 140, 9k steps at batch 4096,
initialised from the stage-1 workdir (`init=DIR` or --config.init_from=DIR).

Stage 1's teacher carries on (`init_teacher=continue`: EMA heads, EMA encoder with full EMA, DINO/iBOT
centres); `ema` must then be stage 1's EMA mode (a full-EMA stage 1 needs `ema=full`; validation refuses
a mismatch, naming stage 1's mode). `init_teacher=reset` starts a new teacher from the stage-1 params.

Args: variant, init (stage-1 workdir), ema (head | full), init_teacher (continue | reset), steps, batch.
"""

from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """Stage-2 TIPSv2 config (params and teacher from stage 1, fresh optimizer/schedule)."""
  a = args.parse_arg(
    arg, variant="g/14", init="", ema="head", init_teacher="continue", steps=9000, batch=4096
  )
  c = paper.tipsv2(a.variant, ema=a.ema, total_steps=a.steps, batch_size=a.batch)
  return paper.high_resolution_stage(c, init=a.init, init_teacher=a.init_teacher)
