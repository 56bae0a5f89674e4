"""The complete default config: every key that exists, with its default; data presets; typed optional keys.

Why: every experiment file (configs/demo.py, configs/tipsv2_g14.py, ...) is a short `get_config(arg)` that
starts from `base_config(recipe, variant)` and overrides what the paper says; all keys exist here with
their defaults, so `tipsito.config.validation` can reject unknown keys and wrong values before anything
compiles.
"""
from __future__ import annotations

import math
from typing import Any

import ml_collections as mlc
from ml_collections import config_dict

from tipsito.config import args
from tipsito.objective import recipes
from tipsito.models import presets


# Keys whose value may be None, with the type a command-line value is parsed as. Why: ml_collections can
# override a key from the command line (`--config.data.data_dir=/x`) only when it knows the key's type, and
# a bare None has none ("Type NoneType ... is not supported for overriding"). Each of these keys is a typed
# field reference instead, so it stays overridable after a config file sets it to None. `object` takes a
# Python literal (`--config.data.build_options="{'image_size': 32}"`); '*' matches any user-named entry.
OPTIONAL_KEYS = {
    "tokenizer": str, "init_from": str, "export.dir": str,
    "data.data_dir": str, "data.label_key": str, "data.min_records_for_skip_check": int,
    "data.build_options": object,
    "distill.teacher": str, "distill.teacher_image_npz": str, "distill.teacher_text_npz": str,
    "input.crop_ratio": tuple, "input.global_crop_scale": tuple, "input.local_crop_scale": tuple,
    "input.num_epochs": int, "input.read_threads": int, "input.augment_view2": str,
    "input.view2_crop_scale": tuple,
    "model.embed_dim": int, "model.logit_scale_max": float, "model.text.out_dim": int,
    "model.text.vocab_size": int,
    "optim.clip_norm": float, "optim.clip_block_rms": float, "optim.momentum": float,
    "evals.*.data_dir": str, "evals.*.max_examples": int, "evals.*.tokenizer": str,
}


def typed_optionals(c: mlc.ConfigDict, prefix: str = "") -> mlc.ConfigDict:
  """Makes every OPTIONAL_KEYS entry under `c` (whose path is `prefix`) a typed field reference, in place.

  Called by base_config / data_config / eval configs; returns `c` for chaining.
  """
  for path, typ in OPTIONAL_KEYS.items():
    parts = path.split(".")
    if prefix:
      pre = prefix.split(".")
      if parts[:len(pre)] != pre:
        continue
      parts = parts[len(pre):]
    _type_leaves(c, parts, typ)
  return c


def _type_leaves(node: mlc.ConfigDict, parts: list[str], typ: type) -> None:
  head, rest = parts[0], parts[1:]
  keys = list(node.keys()) if head == "*" else [head] if head in node else []
  for k in keys:
    if rest:
      if isinstance(node[k], mlc.ConfigDict):
        _type_leaves(node[k], rest, typ)
      continue
    if isinstance(node._fields.get(k), config_dict.FieldReference):  # pylint: disable=protected-access
      continue
    value = node[k]
    if isinstance(value, mlc.ConfigDict):
      value = value.to_dict()
    if typ is tuple and isinstance(value, list):
      value = tuple(value)
    node[k] = config_dict.FieldReference(value, field_type=typ)


# Paper data mixtures: TFDS names/data dirs are placeholders the user points at their prepared copies
# (converted with `python -m tipsito.data.convert`); field names follow the shared record schema.
DATA_PRESETS = {
    "shapes": dict(name="shapes", caption_keys=("caption_detailed",)),
    "openclipart": dict(name="openclipart", caption_keys=("caption_short", "caption_detailed")),
    "webli": dict(name="webli", caption_keys=("caption_paligemma", "caption_gemini")),
    "cc3m": dict(name="cc3m", caption_keys=()),
    "cc12m": dict(name="cc12m", caption_keys=()),
    "yfcc15m": dict(name="yfcc15m", caption_keys=()),
    "laion100m": dict(name="laion100m", caption_keys=()),
    "datacomp1b": dict(name="datacomp1b", caption_keys=()),
}


