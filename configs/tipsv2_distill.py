"""TIPSv2 distillation (§3.1, Table 2): a frozen g/14 teacher replaces the teacher branch, the student image
encoder starts from random weights, no masking (iBOT++ on every patch), DINO on the global + local crops,
CLIP loss for the student text tower (`--config.distill.init_text=True` starts it from the teacher's).

The teacher (`teacher=DIR`): a tipsito training workdir of the g/14 pretraining (its own EMA DINO/iBOT
heads are then part of the frozen teacher and give the targets, as in the paper), or an export / official
TIPS weights via --config.distill.teacher_image_npz (encoders only: the teacher heads are then the EMA of
the student heads, our inference, logged at start). `feature` (direct feature matching) is off, as in the
paper. Stage 2 at 448 px: `tipsv2_distill_hires.py`. Set --config.tokenizer to the 32k TIPS model.

Args: student (B | L | So400m), teacher (workdir or export dir), steps, batch.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("tipsito_configs_common",
                                               os.path.join(os.path.dirname(__file__), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  """Distillation config; `student=B` -> B/14 student."""
  a = common.parse_arg(arg, student="B", teacher="", steps=90000, batch=8192)
  common.check_choice("student", a.student, ("B", "L", "So400m"))
  c = common.base_config("distill", f"{a.student}/14", total_steps=a.steps, batch_size=a.batch)
  c.model.image.update(dict(dtype="bfloat16", remat=True))
  c.model.text.update(dict(dtype="bfloat16", remat=True))
  c.distill.teacher = a.teacher or "PATH/TO/tipsv2_g14_export"
  c.data = common.data_config("webli", caption_keys=("caption_paligemma", "caption_gemini"))
  c.input.update(dict(mask_ratio=0.0, num_local=6, num_workers=32))
  c.optim.update(dict(lr=1e-3, warmup_steps=10000, momentum_dtype="bfloat16"))
  c.mesh.update(dict(data=1, fsdp=-1, model=1))
  return c
