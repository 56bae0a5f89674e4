"""The loss terms: one short function each, and `TERMS`, the table that names them.

Each term reads the step's `Features` (tipsito/objective/features.py) and the current centres, and
returns its loss, its metrics and its centre update. Weights are `config.loss.<term>` (0 turns a term
off), options `config.loss_opts`; a recipe (tipsito/config/recipes.py) names the terms it allows
and their default weights. Adding a term is one function here, one `TERMS` entry and a weight in a recipe.

  clip        InfoNCE, view 1. One CLS: (CLS, 'text'). Two CLS (TIPS): (CLS1,'text') and (CLS2,'text2'),
              each half (TIPSv2's L_CLIP, the mean over the two captions). logits = s * cos,
              s = exp(logit_scale) clamped to exp(logit_scale_max). With `clip_view2` on and
              `loss_opts.view_weighting='mean'` the (CLS1,'text') part is halved again: see
              `contrastive_pair_weights`.
  siglip      sigmoid loss (CLS, 'text') with learned scale and bias.
  clip_view2  InfoNCE of the second ITO view 'image2' (CLS1) with 'text' (ITO's L_align second half),
              halved with `view_weighting='mean'`.
  fusion      ITO NT-Xent between fusion(view 1, 'text') and fusion(view 2, 'text'), same scale s; its
              weight `config.loss.fusion` is ITO's lambda relative to the alt-text alignment (`fusion_term`).
  koleo       KoLeo regulariser on the student CLS1 of view 1 (off by default).
  dino        DINO CE: student = dino_head(CLS1 of the local crops, or of view 1 if there are none),
              teacher = teacher dino_head(CLS1 of the teacher features on the unmasked 'image');
              `loss_opts.dino_reduction` 'mean' (default) or 'sum' over the student crops.
  ibot        iBOT (`loss_opts.ibot_all_patches=False`) or iBOT++ (True) on the patch tokens of the
              student's masked view vs the teacher's unmasked ones; logs the cross-entropy on masked and
              on visible tokens apart (`ibot/ce_masked`, `ibot/ce_visible`, TIPSv2 Fig. 2).
  feature     distillation only: 1 - cos between the projected student and the frozen teacher tokens
              (CLS and patches), a direct feature-matching term (off by default).

The loss functions are called through their modules (`_con.clip_loss`, ...), so tests can spy on them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from tipsito.choices import CLIP, CLIP_VIEW2, DINO, FEATURE, FUSION, IBOT, KOLEO, SIGLIP
from tipsito.choices import VIEW_WEIGHTINGS  # noqa: F401 (re-exported)
from tipsito.data.batch import IMAGE, IMAGE2, LOCAL_CROPS as LOCAL_CROPS_FIELD, MASK, TEXT
from tipsito.losses import contrastive as _con
from tipsito.losses import dino as _dino
from tipsito.losses import ibot as _ibot
from tipsito.losses import koleo as _koleo
from tipsito.losses import teacher_targets as _targets
from tipsito.objective.context import LossContext
from tipsito.objective.features import (
  CAPTION,
  CAPTION_TOKENS,
  CONTRASTIVE_VIEW,
  LOCAL_CROPS,
  PATCH_TOKENS,
  STUDENT_MASK,
  SYNTHETIC_CAPTION,
  TEACHER,
  VIEW2,
  Features,
  unit,
)
from tipsito.objective.model import TrainModel
from tipsito.objective import collapse


class TermOutput(NamedTuple):
  """A term's loss (logged as `loss/<term>`), extra metrics, new centres ({name: (K,)}), and
  `metric_weights` ({metric name: count}) for the metrics that are means over another count than the
  term's `Term.batch_weight` (exact accumulation weights each such metric by its own count)."""

  loss: jax.Array
  metrics: dict = {}
  centers: dict = {}
  metric_weights: dict = {}


class Pair(NamedTuple):
  """One InfoNCE of the contrastive terms: which term computes it, on which CLS token, caption and view."""

  term: str
  cls: str  # 'CLS1' | 'CLS2'
  caption: str  # 'alt-text' ('text') | 'synthetic' ('text2')
  view: int  # 1 = 'image', 2 = ITO's 'image2'


CLS1_ALT_V1 = Pair(CLIP, "CLS1", "alt-text", 1)
CLS2_SYN_V1 = Pair(CLIP, "CLS2", "synthetic", 1)
CLS1_ALT_V2 = Pair(CLIP_VIEW2, "CLS1", "alt-text", 2)


