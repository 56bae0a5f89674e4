"""The one feature pass of a step: every encoder output the active loss terms read, computed once.

Why a record: each loss term (tipsito/objective/terms.py) is then a short function of `Features`; which
passes run is decided here once from the features the active terms declare (`needs`), so two terms that
read the same view never encode it twice and a term never decides where the teacher's input comes from.

Passes, as the terms need them (an image pass returns patch tokens only when a term declares
PATCH_TOKENS, the caption pass per-token outputs only with CAPTION_TOKENS; otherwise their last blocks
compute the read rows alone):
  student pass  one encoder call per image view (`_student_pass` says why, and why ITO's two views share
                one): view 1 as the student sees it (masked when iBOT masks), view 1 unmasked when the
                contrastive terms must not see the mask (`loss_opts.contrastive_view='unmasked'` [I]: the
                papers do not say; with 75% of the patches replaced by the mask token the CLS cannot carry
                what the caption names; 'masked' reuses the masked pass), and ITO's view 2 (never masked).
  text          one text-tower call over 'text' and, for two CLS tokens, the synthetic caption 'text2'.
  teacher       see `teacher_features`; never differentiated.
  local crops   the student's CLS1 of 'local_crops' (DINO's student views).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from tipsito.data import batch as batch_lib
from tipsito.models.layers import l2_normalize
from tipsito.objective.context import LossContext, teacher_temperature
from tipsito.objective.model import TrainModel
from tipsito.objective import collapse

# What a term can need (`Term.features` in tipsito/objective/terms.py).
CAPTION = "caption"  # text tower on 'text'
SYNTHETIC_CAPTION = "synthetic_caption"  # text tower on 'text2', paired with CLS2 (two CLS tokens only)
CONTRASTIVE_VIEW = "contrastive_view"  # view 1 as the contrastive terms see it
STUDENT_MASK = "student_mask"  # view 1 masked for the student (when `masks_student_view`)
VIEW2 = "view2"  # ITO's second view 'image2'
TEACHER = "teacher"  # teacher features, teacher head params, teacher temperature
LOCAL_CROPS = "local_cls"  # student CLS1 of the local crops
# Token outputs beyond the pooled ones. A step whose terms declare neither encodes with the towers'
# `cls_only` / `pooled_only`: their last block then computes only the rows that are read (the CLS rows,
# the caption's EOT row), the same values up to float rounding at a twelfth fewer FLOPs per ViT-B tower.
PATCH_TOKENS = "patch_tokens"  # the image tower's patch tokens (student view 1, view 2, the teacher's)
CAPTION_TOKENS = "caption_tokens"  # the text tower's per-token outputs of 'text'


@dataclasses.dataclass(frozen=True)
class Forward:
  """`model.apply` with the step's params tree and dropout RNG: `fwd(params, *args, method=...)`."""

  model: TrainModel
  rng: jax.Array

  def __call__(self, params, *args, method, **kw):
    return self.model.apply({"params": params}, *args, method=method, rngs={"dropout": self.rng}, **kw)


def unit(x: jax.Array) -> jax.Array:
  """fp32 unit vectors (the contrastive losses expect them from the caller, whatever the tower dtype)."""
  return l2_normalize(x.astype(jnp.float32))


