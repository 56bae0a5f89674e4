"""Building the training model, born-sharded state and the single jitted, donated train step.

Why in one place: the loop, `bench/step_bench.py`, `info.py`, `plan.py` and the tests all need exactly the
same objects (model, optimiser, state shapes and shardings, step function) from a config; building them
here keeps the train loop thin and guarantees that what `info` reports is what `train` runs.

`build` is a pure builder: it reads no disk. A frozen distillation teacher is passed in (`Teacher`, what
the step gets of it, is defined here); loading one, restoring a workdir's state and `config.init_from`
are tipsito/train/assembly.py, the one module above this one that reads runs from disk.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from tipsito import objective
from tipsito.data import batch as batch_lib
from tipsito.data import tokenizer as tok_lib
from tipsito.objective import LossContext, compute_losses, init_centers
from tipsito.objective import accumulate
from tipsito.objective.model import TrainModel
from tipsito.models.kwargs import module_kwargs
from tipsito.train import optim as optim_lib
from tipsito.train import sharding as sharding_lib
from tipsito.train import state as state_lib
from tipsito.train.state import TrainState


def image_kwargs(config) -> dict:
  """VisionTransformer kwargs of the student image tower."""
  return module_kwargs(config.model.image)


def text_kwargs(config, vocab_size: Optional[int] = None) -> dict:
  """TextEncoder kwargs; `vocab_size=None` in the config means: take it from the tokenizer."""
  kw = module_kwargs(config.model.text)
  if kw["vocab_size"] is None:
    kw["vocab_size"] = vocab_size if vocab_size is not None else tokenizer_vocab_size(config)
  kw.setdefault("max_len", int(config.max_len))
  return kw


def tokenizer_vocab_size(config) -> int:
  """Vocabulary of the configured tokenizer (the shipped demo model when None; + SOT/EOT for 'clip')."""
  return int(tok_lib.from_config(config).vocab_size)


@dataclasses.dataclass
class Teacher:
  """A frozen distillation teacher: its image tower module, config and params, its own DINO/iBOT heads when
  it comes from a tipsito training workdir (`heads`: {'dino_head', 'ibot_head'} -> params, with
  `heads_config` the teacher's `model.heads`), and its text tower (used to initialise the student's text
  tower when `config.distill.init_text`). Loaded by tipsito/train/teacher.py."""

  module: Any
  image_config: dict
  params: Any
  text_params: Any = None
  heads: Optional[dict] = None
  heads_config: Optional[dict] = None
  source: str = ""


def check_teacher_heads(config, teacher: Teacher) -> None:
  """The student heads must have the teacher heads' shape (same `model.heads`), since the student's head
  outputs are compared with the teacher's prototypes."""
  keys = ("num_prototypes", "hidden_dim", "bottleneck_dim", "num_layers")
  got = {k: config.model.heads.get(k) for k in keys}
  want = {k: (teacher.heads_config or {}).get(k) for k in keys}
  if got != want:
    raise ValueError(
      f"config.model.heads {got} differs from the teacher's heads {want} "
      f"({teacher.source}); set --config.model.heads.<key> to the teacher's values"
    )


def frozen_tree(teacher: Teacher) -> dict:
  """The frozen step input: {'image': teacher encoder[, 'dino_head', 'ibot_head': the teacher's heads]}."""
  return {"image": teacher.params, **(teacher.heads or {})}


@dataclasses.dataclass
class Setup:
  """Everything built from a config: model, recipe, loss context, optimiser, state shapes/shardings."""

  config: Any
  mesh: Mesh
  recipe: Any
  model: TrainModel
  ctx: LossContext
  tx: optax.GradientTransformation
  schedule: Callable
  state_shapes: Any
  state_shardings: Any
  batch_sharding: NamedSharding
  init_fn: Callable[[jax.Array], TrainState]
  teacher: Optional[Teacher] = None
  frozen_shardings: Any = None

  def init_state(self) -> TrainState:
    """Params born sharded: jit(init, out_shardings=...) — no host ever holds the full tree."""
    return jax.jit(self.init_fn, out_shardings=self.state_shardings)(
      jax.random.PRNGKey(int(self.config.seed))
    )

  def frozen(self) -> dict:
    """Frozen (non-trained, non-checkpointed) inputs of the step: the distillation teacher's params."""
    if self.teacher is None:
      return {}
    return jax.device_put(frozen_tree(self.teacher), self.frozen_shardings)


