"""What a recipe is, and the one loss function every recipe shares.

Why: "recipes compose losses and never fork the train loop". A `Recipe` is pure data — which model parts
exist, which loss terms are allowed (with default weights), which batch fields they read, the default EMA
mode and teacher kind. `compute_losses` is the single forward: it runs only what the non-zero terms of
`config.loss` need, returns every term separately (logged as `loss/<term>`) and their weighted sum.

Loss terms (weights in `config.loss.<term>`, options in `config.loss_opts`):
  clip        InfoNCE, view 1. One CLS: (CLS, 'text'). Two CLS (TIPS): mean of (CLS1,'text') and
              (CLS2,'text2'). logits = s * cos, s = exp(logit_scale) clamped to exp(logit_scale_max).
  siglip      sigmoid loss (CLS, 'text') with learned scale and bias.
  clip_view2  InfoNCE of the second ITO view 'image2' (CLS1) with 'text' (ITO's L_align second half).
  fusion      ITO NT-Xent between fusion(view 1, 'text') and fusion(view 2, 'text'), same scale s.
  dino        DINO CE: student = dino_head(CLS1 of the local crops, or of view 1 if there are none),
              teacher = teacher dino_head(CLS1 of the teacher features on the unmasked 'image').
  ibot        iBOT (`loss_opts.ibot_all_patches=False`) or iBOT++ (True) on the patch tokens of the
              student's masked view vs the teacher's unmasked ones.
  koleo       KoLeo regulariser on the student CLS1 of view 1 (off by default).
  feature     distillation only: 1 - cos between the projected student and the frozen teacher tokens
              (CLS and patches), a direct feature-matching term (off by default).
Contrastive view: with iBOT masking on, the contrastive terms (and KoLeo, fusion) read view 1 *unmasked* by
default (`loss_opts.contrastive_view='unmasked'` [I]: the papers do not say; with 75% of the patches replaced
by the mask token, the CLS cannot carry what the caption names). 'masked' reuses the masked pass instead.
Teacher features: head-only EMA -> stop_gradient(student encoder on the unmasked image) (reused from the
student pass when nothing is masked); full EMA -> the EMA image encoder; distill -> the frozen teacher.
Teacher heads are `state.ema` (an EMA of the student heads), except for distillation from a tipsito
training workdir, where the frozen teacher's own EMA heads arrive in `frozen` and there is no EMA.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from tipsito.losses import contrastive as _con
from tipsito.losses import self_distill as _sd
from tipsito.recipes.model import TrainModel, l2n
from tipsito.train import collapse

ALL_TERMS = ("clip", "siglip", "clip_view2", "fusion", "dino", "ibot", "koleo", "feature")
EMA_MODES = ("head", "full", "none")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Declarative description of a training recipe.

  Attributes:
    name: registry key (config.recipe).
    doc: one line shown by `info` and in errors.
    parts: top-level TrainModel parts (see tipsito.recipes.model).
    loss: default weights; the keys are the terms this recipe allows in `config.loss`.
    views: default `config.input.views`.
    num_cls: default number of CLS tokens of the image encoder.
    ema_mode: default `config.ema.mode` ('head' | 'full' | 'none').
    mask_ratio: default iBOT mask ratio.
    optimizer: default `config.optim.name`.
    pixel: 'tips' (mean 0 / std 1) or 'clip' (CLIP statistics).
    teacher: 'ema' (self-distillation) or 'frozen' (distillation from an exported/imported model).
  """
  name: str
  doc: str
  parts: tuple[str, ...]
  loss: dict
  views: str = "single"
  num_cls: int = 1
  ema_mode: str = "none"
  mask_ratio: float = 0.0
  optimizer: str = "adamw"
  pixel: str = "clip"
  teacher: str = "ema"

  @property
  def terms(self) -> tuple[str, ...]:
    """Loss terms this recipe may use (the valid keys of `config.loss`)."""
    return tuple(self.loss)

  def fields(self, weights: dict) -> tuple[str, ...]:
    """Batch fields read by the active (non-zero) terms, for validation and the pipeline."""
    f = {"image"}
    if any(weights.get(t) for t in ("clip", "siglip", "clip_view2", "fusion")):
      f.add("text")
    if weights.get("clip") and self.num_cls == 2:
      f.add("text2")
    if weights.get("clip_view2") or weights.get("fusion"):
      f.add("image2")
    return tuple(sorted(f))