@dataclasses.dataclass
class Features:
  """Every feature of one step; fields a step does not need stay None.

  Image features are {'cls': (B, n_cls, D), 'patches': (B, h, w, D)} dicts.
  """

  forward: Forward
  params: dict
  batch_size: int
  student: dict  # view 1 as the student sees it (masked when iBOT masks)
  contrastive: dict  # view 1 as the contrastive terms see it
  contrastive_cls1: jax.Array  # its CLS1, one slice shared by the terms that read it
  view2: Optional[dict] = None  # ITO's second view
  mask: Optional[jax.Array] = None  # (B, h, w) the student's iBOT mask, None = nothing masked
  scale: Optional[jax.Array] = None  # contrastive scale s = exp(clamped logit_scale)
  caption: Optional[dict] = None  # text tower on 'text': {'pooled', 'tokens', 'valid'}
  caption_emb: Optional[jax.Array] = None  # unit pooled 'text'
  synthetic_caption_emb: Optional[jax.Array] = None  # unit pooled 'text2' (two CLS tokens)
  teacher: Optional[dict] = None  # teacher features of the unmasked view 1 (stop-gradient)
  teacher_params: Optional[dict] = None  # student params with the teacher heads swapped in (stop-gradient)
  teacher_temp: Optional[jax.Array] = None
  student_cls: Optional[jax.Array] = None  # student view-1 CLS1 at the heads' width
  student_patches: Optional[jax.Array] = None  # student view-1 patch tokens at the heads' width
  local_cls: Optional[jax.Array] = None  # (M, B, D) student CLS1 of the local crops, heads' width
  fused: Optional[jax.Array] = None  # (B, 2, D) ITO fusion of (view 1, view 2) with 'text', when given
  metrics: dict = dataclasses.field(default_factory=dict)

  def project(self, x: jax.Array) -> jax.Array:
    """Image embedding for the contrastive losses (unit, fp32)."""
    return unit(self.forward(self.params, x, method=TrainModel.project))

  def to_heads_width(self, x: jax.Array) -> jax.Array:
    """Distillation maps student features to the teacher's width before the heads; identity otherwise."""
    if "distill_proj" in self.params:
      return self.forward(self.params, x, method=TrainModel.to_teacher_width)
    return x


def compute_features(
  ctx: LossContext, needs: frozenset, params: dict, ema: dict, frozen: dict, batch: dict, step, rng
) -> Features:
  """The features `needs` asks for (a union of the active terms' `Term.features`): the tower passes
  (`encode`), then everything built on them (`features_from_encodings`)."""
  enc = encode(ctx, needs, params, ema, frozen, batch, rng)
  return features_from_encodings(ctx, needs, params, ema, frozen, enc, batch, step, rng)


def _student_mask(ctx: LossContext, needs: frozenset, batch: dict):
  """(the student's iBOT mask or None, whether view 1 also runs unmasked for the contrastive terms)."""
  # The batch carries MASK whenever this holds: the ibot term declares it (`Term.fields_when`, terms.py).
  mask = batch[batch_lib.MASK] if (ctx.masks_student_view and STUDENT_MASK in needs) else None
  return mask, mask is not None and CONTRASTIVE_VIEW in needs and ctx.contrastive_view == "unmasked"


def encode(
  ctx: LossContext,
  needs: frozenset,
  params: dict,
  ema: dict,
  frozen: dict,
  batch: dict,
  rng,
  *,
  teacher: bool = True,
) -> dict:
  """The tower passes only: a dict of per-example arrays (leading batch axis), nothing batch-coupled.

  Keys, as `needs` asks: 'student', 'contrastive' (only when it is a separate unmasked chunk), 'view2'
  (image features), 'caption' (text tower on 'text'), 'synthetic_pooled' (pooled 'text2'), 'teacher'
  (stop-gradient; skipped with `teacher=False`), 'local_cls' (B, M, D) the local crops' CLS1 at the
  tower's width. Why separate from `features_from_encodings`: exact gradient accumulation
  (tipsito/objective/accumulate.py) runs this per micro-batch and the rest once on the whole batch.
  """
  fwd = Forward(ctx.model, rng)
  mask, unmasked_v1 = _student_mask(ctx, needs, batch)
  cls_only = PATCH_TOKENS not in needs
  student, contrastive, view2 = _student_pass(fwd, params, batch, mask, unmasked_v1, VIEW2 in needs, cls_only)
  enc = {"student": student}
  if unmasked_v1:
    enc["contrastive"] = contrastive
  if view2 is not None:
    enc["view2"] = view2
  if CAPTION in needs:
    _encode_captions(enc, fwd, params, batch, SYNTHETIC_CAPTION in needs, CAPTION_TOKENS not in needs)
  if TEACHER in needs and teacher:
    # With head-only EMA the teacher's input is the student encoder on the unmasked view 1: the
    # student pass itself when nothing is masked, else its unmasked contrastive chunk if there is one.
    unmasked_pass = student if mask is None else (contrastive if unmasked_v1 else None)
    towers = _Towers(fwd, params)
    enc["teacher"] = jax.lax.stop_gradient(
      teacher_features(ctx, towers, ema, frozen, batch[batch_lib.IMAGE], unmasked_pass, cls_only)
    )
  if LOCAL_CROPS in needs and ctx.has_local_crops:  # declared by the dino term (`Term.fields_when`)
    loc = batch[batch_lib.LOCAL_CROPS]
    b, m = loc.shape[:2]
    loc = loc.reshape((b * m,) + loc.shape[2:])
    l_out = fwd(params, loc, train=True, cls_only=True, method=TrainModel.encode_image)  # DINO reads CLS1
    enc["local_cls"] = l_out["cls"][:, 0].reshape(b, m, -1)
  return enc


