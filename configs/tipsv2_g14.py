"""TIPSv2 stage 1 (TIPSv2 §4 "Implementation details"): ViT-g/14, 1 global crop 224 + 6 local crops 98,
mask ratio 0.75 (iBOT++), head-only EMA, L = L_CLIP + 1.0 L_DINO + 2.0 L_iBOT++, multi-granularity
captions (CLS1 <- web alt-text, CLS2 <- PaliGemma/Gemini caption), Adafactor, 90k steps at batch 8192,
bf16 activations / fp32 params, remat per block, scanned blocks. 512 TPU v5 chips, data parallel (see
the mesh below for why not FSDP).

Args: variant (g/14 | So400m/14 | L/14 | B/14 | S/14), ema (head | full), steps, batch.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("tipsito_configs_common",
                                               os.path.join(os.path.dirname(__file__), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  """Stage-1 TIPSv2 config; `variant=B/14` gives the paper's ViT-B ablation size."""
  a = common.parse_arg(arg, variant="g/14", ema="head", steps=90000, batch=8192)
  common.check_choice("variant", a.variant, ("g/14", "So400m/14", "L/14", "B/14", "S/14"))
  common.check_choice("ema", a.ema, ("head", "full"))
  c = common.base_config("tipsv2", a.variant, total_steps=a.steps, batch_size=a.batch)
  # Scanned blocks: one block body to compile instead of 40 (the step compiles in minutes; same numbers).
  c.model.image.update(dict(dtype="bfloat16", remat=True, scan=True))
  c.model.text.update(dict(dtype="bfloat16", remat=True, scan=True))
  c.ema.mode = a.ema
  c.data = common.data_config("webli", caption_keys=("caption_paligemma", "caption_gemini"))
  c.input.update(dict(global_size=224, local_size=98, num_local=6, mask_ratio=0.75, augment="tips",
                      num_workers=32, prefetch=4))
  c.loss_opts.teacher_temp_warmup_steps = 30000
  c.optim.update(dict(lr=1e-3, warmup_steps=10000, weight_decay=1e-4, clip_norm=1.0, momentum=0.9,
                      momentum_dtype="bfloat16"))
  # Data parallel over every chip (params replicated, 16 images per chip). `python -m tipsito.plan` on
  # v5p:8x8x8 (README "Planning a pod run"): FSDP over all chips (data=1, fsdp=-1) does not fit (the
  # compiler needs ~449 GiB of temporaries per chip: activations end up gathered over the batch), data
  # parallel does.
  c.mesh.update(dict(data=-1, fsdp=1, model=1))
  c.ckpt.update(dict(every_steps=1000, keep=3, async_save=True))
  c.evals.zeroshot = dict(type="zeroshot", dataset="imagenet2012", split="validation", every_steps=10000,
                          batch_size=1024, image_size=224)
  c.evals.retrieval = dict(type="retrieval", dataset="coco_captions", split="val", every_steps=10000,
                           batch_size=1024, image_size=224)
  c.evals.segmentation = dict(type="segmentation", dataset="ade20k", split="validation",
                              every_steps=10000, batch_size=64, image_size=448, cls_index=1)
  return c