@dataclasses.dataclass(frozen=True)
class LossContext:
  """Everything static the loss needs: model, recipe, weights and options (built once from the config)."""
  model: TrainModel
  recipe: Recipe
  weights: dict            # term -> float, zero weights removed
  student_temp: float = 0.1
  teacher_temp: float = 0.07
  warmup_teacher_temp: float = 0.04
  teacher_temp_warmup_steps: int = 0
  center_momentum: float = 0.9
  ibot_all_patches: bool = True
  ibot_token_norm: str = "masked"
  teacher_method: str = "centering"
  contrastive_view: str = "unmasked"
  logit_scale_max: Optional[float] = None
  fusion_cls: int = 0
  ema_keys: tuple[str, ...] = ()
  teacher_model: Any = None  # distill: the frozen teacher's VisionTransformer


def teacher_temperature(ctx: LossContext, step) -> jax.Array:
  """Linear warmup of the teacher temperature (0.04 -> 0.07 over `teacher_temp_warmup_steps`)."""
  if ctx.teacher_temp_warmup_steps <= 0:
    return jnp.asarray(ctx.teacher_temp, jnp.float32)
  frac = jnp.clip(jnp.asarray(step, jnp.float32) / ctx.teacher_temp_warmup_steps, 0.0, 1.0)
  return ctx.warmup_teacher_temp + frac * (ctx.teacher_temp - ctx.warmup_teacher_temp)


