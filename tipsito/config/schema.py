"""The config schema: every config key, declared once, with its type, default, allowed values or range,
whether changing it on resume is safe, and a one-line description.

Why one table: the defaults (`tipsito.config.defaults.base_config` builds them from here), the typing of
keys whose value may be None (`OPTIONAL_KEYS`), validation (`tipsito.config.validation`: types, choices
and ranges are checked from here; only cross-key rules are written as functions there), the resume
guard's safe/unsafe classification (`tipsito.train.resume_guard.SAFE_KEYS`) and
`python -m tipsito.info --schema` all read this table, so adding a key is one `K(...)` line here.

A default is a value, or a function of the `Ctx` (recipe, image/text variant, total steps, batch size)
for the keys whose default depends on the recipe (the values come from the recipe table,
tipsito/config/recipes.py), on the optimizer or on the variant preset (tipsito/config/presets.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Optional

from tipsito.choices import (
  ACTIVATIONS,
  ATTENTIONS,
  AUGMENTS,
  DINO_REDUCTIONS,
  FLAVOURS,
  MASK_TYPES,
  REMAT_POLICIES,
)
from tipsito.choices import TEACHER_METHODS, TERM_NAMES, VIEW_WEIGHTINGS, VIEWS, view_layout
from tipsito.choices import (
  EVAL_TYPES,
  MASK_SOURCES,
  PROBE_TYPES,
  PROTOCOLS,
  RESIZE_MODES,
  SEGMENTATION_BENCHMARKS,
)
from tipsito.config import presets
from tipsito.config import recipes as recipes_lib
from tipsito.config.recipes import EMA_MODES

# Enumerations no other module names as a constant (the modules reading these keys branch on the values).
DTYPES = ("float32", "bfloat16", "float16")
# Declared here, not in the modules that implement them: the config layer sits below tipsito/train/
# (tipsito/train/optim.py and tipsito/train/assembly.py read these tables).
OPTIMIZERS = ("adafactor", "adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant")
# `config.init_teacher`: what a run started with `config.init_from` does with the init run's teacher.
INIT_TEACHER = ("continue", "reset")
EMA_SCHEDULES = ("constant", "cosine")
TOKEN_NORMS = ("masked", "patches", "separate")
FFNS = ("mlp", "swiglu")
CONTRASTIVE_VIEWS = ("unmasked", "masked")
BOOLS = (False, True)


@dataclasses.dataclass(frozen=True)
class Range:
  """A numeric interval; None = unbounded on that side; `lo_open` / `hi_open` exclude the bound."""

  lo: Optional[float] = None
  hi: Optional[float] = None
  lo_open: bool = False
  hi_open: bool = False

  def contains(self, v: float) -> bool:
    if not math.isfinite(float(v)):
      return False
    if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
      return False
    if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
      return False
    return True

  def __str__(self) -> str:
    if self.lo is None and self.hi is None:
      return "any finite number"
    if self.hi is None:
      return f"{'>' if self.lo_open else '>='} {self.lo:g}"
    if self.lo is None:
      return f"{'<' if self.hi_open else '<='} {self.hi:g}"
    return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def _in(r: Range) -> str:
  s = str(r)
  return f"in {s}" if s[0] in "[(" else s


def ge(x: float) -> Range:
  return Range(lo=x)


def gt(x: float) -> Range:
  return Range(lo=x, lo_open=True)


ANY = Range()
UNIT = Range(0.0, 1.0)  # [0, 1]: probabilities, momenta, fractions
UNIT_HI_OPEN = Range(0.0, 1.0, hi_open=True)  # [0, 1): mask ratio, dropout, Adam betas
UNIT_LO_OPEN = Range(0.0, 1.0, lo_open=True)  # (0, 1]: crop area fractions, decay caps


@dataclasses.dataclass(frozen=True)
class Ctx:
  """What a recipe-, optimizer- or variant-dependent default is a function of."""

  recipe: recipes_lib.Recipe
  variant: str
  text_variant: str
  total_steps: int
  batch_size: int

  @property
  def clip_style(self) -> bool:
    """CLIP/SigLIP/ITO (an image projection): OpenCLIP towers; the TIPS recipes: the official TIPS ones."""
    return "image_proj" in self.recipe.parts

  @property
  def structure(self) -> str:
    return "openclip" if self.clip_style else "tips"

  @property
  def image_preset(self) -> dict:
    return presets.vit_config(self.variant)

  @property
  def text_preset(self) -> dict:
    return presets.text_config(self.text_variant)

  @property
  def tips_pixels(self) -> bool:
    return self.recipe.pixel == "tips"


ABSENT = object()  # default of a key the builder does not create (user-named entries: 'evals.*.x')


@dataclasses.dataclass(frozen=True)
class Key:
  """One config key (see the module docstring).

  Attributes:
    path: dotted path ('optim.lr'); '*' stands for any user-named entry ('evals.*.data_dir').
    type: int, float, bool, str, tuple, dict or object (a Python literal); float accepts an int.
    default: the value, a function of `Ctx`, or ABSENT.
    doc: one line.
    choices: the allowed values (a tuple, or a function returning one, resolved when checked).
    range: numeric range of the value (of each element for tuples).
    optional: None is allowed too (and the key is a typed field reference, overridable from the command
      line after a config sets it to None).
    safe: changing it on resume keeps the checkpoints consistent (tipsito/train/resume_guard.py).
    length: a tuple's length (None = any).
    pair: a tuple (lo, hi) with lo <= hi.
    when: the key exists only for recipes where this holds (loss weights: the recipe's terms).
    eval_types: an eval key ('evals.*.k'): the evaluator types that read it (None = every type).
    type_defaults: an eval key's default for the types that differ from `default` ({type: value}).
    typed: an optional key present in a config is made a typed field reference (`optional_keys`); the
      eval keys are, where configs set them to None and the command line overrides them (data_dir,
      max_examples, tokenizer), the others keep the value a config gives.
  """

  path: str
  type: type
  default: Any
  doc: str
  choices: Any = None
  range: Optional[Range] = None
  optional: bool = False
  safe: bool = False
  length: Optional[int] = None
  pair: bool = False
  when: Optional[Callable[[recipes_lib.Recipe], bool]] = None
  eval_types: Optional[tuple[str, ...]] = None
  type_defaults: Optional[dict[str, Any]] = None
  typed: bool = True

  def default_for(self, ctx: Ctx) -> Any:
    return self.default(ctx) if callable(self.default) else self.default

  def allowed_choices(self) -> Optional[tuple]:
    c = self.choices() if callable(self.choices) else self.choices
    return None if c is None else tuple(c)

  def allowed(self) -> str:
    """What is allowed, in words (errors and `info --schema`)."""
    parts = []
    choices = self.allowed_choices()
    if choices is not None:
      parts.append(f"one of {list(choices)}")
    elif self.type is tuple:
      n = f"{self.length} " if self.length else ""
      what = "a pair (lo, hi) with lo <= hi" if self.pair else f"a tuple of {n}values"
      parts.append(what + (f", each {_in(self.range)}" if self.range else ""))
    elif self.range is not None:
      parts.append(f"{'an integer' if self.type is int else 'a number'} {_in(self.range)}")
    else:
      parts.append(
        {
          bool: "True or False",
          str: "a string",
          dict: "a dict",
          object: "a Python literal",
          int: "an integer",
          float: "a number",
        }[self.type]
      )
    if self.optional:
      parts.insert(0, "None or")
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Tree:
  """A sub-dict whose entries are named by the user (evals, optim.lr_mults) or by a module's dataclass
  fields (model.image, ...: every field is a valid key; the declared ones have a default)."""

  path: str
  doc: str
  free_form: bool = False
  safe: bool = False


def K(path: str, typ: type, default: Any, doc: str, **kw: Any) -> Key:
  return Key(path, typ, default, doc, **kw)


def _optim(adafactor: Any, adamw: Any) -> Callable[[Ctx], Any]:
  """Default per optimizer (the recipe's `optimizer`): Adafactor is big_vision's, AdamW optax.adamw's."""
  return lambda ctx: adafactor if ctx.recipe.optimizer == "adafactor" else adamw


def _image_preset(k: str) -> Callable[[Ctx], Any]:
  return lambda ctx: ctx.image_preset[k]


def _text_preset(k: str) -> Callable[[Ctx], Any]:
  return lambda ctx: ctx.text_preset[k]


def _image_structure(k: str) -> Callable[[Ctx], Any]:
  return lambda ctx: presets.IMAGE_STRUCTURE[ctx.structure][k]


def _text_structure(k: str) -> Callable[[Ctx], Any]:
  return lambda ctx: presets.TEXT_STRUCTURE[ctx.structure][k]


def _attention_recompute(tower: str, not_with: str) -> Key:
  """`model.<tower>.attention_recompute` (tipsito/models/layers.py `recomputes_attention`): the same key for
  the image tower, the text tower and the fusion module, which differ in what rematerialises their blocks."""
  return K(
    f"model.{tower}.attention_recompute",
    bool,
    True,
    "the xla attention core keeps only q, k, v for the backward pass and recomputes the probabilities "
    f"(B x heads x T x T per block; one more q k^T per block); off: kept. Not with {not_with} (the policy "
    "decides)",
    choices=BOOLS,
    safe=True,
  )


_C = "the TFDS config names of tipsito.data.builders; see DATA_PRESETS in tipsito/config/defaults.py"

TREES: tuple[Tree, ...] = (
  Tree(
    "evals",
    "evaluations by name, each with the `evals.*` keys of its type (below)",
    free_form=True,
    safe=True,
  ),
  Tree(
    "optim.lr_mults",
    "{regex: lr multiplier} on the '/'-joined parameter path (first match wins)",
    free_form=True,
  ),
  Tree("model.image", "VisionTransformer kwargs (any field of tipsito.models.VisionTransformer)"),
  Tree("model.text", "TextEncoder kwargs (any field of tipsito.models.TextEncoder)"),
  Tree("model.heads", "DINO / iBOT head kwargs (fields of tipsito.models.DINOHead)"),
  Tree("model.fusion", "ITO fusion Transformer kwargs (fields of tipsito.models.FusionTransformer)"),
  Tree("loss", "loss weights, one per term of the recipe (0 turns a term off)"),
)

_POS_INT = ge(1)
_COUNT = ge(0)

KEYS: tuple[Key, ...] = (
  # --- run ---
  K("seed", int, 0, "model init and training RNG seed", range=_COUNT),
  K(
    "recipe",
    str,
    lambda ctx: ctx.recipe.name,
    "training recipe (tipsito/config/recipes.py)",
    choices=lambda: tuple(recipes_lib.RECIPES),
  ),
  K("tokenizer", str, None, "SentencePiece model path; None = the shipped demo model", optional=True),
  K("max_len", int, 64, "caption length in tokens fed to the text tower", range=_POS_INT),
  K(
    "total_steps", int, lambda ctx: ctx.total_steps, "training steps (the schedules end here)", range=_POS_INT
  ),
  K("log_every_steps", int, 50, "console / TensorBoard scalar cadence in steps", range=_POS_INT, safe=True),
  K(
    "peak_tflops",
    float,
    0.0,
    "peak TFLOP/s of one device for FLOP utilisation (0 = per-platform table)",
    range=ge(0),
    safe=True,
  ),
  K(
    "profile_steps",
    int,
    0,
    "JAX profiler trace of this many steps after the first (0 = off)",
    range=_COUNT,
    safe=True,
  ),
  K(
    "init_from",
    str,
    None,
    "what to start from: a workdir (or checkpoints/, a step folder), an export, a Hugging Face Tipsv2 "
    "folder or official TIPS .npz weights (docs/finetuning.md)",
    optional=True,
    safe=True,
  ),
  K(
    "init_teacher",
    str,
    "continue",
    "with init_from: 'continue' the init run's teacher or 'reset' it",
    choices=INIT_TEACHER,
    safe=True,
  ),
  # --- model ---
  K(
    "model.embed_dim",
    int,
    lambda ctx: ctx.image_preset["width"] if ctx.clip_style else None,
    "joint embedding width of the projections (None: TIPS, shared width, no projection)",
    range=_POS_INT,
    optional=True,
  ),
  K(
    "model.logit_scale_init",
    float,
    lambda ctx: ctx.recipe.logit_scale_init,
    "initial log of the contrastive logit scale",
    range=ANY,
  ),
  K(
    "model.logit_scale_max",
    float,
    lambda ctx: math.log(100.0) if ctx.clip_style else None,
    "clamp of the log logit scale (None = no clamp)",
    range=gt(0),
    optional=True,
  ),
  K("model.logit_bias_init", float, -10.0, "initial SigLIP logit bias", range=ANY),
  # image tower (VisionTransformer kwargs)
  K("model.image.width", int, _image_preset("width"), "image tower width (variant preset)", range=_POS_INT),
  K("model.image.depth", int, _image_preset("depth"), "image tower blocks (variant preset)", range=_POS_INT),
  K(
    "model.image.num_heads",
    int,
    _image_preset("num_heads"),
    "attention heads (variant preset)",
    range=_POS_INT,
  ),
  K(
    "model.image.mlp_dim", int, _image_preset("mlp_dim"), "MLP hidden width (variant preset)", range=_POS_INT
  ),
  K("model.image.ffn", str, _image_preset("ffn"), "feed-forward block (variant preset)", choices=FFNS),
  K(
    "model.image.patch_size",
    int,
    _image_preset("patch_size"),
    "patch size in px (variant preset)",
    range=_POS_INT,
  ),
  K("model.image.num_cls_tokens", int, lambda ctx: ctx.recipe.num_cls, "CLS tokens (recipe)", choices=(1, 2)),
  K(
    "model.image.posemb_grid",
    int,
    lambda ctx: 224 // ctx.image_preset["patch_size"] if ctx.clip_style else 32,
    "side of the learned position-embedding grid (resized to the input)",
    range=_POS_INT,
  ),
  K(
    "model.image.use_mask_token",
    bool,
    lambda ctx: ctx.recipe.mask_ratio > 0,
    "learned mask token for iBOT-masked patches",
    choices=BOOLS,
  ),
  K("model.image.dropout", float, 0.0, "dropout rate", range=UNIT_HI_OPEN),
  K("model.image.stochastic_depth", float, 0.0, "stochastic depth (drop-path) rate", range=UNIT_HI_OPEN),
  K("model.image.remat", bool, False, "rematerialise each block with remat_policy", choices=BOOLS),
  K("model.image.dtype", str, "float32", "activation dtype", choices=DTYPES),
  K("model.image.param_dtype", str, "float32", "parameter dtype", choices=DTYPES),
  K(
    "model.image.pixel_mean",
    tuple,
    lambda ctx: tuple(presets.TIPS_PIXEL_MEAN if ctx.tips_pixels else presets.CLIP_PIXEL_MEAN),
    "per-channel mean subtracted from [0, 1] pixels (recipe's pixel statistics)",
    length=3,
    range=ANY,
  ),
  K(
    "model.image.pixel_std",
    tuple,
    lambda ctx: tuple(presets.TIPS_PIXEL_STD if ctx.tips_pixels else presets.CLIP_PIXEL_STD),
    "per-channel std dividing the pixels (recipe's pixel statistics)",
    length=3,
    range=gt(0),
  ),
  K(
    "model.image.activation",
    str,
    _image_structure("activation"),
    "MLP activation (tower structure)",
    choices=tuple(ACTIVATIONS),
  ),
  K(
    "model.image.ln_eps",
    float,
    _image_structure("ln_eps"),
    "LayerNorm epsilon (tower structure)",
    range=gt(0),
  ),
  K(
    "model.image.patch_bias",
    bool,
    _image_structure("patch_bias"),
    "bias in the patch embedding",
    choices=BOOLS,
  ),
  K(
    "model.image.cls_posemb",
    bool,
    _image_structure("cls_posemb"),
    "the CLS tokens get a position row",
    choices=BOOLS,
  ),
  K(
    "model.image.pre_norm",
    bool,
    _image_structure("pre_norm"),
    "LayerNorm before the blocks (OpenCLIP)",
    choices=BOOLS,
  ),
  K(
    "model.image.remat_policy",
    str,
    "nothing_saveable",
    "what a rematerialised block saves",
    choices=tuple(REMAT_POLICIES),
  ),
  K(
    "model.image.scan",
    bool,
    False,
    "run the blocks as one nn.scan (params stacked under 'blocks')",
    choices=BOOLS,
  ),
  K(
    "model.image.attention",
    str,
    "xla",
    "attention core of the image tower: xla (einsum), cudnn (GPU, bf16/fp16), splash (Pallas TPU kernel)",
    choices=ATTENTIONS,
    safe=True,
  ),
  _attention_recompute("image", not_with="remat"),
  # text tower (TextEncoder kwargs)
  K("model.text.width", int, _text_preset("width"), "text tower width (variant preset)", range=_POS_INT),
  K("model.text.depth", int, _text_preset("depth"), "text tower blocks (variant preset)", range=_POS_INT),
  K(
    "model.text.num_heads", int, _text_preset("num_heads"), "attention heads (variant preset)", range=_POS_INT
  ),
  K("model.text.mlp_dim", int, _text_preset("mlp_dim"), "MLP hidden width (variant preset)", range=_POS_INT),
  K(
    "model.text.vocab_size",
    int,
    32000,
    "embedding rows; None = the tokenizer's vocabulary size",
    range=ge(2),
    optional=True,
  ),
  K("model.text.max_len", int, 64, "text position-embedding length", range=_POS_INT),
  K(
    "model.text.out_dim",
    int,
    lambda ctx: ctx.image_preset["width"] if ctx.clip_style else None,
    "text projection width (None = no projection)",
    range=_POS_INT,
    optional=True,
  ),
  K("model.text.dropout", float, 0.0, "dropout rate", range=UNIT_HI_OPEN),
  K("model.text.remat", bool, False, "rematerialise each block with remat_policy", choices=BOOLS),
  K("model.text.dtype", str, "float32", "activation dtype", choices=DTYPES),
  K("model.text.param_dtype", str, "float32", "parameter dtype", choices=DTYPES),
  K(
    "model.text.flavour",
    str,
    _text_structure("flavour"),
    "text tower flavour (tower structure)",
    choices=FLAVOURS,
  ),
  K(
    "model.text.activation",
    str,
    _text_structure("activation"),
    "MLP activation (tower structure)",
    choices=tuple(ACTIVATIONS),
  ),
  K(
    "model.text.ln_eps", float, _text_structure("ln_eps"), "LayerNorm epsilon (tower structure)", range=gt(0)
  ),
  K(
    "model.text.remat_policy",
    str,
    "nothing_saveable",
    "what a rematerialised block saves",
    choices=tuple(REMAT_POLICIES),
  ),
  K("model.text.scan", bool, False, "run the blocks as one nn.scan", choices=BOOLS),
  K(
    "model.text.attention",
    str,
    "xla",
    "attention core of the text tower: xla (einsum), cudnn (GPU, bf16/fp16), splash (Pallas TPU kernel)",
    choices=ATTENTIONS,
    safe=True,
  ),
  _attention_recompute("text", not_with="remat"),
  # heads and fusion
  K("model.heads.num_prototypes", int, 32768, "DINO / iBOT prototypes K", range=_POS_INT),
  K("model.heads.hidden_dim", int, 2048, "head MLP hidden width", range=_POS_INT),
  K("model.heads.bottleneck_dim", int, 256, "head bottleneck width", range=_POS_INT),
  K("model.heads.num_layers", int, 3, "head MLP layers", range=_POS_INT),
  K("model.fusion.width", int, 512, "ITO fusion Transformer width", range=_POS_INT),
  K("model.fusion.depth", int, 2, "ITO fusion Transformer blocks", range=_POS_INT),
  K("model.fusion.num_heads", int, 8, "ITO fusion Transformer heads", range=_POS_INT),
  K(
    "model.fusion.remat",
    bool,
    False,
    "rematerialise each fusion block with model.fusion.remat_policy (gradients bitwise unchanged)",
    choices=BOOLS,
  ),
  K(
    "model.fusion.remat_policy",
    str,
    "nothing_saveable",
    "what a rematerialised fusion block saves",
    choices=tuple(REMAT_POLICIES),
  ),
  K(
    "model.fusion.chunks",
    int,
    1,
    "run the fusion module over this many groups of examples in turn, each rematerialised with "
    "model.fusion.remat_policy: its backward holds one group's activations (1 = all at once; must divide "
    "the examples it fuses per step)",
    range=_POS_INT,
  ),
  K(
    "model.fusion.attention",
    str,
    "xla",
    "attention core of the ITO fusion module: xla (einsum), cudnn (GPU, bf16/fp16), splash (Pallas TPU kernel)",
    choices=ATTENTIONS,
    safe=True,
  ),
  _attention_recompute("fusion", not_with="remat or chunks > 1"),
  # --- loss weights: one key per term the recipe allows ---
  *(
    K(
      f"loss.{term}",
      float,
      (lambda t: lambda ctx: ctx.recipe.loss[t])(term),
      f"weight of the {term} loss term (recipe default; 0 = off)",
      range=ge(0),
      when=(lambda t: lambda r: t in r.loss)(term),
    )
    for term in TERM_NAMES
  ),
  # --- loss options ---
  K("loss_opts.student_temp", float, 0.1, "DINO / iBOT student softmax temperature", range=gt(0)),
  K("loss_opts.teacher_temp", float, 0.07, "DINO / iBOT teacher temperature after warmup", range=gt(0)),
  K(
    "loss_opts.warmup_teacher_temp", float, 0.04, "teacher temperature at step 0 (linear warmup)", range=gt(0)
  ),
  K("loss_opts.teacher_temp_warmup_steps", int, 0, "steps of the teacher temperature warmup", range=_COUNT),
  K("loss_opts.center_momentum", float, 0.9, "momentum of the DINO / iBOT teacher centres", range=UNIT),
  K(
    "loss_opts.ibot_all_patches",
    bool,
    lambda ctx: ctx.recipe.ibot_all_patches,
    "iBOT++ (every patch) instead of iBOT (masked patches only)",
    choices=BOOLS,
  ),
  K(
    "loss_opts.ibot_token_norm",
    str,
    "masked",
    "iBOT normalisation: over masked tokens, all patches, or masked and visible apart (ours)",
    choices=TOKEN_NORMS,
  ),
  K(
    "loss_opts.ibot_visible_weight",
    float,
    1.0,
    "visible tokens' weight with ibot_token_norm='separate' (ours)",
    range=ge(0),
  ),
  K(
    "loss_opts.teacher_method",
    str,
    "centering",
    "teacher target: softmax centering or Sinkhorn-Knopp",
    choices=TEACHER_METHODS,
  ),
  K("loss_opts.fusion_cls", int, 0, "CLS token the ITO fusion module reads (< num_cls_tokens)", range=_COUNT),
  K(
    "loss_opts.contrastive_view",
    str,
    "unmasked",
    "view 1 the contrastive terms see",
    choices=CONTRASTIVE_VIEWS,
  ),
  K(
    "loss_opts.dino_reduction",
    str,
    "mean",
    "DINO cross-entropies over the student crops: mean or sum",
    choices=DINO_REDUCTIONS,
  ),
  K(
    "loss_opts.view_weighting",
    str,
    lambda ctx: ctx.recipe.view_weighting,
    "alt-text InfoNCE over ITO's two views: mean or sum (recipe default)",
    choices=VIEW_WEIGHTINGS,
  ),
  # --- EMA teacher ---
  K(
    "ema.mode",
    str,
    lambda ctx: ctx.recipe.ema_mode,
    "EMA teacher: heads only, full, none (recipe)",
    choices=EMA_MODES,
  ),
  K("ema.momentum", float, 0.996, "EMA teacher momentum (at step 0 with the cosine schedule)", range=UNIT),
  K(
    "ema.schedule",
    str,
    "constant",
    "EMA momentum schedule (cosine: to 1 at the last step, DINO)",
    choices=EMA_SCHEDULES,
  ),
  # --- optimizer (defaults per the recipe's optimizer: Adafactor / AdamW) ---
  K("optim.name", str, lambda ctx: ctx.recipe.optimizer, "optimizer (recipe default)", choices=OPTIMIZERS),
  K("optim.lr", float, _optim(1e-3, 5e-4), "peak learning rate", range=gt(0)),
  K(
    "optim.warmup_steps",
    int,
    lambda ctx: min(10000 if ctx.recipe.optimizer == "adafactor" else 2000, ctx.total_steps // 10),
    "linear warmup steps (default: a tenth of total_steps, at most 10000 Adafactor / 2000 AdamW)",
    range=_COUNT,
  ),
  K("optim.schedule", str, "cosine", "decay after warmup", choices=SCHEDULES),
  K("optim.min_lr_ratio", float, 0.0, "the decay ends at lr * min_lr_ratio", range=UNIT),
  K("optim.weight_decay", float, _optim(1e-4, 0.1), "decoupled weight decay on kernels", range=ge(0)),
  K("optim.clip_norm", float, 1.0, "global-norm gradient clipping (None = off)", range=gt(0), optional=True),
  K(
    "optim.momentum",
    float,
    _optim(0.9, None),
    "Adafactor momentum EMA / SGD trace (None = off)",
    range=UNIT,
    optional=True,
  ),
  K("optim.momentum_dtype", str, "float32", "dtype of the first moment", choices=DTYPES),
  K(
    "optim.decay_rate", float, 0.8, "Adafactor second-moment decay exponent (1 - t^-rate)", range=UNIT_LO_OPEN
  ),
  K("optim.beta2_cap", float, 0.999, "cap of Adafactor's second-moment decay", range=UNIT_LO_OPEN),
  K("optim.min_dim_size_to_factor", int, 32, "Adafactor factors dims at least this large", range=_POS_INT),
  K("optim.eps", float, _optim(1e-30, 1e-6), "epsilon of the second-moment normalisation", range=gt(0)),
  K(
    "optim.clip_block_rms",
    float,
    None,
    "Adafactor per-block RMS clipping (None = off)",
    range=gt(0),
    optional=True,
  ),
  K("optim.b1", float, 0.9, "Adam first-moment decay", range=UNIT_HI_OPEN),
  K("optim.b2", float, _optim(0.999, 0.98), "Adam second-moment decay", range=UNIT_HI_OPEN),
  K("optim.frozen", tuple, (), "regexes of parameter paths that are not trained (no optimizer state)"),
  # --- mesh and sharding (Orbax reshards on restore) ---
  K("mesh.data", int, 1, "data-parallel mesh axis (-1 = the remaining devices)", range=ge(-1), safe=True),
  K("mesh.fsdp", int, -1, "FSDP mesh axis (-1 = the remaining devices)", range=ge(-1), safe=True),
  K("mesh.model", int, 1, "model-parallel mesh axis (-1 = the remaining devices)", range=ge(-1), safe=True),
  K("sharding.rules", tuple, (), "(regex, PartitionSpec) rules for parameter sharding", safe=True),
  K("sharding.min_size", int, 2**12, "parameters smaller than this are replicated", range=_COUNT, safe=True),
  # --- data ---
  K("data.name", str, "shapes", f"TFDS dataset name ({_C})"),
  K("data.split", str, "train", "training split"),
  K("data.data_dir", str, None, "TFDS data dir (None = the TFDS default)", optional=True, safe=True),
  K("data.image_key", str, "image", "record field of the image"),
  K(
    "data.alt_text_key",
    str,
    "alt_text",
    "record field of the alt-text caption ('text'); None: 'text' is drawn from data.caption_keys, as 'text2'",
    optional=True,
  ),
  K("data.caption_keys", tuple, (), "record fields of the synthetic captions ('text2')"),
  K("data.label_key", str, None, "record field of a class label (evals only)", optional=True),
  K(
    "data.max_skip_fraction",
    float,
    0.05,
    "the run stops when more records than this are undecodable",
    range=UNIT,
    safe=True,
  ),
  K(
    "data.min_records_for_skip_check",
    int,
    None,
    "records read before the skip fraction is checked",
    range=_COUNT,
    optional=True,
    safe=True,
  ),
  K("data.build_if_missing", bool, False, "build the dataset on the fly when it is absent", choices=BOOLS),
  K("data.build_options", object, None, "builder options of an on-the-fly build (a dict)", optional=True),
  K("data.max_pixels", int, 4096 * 4096, "images above this are decoded downscaled", range=_POS_INT),
  K("data.hard_max_pixels", int, 16384 * 16384, "images above this are skipped", range=_POS_INT),
  K("data.min_side", int, 2, "images with a shorter side are skipped", range=_POS_INT),
  K("data.max_aspect", float, 20.0, "images beyond this aspect ratio are skipped", range=ge(1)),
  K(
    "data.background",
    tuple,
    (255, 255, 255),
    "RGB that transparent pixels are composited on",
    length=3,
    range=Range(0, 255),
  ),
  # --- input pipeline ---
  K("input.batch_size", int, lambda ctx: ctx.batch_size, "global batch size", range=_POS_INT),
  K(
    "input.microbatches",
    int,
    1,
    "micro-batches per step: the same update as the whole batch at once "
    "(exact accumulation, tipsito/objective/accumulate.py), less memory, one extra forward",
    range=_POS_INT,
    safe=True,
  ),
  K("input.views", str, lambda ctx: ctx.recipe.views, "views per example (recipe)", choices=VIEWS),
  K("input.global_size", int, 224, "global crop / view 1 and 2 size in px (whole patches)", range=_POS_INT),
  K("input.local_size", int, 98, "local crop size in px (whole patches)", range=_POS_INT),
  K(
    "input.num_local",
    int,
    lambda ctx: 6 if view_layout(ctx.recipe.views).local_crops else 0,
    "local crops per example (multicrop views)",
    range=_COUNT,
  ),
  K(
    "input.mask_ratio",
    float,
    lambda ctx: ctx.recipe.mask_ratio,
    "iBOT mask ratio (recipe)",
    range=UNIT_HI_OPEN,
  ),
  K("input.mask_type", str, "random", "iBOT mask shape", choices=MASK_TYPES),
  K("input.mask_prob", float, 1.0, "probability that an image is masked", range=UNIT),
  K(
    "input.augment",
    str,
    lambda ctx: "tips" if ctx.tips_pixels else "ito",
    "augmentation of view 1",
    choices=AUGMENTS,
  ),
  K(
    "input.augment_view2",
    str,
    lambda ctx: "ito" if ctx.recipe.views == "multicrop_two_views" else None,
    "augmentation of view 2 (None = input.augment)",
    choices=(None,) + tuple(AUGMENTS),
    optional=True,
  ),
  K("input.num_workers", int, 0, "grain worker processes (0 = in process)", range=_COUNT),
  K("input.prefetch", int, 2, "batches prefetched", range=_COUNT, safe=True),
  K("input.shuffle_seed", int, 0, "data order seed", range=_COUNT),
  K("input.shuffle", bool, True, "shuffle the records (reshuffled every epoch)", choices=BOOLS),
  K("input.num_epochs", int, None, "epochs to read (None = repeat forever)", range=_POS_INT, optional=True),
  K(
    "input.read_threads",
    int,
    None,
    "reader threads (None = grain's default)",
    range=_POS_INT,
    optional=True,
    safe=True,
  ),
  K(
    "input.global_crop_scale",
    tuple,
    None,
    "global crop area range (None = the augmentation's default)",
    pair=True,
    range=UNIT_LO_OPEN,
    optional=True,
  ),
  K(
    "input.local_crop_scale",
    tuple,
    None,
    "local crop area range (None = DINO's (0.05, 0.32))",
    pair=True,
    range=UNIT_LO_OPEN,
    optional=True,
  ),
  K(
    "input.view2_crop_scale",
    tuple,
    (0.5, 1.0),
    "view 2 crop area range (None = (0.5, 1), ITO's)",
    pair=True,
    range=UNIT_LO_OPEN,
    optional=True,
  ),
  K(
    "input.crop_ratio",
    tuple,
    None,
    "crop aspect-ratio range (None = (3/4, 4/3))",
    pair=True,
    range=gt(0),
    optional=True,
  ),
  # --- checkpoints, guards, export ---
  K(
    "ckpt.every_steps",
    int,
    1000,
    "checkpoint cadence in steps (0 = only at the end)",
    range=_COUNT,
    safe=True,
  ),
  K("ckpt.keep", int, 3, "checkpoints kept", range=_POS_INT, safe=True),
  K("ckpt.async_save", bool, True, "save checkpoints in the background", choices=BOOLS, safe=True),
  K(
    "nonfinite.max_consecutive",
    int,
    10,
    "non-finite steps in a row that stop the run",
    range=_POS_INT,
    safe=True,
  ),
  K("export.enabled", bool, True, "write the export at the end of training", choices=BOOLS, safe=True),
  K("export.dir", str, None, "export directory (None = <workdir>/export)", optional=True, safe=True),
  # --- distillation teacher ---
  K("distill.teacher", str, None, "teacher: a training workdir or an export dir", optional=True),
  K("distill.teacher_image_npz", str, None, "teacher: official TIPS image weights (.npz)", optional=True),
  K("distill.teacher_text_npz", str, None, "official TIPS text weights (.npz) for init_text", optional=True),
  K("distill.init_text", bool, False, "the student text tower starts from the teacher's", choices=BOOLS),
  K(
    "distill.init_image",
    bool,
    False,
    "the student image tower starts from the teacher's (distill only)",
    choices=BOOLS,
  ),
  K(
    "distill.dino_global_crop",
    bool,
    False,
    "the global crop is also a DINO student view (distill only)",
    choices=BOOLS,
  ),
)

# --- evaluation settings: `config.evals.<name>.<key>`, per evaluator type ---
# Every key an evaluator reads (tipsito/evals/*.py document what each means), with its default, which types
# read it (`eval_types`; None = every type) and where a type's default differs (`type_defaults`).
# Validation (tipsito/config/validation.py `eval_settings`) refuses a key its type does not read and checks
# each value here, and the evaluators read the completed settings it returns, so no default lives in them.
_SEG = ("segmentation",)
_KNN_PROBES = ("knn",) + PROBE_TYPES
_DENSE_RESIZE = {"segmentation": "resize", "linear_segmentation": "resize", "linear_depth": "resize"}


def _E(name: str, typ: type, default: Any, doc: str, types: Optional[tuple] = None, **kw: Any) -> Key:
  typed = name in _TYPED_EVAL_KEYS
  return Key(f"evals.*.{name}", typ, default, doc, safe=True, eval_types=types, typed=typed, **kw)


_TYPED_EVAL_KEYS = ("data_dir", "max_examples", "tokenizer")


EVAL_KEYS: tuple[Key, ...] = (
  # read by every evaluator (tipsito/evals/evaluator.py)
  _E("type", str, None, "the evaluator (tipsito/evals/registry.py)", choices=EVAL_TYPES),
  _E("dataset", str, None, "TFDS name of the eval data ('shapes', 'scenes', ...)", optional=True),
  _E("split", str, "test", "the split evaluated"),
  _E("data_dir", str, None, "TFDS data dir of the eval (None = the TFDS default)", optional=True),
  _E("every_steps", int, 0, "eval cadence in training steps (0 = only at the end)", range=_COUNT),
  _E("batch_size", int, 32, "images per encoder call", range=_POS_INT),
  _E(
    "image_size",
    int,
    224,
    "eval image side in px, a whole number of patches (a segmentation benchmark: 448, its short side)",
    range=_POS_INT,
  ),
  _E("cls_index", int, 0, "CLS token of the global evals (< model.image.num_cls_tokens)", range=_COUNT),
  _E(
    "project",
    bool,
    None,
    "apply the image projection (None = what the model was trained with)",
    optional=True,
    choices=BOOLS,
    type_defaults={t: False for t in _KNN_PROBES},
  ),
  _E("max_examples", int, None, "examples the eval reads (None = all)", optional=True, range=_POS_INT),
  _E("image_key", str, "image", "record field of the image"),
  _E("label_key", str, "label", "record field of the class label"),
  _E("segmentation_key", str, "segmentation", "record field of the label map"),
  _E(
    "caption_keys",
    tuple,
    None,
    "record fields of the captions (None = alt-text and every 'caption_*' field)",
    optional=True,
  ),
  _E(
    "resize",
    str,
    "center_crop",
    "how an image reaches image_size",
    choices=RESIZE_MODES,
    type_defaults=_DENSE_RESIZE,
  ),
  _E("num_pictures", int, 0, "images drawn into <workdir>/pictures", range=_COUNT),
  _E("class_names", tuple, None, "class names (None = the dataset's)", optional=True),
  _E(
    "templates",
    object,
    None,
    "prompt templates: a set name of tipsito/evals/templates.py or a list, each with one '{}' "
    "(None = the dataset's)",
    optional=True,
  ),
  _E("text_batch_size", int, 64, "prompts per text-encoder call", range=_POS_INT),
  _E("tokenizer", str, None, "tokenizer of an encoder without one (None = the config's)", optional=True),
  _E("prepare", bool, True, "build a missing built-in dataset", choices=BOOLS),
  _E("enabled", bool, True, "run this eval", choices=BOOLS),
  _E("num_workers", int, 4, "decode threads (0 = 1)", range=_COUNT),
  _E("bootstrap", int, 1000, "bootstrap resamples of the 95 % intervals (0 = none)", range=_COUNT),
  # zero-shot segmentation (tipsito/evals/segmentation.py)
  _E(
    "benchmark",
    str,
    None,
    "a named zero-shot segmentation benchmark (it sets the keys of choices.BENCHMARK_KEYS)",
    _SEG,
    optional=True,
    choices=tuple(SEGMENTATION_BENCHMARKS),
  ),
  _E("protocol", str, "whole", "the whole image at once or sliding windows", _SEG, choices=PROTOCOLS),
  _E(
    "crop_size",
    int,
    None,
    "'slide' window in px (None = the short side; a benchmark: 448)",
    _SEG,
    optional=True,
    range=_POS_INT,
  ),
  _E(
    "stride",
    int,
    None,
    "'slide' step in px (None = 2/3 of the window; a benchmark: 336)",
    _SEG,
    optional=True,
    range=_POS_INT,
  ),
  _E(
    "background_index",
    int,
    0,
    "label value of the prompted background class (None = no background)",
    _SEG,
    optional=True,
    range=_COUNT,
  ),
  _E("background_name", str, "background", "the background class's prompt word", _SEG, optional=True),
  _E(
    "bg_threshold",
    float,
    None,
    "a constant background score instead of its prompt (None = prompted)",
    _SEG,
    optional=True,
    range=ANY,
  ),
  _E(
    "ignore_index",
    int,
    255,
    "label value that is not scored",
    ("segmentation", "linear_segmentation"),
    range=_COUNT,
  ),
  _E(
    "reduce_zero_label",
    bool,
    False,
    "label 0 -> ignored, v -> v - 1",
    ("segmentation", "linear_segmentation"),
    choices=BOOLS,
  ),
  _E("mask_source", str, "auto", "where the label map comes from", _SEG, choices=MASK_SOURCES),
  _E(
    "alpha_label",
    str,
    "label",
    "mask_source='alpha': 'label' labels the foreground label+1, anything else 1",
    _SEG,
  ),
  _E("patch_tokens", bool, True, "also score the final patch tokens ('patches/*')", _SEG, choices=BOOLS),
  _E(
    "global_copy",
    bool,
    True,
    "the CLS answer painted on every pixel ('global_copy/*' reference)",
    _SEG,
    choices=BOOLS,
  ),
  # zero-shot classification, kNN and the probes (tipsito/evals/zeroshot.py, knn.py, probes.py)
  _E("topk", tuple, (1, 5), "the top-k accuracies reported", ("zeroshot", "knn"), range=_POS_INT),
  _E(
    "present_class",
    bool,
    False,
    "also the present-class reference (reads the label maps)",
    ("zeroshot",),
    choices=BOOLS,
  ),
  _E("train_split", str, "train", "the split of the kNN bank / probe training", _KNN_PROBES),
  _E(
    "max_train_examples",
    int,
    None,
    "train-split examples read (None = all)",
    _KNN_PROBES,
    optional=True,
    range=_POS_INT,
  ),
  _E(
    "num_classes",
    int,
    None,
    "classes (None = from the class names or the labels)",
    ("knn", "linear_segmentation", "linear_classification"),
    optional=True,
    range=_POS_INT,
  ),
  _E("k", int, 20, "neighbours that vote", ("knn",), range=_POS_INT),
  _E("temperature", float, 0.07, "vote weight exp(cos / T)", ("knn",), range=gt(0)),
  # retrieval (tipsito/evals/retrieval.py)
  _E("ks", tuple, (1, 5, 10), "the recall@k reported", ("retrieval",), range=_POS_INT),
  _E(
    "max_captions_per_image",
    int,
    None,
    "captions per image (None = all)",
    ("retrieval",),
    optional=True,
    range=_POS_INT,
  ),
  _E("chunk_size", int, 1024, "query rows per similarity block", ("retrieval",), range=_POS_INT),
  # linear probes (tipsito/evals/probes.py)
  _E("steps", int, 1000, "probe training steps", PROBE_TYPES, range=_POS_INT),
  _E("lr", float, 1e-3, "probe learning rate", PROBE_TYPES, range=gt(0)),
  _E("weight_decay", float, 1e-4, "probe weight decay", PROBE_TYPES, range=ge(0)),
  _E("probe_batch_size", int, 16, "probe training batch", PROBE_TYPES, range=_POS_INT),
  _E("seed", int, 0, "probe init and data order seed", PROBE_TYPES, range=_COUNT),
  _E(
    "raw_pixel_probe",
    bool,
    True,
    "also the probe on raw pixels (reference)",
    ("linear_segmentation",),
    choices=BOOLS,
  ),
  _E("depth_key", str, "depth", "record field of the depth map", ("linear_depth",)),
  _E("depth_scale", float, 1000.0, "stored depth / depth_scale = metres", ("linear_depth",), range=gt(0)),
  _E("min_depth", float, 1e-3, "depths below are not scored (m)", ("linear_depth",), range=gt(0)),
  _E("max_depth", float, 10.0, "depths above are not scored (m)", ("linear_depth",), range=gt(0)),
)


def eval_keys(eval_type: str) -> tuple[Key, ...]:
  """The keys an eval of `eval_type` reads (a type of choices.EVAL_TYPES)."""
  return tuple(k for k in EVAL_KEYS if k.eval_types is None or eval_type in k.eval_types)


def eval_default(key: Key, eval_type: str) -> Any:
  """The default of eval key `key` for `eval_type`."""
  return (key.type_defaults or {}).get(eval_type, key.default)


def eval_defaults(eval_type: str) -> dict[str, Any]:
  """{key: default} of an eval of `eval_type` (the leaf names of `eval_keys`)."""
  return {k.path.rpartition(".")[2]: eval_default(k, eval_type) for k in eval_keys(eval_type)}


KEYS = KEYS + EVAL_KEYS

BY_PATH: dict[str, Key] = {k.path: k for k in KEYS}
TREE_BY_PATH: dict[str, Tree] = {t.path: t for t in TREES}

# The tower modules whose kwargs the `model.*` trees hold, and their fields that no key above declares
# (the code sets them, a config may override them). `module_fields(tree)` is what validation accepts
# under a tree without importing Flax; tests/test_light_imports.py checks that it equals the module's
# dataclass fields, so a new module field is declared here or as a key.
MODULE_TREES = {
  "model.image": "VisionTransformer",
  "model.text": "TextEncoder",
  "model.heads": "DINOHead",
  "model.fusion": "FusionTransformer",
}
UNDECLARED_MODULE_FIELDS = {
  "model.heads": ("dtype", "param_dtype"),
  "model.fusion": ("dtype", "max_text_len", "mlp_ratio", "param_dtype"),
}


def module_fields(tree: str) -> tuple[str, ...]:
  """The fields of the module behind `tree` ('model.image', ...): its declared keys and the others."""
  declared = [k.path[len(tree) + 1 :] for k in KEYS if k.path.startswith(tree + ".")]
  return tuple(sorted(set(declared) | set(UNDECLARED_MODULE_FIELDS.get(tree, ()))))


def keys_for(recipe: recipes_lib.Recipe) -> tuple[Key, ...]:
  """The keys a config of `recipe` has (user-named entries excluded)."""
  return tuple(k for k in KEYS if "*" not in k.path and (k.when is None or k.when(recipe)))


def optional_keys() -> dict[str, type]:
  """{path: type} of the keys whose value may be None (the typed field references)."""
  return {k.path: k.type for k in KEYS if k.optional and k.typed}


def safe_keys() -> tuple[str, ...]:
  """Keys, and prefixes ending in '.' (user-named sub-dicts), whose change on resume is safe."""
  return tuple(k.path for k in KEYS if k.safe and "*" not in k.path) + tuple(
    t.path + "." for t in TREES if t.safe
  )


def subtrees() -> Iterable[str]:
  """Every dotted prefix that is a sub-dict ('model', 'model.image', ...), declared keys and trees."""
  out: dict[str, None] = {}
  for p in [k.path for k in KEYS if "*" not in k.path] + [t.path for t in TREES]:
    parts = p.split(".")
    for i in range(1, len(parts)):
      out[".".join(parts[:i])] = None
  out.update({t.path: None for t in TREES})
  return tuple(out)


def defaults_for(ctx: Ctx) -> dict:
  """The nested dict of every default for `ctx` (declared trees start empty)."""
  tree: dict = {}
  for p in subtrees():
    node = tree
    for part in p.split("."):
      node = node.setdefault(part, {})
  for k in keys_for(ctx.recipe):
    node = tree
    *head, leaf = k.path.split(".")
    for part in head:
      node = node[part]
    node[leaf] = k.default_for(ctx)
  return tree
