"""Paper config families: what a paper config shares with its stage-2 or larger-tower follow-up.

Why here and not in configs/: configs/tipsv2_g14_hires.py, configs/tipsv2_distill_hires.py and
configs/ito_l16.py start from another experiment's config. Files under configs/ are loaded by path (they
are the user's `--config` files, not a package), so the part they share lives in the package and each of
them imports it like any module. The paper references for each setting are in the docstrings of those
experiment files.
"""

from __future__ import annotations

import ml_collections as mlc

from tipsito.config import args
from tipsito.config import defaults
from tipsito.config import schema

TIPSV2_VARIANTS = ("g/14", "So400m/14", "L/14", "B/14", "S/14")
TIPSV2_EMA_MODES = ("head", "full")
DISTILL_STUDENTS = ("B", "L", "So400m")
ITO_VARIANTS = ("B/16", "L/16")
# TIPSv2's global view (the teacher's and both CLIP terms' image): the whole image, resized and flipped;
# the quotes behind it are in configs/tipsv2_g14.py. The DINOv2 range (0.32, 1.0) is one override away.
TIPSV2_GLOBAL_CROP_SCALE = (1.0, 1.0)
# ITO's two views: "random resized crop with scale 0.5-1.0" (ITO, Method).
ITO_CROP_SCALE = (0.5, 1.0)
# The ITO fusion module over 2 groups of examples in turn (`model.fusion.chunks`, tipsito/models/fusion.py):
# its backward then holds half the batch's activations at a time. `ito` B/16 at 64 images per chip compiled
# for TPU v5p: 5036 MiB per chip, against 5776 in one group (4990 with the train step's `cond` guard since;
# big_vision's two towers: 5114; docs/performance.md); 4 and 8 groups hold more than 2. Always valid: every
# device fuses an even number of rows (two views per example).
FUSION_CHUNKS = 2
# ITO steps per data set at batch 8192. ITO's results table: "ViT-B/16, 30 epochs unless noted"; the
# noted rows are DataComp-1B ("1 epoch"; a 10-epoch B/16 scaling row; "ViT-L/16, 1 epoch"). So 30-33 epochs
# for CC3M (12k x 8192 = 98M samples, ~3.3M images), CC12M (393M, ~12M), YFCC15M (491M, 15M) and
# LAION-100M (366k x 8192 = 3.0B samples = 30 x 100M; the earlier 120k steps were ~10 epochs), and one
# epoch of DataComp-1B (160k x 8192 = 1.3B samples, about one pass of its ~1.4B pairs).
ITO_STEPS = dict(cc3m=12000, cc12m=48000, yfcc15m=60000, laion100m=366000, datacomp1b=160000)


def linear_probe_evals(every_steps: int, *, datasets=("voc2012", "ade20k", "nyuv2")) -> dict[str, dict]:
  """TIPSv2's image-only probe columns (Tables 1, 2, 4, 7-12: linear segmentation on PASCAL VOC / ADE20k,
  linear depth on NYUv2) as `config.evals` entries (tipsito/evals/probes.py).

  Each benchmark is read from its published layout under `data_dir` (None = <tipsito data dir>/<name>,
  tipsito/data/dense_benchmarks.py). Scale: 224 px (a 16 x 16 grid at patch 14) and 2000 train images,
  so the frozen features of a g/14 fit in a few GiB; the paper's probes use the full train splits.
  """
  kinds = dict(
    voc2012=("linear_segmentation", "validation"),
    ade20k=("linear_segmentation", "validation"),
    nyuv2=("linear_depth", "test"),
  )
  out = {}
  for name in datasets:
    typ, split = kinds[name]
    out[f"{typ}_{name}"] = dict(
      type=typ,
      dataset=name,
      split=split,
      train_split="train",
      max_train_examples=2000,
      every_steps=every_steps,
      batch_size=64,
      image_size=224,
    )
  return out


def tipsv2(variant: str, *, ema: str, total_steps: int, batch_size: int) -> mlc.ConfigDict:
  """TIPSv2 stage 1 (configs/tipsv2_g14.py): ViT `variant`, 1 x 224 + 6 x 98 crops, mask 0.75, Adafactor."""
  args.check_choice("variant", variant, TIPSV2_VARIANTS)
  args.check_choice("ema", ema, TIPSV2_EMA_MODES)
  c = defaults.base_config("tipsv2", variant, total_steps=total_steps, batch_size=batch_size)
  # Scanned blocks: one block body to compile instead of 40 (the step compiles in minutes; same numbers).
  c.model.image.update(dict(dtype="bfloat16", remat=True, scan=True))
  c.model.text.update(dict(dtype="bfloat16", remat=True, scan=True))
  c.ema.mode = ema
  c.data = defaults.data_config("webli", caption_keys=("caption_paligemma", "caption_gemini"))
  c.input.update(
    dict(
      global_size=224,
      local_size=98,
      num_local=6,
      mask_ratio=0.75,
      augment="tips",
      global_crop_scale=TIPSV2_GLOBAL_CROP_SCALE,
      num_workers=32,
      prefetch=4,
    )
  )
  c.loss_opts.teacher_temp_warmup_steps = 30000
  c.optim.update(
    dict(
      lr=1e-3, warmup_steps=10000, weight_decay=1e-4, clip_norm=1.0, momentum=0.9, momentum_dtype="bfloat16"
    )
  )
  # Data parallel over every chip (params replicated, 16 images per chip). `python -m tipsito.plan` on
  # v5p:8x8x8 (README "Planning a pod run"): 28.0 GiB per chip, against 48.8 GiB with FSDP over all chips
  # (data=1, fsdp=-1): at 16 images per chip the replicated params and Adafactor state cost less than
  # FSDP's per-layer weight gathers, which remat repeats in the backward pass.
  c.mesh.update(dict(data=-1, fsdp=1, model=1))
  c.ckpt.update(dict(every_steps=1000, keep=3, async_save=True))
  c.evals.zeroshot = dict(
    type="zeroshot",
    dataset="imagenet2012",
    split="validation",
    every_steps=10000,
    batch_size=1024,
    image_size=224,
  )
  c.evals.retrieval = dict(
    type="retrieval", dataset="coco_captions", split="val", every_steps=10000, batch_size=1024, image_size=224
  )
  # TIPSv2's ADE150 column (tipsito/evals/segmentation.py BENCHMARKS): 150 classes, labels 0 and 255
  # ignored, short side 448 keeping the aspect ratio, scored at the label map's size, 'whole' protocol.
  c.evals.segmentation = dict(
    type="segmentation",
    benchmark="ade150",
    dataset="ade20k",
    split="validation",
    every_steps=10000,
    batch_size=64,
  )
  c.evals.update(linear_probe_evals(10000))
  return c


