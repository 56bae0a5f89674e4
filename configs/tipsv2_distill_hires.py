"""TIPSv2 distillation, stage 2 (high resolution): a distilled student gets the same 448 + 6 x 140 stage as
the pretrained models (`tipsv2_g14_hires.py`), initialised from the stage-1 distillation workdir
(`init=DIR` or --config.init_from=DIR), still distilled from the frozen teacher at 448.

Args: student (B | L | So400m), init (stage-1 distillation workdir), teacher (teacher workdir or export),
steps, batch.
"""
from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """Stage-2 distillation config (params from stage 1, fresh optimizer/schedule)."""
  a = args.parse_arg(arg, student="B", init="", teacher="", steps=9000, batch=4096)
  c = paper.tipsv2_distill(a.student, teacher=a.teacher, total_steps=a.steps, batch_size=a.batch)
  return paper.high_resolution_stage(c, init=a.init)
