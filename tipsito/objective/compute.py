"""`compute_losses`, the one loss function every recipe shares, and the centres its terms keep.

Why this shape: the active terms (non-zero weight) say which features they read, the feature pass
computes exactly those once, and each term is then evaluated from that record; a recipe never forks this.
Every term is returned separately (logged as `loss/<term>`) with the weighted sum (`loss/total`).
Collectives for the batch-wide softmaxes / centres come from GSPMD since the batch is a sharded global
array; nothing here knows about devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tipsito.objective.context import LossContext
from tipsito.objective.features import Features, compute_features
from tipsito.objective.terms import TERMS, Term


def active_terms(ctx: LossContext) -> dict[str, Term]:
  """The terms with a non-zero weight, in `TERMS` order (the summation order of the total)."""
  return {name: term for name, term in TERMS.items() if name in ctx.weights}


def needed_features(ctx: LossContext, batch: dict) -> tuple[dict[str, Term], frozenset]:
  """(the active terms, the union of the features they read); raises when the batch lacks a field."""
  terms = active_terms(ctx)
  for name, term in terms.items():
    missing = [k for k in term.required_fields(ctx) if k not in batch]
    if missing:
      raise KeyError(f"loss term {name!r} needs batch fields {missing}; the batch has {sorted(batch)}")
  return terms, frozenset().union(*(term.features for term in terms.values()))


def evaluate_terms(
  ctx: LossContext, terms: dict[str, Term], features: Features, centers: dict
) -> tuple[jax.Array, tuple[dict, dict]]:
  """The table of terms on one `Features` record: (total, (metrics, new_centers))."""
  losses, metrics, new_centers = {}, dict(features.metrics), dict(centers)
  for name, term in terms.items():
    out = term.fn(ctx, features, centers)
    losses[name] = out.loss
    metrics.update(out.metrics)
    new_centers.update(out.centers)
  total = sum(ctx.weights[t] * losses[t] for t in losses)
  metrics.update({f"loss/{t}": v for t, v in losses.items()})
  metrics["loss/total"] = total
  return total, (metrics, new_centers)


def compute_losses(
  ctx: LossContext, params: dict, ema: dict, centers: dict, frozen: dict, batch: dict, step, rng
) -> tuple[jax.Array, tuple[dict, dict]]:
  """Forward of the active terms on the GLOBAL batch; returns (total, (metrics, new_centers))."""
  terms, needs = needed_features(ctx, batch)
  features = compute_features(ctx, needs, params, ema, frozen, batch, step, rng)
  return evaluate_terms(ctx, terms, features, centers)


def init_centers(ctx: LossContext) -> dict:
  """Zero DINO / iBOT centres (K,) for the active self-distillation terms."""
  k = int(ctx.model.heads_cfg["num_prototypes"]) if ctx.model.heads_cfg else 0
  return {c: jnp.zeros((k,), jnp.float32) for term in active_terms(ctx).values() for c in term.centers}