def compute_losses(ctx: LossContext, params: dict, ema: dict, centers: dict, frozen: dict,
                   batch: dict, step, rng) -> tuple[jax.Array, tuple[dict, dict]]:
  """Forward of the active terms on the GLOBAL batch; returns (total, (metrics, new_centers)).

  Collectives for the batch-wide softmaxes / centres come from GSPMD since the batch is a sharded global
  array; nothing here knows about devices.
  """
  w = ctx.weights
  model = ctx.model
  rngs = {"dropout": rng}

  def apply(p, *args, method, **kw):
    return model.apply({"params": p}, *args, method=method, rngs=rngs, **kw)

  need_text = any(t in w for t in ("clip", "siglip", "clip_view2", "fusion"))
  need_sd = any(t in w for t in ("dino", "ibot", "feature"))
  mask = batch.get("mask") if ("ibot" in w and model.image_cfg.get("use_mask_token")) else None

  out, metrics, new_centers = {}, {}, dict(centers)
  b = batch["image"].shape[0]
  # One encoder pass over every same-shaped image view (bigger matmuls, one encoder in the HLO):
  # view 1 as the student sees it (masked), view 1 unmasked when the contrastive terms must not see the
  # mask (`loss_opts.contrastive_view='unmasked'`; with head-only EMA this chunk, stop-gradiented, is
  # also the teacher's input, so it costs no extra pass), and ITO's view 2 (never masked).
  two_views = ("clip_view2" in w or "fusion" in w)
  need_contrastive = any(t in w for t in ("clip", "siglip", "clip_view2", "fusion", "koleo"))
  unmasked_v1 = mask is not None and need_contrastive and ctx.contrastive_view == "unmasked"
  views = [batch["image"]] + ([batch["image"]] if unmasked_v1 else []) + (
      [batch["image2"]] if two_views else [])
  imgs = jnp.concatenate(views, 0) if len(views) > 1 else views[0]
  if mask is not None and len(views) > 1:
    mask = jnp.concatenate([mask] + [jnp.zeros_like(mask)] * (len(views) - 1), 0)
  allv = apply(params, imgs, mask=mask, train=True, method=TrainModel.encode_image)
  if mask is not None:
    mask = mask[:b]
  chunks = [jax.tree.map(lambda x, i=i: x[i * b:(i + 1) * b], allv) for i in range(len(views))]
  s_img = chunks[0]                              # student view 1 (masked when iBOT is on)
  c_img = chunks[1] if unmasked_v1 else s_img    # view 1 as the contrastive terms see it
  cls1 = c_img["cls"][:, 0]

  if "logit_scale" in params:
    log_s = params["logit_scale"]
    if ctx.logit_scale_max is not None:
      log_s = jnp.minimum(log_s, ctx.logit_scale_max)
    scale = jnp.exp(log_s.astype(jnp.float32))
    metrics["logit_scale"] = scale
  two_cls = "clip" in w and s_img["cls"].shape[1] > 1 and "text2" in batch
  if need_text:
    ids = jnp.concatenate([batch["text"], batch["text2"]], 0) if two_cls else batch["text"]
    txt_all = apply(params, ids, train=True, method=TrainModel.encode_text)
    txt = jax.tree.map(lambda x: x[:b], txt_all)
    t_emb = l2n(txt["pooled"])

  def proj(x):
    return l2n(apply(params, x, method=TrainModel.project))

  if "clip" in w:
    parts = [_con.clip_loss(proj(cls1), t_emb, scale)]
    metrics["clip/cls1"] = parts[0]
    if two_cls:
      parts.append(_con.clip_loss(proj(c_img["cls"][:, 1]), l2n(txt_all["pooled"][b:]), scale))
      metrics["clip/cls2"] = parts[1]
    out["clip"] = sum(parts) / len(parts)
  if "siglip" in w:
    bias = params["logit_bias"].astype(jnp.float32)
    out["siglip"] = _con.siglip_loss(proj(cls1), t_emb, scale, bias)
    metrics["logit_bias"] = bias
  if two_views:
    v2 = chunks[-1]
    if "clip_view2" in w:
      out["clip_view2"] = _con.clip_loss(proj(v2["cls"][:, 0]), t_emb, scale)
    if "fusion" in w:
      c = ctx.fusion_cls
      tok2 = jnp.concatenate([txt["tokens"], txt["tokens"]], 0)
      val2 = jnp.concatenate([txt["valid"], txt["valid"]], 0)
      fused_in = jax.tree.map(lambda x, y: jnp.concatenate([x, y], 0), c_img, v2)
      z = apply(params, fused_in["cls"][:, c], fused_in["patches"], tok2, val2, method=TrainModel.fuse)
      out["fusion"] = _con.ntxent_loss(z[:b], z[b:], scale)
  if "koleo" in w:
    out["koleo"] = _sd.koleo_loss(cls1)

  if need_sd:
    t_temp = teacher_temperature(ctx, step)
    metrics["teacher_temp"] = t_temp
    # Teacher features (never differentiated).
    if ctx.recipe.teacher == "frozen":
      t_feat = ctx.teacher_model.apply({"params": frozen["image"]}, batch["image"])
    elif "image" in ema:
      t_feat = apply({**params, **ema}, batch["image"], method=TrainModel.encode_image)
    elif mask is None:
      t_feat = s_img  # head-only EMA, nothing masked: the student pass *is* the teacher's input.
    elif unmasked_v1:
      t_feat = c_img  # head-only EMA: the unmasked contrastive pass is the teacher's input.
    else:
      t_feat = apply(params, batch["image"], method=TrainModel.encode_image)
    t_feat = jax.lax.stop_gradient(t_feat)
    # Teacher heads: the frozen teacher's own heads (distillation from a training workdir), else the EMA.
    t_heads = {k: frozen[k] for k in ("dino_head", "ibot_head") if k in frozen}
    t_params = jax.lax.stop_gradient({**params, **ema, **t_heads})
    s_cls, s_patches = s_img["cls"][:, 0], s_img["patches"]
    metrics["collapse/cls_effective_rank"] = collapse.effective_rank(jax.lax.stop_gradient(s_cls))
    if "distill_proj" in params:
      s_cls = apply(params, s_cls, method=TrainModel.to_teacher_width)
      s_patches = apply(params, s_patches, method=TrainModel.to_teacher_width)

    if "dino" in w:
      t_logits = apply(t_params, t_feat["cls"][:, 0], method=TrainModel.dino)[None]  # (1,B,K)
      if "local_crops" in batch:
        loc = batch["local_crops"]
        m = loc.shape[1]
        l_out = apply(params, loc.reshape((b * m,) + loc.shape[2:]), train=True,
                      method=TrainModel.encode_image)
        l_cls = l_out["cls"][:, 0].reshape(b, m, -1).swapaxes(0, 1)  # (M,B,D)
        if "distill_proj" in params:
          l_cls = apply(params, l_cls, method=TrainModel.to_teacher_width)
        s_logits = apply(params, l_cls, method=TrainModel.dino)
        if ctx.recipe.teacher == "frozen":  # distillation: the global view is a student crop too.
          g = apply(params, s_cls, method=TrainModel.dino)[None]
          s_logits = jnp.concatenate([g, s_logits], 0)
      else:
        s_logits = apply(params, s_cls, method=TrainModel.dino)[None]
      out["dino"] = _sd.dino_loss(s_logits, t_logits, centers["dino"], ctx.student_temp, t_temp,
                                method=ctx.teacher_method)
      new_centers["dino"] = _sd.update_center(centers["dino"], t_logits, ctx.center_momentum)
      metrics.update(collapse.teacher_signals("dino", _sd.teacher_probs(
          t_logits, centers["dino"], t_temp, method=ctx.teacher_method), centers["dino"]))
    if "ibot" in w:
      sp = apply(params, s_patches.reshape(b, -1, s_patches.shape[-1]), method=TrainModel.ibot)
      tpt = t_feat["patches"]
      tp = apply(t_params, tpt.reshape(b, -1, tpt.shape[-1]), method=TrainModel.ibot)
      flat_mask = None if mask is None else mask.reshape(b, -1)
      all_patches = ctx.ibot_all_patches or flat_mask is None
      out["ibot"] = _sd.ibot_loss(sp, tp, flat_mask, centers["ibot"], ctx.student_temp, t_temp, all_patches,
                                method=ctx.teacher_method, token_norm=ctx.ibot_token_norm)
      new_centers["ibot"] = _sd.update_patch_center(
          centers["ibot"], tp, None if all_patches else flat_mask, ctx.center_momentum)
      metrics.update(collapse.teacher_signals("ibot", _sd.ibot_teacher_probs(
          tp, flat_mask, centers["ibot"], t_temp, all_patches, method=ctx.teacher_method),
          centers["ibot"], weights=None if all_patches else flat_mask))
    if "feature" in w:
      def cos_dist(a, b):
        return jnp.mean(1.0 - jnp.sum(l2n(a) * l2n(b), -1))
      out["feature"] = 0.5 * (cos_dist(s_cls, t_feat["cls"][:, 0]) + cos_dist(s_patches, t_feat["patches"]))

  total = sum(w[t] * out[t] for t in out)
  metrics.update({f"loss/{t}": v for t, v in out.items()})
  metrics["loss/total"] = total
  return total, (metrics, new_centers)


def init_centers(ctx: LossContext) -> dict:
  """Zero DINO / iBOT centres (K,) for the active self-distillation terms."""
  k = int(ctx.model.heads_cfg["num_prototypes"]) if ctx.model.heads_cfg else 0
  c = {}
  if "dino" in ctx.weights:
    c["dino"] = jnp.zeros((k,), jnp.float32)
  if "ibot" in ctx.weights:
    c["ibot"] = jnp.zeros((k,), jnp.float32)
  return c


LossFn = Callable[..., Any]