def build_model(
  config, recipe, *, vocab_size: Optional[int] = None, teacher_width: Optional[int] = None
) -> TrainModel:
  """The recipe's TrainModel from `config.model` (mask token only when iBOT masks the student's view)."""
  img = image_kwargs(config)
  img["use_mask_token"] = objective.masks_student_view(config)
  txt = text_kwargs(config, vocab_size) if "text" in recipe.parts else {}
  parts = tuple(recipe.parts)
  heads = dict(config.model.heads)
  head_dtype = img["dtype"]
  heads.setdefault("dtype", head_dtype)
  fusion = module_kwargs(config.model.fusion)
  fusion.setdefault("max_text_len", int(config.max_len))
  fusion.setdefault("dtype", head_dtype)
  return TrainModel(
    image_cfg=img,
    text_cfg=txt,
    parts=parts,
    embed_dim=config.model.embed_dim,
    heads_cfg=heads,
    fusion_cfg=fusion,
    logit_scale_init=float(config.model.logit_scale_init),
    logit_bias_init=float(config.model.logit_bias_init),
    distill_dim=teacher_width,
  )


def make_loss_context(config, recipe, model, ema_keys, teacher=None) -> LossContext:
  """Static loss options: `config.loss` (weights, zero terms dropped) and every `config.loss_opts` key."""
  lo = config.loss_opts
  return LossContext(
    model=model,
    frozen_teacher=recipe.teacher == "frozen",
    weights={k: float(v) for k, v in config.loss.items() if v},
    masks_student_view=objective.masks_student_view(config),
    has_local_crops=batch_lib.BatchLayout.from_config(config).num_local > 0,
    student_temp=float(lo.student_temp),
    teacher_temp=float(lo.teacher_temp),
    warmup_teacher_temp=float(lo.warmup_teacher_temp),
    teacher_temp_warmup_steps=int(lo.teacher_temp_warmup_steps),
    center_momentum=float(lo.center_momentum),
    ibot_all_patches=bool(lo.ibot_all_patches),
    ibot_token_norm=lo.ibot_token_norm,
    ibot_visible_weight=float(lo.ibot_visible_weight),
    teacher_method=lo.teacher_method,
    contrastive_view=lo.contrastive_view,
    logit_scale_max=None if config.model.logit_scale_max is None else float(config.model.logit_scale_max),
    fusion_cls=int(lo.fusion_cls),
    dino_reduction=lo.dino_reduction,
    view_weighting=lo.view_weighting,
    dino_global_crop=bool(config.distill.dino_global_crop),
    ema_keys=tuple(ema_keys),
    teacher_model=None if teacher is None else teacher.module,
  )


def example_inputs(config) -> tuple[jax.Array, jax.Array]:
  """Dummy (image, ids) with the config's global crop size, for initialisation only."""
  s = int(config.input.global_size)
  return jnp.zeros((1, s, s, 3), jnp.uint8), jnp.ones((1, int(config.max_len)), jnp.int32)