def features_from_encodings(
  ctx: LossContext, needs: frozenset, params: dict, ema: dict, frozen: dict, enc: dict, batch: dict, step, rng
) -> Features:
  """`Features` from `encode`'s output (of the whole batch) and the params of the small parts (scale,
  projection to the heads' width); the heads, projections and fusion are applied by the terms, except
  that exact accumulation (tipsito/objective/accumulate.py) may pass the fusion embeddings, computed per
  micro-batch, as `enc['fused']`."""
  fwd = Forward(ctx.model, rng)
  mask, _ = _student_mask(ctx, needs, batch)
  student = enc["student"]
  contrastive = enc.get("contrastive", student)
  # One CLS1 slice shared by the terms that read it (clip, siglip, koleo): their gradients add up there,
  # in term order, before reaching the encoder, so the step's numbers do not depend on the table's layout.
  f = Features(
    forward=fwd,
    params=params,
    batch_size=batch[batch_lib.IMAGE].shape[0],
    student=student,
    contrastive=contrastive,
    contrastive_cls1=contrastive["cls"][:, 0],
    view2=enc.get("view2"),
    mask=mask,
    fused=enc.get("fused"),
  )
  if "logit_scale" in params:
    log_s = params["logit_scale"]
    if ctx.logit_scale_max is not None:
      log_s = jnp.minimum(log_s, ctx.logit_scale_max)
    f.scale = jnp.exp(log_s.astype(jnp.float32))
    f.metrics["logit_scale"] = f.scale
  if "caption" in enc:
    f.caption = enc["caption"]
    f.caption_emb = unit(f.caption["pooled"])
    if "synthetic_pooled" in enc:
      f.synthetic_caption_emb = unit(enc["synthetic_pooled"])
  if TEACHER in needs:
    _self_distillation(ctx, f, ema, frozen, enc["teacher"], step)
  if "local_cls" in enc:
    f.local_cls = f.to_heads_width(enc["local_cls"].swapaxes(0, 1))
  return f


def _student_pass(
  fwd: Forward, params: dict, batch: dict, mask, unmasked_v1: bool, with_view2: bool, cls_only: bool = False
) -> tuple[dict, dict, Optional[dict]]:
  """(student view 1, contrastive view 1, view 2 or None): one image-tower call per view.

  Per view, not one call over every view stacked on the batch axis: the stacked call's outputs had to be
  cut back into views (strided slices of every returned token array, and their transposes in the
  backward pass), which cost ITO's B/16 towers on two views about 6% of their step time and 120 MiB of
  compiled temporaries on XLA:CPU, and tipsito B/16 355 MiB per chip on TPU (docs/performance.md). ITO's
  two views are no exception: with the fusion module run in groups (`model.fusion.chunks`, as the paper
  configs set it) per-view calls hold less on TPU than one call over both views (docs/performance.md).
  Every call keeps the batch axis as it is sharded, so every view of an example stays on the devices that
  hold the example; per example the tower computes the same values. Only the student's view 1 is masked
  (`mask`); each call after the first gets its own dropout / stochastic-depth key. `cls_only`: no term
  reads patch tokens (`PATCH_TOKENS`)."""

  def encode(x, call, m=None):
    f = (
      fwd if call == 0 or fwd.rng is None else dataclasses.replace(fwd, rng=jax.random.fold_in(fwd.rng, call))
    )
    return f(params, x, mask=m, train=True, cls_only=cls_only, method=TrainModel.encode_image)

  student = encode(batch[batch_lib.IMAGE], 0, mask)
  contrastive = encode(batch[batch_lib.IMAGE], 1) if unmasked_v1 else student
  view2 = encode(batch[batch_lib.IMAGE2], 2) if with_view2 else None
  return student, contrastive, view2