def contrastive_pair_weights(ctx: LossContext, two_cls: bool) -> dict[Pair, float]:
  """The weight of each InfoNCE inside its term (`config.loss.<term>` multiplies it); `two_cls`: the
  image tower has a second CLS token for the synthetic caption.

  Why these numbers (TIPSv2 A.9: "L_CLIP is the averaged result of contrastive losses from the two
  captions"; ITO: L_align contrasts both views with the one caption, averaged over the views):
    per caption:     two CLS: (CLS1, alt-text) and (CLS2, synthetic) 1/2 each; one CLS: (CLS1, alt-text) 1.
                     The alt-text InfoNCE of view 2 (`clip_view2`) gets the same 1/2 or 1 as that of
                     view 1 (`clip`): it is the same InfoNCE on ITO's other view, so at equal term weights
                     (the tipsito recipe: clip = clip_view2 = 1) the two views weigh the same with one or
                     two CLS tokens.
    view_weighting 'mean', with both `clip` and `clip_view2` on: the alt-text InfoNCE is ITO's L_align,
                     the mean over view 1 and view 2, so (CLS1, alt-text) of each view is halved again.
                     tipsito's weights (clip = clip_view2 = 1) then give, with two CLS, CLS1 x alt-text
                     1/4 + 1/4 and CLS2 x synthetic 1/2 (TIPSv2's L_CLIP with its alt-text half spread
                     over ITO's two views, total 1); with one CLS, 1/2 + 1/2 (ITO's L_align, total 1).
    view_weighting 'sum': every InfoNCE at its term's weight as written (the `ito` recipe, whose weights
                     0.5 + 0.5 already are L_align's mean; the tipsito behaviour before the option, CLS1
                     x alt-text 1/2 + 1/2 and CLS2 x synthetic 1/2, total 1.5).
  """
  per_view = 1.0
  if ctx.view_weighting == "mean" and CLIP in ctx.weights and CLIP_VIEW2 in ctx.weights:
    per_view = 0.5
  per_cls = 0.5 if two_cls else 1.0
  out = {CLS1_ALT_V1: per_cls * per_view, CLS1_ALT_V2: per_cls * per_view}
  if two_cls:
    out[CLS2_SYN_V1] = per_cls
  return out


def alignment_weight(ctx: LossContext, two_cls: bool) -> float:
  """A, the weight of the alt-text alignment in `loss/total`: the sum over ITO's views of
  `config.loss.<term>` x the (CLS1, alt-text) pair weight of `contrastive_pair_weights`.

  Why: ITO writes L = L_align + lambda L_fusion (lambda = 2; ITO's Table: an inverted U peaking at 2,
  lambda = 6 below alignment alone), so what matters is fusion's weight *relative to* the alignment it
  regularises. The `ito` recipe has A = 0.5 + 0.5 = 1; tipsito with view_weighting 'mean' and two CLS
  has A = 1/4 + 1/4 = 1/2 (its other half of L_CLIP is the synthetic caption's); 'sum' gives 1."""
  pairs = contrastive_pair_weights(ctx, two_cls)
  return sum(ctx.weights.get(p.term, 0.0) * pairs[p] for p in (CLS1_ALT_V1, CLS1_ALT_V2))


def clip_term(ctx: LossContext, f: Features, centers: dict) -> TermOutput:
  del centers
  two_cls = f.synthetic_caption_emb is not None
  w = contrastive_pair_weights(ctx, two_cls)
  cls1 = _con.clip_loss(f.project(f.contrastive_cls1), f.caption_emb, f.scale)
  loss, metrics = w[CLS1_ALT_V1] * cls1, {"clip/cls1": cls1}
  if two_cls:
    cls2 = _con.clip_loss(f.project(f.contrastive["cls"][:, 1]), f.synthetic_caption_emb, f.scale)
    loss, metrics["clip/cls2"] = loss + w[CLS2_SYN_V1] * cls2, cls2
  return TermOutput(loss, metrics)


def siglip_term(ctx: LossContext, f: Features, centers: dict) -> TermOutput:
  del ctx, centers
  bias = f.params["logit_bias"].astype(jnp.float32)
  loss = _con.siglip_loss(f.project(f.contrastive_cls1), f.caption_emb, f.scale, bias)
  return TermOutput(loss, {"logit_bias": bias})


def clip_view2_term(ctx: LossContext, f: Features, centers: dict) -> TermOutput:
  del centers
  w = contrastive_pair_weights(ctx, f.synthetic_caption_emb is not None)[CLS1_ALT_V2]
  cls1 = _con.clip_loss(f.project(f.view2["cls"][:, 0]), f.caption_emb, f.scale)
  return TermOutput(w * cls1, {"clip_view2/cls1": cls1})


