"""Exact gradient accumulation (`config.input.microbatches = K`): the update of the whole global batch,
computed K micro-batches at a time (the GradCache method, open_clip's `--accum-freq`), for every term.

Why not average micro-batch gradients: the contrastive terms (CLIP / SigLIP over both CLS tokens, both ITO
views, the fusion NT-Xent) use every other example of the global batch as negatives, KoLeo looks for
nearest neighbours in it and the DINO / iBOT centres are updated from all of its teacher outputs; naive
accumulation trains another objective with K times fewer negatives. Here the objective is the one of
`compute_losses`, on the whole batch, with the active terms in two groups:

  per example   DINO, iBOT / iBOT++ (with centred teacher targets) and `feature` (`Term.per_example` in
                tipsito/objective/terms.py): given the centres, the loss is a mean over examples, and the
                centre update and metrics are weighted means. They run inside pass 2 on each micro-batch
                (teacher forward and 32768-prototype heads included), and are combined exactly: losses
                by the mean over micro-batches, centre means and metrics weighted by `Term.batch_weight`
                (examples, or the tokens iBOT counts), the centre EMA applied once.
  batch-coupled everything else (CLIP / SigLIP, clip_view2, fusion's NT-Xent, KoLeo; DINO / iBOT with
                Sinkhorn-Knopp targets, which normalise over the batch): evaluated once on the whole
                batch's small encodings (the CLS tokens and pooled captions; the ITO fusion Transformer
                is per example, so its embeddings are computed per micro-batch too).

  pass 1   `lax.scan` over the micro-batches: the tower passes (`features.encode`) and the fusion
           embeddings, without gradient, reduced to what the batch-coupled terms read and concatenated to
           the global batch (plus the teacher only with Sinkhorn targets).
  loss     `jax.value_and_grad` of the batch-coupled terms w.r.t. (params, encodings): the direct gradient
           of the small parts they apply on the whole batch (projections, logit scale and bias), their
           loss and metrics, and the cotangent of every encoding.
  pass 2   `lax.scan` over the micro-batches: the same tower passes again (now with the teacher when a
           per-example term reads it), `jax.vjp` w.r.t. the params of (the encodings, the per-example
           terms' share of the loss), pulled back with (that micro-batch's slice of the cotangents, 1).

The gradient is the sum, exactly the whole-batch gradient up to float summation order. Cost: one extra
forward of the towers and the fusion Transformer (FLOPs at most about 4/3 of K = 1); memory: the activations of one micro-batch (towers,
heads, fusion) plus the CLS-sized encodings of the whole batch. Each micro-batch uses the same dropout key
in both passes (`fold_in(rng, k)`). Micro-batch k holds examples k, k+K, k+2K, ... of the global batch:
with the batch split over the (data, fsdp) devices in contiguous blocks of B/n (n | B/K, checked by the
config validation) that is a local reshape, and every micro-batch stays split over all the batch devices.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from tipsito.losses import dino as dino_lib
from tipsito.models.activation_sharding import constrain_batch, constrain_microbatches
from tipsito.objective.compute import evaluate_terms, needed_features
from tipsito.objective.context import LossContext
from tipsito.objective.features import (
  LOCAL_CROPS,
  TEACHER,
  encode,
  features_from_encodings,
  self_distillation_metrics,
)
from tipsito.objective.terms import FUSION, fused_embeddings


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


def _small(enc: dict) -> dict:
  """The encodings the batch-coupled terms read when none of them self-distils: CLS tokens, pooled
  captions and fusion embeddings (no patch or caption tokens, no local crops)."""
  out = {k: {"cls": enc[k]["cls"]} for k in ("student", "contrastive", "view2") if k in enc}
  if "caption" in enc:
    out["caption"] = {"pooled": enc["caption"]["pooled"]}
  for k in ("synthetic_pooled", "fused"):
    if k in enc:
      out[k] = enc[k]
  return out


def _average(x, w):
  """The mean of K micro-batch values x (K, ...) weighted by their counts w (K,); the plain mean when
  every count is 0."""
  total = jnp.sum(w)
  wx = jnp.tensordot(w, x, axes=1)
  return jnp.where(total > 0, wx / jnp.where(total > 0, total, 1.0), jnp.mean(x, 0))


def _combine(
  ctx: LossContext,
  centers: dict,
  losses: dict,
  metrics: dict,
  means: dict,
  weights: dict,
  metric_weights: dict,
):
  """The per-example terms' (losses, metrics, new centres) on the whole batch from their K micro-batch
  values (leading axis K): losses by the mean; metrics and centre means weighted by the terms' batch
  weights, a metric with a count of its own (`TermOutput.metric_weights`) by that count; then the centre
  EMA of `update_center` once (unchanged when no token of the batch counts)."""
  out_losses = {n: jnp.mean(v) for n, v in losses.items()}
  out_metrics, out_centers = {}, {}
  for n, w in weights.items():
    own = metric_weights[n]
    out_metrics.update({name: _average(v, own.get(name, w)) for name, v in metrics[n].items()})
    for c, mean_k in means[n].items():
      # `update_center` of one row (the weighted mean): its EMA, applied once.
      new = dino_lib.update_center(centers[c], _average(mean_k, w)[None], ctx.center_momentum)
      out_centers[c] = jnp.where(jnp.sum(w) > 0, new, centers[c])
  return out_losses, out_metrics, out_centers


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
  local = {n: t for n, t in terms.items() if t.per_example(ctx)}
  coupled = {n: t for n, t in terms.items() if n not in local}
  coupled_needs = frozenset().union(*(t.features for t in coupled.values()))
  whole_teacher = TEACHER in coupled_needs  # Sinkhorn targets: the teacher of the whole batch
  local_teacher = any(TEACHER in t.features for t in local.values())
  # The per-example terms' centre outputs are then their batch means (momentum 0), combined by _combine.
  local_ctx = dataclasses.replace(ctx, center_momentum=0.0)
  mbs = split(batch, k)
  index = jnp.arange(k)
  pin = constrain_grads or (lambda g: g)

  def tower_passes(p, mb, i, pass_needs, with_teacher: bool):
    return encode(ctx, pass_needs, p, ema, frozen, mb, jax.random.fold_in(rng, i), teacher=with_teacher)

  def coupled_inputs(p, enc, mb, i) -> dict:
    """What the batch-coupled terms read of one micro-batch (the teacher apart): `_small` unless one
    of them self-distils, with the fusion embeddings."""
    out = {key: v for key, v in enc.items() if key != "teacher"}
    if LOCAL_CROPS not in coupled_needs:
      out.pop("local_cls", None)
    if FUSION in coupled:
      f = features_from_encodings(
        ctx, coupled_needs - {TEACHER}, p, ema, frozen, enc, mb, step, jax.random.fold_in(rng, i)
      )
      out["fused"] = jnp.stack(fused_embeddings(ctx, f), 1)
    return out if whole_teacher else _small(out)

  # Pass 1 skips what only the per-example terms read: the local crops, and the teacher.
  first_needs = needs if LOCAL_CROPS in coupled_needs else needs - {LOCAL_CROPS}

  def first(carry, xs):
    mb, i = xs
    enc = tower_passes(params, mb, i, first_needs, whole_teacher)
    return carry, jax.lax.stop_gradient((coupled_inputs(params, enc, mb, i), enc.get("teacher")))

  _, (encs, teachers) = jax.lax.scan(first, None, (mbs, index))
  enc = merge(encs)
  teacher = merge(teachers) if whole_teacher else None
  leaves, treedef = jax.tree.flatten(enc)
  is_f = [_floating(x) for x in leaves]

  def unflatten(diff):
    it = iter(diff)
    return treedef.unflatten([next(it) if f else x for x, f in zip(leaves, is_f)])

  def objective(p, diff):
    e = unflatten(diff)
    if teacher is not None:
      e["teacher"] = teacher
    f = features_from_encodings(ctx, coupled_needs, p, ema, frozen, e, batch, step, rng)
    total, aux = evaluate_terms(ctx, coupled, f, centers)
    return jnp.asarray(total, jnp.float32), aux

  diff0 = [x for x, f in zip(leaves, is_f) if f]
  (_, (metrics, new_centers)), (g_direct, g_enc) = jax.value_and_grad(
    objective, argnums=(0, 1), has_aux=True
  )(params, diff0)
  cts = split(g_enc, k)

  def second(acc, xs):
    mb, i, ct = xs

    def micro(p):
      enc = tower_passes(p, mb, i, needs, local_teacher)
      shared = [x for x, f in zip(jax.tree.leaves(coupled_inputs(p, enc, mb, i)), is_f) if f]
      if not local:
        return (shared, jnp.float32(0.0)), ({}, {}, {}, {}, {})
      f = features_from_encodings(local_ctx, needs, p, ema, frozen, enc, mb, step, jax.random.fold_in(rng, i))
      outs = {n: t.fn(local_ctx, f, centers) for n, t in local.items()}
      share = sum(ctx.weights[n] * o.loss for n, o in outs.items()) / k
      aux = (
        {n: o.loss for n, o in outs.items()},
        {n: o.metrics for n, o in outs.items()},
        {n: o.centers for n, o in outs.items()},
        {n: t.batch_weight(ctx, f) for n, t in local.items()},
        {n: o.metric_weights for n, o in outs.items()},
      )
      return (shared, share), aux

    (_, share), vjp, aux = jax.vjp(micro, params, has_aux=True)
    (g,) = vjp((ct, jnp.ones_like(share)))
    return pin(jax.tree.map(jnp.add, acc, g)), aux

  zeros = pin(jax.tree.map(jnp.zeros_like, params))
  g_towers, per_mb = jax.lax.scan(second, zeros, (mbs, index, cts))
  grads = pin(jax.tree.map(jnp.add, g_direct, g_towers))
  if not local:
    return metrics["loss/total"], (metrics, new_centers), grads

  losses, local_metrics, local_centers = _combine(ctx, centers, *per_mb)
  metrics = dict(metrics)
  if not whole_teacher:
    metrics.update(self_distillation_metrics(ctx, enc["student"]["cls"], step))
  metrics.update(local_metrics)
  new_centers = {**new_centers, **local_centers}
  losses.update({n: metrics[f"loss/{n}"] for n in coupled})
  total = sum(ctx.weights[n] * losses[n] for n in terms)  # in TERMS order, as `evaluate_terms`
  metrics.update({f"loss/{n}": losses[n] for n in terms})
  metrics["loss/total"] = total
  return total, (metrics, new_centers), grads