def _encode_captions(
  enc: dict, fwd: Forward, params: dict, batch: dict, synthetic: bool, pooled_only: bool
) -> None:
  """Text tower on 'text' (and 'text2' in the same call when CLS2 has a synthetic caption to match);
  `pooled_only`: no term reads per-token outputs (`CAPTION_TOKENS`)."""
  text = batch[batch_lib.TEXT]
  b = text.shape[0]
  two_cls = synthetic and enc["student"]["cls"].shape[1] > 1 and batch_lib.TEXT2 in batch
  ids = jnp.concatenate([text, batch[batch_lib.TEXT2]], 0) if two_cls else text
  txt_all = fwd(params, ids, train=True, pooled_only=pooled_only, method=TrainModel.encode_text)
  enc["caption"] = jax.tree.map(lambda x: x[:b], txt_all)
  if two_cls:
    enc["synthetic_pooled"] = txt_all["pooled"][b:]


class _Towers(NamedTuple):
  """What `teacher_features` reads of a step: the forward and the student params."""

  forward: Forward
  params: dict


def teacher_features(
  ctx: LossContext,
  f,
  ema: dict,
  frozen: dict,
  image: jax.Array,
  unmasked_pass: Optional[dict],
  cls_only: bool = False,
) -> dict:
  """The teacher's features of the unmasked view 1 (the caller stops their gradient).

  distill: the frozen teacher encoder; full EMA: the EMA image encoder; head-only EMA: the student
  encoder itself, reusing `unmasked_pass` (the student's pass on the unmasked view 1) when there is one.
  `f`: anything with the step's `forward` and `params` (`Features`, or the towers of `encode`).
  `cls_only`: no term reads patch tokens, so the EMA and student passes return the CLS tokens alone.
  """
  if ctx.frozen_teacher:
    return ctx.teacher_model.apply({"params": frozen["image"]}, image)
  if "image" in ema:
    return f.forward({**f.params, **ema}, image, cls_only=cls_only, method=TrainModel.encode_image)
  if unmasked_pass is not None:
    return unmasked_pass
  return f.forward(f.params, image, cls_only=cls_only, method=TrainModel.encode_image)


def self_distillation_metrics(ctx: LossContext, student_cls: jax.Array, step) -> dict:
  """`teacher_temp` and `collapse/cls_effective_rank` (of the student's view-1 CLS1, (B, n_cls, D)) of
  the whole batch; a function of its own because exact accumulation evaluates DINO / iBOT micro-batch
  by micro-batch but logs these from the whole batch."""
  return {
    "teacher_temp": teacher_temperature(ctx, step),
    "collapse/cls_effective_rank": collapse.effective_rank(jax.lax.stop_gradient(student_cls[:, 0])),
  }


def _self_distillation(ctx: LossContext, f: Features, ema: dict, frozen: dict, teacher: dict, step) -> None:
  """Teacher features (from `encode`, stop-gradient), teacher head params and temperature, and the
  student's view-1 tokens at the heads' width. Teacher heads: the frozen teacher's own (distillation from
  a training workdir), else `state.ema` (an EMA of the student heads)."""
  f.metrics.update(self_distillation_metrics(ctx, f.student["cls"], step))
  f.teacher_temp = f.metrics["teacher_temp"]
  f.teacher = teacher
  t_heads = {k: frozen[k] for k in ("dino_head", "ibot_head") if k in frozen}
  f.teacher_params = jax.lax.stop_gradient({**f.params, **ema, **t_heads})
  f.student_cls = f.to_heads_width(f.student["cls"][:, 0])
  if "patches" in f.student:  # a term reads them (PATCH_TOKENS)
    f.student_patches = f.to_heads_width(f.student["patches"])