def _interleave(x: jax.Array, y: jax.Array) -> jax.Array:
  """Rows 2i and 2i + 1 are x[i] and y[i] (example-major): with the batch axis sharded, each example's two
  rows stay on the devices that hold the example, where [x; y] would move half of them."""
  return jnp.stack([x, y], 1).reshape((2 * x.shape[0],) + x.shape[1:])


def fused_embeddings(ctx: LossContext, f: Features) -> tuple[jax.Array, jax.Array]:
  """(fusion(view 1, 'text'), fusion(view 2, 'text')), each (B, D): one fusion call over both views.

  Per example (the fusion Transformer attends within one image-caption pair), so exact gradient
  accumulation (tipsito/objective/accumulate.py) computes it micro-batch by micro-batch and hands the
  term only these embeddings, in `Features.fused`."""
  c, b, txt = ctx.fusion_cls, f.batch_size, f.caption
  # Rows 2i and 2i + 1 are example i's two views (`_interleave`), not [view 1; view 2]; per example the
  # values are the same.
  twice = lambda x: _interleave(x, x)  # noqa: E731
  both = jax.tree.map(_interleave, f.contrastive, f.view2)
  z = f.forward(
    f.params,
    both["cls"][:, c],
    both["patches"],
    twice(txt["tokens"]),
    twice(txt["valid"]),
    method=TrainModel.fuse,
  )
  z = z.reshape((b, 2) + z.shape[1:])
  return z[:, 0], z[:, 1]


def fusion_term(ctx: LossContext, f: Features, centers: dict) -> TermOutput:
  """ITO's fusion NT-Xent, weighted relative to the alt-text alignment: `config.loss.fusion` is ITO's
  lambda, and the term's weight in `loss/total` is

      lambda x A,   A = `alignment_weight` (the alt-text InfoNCE's weight over the two views),

  so fusion : alignment = lambda whatever the view weighting and the number of CLS tokens (ITO:
  L = L_align + lambda L_fusion, lambda = 2). The `ito` recipe (A = 1) keeps weight 2; tipsito with
  view_weighting 'mean' and two CLS (A = 1/2) gets 1, not 2 (a ratio of 4). `loss/fusion` is A x the
  NT-Xent, `fusion/ntxent` the NT-Xent itself."""
  del centers
  z1, z2 = (f.fused[:, 0], f.fused[:, 1]) if f.fused is not None else fused_embeddings(ctx, f)
  ntxent = _con.ntxent_loss(z1, z2, f.scale)
  a = alignment_weight(ctx, f.synthetic_caption_emb is not None)
  return TermOutput(ntxent if a == 1.0 else a * ntxent, {"fusion/ntxent": ntxent})


def koleo_term(ctx: LossContext, f: Features, centers: dict) -> TermOutput:
  del ctx, centers
  return TermOutput(_koleo.koleo_loss(f.contrastive_cls1))


def dino_student_views(ctx: LossContext, num_local: int) -> int:
  """How many student views DINO compares with the teacher's one global view: the `num_local` local crops
  (plus the student's global crop when distilling with `distill.dino_global_crop`), or view 1 alone when
  there are no local crops."""
  if not num_local:
    return 1
  return num_local + int(ctx.frozen_teacher and ctx.dino_global_crop)


def dino_term(ctx: LossContext, f: Features, centers: dict) -> TermOutput:
  """Student views: see `dino_student_views`. Distillation keeps the pretraining views by default: TIPSv2
  §3.1 says distillation "only requires two modifications" (frozen teacher, no mask), so the student's
  global crop is a DINO student view only with `config.distill.dino_global_crop=True`.

  `ctx.dino_reduction` combines the cross-entropies of the student views: 'mean' (default) or 'sum'
  (= M x 'mean' for M views). TIPSv2 Eq. 1 writes a sum over the M local crops, read literally 6x the DINO
  weight; 'mean' is the default because (a) the DINO loss here is DINOv2's (pinned in
  tests/test_losses_self_distill.py), and DINOv2's meta-arch divides the local-crop sum by the number of
  loss terms (M with one global crop); (b) the paper's sums are schematic: Eq. 1 has no batch average
  either, and Eq. 2 and 3 sum over patches, which iBOT, DINOv2 and this repo average, so reading Eq. 1
  as a sum but Eq. 3 as a mean would be inconsistent; (c) the DINO weight then does not depend on the
  number of local crops. TIPSv2 A.9 gives alpha = 1 for an implementation that "closely follows that of
  TIPS" without saying how it normalises; the choice is ours, hence a key.
  """
  fwd, t_temp, center = f.forward, f.teacher_temp, centers["dino"]
  t_logits = fwd(f.teacher_params, f.teacher["cls"][:, 0], method=TrainModel.dino)[None]  # (1,B,K)
  if f.local_cls is not None:
    s_logits = fwd(f.params, f.local_cls, method=TrainModel.dino)
    if ctx.frozen_teacher and ctx.dino_global_crop:
      g = fwd(f.params, f.student_cls, method=TrainModel.dino)[None]
      s_logits = jnp.concatenate([g, s_logits], 0)
  else:
    s_logits = fwd(f.params, f.student_cls, method=TrainModel.dino)[None]
  loss = _dino.dino_loss(
    s_logits,
    t_logits,
    center,
    ctx.student_temp,
    t_temp,
    method=ctx.teacher_method,
    reduction=ctx.dino_reduction,
  )
  metrics = collapse.teacher_signals(
    "dino", _targets.teacher_probs(t_logits, center, t_temp, method=ctx.teacher_method), center
  )
  return TermOutput(loss, metrics, {"dino": _dino.update_center(center, t_logits, ctx.center_momentum)})


