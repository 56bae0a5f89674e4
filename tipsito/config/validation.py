"""Config validation: every wrong key or value fails before anything compiles, naming the key and what is
allowed.

Why: a typo in `--config.loss.ibot=...` or `--config.input.views=multicrops` must cost seconds on a laptop,
not a pod allocation and a 20-minute compile. Which keys exist, their types, allowed values and numeric
ranges come from the config schema (tipsito/config/schema.py; no default config is built to learn them);
the allowed module kwargs are the dataclass fields of the modules; the rules that relate several keys
(geometry, the recipe's loss terms, views, distillation, init) are the explicit functions below.
"""

from __future__ import annotations

from typing import Any, Iterable

import ml_collections as mlc

from tipsito import paths
from tipsito.config import init_source
from tipsito.config import mesh as mesh_lib
from tipsito.config import run_file
from tipsito.config import schema
from tipsito.config import recipes as recipes_lib
from tipsito.choices import SECOND_VIEW_TERMS, TWO_VIEWS, view_layout
from tipsito.choices import BENCHMARK_KEYS, BENCHMARK_SIZES, SEGMENTATION_BENCHMARKS, TEMPLATE_SET_NAMES

# Enumerations no other module names as a constant (declared with the schema).
DTYPES = schema.DTYPES
EMA_SCHEDULES = schema.EMA_SCHEDULES
TOKEN_NORMS = schema.TOKEN_NORMS
FFNS = schema.FFNS
# Sub-dicts whose keys are free-form (user-named).
FREE_FORM = tuple(t.path for t in schema.TREES if t.free_form)


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
    raise ConfigError(
      f"config.{key}={value} must be a multiple of config.{by_key}={by} ({why}); "
      f"valid values: multiples of {by}, e.g. {' or '.join(map(str, near))}"
    )


_MISSING = object()


def _lookup(config: Any, path: str) -> Any:
  node = config
  for part in path.split("."):
    if not hasattr(node, "keys") or part not in node:
      return _MISSING
    node = node[part]
  return node


def _schema_error(key: schema.Key, path: str, value: Any, why: str) -> ConfigError:
  return ConfigError(
    f"config.{path}={value!r} {why}; valid values: {key.allowed()} ({key.doc}). Set --config.{path} "
    f"(or the config file) to an allowed value; `python -m tipsito.info --schema` lists every key"
  )


def _is_number(v: Any, typ: type) -> bool:
  if isinstance(v, bool):
    return False
  if typ is int:
    return isinstance(v, int) or (
      hasattr(v, "dtype") and getattr(v.dtype, "kind", "") in "iu" and not hasattr(v, "__len__")
    )
  return isinstance(v, (int, float)) or (
    hasattr(v, "dtype") and getattr(v.dtype, "kind", "") in "iuf" and not hasattr(v, "__len__")
  )


def check_value(key: schema.Key, value: Any, path: str | None = None) -> None:
  """Type, choices and range of one value, from its schema declaration; raises ConfigError."""
  path = path or key.path
  if value is None:
    if key.optional:
      return
    raise _schema_error(key, path, value, "is not allowed (the key is not optional)")
  choices = key.allowed_choices()
  if choices is not None:
    if (key.type is bool) != isinstance(value, bool) or value not in choices:
      raise _schema_error(key, path, value, "is not allowed")
    return
  typ = key.type
  if typ in (int, float):
    if not _is_number(value, typ):
      raise _schema_error(key, path, value, f"has type {type(value).__name__}")
    if key.range is not None and not key.range.contains(value):
      raise _schema_error(key, path, value, "is out of range")
  elif typ is bool:
    if not isinstance(value, bool):
      raise _schema_error(key, path, value, f"has type {type(value).__name__}")
  elif typ is str:
    if not isinstance(value, str):
      raise _schema_error(key, path, value, f"has type {type(value).__name__}")
  elif typ is tuple:
    if not isinstance(value, (tuple, list)):
      raise _schema_error(key, path, value, f"has type {type(value).__name__}")
    n = 2 if key.pair else key.length
    if n is not None and len(value) != n:
      raise _schema_error(key, path, value, f"has {len(value)} elements")
    if key.range is not None:
      for v in value:
        if not _is_number(v, float) or not key.range.contains(v):
          raise _schema_error(key, path, value, f"has an element {v!r} out of range")
    if key.pair and not float(value[0]) <= float(value[1]):
      raise _schema_error(key, path, value, "has lo > hi")
  elif typ is dict:
    if not hasattr(value, "keys"):
      raise _schema_error(key, path, value, f"has type {type(value).__name__}")


