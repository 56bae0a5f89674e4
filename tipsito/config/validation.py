"""Config validation: every wrong key or value fails before anything compiles, naming the key and what is
allowed.

Why: a typo in `--config.loss.ibot=...` or `--config.input.views=multicrops` must cost seconds on a laptop,
not a pod allocation and a 20-minute compile. The allowed key set is the reference config of the same
recipe (`tipsito.config.defaults.base_config`), the allowed module kwargs are the dataclass fields of the
modules, and each enumeration is the one the module that uses it defines (views and augmentations:
tipsito/data/pipeline.py, mask types: tipsito/data/masking.py, optimizers and schedules:
tipsito/train/optim.py, EMA modes: tipsito/objective/recipes.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import ml_collections as mlc

from tipsito import models
from tipsito.config import defaults
from tipsito.data.masking import MASK_TYPES
from tipsito.data.pipeline import AUGMENTS, VIEWS
from tipsito.losses.self_distill import DINO_REDUCTIONS, TEACHER_METHODS
from tipsito.models.text import FLAVOURS
from tipsito.objective import recipes as recipes_lib
from tipsito.objective.recipes import EMA_MODES
from tipsito.objective.terms import TERMS, VIEW_WEIGHTINGS
from tipsito.train import sharding
from tipsito.train import workdir as workdir_lib
from tipsito.train.optim import OPTIMIZERS, SCHEDULES

# Enumerations no other module names as a constant (the modules reading these keys branch on the values).
DTYPES = ("float32", "bfloat16", "float16")
EMA_SCHEDULES = ("constant", "cosine")
TOKEN_NORMS = ("masked", "patches")
FFNS = ("mlp", "swiglu")
# Sub-dicts whose keys are free-form (user-named).
FREE_FORM = ("evals", "optim.lr_mults")


class ConfigError(ValueError):
  """A config key or value is wrong; the message names the key and the allowed keys/values."""


def _choice(key: str, value: Any, allowed: Iterable) -> None:
  allowed = tuple(allowed)
  if value not in allowed:
    raise ConfigError(f"config.{key}={value!r} is not allowed; valid values: {list(allowed)}")


def _int_at_least(key: str, value: Any, lo: int, *, optional: bool = False) -> None:
  """Counts and sizes: an int >= lo (None also allowed when `optional`)."""
  if optional and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < lo:
    none = "None or " if optional else ""
    raise ConfigError(f"config.{key}={value!r} is not allowed; valid values: {none}an integer >= {lo}")


def _divisible(key: str, value: int, by_key: str, by: int, why: str) -> None:
  if value % by:
    lo, hi = value - value % by, value - value % by + by
    near = [v for v in (lo, hi) if v > 0]
    raise ConfigError(f"config.{key}={value} must be a multiple of config.{by_key}={by} ({why}); "
                      f"valid values: multiples of {by}, e.g. {' or '.join(map(str, near))}")


def _check_geometry(config: mlc.ConfigDict, recipe) -> None:
  """Model and input geometry that would otherwise fail deep inside Flax, Orbax or the pipeline."""
  m, inp = config.model, config.input
  for tower in ("image", "text"):
    if tower == "text" and "text" not in recipe.parts:
      continue
    t = m[tower]
    for k in ("width", "depth", "num_heads", "mlp_dim"):
      if k in t:
        _int_at_least(f"model.{tower}.{k}", t[k], 1)
    if "width" in t and "num_heads" in t:
      _divisible(f"model.{tower}.width", t.width, f"model.{tower}.num_heads", t.num_heads,
                 "attention splits the width into equal heads")
  img = m.image
  _int_at_least("model.image.patch_size", img.patch_size, 1)
  if "posemb_grid" in img:
    _int_at_least("model.image.posemb_grid", img.posemb_grid, 1)
  if "text" in recipe.parts:
    _int_at_least("model.text.vocab_size", m.text.get("vocab_size"), 2, optional=True)
    _int_at_least("model.text.max_len", m.text.get("max_len", 1), 1)
    _int_at_least("max_len", config.max_len, 1)
  if "fusion" in recipe.parts:
    f = m.fusion
    for k in ("width", "depth", "num_heads"):
      _int_at_least(f"model.fusion.{k}", f[k], 1)
    _divisible("model.fusion.width", f.width, "model.fusion.num_heads", f.num_heads,
               "attention splits the width into equal heads")
  if any(p in recipe.parts for p in ("dino_head", "ibot_head")):
    for k in ("num_prototypes", "hidden_dim", "bottleneck_dim", "num_layers"):
      if k in m.heads:
        _int_at_least(f"model.heads.{k}", m.heads[k], 1)
  p = int(img.patch_size)
  # Every training crop is whole patches. The ViT centre zero-pads an input that is not (the official
  # release's rule, kept for evaluation inputs, which are not checked here), so a 98 px local crop on a
  # patch-16 tower would be a 112 px input whose outer 23 % is a black frame the teacher never sees; the
  # iBOT mask lives on the global crop's patch grid. View 2 ('image2') is drawn at input.global_size.
  view2 = " and view 2" if "two_views" in inp.views else ""
  _int_at_least("input.global_size", inp.global_size, p)
  _divisible("input.global_size", inp.global_size, "model.image.patch_size", p,
             f"the global crop{view2} must be whole patches for training; only evaluation inputs are "
             "zero-padded")
  _int_at_least("input.num_local", inp.num_local, 0)
  if "multicrop" in inp.views and inp.num_local:
    _int_at_least("input.local_size", inp.local_size, p)
    _divisible("input.local_size", inp.local_size, "model.image.patch_size", p,
               "local crops must be whole patches for training, or the ViT zero-pads them with a frame "
               "the teacher never sees; only evaluation inputs are zero-padded")
  for k, lo in (("num_workers", 0), ("prefetch", 0), ("batch_size", 1)):
    _int_at_least(f"input.{k}", inp[k], lo)
  _int_at_least("input.microbatches", inp.get("microbatches", 1), 1)
  _divisible("input.batch_size", inp.batch_size, "input.microbatches", inp.get("microbatches", 1),
             "the step processes the global batch in that many equal micro-batches")
  _int_at_least("input.read_threads", inp.get("read_threads"), 1, optional=True)
  _int_at_least("input.num_epochs", inp.get("num_epochs"), 1, optional=True)
  _int_at_least("ckpt.keep", config.ckpt.keep, 1)
  _int_at_least("nonfinite.max_consecutive", config.nonfinite.max_consecutive, 1)
  _int_at_least("ckpt.every_steps", config.ckpt.every_steps, 0)
  _int_at_least("log_every_steps", config.log_every_steps, 1)
  _int_at_least("total_steps", config.total_steps, 1)
  _int_at_least("optim.warmup_steps", config.optim.warmup_steps, 0)


def _check_keys(key: str, got: Any, allowed: Iterable[str]) -> None:
  allowed = sorted(allowed)
  for k in got.keys():
    if k not in allowed:
      raise ConfigError(f"config.{key + '.' if key else ''}{k} is not a known key; valid keys under "
                        f"config{'.' + key if key else ''}: {allowed}")


def _module_fields(cls) -> list[str]:
  return [f.name for f in dataclasses.fields(cls) if f.name not in ("parent", "name")]


def _compare_tree(key: str, got: mlc.ConfigDict, ref: mlc.ConfigDict) -> None:
  """Unknown keys anywhere under `got` (relative to the reference config) are errors."""
  _check_keys(key, got, ref.keys())
  for k in got.keys():
    sub = f"{key}.{k}" if key else k
    if sub in FREE_FORM or sub in ("model.image", "model.text", "model.heads", "model.fusion", "loss"):
      continue
    if isinstance(got[k], mlc.ConfigDict) and isinstance(ref.get(k), mlc.ConfigDict):
      _compare_tree(sub, got[k], ref[k])


def check_text_vocab(config: mlc.ConfigDict) -> None:
  """`config.tokenizer` must load, and its vocabulary must equal `config.model.text.vocab_size` (when that
  is not None, which means: take the size from the tokenizer).

  Why: the paper configs size the embedding for the official 32k (TIPS) / 49k (CLIP) tokenizers while
  `config.tokenizer=None` is the 2k demo model; training would silently use 2k of 32k rows, and released
  text weights would be indexed by the wrong ids.
  """
  recipe = recipes_lib.get_recipe(config.recipe)
  vocab = config.model.text.get("vocab_size")
  if "text" not in recipe.parts:
    return
  from tipsito.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
  try:
    tok = tok_lib.from_config(config)  # the text flavour's special tokens count ('clip': SOT/EOT)
  except FileNotFoundError as e:
    raise ConfigError(f"config.tokenizer={config.tokenizer!r}: {e}") from None
  if vocab is not None and tok.vocab_size != int(vocab):
    which = ("None (the shipped demo model)" if config.tokenizer is None else repr(config.tokenizer))
    special = (f" ({tok.vocab_size - 2} of the model + SOT/EOT of the 'clip' text flavour)"
               if tok.flavour == "clip" else "")
    raise ConfigError(
        f"config.tokenizer={which} has a vocabulary of {tok.vocab_size}{special} but "
        f"config.model.text.vocab_size={vocab}; set --config.tokenizer to the SentencePiece model the text tower is sized for (e.g. the "
        f"official 32k TIPS model for vocab_size=32000), or --config.model.text.vocab_size=None to take the "
        f"size from the tokenizer")


def validate(config: mlc.ConfigDict, *, num_devices: int | None = None, process_count: int = 1,
             check_tokenizer: bool = True) -> None:
  """Raises ConfigError naming the first wrong key/value. Cheap: no model is built.

  Args:
    config: the full training config.
    num_devices: when given, also checks the mesh and that the global batch splits over (data, fsdp).
    process_count: number of JAX processes (the batch must split over hosts too).
    check_tokenizer: load `config.tokenizer` and compare its vocabulary with `model.text.vocab_size`
      (`check_text_vocab`). Off only for tools that never tokenize (info, bench on synthetic batches).
  """
  if "recipe" not in config:
    raise ConfigError(f"config.recipe is missing; valid values: {sorted(recipes_lib.RECIPES)}")
  _choice("recipe", config.recipe, recipes_lib.RECIPES)
  recipe = recipes_lib.get_recipe(config.recipe)
  _compare_tree("", config, defaults.base_config(config.recipe, "tiny/16"))
  _check_model(config, recipe)
  weights = _check_loss(config, recipe)
  _check_optim(config)
  _check_input(config, recipe, weights)
  _check_init(config)
  if num_devices is not None:
    _check_batch_split(config, num_devices, process_count)
  _check_keys("mesh", config.mesh, ("data", "fsdp", "model"))
  _check_evals(config)
  if check_tokenizer:
    check_text_vocab(config)


def _check_evals(config: mlc.ConfigDict) -> None:
  """Enabled segmentation evals: keys and values (benchmark, protocol, resize; tipsito/evals/segmentation.py)."""
  from tipsito.evals import segmentation  # pylint: disable=g-import-not-at-top
  for name, ev in (config.get("evals") or {}).items():
    ev = ev.to_dict() if hasattr(ev, "to_dict") else dict(ev)
    if ev.get("type") != "segmentation" or ev.get("enabled", True) is False:
      continue
    try:
      segmentation.resolve_config(ev)
    except (KeyError, ValueError) as e:
      raise ConfigError(f"config.evals.{name}: {e.args[0]}") from None


def _check_model(config: mlc.ConfigDict, recipe) -> None:
  """Module kwargs are the modules' dataclass fields; enumerations, geometry and the projection rule."""
  m = config.model
  _check_keys("model.image", m.image, _module_fields(models.VisionTransformer))
  _check_keys("model.text", m.text, _module_fields(models.TextEncoder))
  _check_keys("model.heads", m.heads, _module_fields(models.DINOHead))
  _check_keys("model.fusion", m.fusion, _module_fields(models.FusionTransformer))
  for req in ("patch_size", "width", "depth", "num_heads", "mlp_dim"):
    if req not in m.image:
      raise ConfigError(f"config.model.image.{req} is missing")
  _choice("model.image.ffn", m.image.get("ffn", "mlp"), FFNS)
  _choice("model.image.num_cls_tokens", m.image.get("num_cls_tokens", 1), (1, 2))
  _choice("model.text.flavour", m.text.get("flavour", "tips"), FLAVOURS)
  _check_geometry(config, recipe)
  for tower in ("image", "text"):
    for dk in ("dtype", "param_dtype"):
      if dk in m[tower]:
        _choice(f"model.{tower}.{dk}", str(m[tower][dk]), DTYPES)
    if "remat_policy" in m[tower]:
      _choice(f"model.{tower}.remat_policy", m[tower].remat_policy, sorted(models.layers.REMAT_POLICIES))
  if "image_proj" in recipe.parts and not m.embed_dim:
    raise ConfigError(f"config.model.embed_dim must be a positive int for recipe {recipe.name!r} "
                      "(it has an image projection)")
  if "image_proj" not in recipe.parts and m.embed_dim is not None:
    if m.text.width != m.image.width:
      raise ConfigError(f"config.model.embed_dim must be None for recipe {recipe.name!r} and "
                        f"model.text.width ({m.text.width}) must equal model.image.width "
                        f"({m.image.width}) (TIPS: shared width, no projection)")