def _ibot_tokens(ctx: LossContext, f: Features):
  """(the student's (B, N) iBOT mask or None, whether every patch carries loss: iBOT++ or no mask)."""
  flat_mask = None if f.mask is None else f.mask.reshape(f.batch_size, -1)
  return flat_mask, ctx.ibot_all_patches or flat_mask is None


def ibot_counted_tokens(ctx: LossContext, f: Features) -> jax.Array:
  """How many teacher tokens this batch's iBOT centre mean and teacher entropy average over: every
  patch (iBOT++, or nothing masked), else the masked ones."""
  flat_mask, all_patches = _ibot_tokens(ctx, f)
  if all_patches:
    return jnp.float32(f.batch_size * math.prod(f.student_patches.shape[1:-1]))
  return jnp.sum(flat_mask.astype(jnp.float32))


def examples(ctx: LossContext, f: Features) -> jax.Array:
  """The batch size: the weight of a term whose centre mean and metrics average over examples."""
  del ctx
  return jnp.float32(f.batch_size)


def ibot_term(ctx: LossContext, f: Features, centers: dict) -> TermOutput:
  """iBOT / iBOT++ (`loss_opts.ibot_all_patches`, `ibot_token_norm`, `ibot_visible_weight`: see
  `ibot_loss_from_probs` in tipsito/losses/ibot.py), and the mechanism metrics of TIPSv2 Fig. 2
  whatever tokens the loss uses: `ibot/ce_masked` (only when the student view is masked) and
  `ibot/ce_visible`, the token means of the cross-entropy against the teacher targets the loss uses
  (`ibot_masked_visible_cross_entropy`; with Sinkhorn targets and plain iBOT, which has none for the
  visible tokens, those of Sinkhorn over every token)."""
  b, t_temp, center = f.batch_size, f.teacher_temp, centers["ibot"]
  sp = f.forward(
    f.params, f.student_patches.reshape(b, -1, f.student_patches.shape[-1]), method=TrainModel.ibot
  )
  tpt = f.teacher["patches"]
  tp = f.forward(f.teacher_params, tpt.reshape(b, -1, tpt.shape[-1]), method=TrainModel.ibot)
  flat_mask, all_patches = _ibot_tokens(ctx, f)
  loss = _ibot.ibot_loss(
    sp,
    tp,
    flat_mask,
    center,
    ctx.student_temp,
    t_temp,
    all_patches,
    method=ctx.teacher_method,
    token_norm=ctx.ibot_token_norm,
    visible_weight=ctx.ibot_visible_weight,
  )
  counted = None if all_patches else flat_mask
  t_probs = _ibot.ibot_teacher_probs(tp, flat_mask, center, t_temp, all_patches, method=ctx.teacher_method)
  metrics = collapse.teacher_signals("ibot", t_probs, center, weights=counted)
  # Sinkhorn targets of plain iBOT exist for the masked tokens only: the visible ones get the Sinkhorn
  # targets over every token (iBOT++'s), so that ce_visible is a cross-entropy against real targets.
  probs = t_probs
  if not all_patches and ctx.teacher_method != "centering":
    probs = _ibot.ibot_teacher_probs(tp, flat_mask, center, t_temp, True, method=ctx.teacher_method)
    probs = jnp.where(flat_mask[..., None], t_probs, probs)
  split = _ibot.ibot_masked_visible_cross_entropy(sp, probs, flat_mask, ctx.student_temp)
  metrics.update({f"ibot/ce_{name}": mean for name, (mean, _) in split.items()})
  weights = {f"ibot/ce_{name}": count for name, (_, count) in split.items()}
  new_center = _ibot.update_patch_center(center, tp, counted, ctx.center_momentum)
  return TermOutput(loss, metrics, {"ibot": new_center}, weights)


