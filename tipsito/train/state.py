"""The explicit training state.

Why a flax.struct dataclass with every piece spelled out: everything that changes during training — the
step, the student parameters, the optimiser state, the EMA teacher (heads only by default, or encoder +
heads for the full-EMA ablation), the DINO/iBOT centres and the RNG key — is a leaf of one pytree. One
pytree means one sharding tree, one donated argument of the jitted step, and one Orbax checkpoint item, so
resuming is exact by construction. Nothing training-relevant hides in Python objects.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class TrainState:
  """Step, params, optimiser state, EMA teacher subset, self-distillation centres and RNG.

  Attributes:
    step: int32 scalar, number of optimiser updates applied.
    params: student parameters of the recipe's training model (encoders, projection, temperature, heads,
      fusion module).
    opt_state: optax state for `params`.
    ema: EMA teacher parameters: a dict holding a subset of the top-level entries of `params`
      (head-only EMA: {'dino_head', 'ibot_head'}; full EMA: also {'image'}; {} when the recipe has no
      self-distillation). In head-only mode there is, by construction, no copy of any encoder here.
    centers: {'dino': (K,), 'ibot': (K,)} teacher-logit centres (DINO softmax centering), {} if unused.
    rng: raw uint32[2] PRNG key data; the per-step key is fold_in(rng, step), so resuming at step N
      reproduces the exact randomness of an uninterrupted run.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  ema: Any
  centers: Any
  rng: jax.Array

  def step_key(self) -> jax.Array:
    """The PRNG key for the current step (deterministic in (seed, step))."""
    return jax.random.fold_in(self.rng, self.step)


def ema_keys(recipe, ema_mode: str) -> tuple[str, ...]:
  """Top-level param entries that get an EMA copy, given the recipe's parts and `config.ema.mode`.

  head: the DINO/iBOT student heads only (TIPSv2's head-only EMA); full: the image encoder as well
  (TIPS / DINO-style teacher); none: nothing (unstable for self-distillation, allowed for ablations).
  """
  heads = tuple(k for k in ("dino_head", "ibot_head") if k in recipe.parts)
  if not heads or ema_mode == "none":
    return ()
  if ema_mode == "full":
    return ("image",) + heads
  return heads


def init_ema(params: dict, keys: tuple[str, ...]) -> dict:
  """EMA teacher initialised as an exact copy of the student subset (as DINO/iBOT do)."""
  return {k: jax.tree.map(jnp.array, params[k]) for k in keys}


def ema_momentum(ema_cfg, step, total_steps: int) -> jax.Array:
  """Teacher momentum at `step`: `ema.schedule='constant'` -> `ema.momentum`; 'cosine' -> DINO's schedule
  m(t) = 1 - (1 - m0) (cos(pi t / T) + 1) / 2, from m0 at step 0 to 1 at the last step T = total_steps.

  Why: DINO/iBOT anneal the teacher to a frozen copy at the end of training; TIPSv2 does not say, so the
  default stays constant.
  """
  m0 = jnp.float32(ema_cfg.momentum)
  if ema_cfg.schedule == "constant":
    return m0
  frac = jnp.clip(jnp.asarray(step, jnp.float32) / max(int(total_steps), 1), 0.0, 1.0)
  return 1.0 - (1.0 - m0) * (jnp.cos(jnp.pi * frac) + 1.0) / 2.0


def ema_update(ema: dict, params: dict, momentum: jax.Array) -> dict:
  """teacher <- m * teacher + (1 - m) * student, leaf by leaf, for the EMA subset only."""
  return {
    k: jax.tree.map(lambda t, s: momentum * t + (1.0 - momentum) * s.astype(t.dtype), ema[k], params[k])
    for k in ema
  }
