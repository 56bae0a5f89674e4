"""Fidelity of the tipsito composition and the mechanism metrics (issue 33 items 1 and 4, issue 31 item 2).

What must hold, measured on the train step's own loss (tiny depth-1 towers):
- fusion : alt-text alignment = ITO's lambda (`config.loss.fusion`, 2) for tipsito with either view
  weighting and one or two CLS tokens, and for ITO (tipsito/objective/terms.py: `fusion_term`);
- with one CLS token and view_weighting 'mean' the two views weigh the same (1/2 + 1/2), as with two;
- `ibot/ce_masked` and `ibot/ce_visible` are the token means of the cross-entropy against the teacher's
  centred and sharpened targets (the loss's), recomputed here from the arguments the iBOT loss receives;
- `loss_opts.ibot_token_norm='separate'` with `ibot_visible_weight` w_v (ours) trains on
  ce_masked + w_v ce_visible.
Weights are measured as d loss/total / d (each loss call's value), with every loss call replaced by a
probe scalar, so a wrong weight anywhere in the composition shows.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito import info
from tipsito import objective
from tipsito.config import validation as config_validation
from tipsito.config.validation import ConfigError
from tipsito.losses import contrastive as con_lib
from tipsito.losses import ibot as ibot_lib

from test_fidelity_objective import build, close, run_losses, tiny

ALT_TEXT = (("CLS1", "alt-text", 1), ("CLS1", "alt-text", 2))
# Two more compositions (view_weighting 'sum'; loss.fusion=4) with TIPSITO_ALL_COMPOSITIONS=1 (~1.5 min).
ALL = bool(os.environ.get("TIPSITO_ALL_COMPOSITIONS"))
EXTRA = pytest.mark.skipif(not ALL, reason="set TIPSITO_ALL_COMPOSITIONS=1")


def measured_weights(setup, state, batch):
  """{(cls, caption, view): weight, 'fusion': weight}: d loss/total / d (each InfoNCE and the NT-Xent),
  every call's value replaced by a probe scalar. The InfoNCE calls come in `TERMS` order: clip's
  (CLS1, alt-text) then, with two CLS, (CLS2, synthetic), then clip_view2's (CLS1, alt-text) of view 2
  (the arguments each call reads are pinned by tests/test_recipes_wiring.py)."""
  two_cls = setup.config.model.image.num_cls_tokens > 1
  names = [("CLS1", "alt-text", 1)] + [("CLS2", "synthetic", 1)] * two_cls + [("CLS1", "alt-text", 2)]
  real = (con_lib.clip_loss, con_lib.ntxent_loss)

  def total_of(probes):
    calls = []

    def probe(*a, **kw):
      del a, kw
      calls.append(1)
      return probes[len(calls) - 1]

    con_lib.clip_loss = con_lib.ntxent_loss = probe
    try:
      total, _ = objective.compute_losses(
        setup.ctx, state.params, state.ema, state.centers, {}, batch, state.step, jax.random.PRNGKey(0)
      )
    finally:
      con_lib.clip_loss, con_lib.ntxent_loss = real
    assert len(calls) == len(names) + 1
    return total

  grads = jax.jit(jax.grad(total_of))(jnp.zeros((len(names) + 1,), jnp.float32))
  return dict(zip(names + ["fusion"], (float(g) for g in grads)))


@pytest.mark.parametrize(
  "recipe, opts, cls_tokens, fusion_key, alt_text, fusion",
  [
    ("tipsito", {}, 2, 2.0, 0.25, 1.0),  # the recipe: view_weighting 'mean', two CLS
    pytest.param("tipsito", {"view_weighting": "sum"}, 2, 2.0, 0.5, 2.0, marks=EXTRA),
    ("tipsito", {}, 1, 2.0, 0.5, 2.0),  # one CLS, 'mean': ITO's L_align, 1/2 per view (was 1/2 and 1/4)
    # loss.fusion=4: the composition before, a ratio of 4.
    pytest.param("tipsito", {}, 2, 4.0, 0.25, 2.0, marks=EXTRA),
    ("ito", {}, 1, 2.0, 0.5, 2.0),
  ],
  ids=["tipsito-mean", "tipsito-sum", "tipsito-one-cls-mean", "tipsito-fusion4", "ito"],
)
def test_fusion_to_alignment_ratio_is_itos_lambda(recipe, opts, cls_tokens, fusion_key, alt_text, fusion):
  """ITO: L = L_align + lambda L_fusion with lambda = `config.loss.fusion`: the measured fusion weight
  over the measured weight of the alt-text InfoNCE summed over the two views is lambda, whatever the
  view weighting and the number of CLS tokens, and the two views weigh the same; `info` prints the
  measured fusion weight."""
  c = tiny(recipe)
  c.loss_opts.update(opts)
  c.model.image.num_cls_tokens = cls_tokens
  c.loss.fusion = fusion_key
  config_validation.validate(c)
  setup, state, batch = build(c)
  got = measured_weights(setup, state, batch)
  alt = [got[k] for k in ALT_TEXT]
  assert alt == pytest.approx([alt_text, alt_text], abs=1e-6)
  assert got["fusion"] == pytest.approx(fusion, abs=1e-6)
  assert got["fusion"] / sum(alt) == pytest.approx(fusion_key, abs=1e-6)
  (row,) = [r for r in info.effective_weights(c, setup.ctx) if r["pair"].startswith("fusion")]
  assert row["weight"] == pytest.approx(fusion, abs=1e-6)


def test_fusion_without_alignment_is_refused():
  c = tiny("tipsito")
  c.loss.update(dict(clip=0.0, clip_view2=0.0))
  with pytest.raises(ConfigError, match=r"config\.loss\.fusion=2\.0 is ITO's lambda.*clip_view2"):
    config_validation.validate(c)


# --- masked / visible patch cross-entropy (TIPSv2 Fig. 2) ----------------------------------------------


def ibot_arguments(setup, state, batch, ctx):
  """(metrics, the arguments of the one `ibot_loss` call, its keywords) of the loss on `batch`."""
  real = ibot_lib.ibot_loss
  keywords = []

  def f(params, batch):
    seen = []

    def spy(*a, **kw):
      seen.append(a)
      keywords.append(kw)
      return real(*a, **kw)

    ibot_lib.ibot_loss = spy
    try:
      _, (metrics, _) = objective.compute_losses(
        ctx, params, state.ema, state.centers, {}, batch, state.step, jax.random.PRNGKey(0)
      )
    finally:
      ibot_lib.ibot_loss = real
    (args,) = seen
    return metrics, args

  metrics, args = jax.jit(f)(state.params, batch)
  return metrics, args, keywords[0]


def direct_split(args):
  """ce_masked, ce_visible from the iBOT loss's arguments, in numpy: teacher targets
  softmax((t - c) / tau_t), per-token CE with log_softmax(s / tau_s), token means over the batch."""
  s, t, mask, center, tau_s, tau_t = (np.asarray(a, np.float64) for a in args[:6])
  z = (t - center.reshape(-1)) / tau_t
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  y = s / tau_s
  y = y - y.max(-1, keepdims=True)
  ce = -(p * (y - np.log(np.exp(y).sum(-1, keepdims=True)))).sum(-1)
  mask = mask.astype(bool)
  return ce[mask].mean(), ce[~mask].mean(), ce


@pytest.mark.parametrize("recipe", ["tips", "tipsv2"])
def test_masked_and_visible_cross_entropy_metrics_equal_a_direct_computation(recipe):
  """iBOT (tips) trains on the masked tokens only, iBOT++ (tipsv2) on all: both log both means. The mask
  is made ragged (two images unmasked) so token means and image means differ. With the pipeline's
  masks (as many tokens in every image) ce_masked of plain iBOT is its loss itself."""
  c = tiny(recipe)
  setup, state, batch = build(c)
  state = state.replace(centers={k: v + 0.3 for k, v in state.centers.items()})  # a centre that matters
  ctx = dataclasses.replace(setup.ctx, weights={"ibot": 1.0})
  mask = np.array(batch["mask"])
  assert len(set(mask.reshape(len(mask), -1).sum(1))) == 1
  metrics, _, _ = ibot_arguments(setup, state, batch, ctx)
  if recipe == "tips":
    close(metrics["ibot/ce_masked"], metrics["loss/ibot"], 1e-6)
  mask[:2] = False
  metrics, args, kw = ibot_arguments(setup, state, {**batch, "mask": jnp.asarray(mask)}, ctx)
  assert kw["method"] == "centering"
  masked, visible, _ = direct_split(args)
  close(metrics["ibot/ce_masked"], masked, 1e-5)
  close(metrics["ibot/ce_visible"], visible, 1e-5)
  assert abs(masked - visible) > 1e-3


def test_no_mask_logs_the_visible_cross_entropy_only():
  c = tiny("tipsv2")
  c.input.mask_ratio = 0.0
  config_validation.validate(c)
  setup, state, batch = build(c)
  metrics, args, _ = ibot_arguments(
    setup, state, batch, dataclasses.replace(setup.ctx, weights={"ibot": 1.0})
  )
  assert "ibot/ce_masked" not in metrics and args[2] is None
  close(metrics["ibot/ce_visible"], metrics["loss/ibot"], 1e-6)


# --- ours: iBOT++ with masked and visible tokens normalised apart -------------------------------------


def test_separate_norm_trains_on_masked_plus_weighted_visible():
  """`ibot_token_norm='separate'`, `ibot_visible_weight=0.25` from the config: loss/ibot =
  ce_masked + 0.25 ce_visible (every image masks as many tokens, so token and image means agree)."""
  c = tiny("tipsv2")
  c.loss_opts.update(dict(ibot_token_norm="separate", ibot_visible_weight=0.25))
  config_validation.validate(c)
  setup, state, batch = build(c)
  _, metrics = run_losses(setup, state, batch, dataclasses.replace(setup.ctx, weights={"ibot": 1.0}))
  close(metrics["loss/ibot"], metrics["ibot/ce_masked"] + 0.25 * metrics["ibot/ce_visible"], 1e-5)
  _, plain = run_losses(
    setup, state, batch, dataclasses.replace(setup.ctx, weights={"ibot": 1.0}, ibot_token_norm="masked")
  )
  assert abs(float(plain["loss/ibot"]) - float(metrics["loss/ibot"])) > 1e-3


def test_separate_norm_options_are_validated():
  c = tiny("tips")
  c.loss_opts.ibot_token_norm = "separate"
  with pytest.raises(ConfigError, match=r"ibot_token_norm='separate' is an iBOT\+\+ option"):
    config_validation.validate(c)
  c = tiny("tipsv2")
  c.loss_opts.ibot_visible_weight = 0.5
  with pytest.raises(ConfigError, match=r"ibot_visible_weight=0\.5 is read only with"):
    config_validation.validate(c)