def feature_term(ctx: LossContext, f: Features, centers: dict) -> TermOutput:
  del ctx, centers

  def cos_dist(a, b):
    return jnp.mean(1.0 - jnp.sum(unit(a) * unit(b), -1))

  return TermOutput(
    0.5
    * (cos_dist(f.student_cls, f.teacher["cls"][:, 0]) + cos_dist(f.student_patches, f.teacher["patches"]))
  )


@dataclasses.dataclass(frozen=True)
class Term:
  """A loss term: its function, the batch fields it requires, the features it reads (features.py names),
  the centres it keeps ((K,) zeros at init, updated every step), and `batch_weight` for the terms that
  are per example (below)."""

  fn: Callable[[LossContext, Features, dict], TermOutput]
  fields: tuple[str, ...]
  features: frozenset
  centers: tuple[str, ...] = ()
  # Set for a term whose loss is a mean over examples of values that depend on no other example (given
  # the centres), and whose centre update and metrics are means weighted by `batch_weight(ctx, f)` (a
  # count). Then the term on the whole batch equals its K micro-batch values combined: loss by the plain
  # mean (equal micro-batches), centre means and metrics weighted by `batch_weight`; see `per_example`.
  batch_weight: Optional[Callable[[LossContext, Features], jax.Array]] = None
  # Batch fields the term reads only under a run option: (field, the `LossContext` flag that turns it on).
  # Declared so that a batch lacking one fails by the field's name (`required_fields`) instead of the
  # term quietly changing meaning (iBOT without its mask would score every patch, i.e. become iBOT++).
  fields_when: tuple[tuple[str, str], ...] = ()

  def required_fields(self, ctx: LossContext) -> tuple[str, ...]:
    """The batch fields this term reads in this run: `fields`, and each of `fields_when` whose flag is on."""
    return self.fields + tuple(field for field, flag in self.fields_when if getattr(ctx, flag))

  def per_example(self, ctx: LossContext) -> bool:
    """Whether exact accumulation may evaluate the term micro-batch by micro-batch. Not with
    Sinkhorn-Knopp teacher targets: they normalise over every example of the batch."""
    return self.batch_weight is not None and (not self.centers or ctx.teacher_method == "centering")


def _term(fn, fields, features, centers=(), batch_weight=None, fields_when=()) -> Term:
  return Term(fn, tuple(fields), frozenset(features), tuple(centers), batch_weight, tuple(fields_when))


# The order is the order in which the terms are summed into `loss/total` (kept for bit-equal totals).
# clip_view2 lists CONTRASTIVE_VIEW although it reads only view 2: with iBOT masking and head-only EMA the
# unmasked view-1 chunk of the student pass it keeps is the teacher's input (see features.py).
TERMS: dict[str, Term] = {
  CLIP: _term(clip_term, (IMAGE, TEXT), (CAPTION, SYNTHETIC_CAPTION, CONTRASTIVE_VIEW)),
  SIGLIP: _term(siglip_term, (IMAGE, TEXT), (CAPTION, CONTRASTIVE_VIEW)),
  CLIP_VIEW2: _term(clip_view2_term, (IMAGE2, TEXT), (CAPTION, VIEW2, CONTRASTIVE_VIEW)),
  FUSION: _term(
    fusion_term, (IMAGE, IMAGE2, TEXT), (CAPTION, VIEW2, CONTRASTIVE_VIEW, PATCH_TOKENS, CAPTION_TOKENS)
  ),
  KOLEO: _term(koleo_term, (IMAGE,), (CONTRASTIVE_VIEW,)),
  DINO: _term(
    dino_term,
    (IMAGE,),
    (TEACHER, LOCAL_CROPS),
    centers=("dino",),
    batch_weight=examples,
    fields_when=((LOCAL_CROPS_FIELD, "has_local_crops"),),
  ),
  IBOT: _term(
    ibot_term,
    (IMAGE,),
    (TEACHER, STUDENT_MASK, PATCH_TOKENS),
    centers=("ibot",),
    batch_weight=ibot_counted_tokens,
    fields_when=((MASK, "masks_student_view"),),
  ),
  FEATURE: _term(feature_term, (IMAGE,), (TEACHER, PATCH_TOKENS), batch_weight=examples),
}