def _check_loss(config: mlc.ConfigDict, recipe) -> dict[str, float]:
  """Loss weights (keys restricted to the recipe's terms), loss options and EMA; returns the non-zero weights."""
  for k, v in config.loss.items():
    if k not in recipe.terms:
      raise ConfigError(f"config.loss.{k} is not a loss term of recipe {recipe.name!r}; valid keys: "
                        f"{list(recipe.terms)}")
    if not isinstance(v, (int, float)) or v < 0:
      raise ConfigError(f"config.loss.{k}={v!r}: must be a float >= 0")
  weights = {k: float(v) for k, v in config.loss.items() if v}
  if not weights:
    raise ConfigError(f"config.loss: every weight is 0; set at least one of {list(recipe.terms)}")
  lo = config.loss_opts
  _choice("loss_opts.teacher_method", lo.teacher_method, TEACHER_METHODS)
  _choice("loss_opts.ibot_token_norm", lo.ibot_token_norm, TOKEN_NORMS)
  _choice("loss_opts.contrastive_view", lo.contrastive_view, ("unmasked", "masked"))
  _choice("loss_opts.fusion_cls", lo.fusion_cls, tuple(range(config.model.image.get("num_cls_tokens", 1))))
  _choice("loss_opts.dino_reduction", lo.dino_reduction, DINO_REDUCTIONS)
  _choice("loss_opts.view_weighting", lo.view_weighting, VIEW_WEIGHTINGS)
  _choice("distill.dino_global_crop", config.distill.dino_global_crop, (False, True))
  _choice("distill.init_image", config.distill.init_image, (False, True))
  if config.distill.init_image and recipe.teacher != "frozen":
    raise ConfigError(f"config.distill.init_image=True is for recipe 'distill' only (recipe "
                      f"{config.recipe!r} has no frozen teacher); valid values: [False]")
  if config.distill.dino_global_crop and recipe.teacher != "frozen":
    raise ConfigError(f"config.distill.dino_global_crop=True is for recipe 'distill' only (recipe "
                      f"{recipe.name!r} has no frozen teacher); valid values: [False]")
  _choice("ema.mode", config.ema.mode, EMA_MODES)
  if not 0.0 <= float(config.ema.momentum) <= 1.0:
    raise ConfigError(f"config.ema.momentum={config.ema.momentum}: must be in [0, 1]")
  _choice("ema.schedule", config.ema.get("schedule", "constant"), EMA_SCHEDULES)
  if recipe.teacher == "frozen" and config.ema.mode == "full":
    raise ConfigError("config.ema.mode='full' is not allowed for recipe 'distill' (the teacher encoder is "
                      "frozen); valid values: ['head', 'none']")
  return weights