def _check_schema(config: mlc.ConfigDict, recipe) -> None:
  """Unknown keys, missing keys, and every declared key's type, choices and range (tipsito/config/schema.py).

  A missing key is an error rather than a default: the code reads every key without a fallback.
  """
  children: dict[str, set[str]] = {}
  declared = [k.path for k in schema.KEYS if "*" not in k.path] + list(schema.subtrees())
  for p in declared:
    parent, _, leaf = p.rpartition(".")
    children.setdefault(parent, set()).add(leaf)

  def walk(node, prefix: str) -> None:
    if prefix in schema.TREE_BY_PATH:  # user-named entries, module kwargs or loss terms: checked below
      return
    _check_keys(prefix, node, children.get(prefix, ()))
    for k in node.keys():
      sub = f"{prefix}.{k}" if prefix else k
      if sub in children and isinstance(node[k], mlc.ConfigDict):
        walk(node[k], sub)

  walk(config, "")
  for p in schema.subtrees():
    if not isinstance(_lookup(config, p), (mlc.ConfigDict, dict)):
      raise ConfigError(
        f"config.{p} is missing or not a dict; every config has it (start the config "
        f"from tipsito.config.defaults.base_config)"
      )
  for key in schema.keys_for(recipe):
    value = _lookup(config, key.path)
    if value is _MISSING:
      raise ConfigError(
        f"config.{key.path} is missing ({key.doc}; valid values: {key.allowed()}); every key must be set "
        f"(the code reads it without a fallback): start the config from "
        f"tipsito.config.defaults.base_config, or add the key"
      )
    check_value(key, value)
  for regex, mult in config.optim.lr_mults.items():
    if not _is_number(mult, float) or not float(mult) >= 0:
      raise ConfigError(
        f"config.optim.lr_mults[{regex!r}]={mult!r} is not allowed; valid values: a "
        f"number >= 0 (a learning-rate multiplier)"
      )


def _check_geometry(config: mlc.ConfigDict, recipe) -> None:
  """Model and input geometry that would otherwise fail deep inside Flax, Orbax or the pipeline (the
  per-key ranges are the schema's; these rules relate keys)."""
  m, inp = config.model, config.input
  for tower in ("image", "text"):
    if tower == "text" and "text" not in recipe.parts:
      continue
    t = m[tower]
    _divisible(
      f"model.{tower}.width",
      t.width,
      f"model.{tower}.num_heads",
      t.num_heads,
      "attention splits the width into equal heads",
    )
  img = m.image
  if "fusion" in recipe.parts:
    f = m.fusion
    _divisible(
      "model.fusion.width",
      f.width,
      "model.fusion.num_heads",
      f.num_heads,
      "attention splits the width into equal heads",
    )
  p = int(img.patch_size)
  # Every training crop is whole patches. The ViT centre zero-pads an input that is not (the official
  # release's rule, kept for evaluation inputs, which are not checked here), so a 98 px local crop on a
  # patch-16 tower would be a 112 px input whose outer 23 % is a black frame the teacher never sees; the
  # iBOT mask lives on the global crop's patch grid. View 2 ('image2') is drawn at input.global_size.
  views = view_layout(inp.views)
  view2 = " and view 2" if views.two_views else ""
  _int_at_least("input.global_size", inp.global_size, p)
  _divisible(
    "input.global_size",
    inp.global_size,
    "model.image.patch_size",
    p,
    f"the global crop{view2} must be whole patches for training (and config.evals image sizes too); "
    "only images given to an encoder directly are zero-padded",
  )
  if views.local_crops and inp.num_local:
    _int_at_least("input.local_size", inp.local_size, p)
    _divisible(
      "input.local_size",
      inp.local_size,
      "model.image.patch_size",
      p,
      "local crops must be whole patches for training, or the ViT zero-pads them with a frame "
      "the teacher never sees; only images given to an encoder directly are zero-padded",
    )
  sizes = {a: config.mesh[a] for a in ("data", "fsdp", "model")}
  if 0 in sizes.values() or list(sizes.values()).count(-1) > 1:
    raise ConfigError(
      f"config.mesh={sizes} is not allowed; valid values: axis sizes >= 1, at most one of "
      f"them -1 (= the remaining devices)"
    )
  _divisible(
    "input.batch_size",
    inp.batch_size,
    "input.microbatches",
    inp.microbatches,
    "the step processes the global batch in that many equal micro-batches",
  )