def tipsv2_distill(student: str, *, teacher: str, total_steps: int, batch_size: int) -> mlc.ConfigDict:
  """TIPSv2 distillation stage 1 (configs/tipsv2_distill.py): a `student`/14 from a frozen teacher, no mask."""
  args.check_choice("student", student, DISTILL_STUDENTS)
  c = defaults.base_config("distill", f"{student}/14", total_steps=total_steps, batch_size=batch_size)
  c.model.image.update(dict(dtype="bfloat16", remat=True))
  c.model.text.update(dict(dtype="bfloat16", remat=True))
  c.distill.teacher = teacher or "PATH/TO/tipsv2_g14_export"
  c.data = defaults.data_config("webli", caption_keys=("caption_paligemma", "caption_gemini"))
  # "Distillation ... mirrors the pretraining setup" (TIPSv2 §3.1): the same views as tipsv2 above.
  c.input.update(
    dict(mask_ratio=0.0, num_local=6, global_crop_scale=TIPSV2_GLOBAL_CROP_SCALE, num_workers=32)
  )
  c.optim.update(dict(lr=1e-3, warmup_steps=10000, momentum_dtype="bfloat16"))
  c.mesh.update(dict(data=1, fsdp=-1, model=1))
  # What distillation is for (TIPSv2 Table 1): the student's dense patch-text alignment (zero-shot ADE150,
  # as in tipsv2 above) and its dense image-only features (linear probes on PASCAL VOC and NYUv2).
  c.evals.segmentation = dict(
    type="segmentation",
    benchmark="ade150",
    dataset="ade20k",
    split="validation",
    every_steps=10000,
    batch_size=64,
  )
  c.evals.update(linear_probe_evals(10000, datasets=("voc2012", "nyuv2")))
  return c


def high_resolution_stage(c: mlc.ConfigDict, *, init: str, init_teacher: str = "continue") -> mlc.ConfigDict:
  """Stage 2 of a TIPSv2 config, in place: 448 + 6 x 140 crops, a fresh short schedule, params from `init`.

  The same stage for pretraining (configs/tipsv2_g14_hires.py) and distillation
  (configs/tipsv2_distill_hires.py); `init` = '' leaves `init_from` unset (--config.init_from sets it).
  The teacher of stage 1 carries on (`init_teacher='continue'`: its EMA heads, EMA encoder with full EMA,
  and DINO/iBOT centres; TIPSv2 §4 calls stage 2 "a high-resolution adaptation stage", and the teacher
  temperature stays at its final value, no second warmup); `c.ema.mode` must then be stage 1's, which
  validation checks against stage 1's config.json. 'reset' starts a new teacher from the stage-1 params.
  """
  args.check_choice("init_teacher", init_teacher, schema.INIT_TEACHER)
  c.input.update(dict(global_size=448, local_size=140))
  c.optim.update(dict(lr=2e-4, warmup_steps=500))
  c.loss_opts.teacher_temp_warmup_steps = 0
  c.init_from = init or None
  c.init_teacher = init_teacher
  return c


def ito(data: str, variant: str, *, total_steps: int, batch_size: int) -> mlc.ConfigDict:
  """ITO (configs/ito_b16.py): two views, CLIP-style 512-d text tower, AdamW; `total_steps`=0 = ITO_STEPS."""
  args.check_choice("data", data, tuple(ITO_STEPS))
  args.check_choice("variant", variant, ITO_VARIANTS)
  c = defaults.base_config("ito", variant, total_steps=total_steps or ITO_STEPS[data], batch_size=batch_size)
  c.model.embed_dim = 512
  c.model.text.update(
    dict(
      out_dim=512,
      width=512,
      depth=12,
      num_heads=8,
      mlp_dim=2048,
      vocab_size=49408,
      max_len=77,
      dtype="bfloat16",
    )
  )
  c.max_len = 77
  c.model.fusion.update(dict(max_text_len=77, chunks=FUSION_CHUNKS))
  c.model.image.update(dict(dtype="bfloat16"))
  c.data = defaults.data_config(data)
  c.input.update(
    dict(
      views="two_views",
      augment="ito",
      num_local=0,
      global_crop_scale=ITO_CROP_SCALE,
      view2_crop_scale=ITO_CROP_SCALE,
      num_workers=32,
    )
  )
  c.optim.update(dict(name="adamw", lr=1e-3, warmup_steps=2000, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.1))
  c.evals.zeroshot = dict(
    type="zeroshot",
    dataset="imagenet2012",
    split="validation",
    every_steps=5000,
    batch_size=1024,
    image_size=224,
  )
  return c