def _check_optim(config: mlc.ConfigDict) -> None:
  """Optimizer, schedule, step counts and the observability knobs."""
  o = config.optim
  _choice("optim.name", o.name, OPTIMIZERS)
  _choice("optim.schedule", o.schedule, SCHEDULES)
  if not float(o.lr) > 0:
    raise ConfigError(f"config.optim.lr={o.lr}: must be > 0")
  _choice("optim.momentum_dtype", str(o.get("momentum_dtype", "float32")), DTYPES)
  if not 0.0 < float(o.get("beta2_cap", 0.999)) <= 1.0:
    raise ConfigError(f"config.optim.beta2_cap={o.beta2_cap}: must be in (0, 1]")
  if int(config.total_steps) <= 0:
    raise ConfigError(f"config.total_steps={config.total_steps}: must be > 0")
  if int(config.get("profile_steps", 0)) < 0:
    raise ConfigError(f"config.profile_steps={config.profile_steps}: must be >= 0 (0 = no trace)")
  if float(config.get("peak_tflops", 0.0)) < 0:
    raise ConfigError(f"config.peak_tflops={config.peak_tflops}: must be >= 0 (0 = per-platform table)")


def _check_input(config: mlc.ConfigDict, recipe, weights: dict[str, float]) -> None:
  """Views, masking, augmentation and crop ranges, and the inputs the weighted loss terms need."""
  inp = config.input
  _choice("input.views", inp.views, VIEWS)
  _choice("input.mask_type", inp.mask_type, MASK_TYPES)
  _choice("input.augment", inp.augment, AUGMENTS)
  _choice("input.augment_view2", inp.get("augment_view2"), (None,) + tuple(AUGMENTS))
  if not 0.0 <= float(inp.mask_ratio) < 1.0:
    raise ConfigError(f"config.input.mask_ratio={inp.mask_ratio}: must be in [0, 1)")
  if int(inp.batch_size) <= 0:
    raise ConfigError(f"config.input.batch_size={inp.batch_size}: must be > 0")
  for key in ("global_crop_scale", "local_crop_scale", "view2_crop_scale", "crop_ratio"):
    v = inp.get(key)
    if v is None:
      continue
    ok = isinstance(v, (tuple, list)) and len(v) == 2 and 0 < float(v[0]) <= float(v[1])
    if ok and key != "crop_ratio":
      ok = float(v[1]) <= 1.0
    if not ok:
      bound = "0 < lo <= hi" if key == "crop_ratio" else "0 < lo <= hi <= 1"
      raise ConfigError(f"config.input.{key}={v!r}: must be None or a pair (lo, hi) with {bound}")
  second_view = sorted(t for t in weights if "image2" in TERMS[t].fields)
  if second_view and "two_views" not in inp.views:
    raise ConfigError(f"config.input.views={inp.views!r}: loss terms {second_view} "
                      "need a second view; valid values: ['two_views', 'multicrop_two_views']")
  if "ibot" in weights and inp.mask_ratio > 0 and not config.model.image.get("use_mask_token"):
    raise ConfigError("config.model.image.use_mask_token must be True when config.loss.ibot > 0 and "
                      "config.input.mask_ratio > 0")
  if recipe.teacher == "frozen" and not (config.distill.teacher or config.distill.teacher_image_npz):
    raise ConfigError("config.distill.teacher (an export dir) or config.distill.teacher_image_npz "
                      "(official TIPS weights) is required for recipe 'distill'")