def build(
  config, mesh: Optional[Mesh] = None, *, vocab_size: Optional[int] = None, teacher: Optional[Teacher] = None
) -> Setup:
  """Builds the Setup for `config` on `mesh` (default: all devices, `config.mesh`); reads no disk.

  A recipe with a frozen teacher needs `teacher` (tipsito/train/teacher.py `load_teacher`, or
  tipsito/train/assembly.py `build`, which loads it from `config.distill`).
  """
  mesh = mesh or sharding_lib.make_mesh(config.mesh)
  recipe = objective.get_recipe(config.recipe)
  if recipe.teacher == "frozen" and teacher is None:
    raise ValueError(
      f"config.recipe={config.recipe!r} distills from a frozen teacher: build it with "
      "tipsito.train.assembly.build(config, mesh), which loads config.distill's teacher, "
      "or pass teacher="
    )
  teacher_width = None if teacher is None else int(teacher.image_config["width"])
  model = build_model(config, recipe, vocab_size=vocab_size, teacher_width=teacher_width)
  ema_keys = state_lib.ema_keys(recipe, config.ema.mode)
  if teacher is not None and teacher.heads:
    check_teacher_heads(config, teacher)
    ema_keys = ()  # the teacher's own frozen heads give the targets: no EMA of the student heads
  ctx = make_loss_context(config, recipe, model, ema_keys, teacher)
  images, ids = example_inputs(config)

  def init_params(rng):
    return model.init({"params": rng, "dropout": rng}, images, ids, method=TrainModel.init_all)["params"]

  params_shape = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  tx, schedule = optim_lib.make_optimizer(config, params_shape)

  def init_fn(rng) -> TrainState:
    p_rng, s_rng = jax.random.split(rng)
    params = init_params(p_rng)
    if config.distill.init_text and teacher is not None and teacher.text_params is not None:
      want = jax.tree.map(lambda x: x.shape, params["text"])
      got = jax.tree.map(lambda x: tuple(x.shape), teacher.text_params)
      if want != got:
        raise ValueError(
          "config.distill.init_text=True but the teacher's text tower does not match "
          "config.model.text (set the same width/depth/vocab_size, or init_text=False)"
        )
      params = {**params, "text": jax.tree.map(jnp.asarray, teacher.text_params)}
    if config.distill.init_image and teacher is not None:
      params = {**params, "image": _teacher_image_init(params["image"], teacher.params)}
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=tx.init(params),
      ema=state_lib.init_ema(params, ema_keys),
      centers=init_centers(ctx),
      rng=s_rng,
    )

  state_shapes = jax.eval_shape(init_fn, jax.random.PRNGKey(0))
  rules = [tuple(r) for r in config.sharding.rules]
  state_shardings = sharding_lib.tree_shardings(
    state_shapes, mesh, rules, min_size=int(config.sharding.min_size)
  )
  frozen_shardings = None
  if teacher is not None:
    frozen_shardings = sharding_lib.tree_shardings(
      frozen_tree(teacher), mesh, rules, min_size=int(config.sharding.min_size)
    )
  return Setup(
    config=config,
    mesh=mesh,
    recipe=recipe,
    model=model,
    ctx=ctx,
    tx=tx,
    schedule=schedule,
    state_shapes=state_shapes,
    state_shardings=state_shardings,
    batch_sharding=sharding_lib.batch_sharding(mesh),
    init_fn=init_fn,
    teacher=teacher,
    frozen_shardings=frozen_shardings,
  )


def _teacher_image_init(student: dict, teacher: dict) -> dict:
  """The student image encoder started from the frozen teacher's (`config.distill.init_image`; TIPSv2 §3.1
  reports that this pretrained init removes the gain of distillation, the ablation it enables). The
  student keeps its own mask token (the teacher has none); every other leaf must match in shape."""
  want = {k: jax.tree.map(lambda x: tuple(x.shape), v) for k, v in student.items() if k != "mask_token"}
  got = jax.tree.map(lambda x: tuple(x.shape), dict(teacher))
  if want != got:
    raise ValueError(
      "config.distill.init_image=True but the teacher's image tower does not match "
      "config.model.image (set the same variant, patch size and CLS count, or "
      "init_image=False)"
    )
  out = {k: jax.tree.map(jnp.asarray, v) for k, v in teacher.items()}
  if "mask_token" in student:
    out["mask_token"] = student["mask_token"]
  return out


def microbatches(config) -> int:
  """`config.input.microbatches` (a workdir's config.json saved before the key existed gains it when read:
  tipsito/config/run_file.py)."""
  return int(config.input.microbatches)


