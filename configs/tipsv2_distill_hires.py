"""TIPSv2 distillation, stage 2 (high resolution): a distilled student gets the same 448 + 6 x 140 stage as
the pretrained models (`tipsv2_g14_hires.py`), initialised from the stage-1 distillation workdir
(`init=DIR` or --config.init_from=DIR), still distilled from the frozen teacher at 448. The EMA teacher
heads (when the teacher has none of its own) and the DINO/iBOT centres of stage 1 carry on
(`init_teacher=continue`); `init_teacher=reset` starts them anew.

Args: student (B | L | So400m), init (stage-1 distillation workdir), teacher (teacher workdir or export),
init_teacher (continue | reset), steps, batch.
"""

from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """Stage-2 distillation config (params and teacher state from stage 1, fresh optimizer/schedule)."""
  a = args.parse_arg(arg, student="B", init="", teacher="", init_teacher="continue", steps=9000, batch=4096)
  c = paper.tipsv2_distill(a.student, teacher=a.teacher, total_steps=a.steps, batch_size=a.batch)
  return paper.high_resolution_stage(c, init=a.init, init_teacher=a.init_teacher)
