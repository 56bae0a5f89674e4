"""TIPSv2 distillation (§3.1, Table 2): a frozen g/14 teacher replaces the teacher branch, the student image
encoder starts from random weights, no masking (iBOT++ on every patch), DINO on the local crops (the
paper's two changes only; `--config.distill.dino_global_crop=True` adds the global crop as a DINO student
view), CLIP loss for the student text tower (`--config.distill.init_text=True` starts it from the teacher's).

The teacher (`teacher=DIR`): a tipsito training workdir of the g/14 pretraining (its own EMA DINO/iBOT
heads are then part of the frozen teacher and give the targets, as in the paper), or an export / official
TIPS weights via --config.distill.teacher_image_npz (encoders only: the teacher heads are then the EMA of
the student heads, our inference, logged at start). `feature` (direct feature matching) is off, as in the
paper. The views are stage 1's (TIPSv2 §3.1: distillation "mirrors the pretraining setup"): the global
view is the whole image (`input.global_crop_scale=(1.0, 1.0)`, sources in `tipsv2_g14.py`; the DINOv2
range is `--config.input.global_crop_scale='(0.32, 1.0)'`). Stage 2 at 448 px: `tipsv2_distill_hires.py`. Set --config.tokenizer to the 32k TIPS model.

Args: student (B | L | So400m), teacher (workdir or export dir), steps, batch.
"""

from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """Distillation config; `student=B` -> B/14 student."""
  a = args.parse_arg(arg, student="B", teacher="", steps=90000, batch=8192)
  return paper.tipsv2_distill(a.student, teacher=a.teacher, total_steps=a.steps, batch_size=a.batch)