def _check_keys(key: str, got: Any, allowed: Iterable[str]) -> None:
  allowed = sorted(allowed)
  for k in got.keys():
    if k not in allowed:
      raise ConfigError(
        f"config.{key + '.' if key else ''}{k} is not a known key; valid keys under "
        f"config{'.' + key if key else ''}: {allowed}"
      )


def validate(
  config: mlc.ConfigDict,
  *,
  num_devices: int | None = None,
  process_count: int = 1,
) -> None:
  """Raises ConfigError naming the first wrong key/value. Cheap: no model is built, and no file is read but
  an existing `init_from`'s kind and config.json (what needs the tokenizer or the eval data on disk is
  checked before training by tipsito/train/loop.py `_check_workdir`).

  Args:
    config: the full training config.
    num_devices: when given, also checks the mesh and that the global batch splits over (data, fsdp).
    process_count: number of JAX processes (the batch must split over hosts too).
  """
  if "recipe" not in config:
    raise ConfigError(f"config.recipe is missing; valid values: {sorted(recipes_lib.RECIPES)}")
  check_value(schema.BY_PATH["recipe"], config.recipe)
  recipe = recipes_lib.get_recipe(config.recipe)
  _check_schema(config, recipe)
  _check_model(config, recipe)
  weights = _check_loss(config, recipe)
  _check_input(config, recipe, weights)
  _check_init(config)
  if num_devices is not None:
    _check_batch_split(config, num_devices, process_count)
  _check_evals(config)


def _eval_error(name: str, key: str, value: Any, why: str) -> ConfigError:
  return ConfigError(
    f"config.evals.{name}.{key}={value!r} {why}. Set --config.evals.{name}.{key} (or the config file) "
    f"accordingly; `python -m tipsito.info --schema` lists every evals.* key"
  )


def eval_settings(name: str, cfg: Any, *, need_dataset: bool = True) -> dict[str, Any]:
  """The completed settings of eval `name` (`config.evals.<name>`): every key its type reads, the given
  value or the schema's default (tipsito/config/schema.py `EVAL_KEYS`), each checked; a segmentation
  benchmark's sizes filled in where the eval leaves them unset. Raises ConfigError naming the key.

  Why one function: validation runs it on every enabled eval before anything compiles, and the evaluators
  (tipsito/evals/evaluator.py) read what it returns, so an eval reads no key with a default of its own and
  a value that cannot run is refused before training, not in the final eval. `need_dataset`: False for an
  evaluator given its records directly (tests).
  """
  given = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg or {})
  typ = given.get("type")
  check_value(schema.BY_PATH["evals.*.type"], typ, f"evals.{name}.type")
  keys = {k.path.rpartition(".")[2]: k for k in schema.eval_keys(typ)}
  unknown = sorted(set(given) - set(keys))
  if unknown:
    raise ConfigError(
      f"config.evals.{name}: {unknown} {'is not a key' if len(unknown) == 1 else 'are not keys'} of an eval "
      f"of type {typ!r}; valid keys: {sorted(keys)} (`python -m tipsito.info --schema` lists them)"
    )
  for k, v in given.items():
    check_value(keys[k], v, f"evals.{name}.{k}")
  out = {k: given[k] if k in given else schema.eval_default(key, typ) for k, key in keys.items()}
  if need_dataset and not out["dataset"]:
    raise _eval_error(name, "dataset", out["dataset"], "is not allowed; valid values: a TFDS dataset name")
  for k in ("topk", "ks"):
    if k in out and not out[k]:
      raise _eval_error(name, k, out[k], "is not allowed; valid values: a non-empty tuple of integers >= 1")
  _check_templates(name, out["templates"])
  if typ == "linear_depth" and not out["min_depth"] < out["max_depth"]:
    raise _eval_error(
      name, "min_depth", out["min_depth"], f"must be below max_depth={out['max_depth']!r} (metres scored)"
    )
  if typ == "segmentation":
    _complete_benchmark(name, given, out)
  return out