def data_config(preset: str, **overrides: Any) -> mlc.ConfigDict:
  """`config.data` for a named preset (see DATA_PRESETS)."""
  args.check_choice("data", preset, DATA_PRESETS)
  d = dict(name=preset, split="train", data_dir=None, image_key="image", alt_text_key="alt_text",
           caption_keys=(), label_key=None, max_skip_fraction=0.05,
           min_records_for_skip_check=None, build_if_missing=False, build_options=None,
           # Image limits (tipsito.data.transforms.ImageLimits): decode large images downscaled above
           # max_pixels, skip above hard_max_pixels, below min_side or beyond max_aspect; transparent
           # pixels are composited on `background`.
           max_pixels=4096 * 4096, hard_max_pixels=16384 * 16384, min_side=2, max_aspect=20.0,
           background=(255, 255, 255))
  d.update(DATA_PRESETS[preset])
  d.update(overrides)
  return typed_optionals(mlc.ConfigDict(d), "data")


# Per tower: `remat` rematerialises each block with `remat_policy` (tipsito.models.layers.REMAT_POLICIES);
# `scan` runs the blocks as one nn.scan (params stacked under 'blocks'; compiles once per tower instead of
# once per block, see tipsito.models.layer_stack). Unrolled is the default; `python -m tipsito.plan --search`
# picks these for a TPU topology.
SCAN_DEFAULTS = dict(remat_policy="nothing_saveable", scan=False)


def base_config(recipe_name: str, variant: str, *, text_variant: str | None = None,
                total_steps: int = 1000, batch_size: int = 1024) -> mlc.ConfigDict:
  """The complete default config for `recipe_name` with image tower `variant` (e.g. 'B/14').

  Recipe defaults (loss weights, views, CLS count, EMA mode, mask ratio, optimizer, pixel statistics)
  come from the recipe registry; everything is overridable afterwards.
  """
  r = recipes.get_recipe(recipe_name)
  c = mlc.ConfigDict()
  c.seed = 0
  c.recipe = recipe_name
  c.tokenizer = None
  c.max_len = 64
  c.total_steps = total_steps
  c.model = _model_config(r, variant, text_variant or variant)

  c.loss = mlc.ConfigDict(dict(r.loss))
  # dino_reduction: 'mean' | 'sum' of DINO's cross-entropies over the student crops (TIPSv2 Eq. 1 writes
  # a sum; 'mean' is DINOv2's implementation, why it is the default: `dino_term` in
  # tipsito/objective/terms.py). view_weighting: 'mean' | 'sum' of the alt-text InfoNCE over ITO's two
  # views (`contrastive_pair_weights` there; the recipe's default: 'mean' for tipsito).
  c.loss_opts = mlc.ConfigDict(dict(
      student_temp=0.1, teacher_temp=0.07, warmup_teacher_temp=0.04, teacher_temp_warmup_steps=0,
      center_momentum=0.9, ibot_all_patches=recipe_name != "tips", ibot_token_norm="masked",
      teacher_method="centering", fusion_cls=0, contrastive_view="unmasked", dino_reduction="mean",
      view_weighting=r.view_weighting))
  # EMA teacher momentum: `constant`, or `cosine` from `momentum` at step 0 to 1 at the last step (DINO).
  c.ema = mlc.ConfigDict(dict(mode=r.ema_mode, momentum=0.996, schedule="constant"))
  c.optim = _optim_config(r.optimizer, total_steps)
  c.mesh = mlc.ConfigDict(dict(data=1, fsdp=-1, model=1))
  c.sharding = mlc.ConfigDict(dict(rules=(), min_size=2 ** 12))
  c.data = data_config("shapes")
  c.input = _input_config(r, batch_size)
  c.evals = mlc.ConfigDict()
  _add_run_keys(c)
  return typed_optionals(c)