def loss_and_grads(setup: Setup, state: TrainState, batch: dict, frozen: dict):
  """(total, metrics, new_centers, grads) of one step, without applying it (tests, benchmarks).

  With `config.input.microbatches` K > 1 the same numbers come from K micro-batches (exact gradient
  accumulation, tipsito/objective/accumulate.py); K = 1 is the one whole-batch pass.
  """
  k = microbatches(setup.config)
  if k > 1:
    shardings = setup.state_shardings.params
    total, (metrics, centers), grads = accumulate.loss_and_grads(
      setup.ctx,
      k,
      state.params,
      state.ema,
      state.centers,
      frozen,
      batch,
      state.step,
      state.step_key(),
      constrain_grads=lambda g: jax.lax.with_sharding_constraint(g, shardings),
    )
    return total, metrics, centers, grads

  def loss_fn(params):
    return compute_losses(
      setup.ctx, params, state.ema, state.centers, frozen, batch, state.step, state.step_key()
    )

  (total, (metrics, centers)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return total, metrics, centers, grads


def train_step(setup: Setup, state: TrainState, batch: dict, frozen: dict) -> tuple[TrainState, dict]:
  """One optimiser step: losses on the global batch, update, EMA of the teacher subset, new centres.

  Non-finite guard: when the loss, the gradient norm or the update norm is not finite, every part of the
  state except `step` keeps its old value (params, optimizer state, EMA, centres), so one bad batch can
  neither poison the params nor reach a checkpoint; `train/nonfinite` is 1 for such a step and
  `tipsito.train.nonfinite.NonFiniteMonitor` stops the run after too many in a row. A `cond` on the
  finiteness, not an element-wise select of every leaf between new and old: the select is one more pass
  over the params and optimizer state and keeps new and old copies of both live at once, where the
  cond's taken branch writes the updated params in place of the donated ones (B/16 `clip` on XLA:CPU:
  compiled temporaries 2484 -> 2284 MiB, step time 0.7 % lower; docs/performance.md). The values are
  the same either way.
  """
  total, metrics, centers, grads = loss_and_grads(setup, state, batch, frozen)
  updates, opt_state = setup.tx.update(grads, state.opt_state, state.params)
  momentum = state_lib.ema_momentum(setup.config.ema, state.step, setup.config.total_steps)
  metrics = dict(metrics)
  if state.ema:
    metrics["ema_momentum"] = momentum
  metrics["grad_norm"] = optax.tree.norm(grads)
  metrics["update_norm"] = optax.tree.norm(updates)
  metrics["lr"] = setup.schedule(state.step)
  finite = jnp.isfinite(total) & jnp.isfinite(metrics["grad_norm"]) & jnp.isfinite(metrics["update_norm"])
  metrics["train/nonfinite"] = jnp.logical_not(finite).astype(jnp.int32)

  def applied(old: TrainState) -> TrainState:
    params = optax.apply_updates(old.params, updates)
    ema = state_lib.ema_update(old.ema, params, momentum)
    return old.replace(params=params, opt_state=opt_state, ema=ema, centers=centers)

  kept = jax.lax.cond(finite, applied, lambda old: old, state)
  return kept.replace(step=state.step + 1), metrics


def all_finite(tree: Any) -> jax.Array:
  """Whether every floating leaf of `tree` is finite (checked before a checkpoint is written)."""
  leaves = [
    jnp.all(jnp.isfinite(x))
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _on_mesh(setup: Setup, fn: Callable) -> Callable:
  """`fn(setup, state, batch, frozen)` traced with `setup.mesh` as the current mesh, so that the towers'
  batch constraints (tipsito/models/activation_sharding.py) keep activations sharded over the batch."""

  def traced(state, batch, frozen):
    with jax.sharding.use_abstract_mesh(setup.mesh.abstract_mesh):
      return fn(setup, state, batch, frozen)

  return traced


def jit_train_step(setup: Setup) -> Callable:
  """The one jitted step: explicit in/out shardings, state donated (updated in place on device)."""
  rep = sharding_lib.replicated(setup.mesh)
  frozen_sh = setup.frozen_shardings if setup.frozen_shardings is not None else rep
  return jax.jit(
    _on_mesh(setup, train_step),
    in_shardings=(setup.state_shardings, setup.batch_sharding, frozen_sh),
    out_shardings=(setup.state_shardings, rep),
    donate_argnums=(0,),
  )


def jit_loss_and_grads(setup: Setup) -> Callable:
  """Jitted `loss_and_grads` with the same shardings as the step (grads sharded like params)."""
  rep = sharding_lib.replicated(setup.mesh)
  frozen_sh = setup.frozen_shardings if setup.frozen_shardings is not None else rep
  return jax.jit(
    _on_mesh(setup, loss_and_grads),
    in_shardings=(setup.state_shardings, setup.batch_sharding, frozen_sh),
    out_shardings=(rep, rep, rep, setup.state_shardings.params),
  )