def eval_enabled(cfg: Any) -> bool:
  """Whether eval settings `cfg` run (`enabled`, read before the rest is checked: a disabled eval is
  neither built nor checked, so a config can keep one it does not run)."""
  key = "enabled"
  return (cfg[key] if key in cfg else schema.BY_PATH["evals.*.enabled"].default) is not False


def _check_templates(name: str, spec: Any) -> None:
  """`templates`: None, a set name, one template, or a non-empty list; every template has one '{}'."""
  if spec is None:
    return
  if isinstance(spec, str):
    if spec in TEMPLATE_SET_NAMES:
      return
    spec = (spec,)
  elif not isinstance(spec, (tuple, list)) or not spec:
    raise _eval_error(
      name,
      "templates",
      spec,
      f"is not allowed; valid values: None, a set name {list(TEMPLATE_SET_NAMES)} or a non-empty list of "
      "templates with one '{}' each",
    )
  for t in spec:
    if not isinstance(t, str) or t.count("{}") != 1:
      raise _eval_error(
        name,
        "templates",
        spec,
        f"has {t!r}, which is not a set name {list(TEMPLATE_SET_NAMES)} nor a template with exactly one "
        "'{}' (where the class name goes)",
      )


def _complete_benchmark(name: str, given: dict, out: dict) -> None:
  """A segmentation `benchmark` sets the keys of choices.BENCHMARK_KEYS itself (the evaluator fills them,
  tipsito/evals/segmentation.py `resolve_config`), so giving one beside it is refused; its sizes apply
  where the eval leaves them unset; `bg_threshold` needs a background class."""
  bench = out["benchmark"]
  if bench is None:
    return
  clash = sorted(k for k in BENCHMARK_KEYS if k in given)
  if clash:
    raise ConfigError(
      f"config.evals.{name}: benchmark={bench!r} defines {clash}; remove them, or drop `benchmark` and set "
      f"every key yourself"
    )
  for k, v in BENCHMARK_SIZES.items():
    if given.get(k) is None:
      out[k] = v
  if not SEGMENTATION_BENCHMARKS[bench] and out["bg_threshold"] is not None:
    raise _eval_error(
      name, "bg_threshold", out["bg_threshold"], f"is set but benchmark={bench!r} has no background class"
    )


def _check_evals(config: mlc.ConfigDict) -> None:
  """Every enabled eval: its settings (`eval_settings`) and the rules that relate them to the model: the
  image size a whole number of patches and a CLS index the image tower has. What needs the data on disk
  (splits, fields, a dense benchmark's kind) is checked before training by tipsito/evals/config_checks.py
  `check_evals_on_disk`."""
  patch = config.model.image.patch_size
  num_cls = config.model.image.num_cls_tokens
  for name, ev in config.evals.items():
    if not hasattr(ev, "keys"):
      raise ConfigError(f"config.evals.{name}={ev!r} is not a dict of eval settings (`evals.*` keys)")
    if not eval_enabled(ev):
      continue
    s = eval_settings(name, ev)
    if s["image_size"] % patch:
      lo = s["image_size"] - s["image_size"] % patch
      near = " or ".join(str(v) for v in (lo, lo + patch) if v > 0)
      raise _eval_error(
        name,
        "image_size",
        s["image_size"],
        f"is not a whole number of patches of config.model.image.patch_size={patch}; valid values: "
        f"multiples of {patch}, e.g. {near}",
      )
    if s["cls_index"] >= num_cls:
      raise _eval_error(
        name,
        "cls_index",
        s["cls_index"],
        f"is not a CLS token of the image tower (config.model.image.num_cls_tokens={num_cls}); valid "
        f"values: {list(range(num_cls))}",
      )