def _model_config(r: recipes.Recipe, variant: str, text_variant: str) -> mlc.ConfigDict:
  """`config.model`: the towers of `variant` / `text_variant`, the heads, the fusion block, the logit scale."""
  tips_px = r.pixel == "tips"
  mean = presets.TIPS_PIXEL_MEAN if tips_px else presets.CLIP_PIXEL_MEAN
  std = presets.TIPS_PIXEL_STD if tips_px else presets.CLIP_PIXEL_STD
  # CLIP/SigLIP/ITO (the recipes with an image projection) use OpenCLIP's towers, TIPS recipes the
  # official TIPS ones (tipsito.models.presets.IMAGE_STRUCTURE / TEXT_STRUCTURE). OpenCLIP's position
  # table is the 224px grid (ViT-B-16: 14x14 + the class row); TIPSv2's is 32x32 without one.
  clip_style = "image_proj" in r.parts
  structure = "openclip" if clip_style else "tips"
  patch = presets.vit_config(variant)["patch_size"]
  m = mlc.ConfigDict()
  m.image = presets.vit_config(
      variant, num_cls_tokens=r.num_cls, posemb_grid=224 // patch if clip_style else 32,
      use_mask_token=r.mask_ratio > 0,
      dropout=0.0, stochastic_depth=0.0, remat=False, dtype="float32", param_dtype="float32",
      pixel_mean=tuple(mean), pixel_std=tuple(std), **presets.IMAGE_STRUCTURE[structure],
      **SCAN_DEFAULTS)
  width = m.image.width
  m.text = presets.text_config(
      text_variant, vocab_size=32000, max_len=64, out_dim=None, dropout=0.0, remat=False,
      dtype="float32", param_dtype="float32", **presets.TEXT_STRUCTURE[structure], **SCAN_DEFAULTS)
  # CLIP/ITO: both towers project to embed_dim; TIPS: shared width, no projection.
  m.embed_dim = width if clip_style else None
  if clip_style:
    m.text.out_dim = width
  m.heads = mlc.ConfigDict(dict(num_prototypes=32768, hidden_dim=2048, bottleneck_dim=256, num_layers=3))
  m.fusion = mlc.ConfigDict(dict(width=512, depth=2, num_heads=8))
  m.logit_scale_init = math.log(10.0) if r.name == "siglip" else math.log(1 / 0.07)
  m.logit_scale_max = math.log(100.0) if clip_style else None
  m.logit_bias_init = -10.0
  return m