def _check_init(config: mlc.ConfigDict) -> None:
  """`init_teacher`; with 'continue', the EMA mode must be the one of the `init_from` run (its config.json)
  since its EMA subset is restored as it is (tipsito/train/workdir.py `init_from_run`). Refusing, rather
  than silently following the init run, keeps the config the one source of what the run does."""
  _choice("init_teacher", config.init_teacher, workdir_lib.INIT_TEACHER)
  if not config.init_from or config.init_teacher != "continue":
    return
  saved = workdir_lib.init_run_config(config.init_from)
  if saved is None:  # not a workdir (or not readable yet): the restore names what is missing
    return
  was = (saved.get("ema") or {}).get("mode")
  if was != config.ema.mode:
    hint = (" (configs/tipsv2_g14_hires.py: `ema=full`)" if was == "full" else "")
    raise ConfigError(
        f"config.ema.mode={config.ema.mode!r} but config.init_from={config.init_from!r} was trained with "
        f"ema.mode={was!r}; config.init_teacher='continue' (the default) continues that run's teacher, so "
        f"set --config.ema.mode={was}{hint}, or --config.init_teacher=reset to start a new teacher from "
        f"its params")


def _check_batch_split(config: mlc.ConfigDict, num_devices: int, process_count: int) -> None:
  """The mesh fits `num_devices` and the global batch splits over (data, fsdp) and over the hosts."""
  try:
    shape = sharding.mesh_shape(config.mesh, num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  split = shape[0] * shape[1]
  batch_size = config.input.batch_size
  if batch_size % split or batch_size % process_count:
    raise ConfigError(f"config.input.batch_size={batch_size} must be divisible by mesh data*fsdp="
                      f"{split} and the process count {process_count}")
  k = int(config.input.get("microbatches", 1))
  if (batch_size // k) % split:
    raise ConfigError(f"config.input.batch_size={batch_size} / config.input.microbatches={k} = "
                      f"{batch_size // k} per micro-batch must be divisible by mesh data*fsdp={split}")