def _check_model(config: mlc.ConfigDict, recipe) -> None:
  """Module kwargs are the modules' dataclass fields; geometry and the projection rule."""
  m = config.model
  for tree in schema.MODULE_TREES:
    _check_keys(tree, _lookup(config, tree), schema.module_fields(tree))
  _check_geometry(config, recipe)
  _check_attention(m)
  if "image_proj" in recipe.parts and not m.embed_dim:
    raise ConfigError(
      f"config.model.embed_dim must be a positive int for recipe {recipe.name!r} (it has an image projection)"
    )
  if "image_proj" not in recipe.parts and m.embed_dim is not None:
    if m.text.width != m.image.width:
      raise ConfigError(
        f"config.model.embed_dim must be None for recipe {recipe.name!r} and "
        f"model.text.width ({m.text.width}) must equal model.image.width "
        f"({m.image.width}) (TIPS: shared width, no projection)"
      )


def _check_attention(m: mlc.ConfigDict) -> None:
  """cuDNN flash attention runs in bfloat16 / float16 only (jax.nn.dot_product_attention); the fusion
  module runs in its own dtype or, unset, the image tower's (tipsito/train/step.py build_model)."""
  for tower, sub in (("image", m.image), ("text", m.text), ("fusion", m.fusion)):
    dtype = sub.get("dtype", None) or (m.image.dtype if tower == "fusion" else "float32")
    if sub.get("attention", "xla") == "cudnn" and dtype not in ("bfloat16", "float16"):
      raise ConfigError(
        f"config.model.{tower}.attention='cudnn' needs model.{tower}.dtype 'bfloat16' or 'float16' "
        f"(got {dtype!r}); set the dtype or use attention 'xla'"
      )


def _check_loss(config: mlc.ConfigDict, recipe) -> dict[str, float]:
  """Loss weights (keys restricted to the recipe's terms), cross-key loss options and EMA; returns the
  non-zero weights."""
  for k in config.loss.keys():
    if k not in recipe.terms:
      raise ConfigError(
        f"config.loss.{k} is not a loss term of recipe {recipe.name!r}; valid keys: {list(recipe.terms)}"
      )
  weights = {k: float(v) for k, v in config.loss.items() if v}
  if not weights:
    raise ConfigError(f"config.loss: every weight is 0; set at least one of {list(recipe.terms)}")
  _choice(
    "loss_opts.fusion_cls", config.loss_opts.fusion_cls, tuple(range(config.model.image.num_cls_tokens))
  )
  _check_ibot_options(config.loss_opts)
  if "fusion" in weights and not {"clip", "clip_view2"} & set(weights):
    raise ConfigError(
      f"config.loss.fusion={weights['fusion']} is ITO's lambda, relative to the alt-text alignment "
      "(config.loss.clip and config.loss.clip_view2), which is off; turn one of them on or set "
      "config.loss.fusion=0 (tipsito/objective/terms.py: fusion_term)"
    )
  if config.distill.init_image and recipe.teacher != "frozen":
    raise ConfigError(
      f"config.distill.init_image=True is for recipe 'distill' only (recipe "
      f"{config.recipe!r} has no frozen teacher); valid values: [False]"
    )
  if config.distill.dino_global_crop and recipe.teacher != "frozen":
    raise ConfigError(
      f"config.distill.dino_global_crop=True is for recipe 'distill' only (recipe "
      f"{recipe.name!r} has no frozen teacher); valid values: [False]"
    )
  if recipe.teacher == "frozen" and config.ema.mode == "full":
    raise ConfigError(
      "config.ema.mode='full' is not allowed for recipe 'distill' (the teacher encoder is "
      "frozen); valid values: ['head', 'none']"
    )
  return weights


def _check_ibot_options(lo: mlc.ConfigDict) -> None:
  """`ibot_token_norm='separate'` normalises masked and visible tokens apart, so it needs the visible
  tokens in the loss (iBOT++); `ibot_visible_weight` is read by that norm only."""
  if lo.ibot_token_norm == "separate" and not lo.ibot_all_patches:
    raise ConfigError(
      "config.loss_opts.ibot_token_norm='separate' is an iBOT++ option (masked and visible tokens "
      "normalised apart): set config.loss_opts.ibot_all_patches=True or another ibot_token_norm"
    )
  if float(lo.ibot_visible_weight) != 1.0 and lo.ibot_token_norm != "separate":
    raise ConfigError(
      f"config.loss_opts.ibot_visible_weight={lo.ibot_visible_weight} is read only with "
      f"config.loss_opts.ibot_token_norm='separate' (it is {lo.ibot_token_norm!r}); set both or neither"
    )


