"""Optimisers and learning-rate schedules for tipsito.

Why this module exists: TIPSv2 trains with Adafactor (factored second moments keep the optimiser state of a
ViT-g small) while the ITO/CLIP reproductions use AdamW; both need the same warmup + cosine schedule, the
same global-norm clipping, weight decay on kernels only, and parameter groups chosen by regex (frozen parts,
learning-rate multipliers). Everything here is driven by `config.optim`, so a recipe never has to touch the
optimiser code.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from tipsito.config.schema import OPTIMIZERS  # declared with its config key
from tipsito.train import sharding as sharding_lib


def make_schedule(
  optim_cfg, total_steps: int, *, base: float | None = None
) -> Callable[[jax.Array], jax.Array]:
  """Linear warmup from 0 to `lr`, then cosine (or linear/constant) decay to `lr * min_lr_ratio`.

  Why: the paper recipes (TIPSv2, ITO) all use warmup + cosine; the decay end is a config key so short
  CPU runs (demo) and 90k-step pod runs share one code path. `base` replaces `lr` as the peak: Adafactor
  uses the shape with peak 1 (big_vision multiplies lr and weight decay by it separately).
  """
  lr = float(optim_cfg.lr) if base is None else float(base)
  warmup = int(optim_cfg.warmup_steps)
  min_ratio = float(optim_cfg.min_lr_ratio)
  decay_steps = max(int(total_steps) - warmup, 1)
  kind = optim_cfg.schedule
  if kind == "cosine":
    decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=min_ratio)
  elif kind == "linear":
    decay = optax.linear_schedule(lr, lr * min_ratio, decay_steps)
  else:
    decay = optax.constant_schedule(lr)
  if warmup <= 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def _path_labels(params: Any, fn: Callable[[str, Any], Any]) -> Any:
  """Maps every leaf to fn('/'-joined path, leaf) — the basis of all regex parameter groups."""
  return jax.tree_util.tree_map_with_path(lambda p, x: fn(sharding_lib.path_str(p), x), params)


def kernel_mask(params: Any) -> Any:
  """True for matrices named `kernel` (weight decay target); biases, norms, embeddings, scales: False.

  Why: decoupled weight decay on kernels only (big_vision's convention); decaying LayerNorm scales, position embeddings,
  CLS/mask tokens or the learned temperature hurts contrastive training.
  """
  return _path_labels(params, lambda path, x: path.rsplit("/", 1)[-1] == "kernel" and x.ndim >= 2)


def lr_multipliers(params: Any, optim_cfg) -> Any:
  """Per-leaf learning-rate multiplier from `optim.lr_mults` {regex: mult} and `optim.frozen` (mult 0).

  The first matching regex wins (re.search on the '/'-joined path); unmatched leaves get 1.0.
  """
  mults = [(re.compile(k), float(v)) for k, v in dict(optim_cfg.lr_mults or {}).items()]
  frozen = [re.compile(r) for r in (optim_cfg.frozen or ())]

  def mult(path, _):
    if any(r.search(path) for r in frozen):
      return 0.0
    for r, m in mults:
      if r.search(path):
        return m
    return 1.0

  return _path_labels(params, mult)


def _scale_by_mults(mults_fn: Callable[[Any], Any]) -> optax.GradientTransformation:
  """Multiplies each update by a per-leaf float computed from its path at trace time (stateless).

  Computed from the updates tree itself (not a precomputed tree) so it composes with `multi_transform`,
  whose inner transforms see masked trees.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    mults = mults_fn(updates)
    return jax.tree.map(lambda u, m: u if m == 1.0 else u * m, updates, mults), state

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_adafactor(o) -> optax.GradientTransformation:
  """big_vision's Adafactor core (`big_vision/optax.py: scale_by_adafactor`) from optax parts.

  Factored second moments with decay `min(beta2_cap, 1 - (t+1)^-decay_rate)` (optax's default decay has no
  cap), optional block-RMS clipping, then momentum as an EMA without debiasing, m <- 0.9 m + 0.1 u, kept in
  `momentum_dtype`. Why an EMA and not `optax.trace`: a heavy-ball trace (m <- u + 0.9 m) settles at 10x
  the update, which is a different optimiser from the paper's at the same learning rate.
  """
  cap = float(o.beta2_cap)

  def decay_rate_fn(step, exponent):
    t = jnp.asarray(step, jnp.float32) + 1.0
    return jnp.minimum(cap, 1.0 - t ** (-exponent))

  parts = [
    optax.scale_by_factored_rms(
      factored=True,
      decay_rate=float(o.decay_rate),
      min_dim_size_to_factor=int(o.min_dim_size_to_factor),
      epsilon=float(o.eps),
      decay_rate_fn=decay_rate_fn,
    )
  ]
  if o.clip_block_rms:
    parts.append(optax.clip_by_block_rms(float(o.clip_block_rms)))
  if o.momentum:
    parts.append(optax.ema(float(o.momentum), debias=False, accumulator_dtype=jnp.dtype(o.momentum_dtype)))
  return optax.chain(*parts)


def make_optimizer(config, params_shape: Any) -> tuple[optax.GradientTransformation, Callable]:
  """Builds the optax chain for `config.optim` and returns (tx, lr_schedule).

  Conventions (`python -m tipsito.info` prints them):
    adafactor  big_vision's (`big_vision/optax.py: make`): update = -sched(t) * (lr * mult *
               adafactor(clip(g)) + wd * mask * p), sched = warmup + decay shape with peak 1, mask = kernels.
               Weight decay is NOT multiplied by lr, only by the schedule (per-step decay 1e-4 at the paper
               settings, not lr * wd = 1e-7). Pinned by tests/test_train_optim_adafactor.py against a
               trajectory of big_vision's own code.
    adamw      optax.adamw's: update = -lr(t) * mult * (adam(clip(g)) + wd * mask * p), the decoupled decay
               multiplied by the learning rate (PyTorch / open_clip convention).
    sgd        -lr(t) * mult * (trace(clip(g)) + wd * mask * p).
  The returned schedule is the learning rate lr(t) (logged as `lr`) in every case.
  `params_shape` may be a tree of ShapeDtypeStructs (masks only look at paths and ranks), so the optimiser
  can be built before any parameter exists (params are born sharded later).
  Frozen leaves (regex in `optim.frozen`) get `optax.set_to_zero` and no optimiser state at all, which is
  what a frozen distillation teacher or a frozen text tower needs to be free in memory.
  """
  o = config.optim
  sched = make_schedule(o, config.total_steps)
  name = o.name
  mults = lr_multipliers(params_shape, o)
  scale_mults = (
    [_scale_by_mults(lambda tree: lr_multipliers(tree, o))]
    if any(m != 1.0 for m in jax.tree.leaves(mults))
    else []
  )
  parts = []
  if o.clip_norm:
    parts.append(optax.clip_by_global_norm(float(o.clip_norm)))
  if name == "adafactor":
    parts += [scale_by_adafactor(o), optax.scale(float(o.lr)), *scale_mults]
    if o.weight_decay:
      parts.append(optax.add_decayed_weights(float(o.weight_decay), mask=kernel_mask))
    parts += [optax.scale_by_schedule(make_schedule(o, config.total_steps, base=1.0)), optax.scale(-1.0)]
  elif name in ("adamw", "sgd"):
    if name == "adamw":
      parts.append(
        optax.scale_by_adam(
          b1=float(o.b1), b2=float(o.b2), eps=float(o.eps), mu_dtype=jnp.dtype(o.momentum_dtype)
        )
      )
    elif o.momentum:
      parts.append(optax.trace(decay=float(o.momentum)))
    if o.weight_decay:
      # Decoupled (AdamW-style) decay: added after the adaptive scaling, then multiplied by the lr schedule.
      parts.append(optax.add_decayed_weights(float(o.weight_decay), mask=kernel_mask))
    parts += [optax.scale_by_learning_rate(sched), *scale_mults]
  else:  # validated earlier; keep a clear error for direct callers.
    raise ValueError(f"optim.name={name!r} not in {OPTIMIZERS}")
  tx = optax.chain(*parts)
  frozen_labels = jax.tree.map(lambda m: "frozen" if m == 0.0 else "train", mults)
  if any(lbl == "frozen" for lbl in jax.tree.leaves(frozen_labels)):
    tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, frozen_labels)
  return tx, sched