def _optim_config(name: str, total_steps: int) -> mlc.ConfigDict:
  """`config.optim` for the recipe's optimizer, with the other optimizer's keys present too.

  Adafactor is big_vision's (tipsito/train/optim.py): -sched * (lr * adafactor(clip(g)) + wd * p_kernel),
  second-moment decay min(beta2_cap, 1 - t^-decay_rate), momentum an EMA (not a trace) kept in
  momentum_dtype (bfloat16 in the pod configs as big_vision's default; float32 here, for tests).
  AdamW is optax.adamw: the decoupled decay is multiplied by the learning rate.
  """
  if name == "adafactor":
    return mlc.ConfigDict(dict(
        name="adafactor", lr=1e-3, warmup_steps=min(10000, total_steps // 10), schedule="cosine",
        min_lr_ratio=0.0, weight_decay=1e-4, clip_norm=1.0, momentum=0.9, momentum_dtype="float32",
        decay_rate=0.8, beta2_cap=0.999, min_dim_size_to_factor=32, eps=1e-30, clip_block_rms=None,
        b1=0.9, b2=0.999, lr_mults={}, frozen=()))
  return mlc.ConfigDict(dict(
      name="adamw", lr=5e-4, warmup_steps=min(2000, total_steps // 10), schedule="cosine",
      min_lr_ratio=0.0, weight_decay=0.1, clip_norm=1.0, b1=0.9, b2=0.98, eps=1e-6,
      momentum=None, momentum_dtype="float32", decay_rate=0.8, beta2_cap=0.999, min_dim_size_to_factor=32,
      clip_block_rms=None, lr_mults={}, frozen=()))


def _input_config(r: recipes.Recipe, batch_size: int) -> mlc.ConfigDict:
  """`config.input`: views, crop sizes, masking and augmentation of the recipe; loader settings."""
  return mlc.ConfigDict(dict(
      # microbatches: the step processes the global batch in K equal micro-batches with the same update
      # (exact gradient accumulation, tipsito/objective/accumulate.py): less memory, one extra forward.
      batch_size=batch_size, microbatches=1, views=r.views, global_size=224, local_size=98,
      num_local=6 if "multicrop" in r.views else 0, mask_ratio=r.mask_ratio, mask_type="random",
      mask_prob=1.0, augment="tips" if r.pixel == "tips" else "ito",
      # multicrop_two_views (tipsito): ITO's photometric augmentation on the second view, which ITO credits
      # for its gain; view 1 keeps the TIPS crop + flip. None = same as `augment`.
      augment_view2="ito" if r.views == "multicrop_two_views" else None,
      num_workers=0, prefetch=2, shuffle_seed=0,
      shuffle=True, num_epochs=None, read_threads=None,
      # Crop area fractions and aspect range; None = the augmentation's default (ITO global (0.5, 1),
      # DINO global (0.32, 1), local (0.05, 0.32), ratio (3/4, 4/3)). view2_crop_scale: the second view
      # ('image2', two-view modes) has its own range, ITO's RandomResizedCrop scale (ITO "Method": "random
      # resized crop with scale 0.5-1.0") whatever view 1 uses (None also means (0.5, 1)).
      global_crop_scale=None, local_crop_scale=None, view2_crop_scale=(0.5, 1.0), crop_ratio=None))


def _add_run_keys(c: mlc.ConfigDict) -> None:
  """Checkpointing, guards, logging, profiling, export, initialisation and distillation-teacher keys."""
  c.ckpt = mlc.ConfigDict(dict(every_steps=1000, keep=3, async_save=True))
  # Non-finite guard (tipsito/train/step.py): a step with a non-finite loss, gradient or update leaves the
  # state unchanged; this many such steps in a row stop the run.
  c.nonfinite = mlc.ConfigDict(dict(max_consecutive=10))
  c.log_every_steps = 50
  # Observability (tipsito/train/observability.py): peak TFLOP/s of one device for the FLOP utilisation
  # (0 = the per-platform table there; CPU has none), and a JAX profiler trace of this many steps after
  # the first (compiling) step, written to <workdir>/plugins/profile (0 = off).
  c.peak_tflops = 0.0
  c.profile_steps = 0
  c.export = mlc.ConfigDict(dict(enabled=True, dir=None))
  c.init_from = None
  # With init_from (stage 2): 'continue' carries on the init run's teacher (its EMA heads / EMA encoder
  # and DINO/iBOT centres; the EMA mode must then be the init run's, checked by validation), 'reset'
  # rebuilds it from the restored params (EMA = copy of the student, zero centres).
  c.init_teacher = "continue"
  # dino_global_crop: distillation also uses the student's global crop as a DINO student view (off:
  # TIPSv2 §3.1 changes only the teacher and the mask for distillation); init_image: the student image
  # encoder starts from the teacher's (the paper starts it at random: its ablation, Table 2).
  c.distill = mlc.ConfigDict(dict(teacher=None, teacher_image_npz=None, teacher_text_npz=None,
                                  init_text=False, init_image=False, dino_global_crop=False))


def tiny_config(recipe_name: str, *, batch_size: int = 8, total_steps: int = 10,
                image_size: int = 32, num_local: int = 2) -> mlc.ConfigDict:
  """A CPU-sized config of any recipe (tests, `bench` smoke runs): tiny/16 towers, small heads."""
  c = base_config(recipe_name, "tiny/16", total_steps=total_steps, batch_size=batch_size)
  c.model.text.vocab_size = None  # the demo tokenizer's size (tests that never tokenize pass their own)
  c.max_len = 8
  c.model.text.max_len = 8
  c.model.heads.update(dict(num_prototypes=64, hidden_dim=32, bottleneck_dim=16))
  c.model.fusion.update(dict(width=32, depth=1, num_heads=2))
  c.input.update(dict(global_size=image_size, local_size=image_size // 2))
  if c.input.num_local:
    c.input.num_local = num_local
  c.optim.warmup_steps = 0
  c.optim.lr = 1e-3
  c.optim.min_dim_size_to_factor = 32
  c.ckpt.update(dict(every_steps=5, keep=2, async_save=False))
  c.log_every_steps = 1
  return c