def _check_input(config: mlc.ConfigDict, recipe, weights: dict[str, float]) -> None:
  """The inputs the weighted loss terms need, and the distillation teacher."""
  inp = config.input
  second_view = sorted(t for t in weights if t in SECOND_VIEW_TERMS)
  if second_view and not view_layout(inp.views).two_views:
    raise ConfigError(
      f"config.input.views={inp.views!r}: loss terms {second_view} "
      f"need a second view; valid values: {list(TWO_VIEWS)}"
    )
  if "ibot" in weights and inp.mask_ratio > 0 and not config.model.image.use_mask_token:
    raise ConfigError(
      "config.model.image.use_mask_token must be True when config.loss.ibot > 0 and "
      "config.input.mask_ratio > 0"
    )
  if recipe.teacher == "frozen" and not (config.distill.teacher or config.distill.teacher_image_npz):
    raise ConfigError(
      "config.distill.teacher (an export dir) or config.distill.teacher_image_npz "
      "(official TIPS weights) is required for recipe 'distill'"
    )


def _check_init(config: mlc.ConfigDict) -> None:
  """`init_from`: its kind (tipsito/config/init_source.py) when the path exists (a missing one is refused
  by the pre-run check, tipsito/train/assembly.py `check_init_from`, which also compares the towers);
  for a training run with `init_teacher='continue'`, the EMA mode must be the init run's (its
  config.json) since its EMA subset is restored as it is (tipsito/train/assembly.py `init_from_run`).
  Refusing, rather than silently following the init run, keeps the config the one source of what the run
  does. A towers-only source (an export, a Hugging Face folder, official TIPS weights) has no teacher:
  either `init_teacher` starts one from the loaded towers."""
  if not config.init_from:
    return
  if not paths.as_path(config.init_from).exists():
    return
  try:
    src = init_source.detect(config.init_from)
  except init_source.InitSourceError as e:
    raise ConfigError(str(e)) from None
  if src.kind != "workdir" or config.init_teacher != "continue":
    return
  saved = run_file.init_run_config(config.init_from)
  if saved is None:  # a checkpoints folder without its run's config.json: the restore names what fails
    return
  was = (saved.get("ema") or {}).get("mode")
  if was != config.ema.mode:
    hint = " (configs/tipsv2_g14_hires.py: `ema=full`)" if was == "full" else ""
    raise ConfigError(
      f"config.ema.mode={config.ema.mode!r} but config.init_from={config.init_from!r} was trained with "
      f"ema.mode={was!r}; config.init_teacher='continue' (the default) continues that run's teacher, so "
      f"set --config.ema.mode={was}{hint}, or --config.init_teacher=reset to start a new teacher from "
      f"its params"
    )


def _check_batch_split(config: mlc.ConfigDict, num_devices: int, process_count: int) -> None:
  """The mesh fits `num_devices` and the global batch splits over (data, fsdp) and over the hosts."""
  try:
    shape = mesh_lib.mesh_shape(config.mesh, num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  split = shape[0] * shape[1]
  batch_size = config.input.batch_size
  if batch_size % split or batch_size % process_count:
    raise ConfigError(
      f"config.input.batch_size={batch_size} must be divisible by mesh data*fsdp="
      f"{split} and the process count {process_count}"
    )
  k = int(config.input.microbatches)
  if (batch_size // k) % split:
    raise ConfigError(
      f"config.input.batch_size={batch_size} / config.input.microbatches={k} = "
      f"{batch_size // k} per micro-batch must be divisible by mesh data*fsdp={split}"
    )
  chunks = int(config.model.fusion.get("chunks", 1))
  if chunks > 1 and config.loss.get("fusion", 0.0):
    rows = 2 * (batch_size // k) // split  # both views of each example, per micro-batch, per device
    if rows % chunks:
      raise ConfigError(
        f"config.model.fusion.chunks={chunks} must divide the {rows} rows the fusion module reads per "
        f"device (2 views x batch_size {batch_size} / microbatches {k} / mesh data*fsdp {split}), so that "
        "each device holds its share of every group; pick a divisor of it, or chunks=1"
      )
