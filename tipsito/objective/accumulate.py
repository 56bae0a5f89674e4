"""Exact gradient accumulation (`config.input.microbatches = K`): the update of the whole global batch,
computed K micro-batches at a time (the GradCache method, open_clip's `--accum-freq`), for every term.

Why not average micro-batch gradients: the contrastive terms (CLIP / SigLIP over both CLS tokens, both ITO
views, the fusion NT-Xent) use every other example of the global batch as negatives, KoLeo looks for
nearest neighbours in it and the DINO / iBOT centres are updated from all of its teacher outputs; naive
accumulation trains another objective with K times fewer negatives. Here the objective is the one of
`compute_losses`, on the whole batch:

  pass 1   `lax.scan` over the micro-batches: `features.encode` (the tower passes: student views, text,
           local crops, teacher) without gradient; the outputs are concatenated to the global batch.
  loss     `jax.value_and_grad` of the table of terms w.r.t. (params, encodings): the direct gradient of
           the small parts the terms apply on the whole batch (projections, heads, fusion, logit scale and
           bias, distillation projection), the loss, metrics and new centres (from the whole batch's
           teacher outputs, once), and the cotangent of every encoding.
  pass 2   `lax.scan` over the micro-batches: `encode` again (without the teacher: it gets no gradient),
           `jax.vjp` w.r.t. the params, pulled back with that micro-batch's slice of the cotangents, summed.

The gradient is the sum of the two, exactly the whole-batch gradient up to float summation order. Cost: one
extra forward of the towers (FLOPs about 4/3 of K = 1); memory: the towers' activations of one micro-batch
plus the encodings of the whole batch. Each micro-batch uses the same dropout key in both passes
(`fold_in(rng, k)`). Micro-batch k holds examples k, k+K, k+2K, ... of the global batch: with the batch
split over the (data, fsdp) devices in contiguous blocks of B/n (n | B/K, checked by the config
validation) that is a local reshape, and every micro-batch stays split over all the batch devices.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from tipsito.models.activation_sharding import constrain_batch, constrain_microbatches
from tipsito.objective.compute import evaluate_terms, needed_features
from tipsito.objective.context import LossContext
from tipsito.objective.features import encode, features_from_encodings


def split(tree, k: int):
  """Every leaf (B, ...) -> (K, B/K, ...); micro-batch j holds examples j, j+K, j+2K, ..."""

  def one(x):
    y = x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)
    return constrain_microbatches(y)

  return jax.tree.map(one, tree)


def merge(tree):
  """The inverse of `split`: (K, B/K, ...) -> (B, ...) in the global batch's order."""

  def one(x):
    y = x.swapaxes(0, 1)
    return constrain_batch(y.reshape((y.shape[0] * y.shape[1],) + y.shape[2:]))

  return jax.tree.map(one, tree)


def _floating(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def loss_and_grads(
  ctx: LossContext,
  k: int,
  params: dict,
  ema: dict,
  centers: dict,
  frozen: dict,
  batch: dict,
  step,
  rng,
  *,
  constrain_grads: Optional[Callable] = None,
) -> tuple[jax.Array, tuple[dict, dict], dict]:
  """(total, (metrics, new_centers), grads) of `compute_losses` on the global batch, in `k` micro-batches.

  `constrain_grads`: applied to the accumulated gradient (the step pins it to the params' shardings).
  """
  terms, needs = needed_features(ctx, batch)
  mbs = split(batch, k)
  index = jnp.arange(k)
  pin = constrain_grads or (lambda g: g)

  def encode_mb(p, mb, i, with_teacher: bool):
    return encode(ctx, needs, p, ema, frozen, mb, jax.random.fold_in(rng, i), teacher=with_teacher)

  def first(carry, xs):
    mb, i = xs
    return carry, jax.lax.stop_gradient(encode_mb(params, mb, i, True))

  _, encs = jax.lax.scan(first, None, (mbs, index))
  enc = merge(encs)
  teacher = enc.pop("teacher", None)
  leaves, treedef = jax.tree.flatten(enc)
  is_f = [_floating(x) for x in leaves]

  def unflatten(diff):
    it = iter(diff)
    return treedef.unflatten([next(it) if f else x for x, f in zip(leaves, is_f)])

  def objective(p, diff):
    e = unflatten(diff)
    if teacher is not None:
      e["teacher"] = teacher
    f = features_from_encodings(ctx, needs, p, ema, frozen, e, batch, step, rng)
    return evaluate_terms(ctx, terms, f, centers)

  diff0 = [x for x, f in zip(leaves, is_f) if f]
  (total, aux), (g_direct, g_enc) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(params, diff0)
  cts = split(g_enc, k)

  def second(acc, xs):
    mb, i, ct = xs

    def towers(p):
      out = jax.tree.leaves(encode_mb(p, mb, i, False))
      return [x for x, f in zip(out, is_f) if f]

    _, vjp = jax.vjp(towers, params)
    (g,) = vjp(ct)
    return pin(jax.tree.map(jnp.add, acc, g)), None

  g_towers, _ = jax.lax.scan(second, pin(jax.tree.map(jnp.zeros_like, params)), (mbs, index, cts))
  grads = pin(jax.tree.map(jnp.add, g_direct, g_towers))
  return total, aux, grads
