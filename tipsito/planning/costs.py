"""What a config costs, without memory: the library behind `python -m tipsito.info` (tipsito/info.py: the
command).

`compute_info` gives parameter counts per tower and per training-only part, the size of the whole train state
(params, optimiser state, EMA teacher), the head-only vs full EMA saving, the training crops, the effective
loss weights and (optionally) the sharding plan, all through `jax.eval_shape`; `schema_rows` / `schema_table`
list the keys of tipsito/config/schema.py. Library code (tipsito/studies/results.py) calls it here.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from tipsito.config import schema
from tipsito.config import validation as config_validation
from tipsito.data import batch as batch_lib
from tipsito.data import pipeline
from tipsito.config import recipes
from tipsito.objective import terms as terms_lib
from tipsito.train import sharding as sharding_lib
from tipsito.train import step as step_lib
from tipsito.train import teacher as teacher_lib

PAPER_SAVING_B = 0.42  # TIPSv2 §3.4: "on ViT-B, this method reduces training parameters by 42%".


def _count(tree) -> int:
  return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)))


def _bytes(tree) -> int:
  return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _setup(config, mesh, ema_mode: Optional[str] = None):
  import ml_collections as mlc  # pylint: disable=import-outside-toplevel

  c = mlc.ConfigDict(config.to_dict())
  if ema_mode is not None:
    c.ema.mode = ema_mode
  teacher = None
  if recipes.get_recipe(c.recipe).teacher == "frozen":
    try:
      teacher = teacher_lib.load_teacher(c)
    except Exception:  # pylint: disable=broad-except  # teacher not on this machine: shapes only.
      teacher = teacher_lib.abstract_teacher(c)
  return step_lib.build(c, mesh, teacher=teacher)


def sharding_plan(config, setup, devices: int, processes: int = 1) -> dict[str, Any]:
  """Parameter specs on the mesh `config.mesh` resolves to for `devices` devices (an AbstractMesh: no
  devices needed), per-device parameter bytes, and what each of `processes` hosts does."""
  from jax.sharding import AbstractMesh  # pylint: disable=import-outside-toplevel

  if devices % processes:
    raise ValueError(f"--devices={devices} is not divisible by --processes={processes}")
  batch = int(config.input.batch_size)
  if batch % processes:
    raise ValueError(f"config.input.batch_size={batch} is not divisible by --processes={processes}")
  shape = sharding_lib.mesh_shape(config.mesh, devices)
  mesh = AbstractMesh(shape, sharding_lib.MESH_AXES)
  rules = [tuple(r) for r in config.sharding.rules]
  shardings = sharding_lib.tree_shardings(
    setup.state_shapes, mesh, rules, min_size=int(config.sharding.min_size)
  )
  params = setup.state_shapes.params
  rows, per_device = [], 0
  for (path, spec_shape, spec), x, sh in zip(
    sharding_lib.describe(shardings.params, params),
    jax.tree.leaves(params),
    jax.tree.leaves(shardings.params),
  ):
    axes = [
      a for entry in sh.spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))
    ]
    split = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
    nbytes = int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize // split
    per_device += nbytes
    rows.append(dict(path=path, shape=list(spec_shape), spec=spec, bytes_per_device=nbytes))
  return {
    "mesh": dict(zip(sharding_lib.MESH_AXES, shape)),
    "devices": devices,
    "processes": processes,
    "params_bytes_per_device": per_device,
    "rows": rows,
    "per_process": (
      f"{devices // processes} devices and {batch // processes} examples of the global batch "
      f"{batch} per process; each process reads its own strided data shard, saves its shards of "
      f"the train state and its own data-iterator state (resume needs {processes} processes); "
      f"SIGTERM on any process stops all after the same step (exit 75); evals split every batch "
      f"over the processes; process 0 writes the export"
    ),
  }


def optimizer_convention(o) -> str:
  """One line saying what `config.optim` computes (see tipsito/train/optim.py: make_optimizer)."""
  mom = o.momentum
  if o.name == "adafactor":
    return (
      f"big_vision Adafactor: p -= sched(t) * ({o.lr:g} * adafactor(clip_{o.clip_norm}(g)) + "
      f"{o.weight_decay or 0:g} * p[kernels]); sched = warmup {o.warmup_steps} + {o.schedule} "
      f"with peak 1 (weight decay not multiplied by lr); factored 2nd moments, decay "
      f"min({o.beta2_cap}, 1 - t^-{o.decay_rate}); momentum "
      + (f"EMA {mom} (no debias) in {o.momentum_dtype}" if mom else "off")
    )
  if o.name == "adamw":
    return (
      f"optax.adamw: p -= lr(t) * (adam(clip_{o.clip_norm}(g)) + {o.weight_decay or 0:g} "
      f"* p[kernels]), lr(t) = warmup {o.warmup_steps} + {o.schedule} to {o.lr:g} (decoupled decay "
      f"multiplied by lr)"
    )
  return f"sgd: p -= lr(t) * (trace_{mom}(clip_{o.clip_norm}(g)) + {o.weight_decay or 0:g} * p[kernels])"


def _default_text(key: schema.Key) -> str:
  """A key's default for the schema listing: the value, or what it depends on."""
  if key.default is schema.ABSENT:
    return "(absent)"
  if key.type_defaults:
    per = ", ".join(f"{t} {v!r}" for t, v in key.type_defaults.items())
    return f"{key.default!r} ({per})"
  if not callable(key.default):
    return repr(key.default)
  values = {}
  for name, r in recipes.RECIPES.items():
    if key.when is None or key.when(r):
      ctx = schema.Ctx(recipe=r, variant="B/16", text_variant="B/16", total_steps=1000, batch_size=1024)
      values.setdefault(repr(key.default_for(ctx)), []).append(name)
  if len(values) == 1:
    return next(iter(values)) + " (B/16, 1000 steps, batch 1024)"
  return "per recipe: " + ", ".join(f"{'/'.join(v)} {k}" for k, v in values.items())


def schema_rows(config=None) -> list[dict[str, Any]]:
  """Every declared key (and user-named sub-dict) of tipsito/config/schema.py as a row: key, type, default,
  allowed, safe (on resume), doc; with `config`, also its `value` there ('(absent)' when it has none)."""
  rows = []
  for k in schema.KEYS:
    row = {
      "key": k.path,
      "type": k.type.__name__ + (" | None" if k.optional else ""),
      "default": _default_text(k),
      "allowed": k.allowed(),
      "safe": k.safe,
      "doc": k.doc + (f" [eval types: {', '.join(k.eval_types)}]" if k.eval_types else ""),
    }
    if config is not None and "*" not in k.path:
      node = config
      for part in k.path.split("."):
        node = node[part] if hasattr(node, "keys") and part in node else schema.ABSENT
        if node is schema.ABSENT:
          break
      row["value"] = "(absent)" if node is schema.ABSENT else repr(node)
    rows.append(row)
  for t in schema.TREES:
    rows.append(
      {
        "key": t.path + ".*",
        "type": "dict",
        "default": "{}" if t.free_form else "(see keys)",
        "allowed": "user-named entries" if t.free_form else "the declared keys / module fields",
        "safe": t.safe,
        "doc": t.doc,
      }
    )
  return rows


def schema_table(rows: list[dict[str, Any]]) -> str:
  lines = []
  for r in rows:
    value = f"  value {r['value']}" if "value" in r else ""
    lines.append(
      f"{r['key']}  ({r['type']}; {'safe' if r['safe'] else 'unsafe'} on resume){value}\n"
      f"    default {r['default']}; allowed: {r['allowed']}\n    {r['doc']}"
    )
  return "\n".join(lines)


def _ema_comparison(config, mesh, towers: dict, parts: dict, student: int) -> dict[str, Any]:
  """Head-only vs full EMA: parameters and bytes held for training, counted two ways, against the
  paper's ViT-B saving (self-distillation recipes only)."""
  head_only = _setup(config, mesh, "head").state_shapes
  full = _setup(config, mesh, "full").state_shapes
  n_head = student + _count(head_only.ema)
  n_full = student + _count(full.ema)
  heads = sum(parts.get(k, 0) for k in ("dino_head", "ibot_head"))
  img = towers["image"] + parts.get("mask_token", 0)
  vis_head = img + 2 * heads
  vis_full = 2 * (img + heads)
  # Head size that would make the vision-side saving equal the paper's 42%: img / (2 (img + H)).
  h42 = img / (2 * PAPER_SAVING_B) - img
  return {
    "train_state_params_head_only_ema": n_head,
    "train_state_params_full_ema": n_full,
    "fraction_saved": round(1 - n_head / n_full, 4),
    "vision_side_params_head_only_ema": vis_head,
    "vision_side_params_full_ema": vis_full,
    "vision_side_fraction_saved": round(1 - vis_head / vis_full, 4),
    "train_state_bytes_head_only_ema": _bytes(head_only),
    "train_state_bytes_full_ema": _bytes(full),
    "bytes_fraction_saved": round(1 - _bytes(head_only) / _bytes(full), 4),
    "paper_fraction_saved_vit_b": PAPER_SAVING_B,
    "explanation": (
      f"Head-only EMA drops the EMA copy of the image encoder ({img / 1e6:.1f}M) and keeps EMA "
      f"copies of the DINO+iBOT heads ({heads / 1e6:.1f}M, K={config.model.heads.num_prototypes}). "
      f"Counting every parameter held for training (student image+text towers, heads, EMA), "
      f"{n_full / 1e6:.1f}M -> {n_head / 1e6:.1f}M = {100 * (1 - n_head / n_full):.1f}% saved; "
      f"counting the vision side only (image encoder + heads + their EMA), "
      f"{vis_full / 1e6:.1f}M -> {vis_head / 1e6:.1f}M = {100 * (1 - vis_head / vis_full):.1f}%. "
      f"The paper's 42% (ViT-B) is not reproduced by either accounting with our DINOv2-style heads: "
      f"it corresponds to the vision-side count with heads of ~{h42 / 1e6:.1f}M in total, i.e. much "
      f"smaller heads than 2 x (3-layer 2048-wide MLP + 256x{config.model.heads.num_prototypes} "
      f"prototypes); the paper does not publish its head sizes or exactly what it counts. The "
      f"text tower, which has no EMA in either mode, dilutes the all-parameter saving."
    ),
  }


def crop_geometry(config) -> dict[str, Any]:
  """The training crops `config` cuts, in patches: global, view 2 (two-view modes) and local crops, each
  with its size, count, patch grid, crop-area range (as the pipeline resolves it) and any zero-padding.

  Why: a crop that is not whole patches is centre zero-padded by the ViT (a frame the teacher never sees);
  validation refuses it for training, and this section shows each crop's patch grid and area range.
  Returns {'patch_px', 'crops': [...], 'lines': [...]} ('lines': the table section).
  """
  spec = pipeline.ExampleSpec.from_config(config)
  p = int(spec.patch_size)
  layout = spec.layout
  resized = spec.augment == "none" and not layout.local_crops  # deterministic resize, no crop draw
  views = [("global", spec.global_size, 1, None if resized else spec.global_scale)]
  if layout.two_views:
    views.append(("view 2", spec.global_size, 1, None if resized else spec.view2_scale))
  if spec.num_local:
    views.append(("local", spec.local_size, spec.num_local, spec.local_scale))
  crops, lines = [], [f"  training crops (patch {p} px):"]
  for name, px, count, scale in views:
    padded = -(-px // p) * p
    crop = dict(
      name=name,
      px=px,
      count=count,
      patches=px / p,
      grid=[padded // p] * 2,
      scale=list(scale) if scale else None,
      padded_px=padded,
      padding_fraction=round(1 - px * px / (padded * padded), 4),
    )
    crops.append(crop)
    n = f"{px // p}" if px % p == 0 else f"{px / p:g}"
    line = f"    {name:<7s}{f'{count} x ' if count > 1 else ''}{px} px = {n} x {p} px patches"
    line += f" (grid {padded // p} x {padded // p})"
    if scale:
      whole = " (the whole image)" if tuple(scale) == (1.0, 1.0) else ""
      line += f", crop area {tuple(float(v) for v in scale)} of the image{whole}"
    else:
      line += ", fixed resize"
    if padded != px:
      line += (
        f"; NOT WHOLE PATCHES: zero-padded to {padded} px "
        f"({100 * crop['padding_fraction']:.1f}% of the input is padding)"
      )
    lines.append(line)
  return {"patch_px": p, "crops": crops, "lines": lines}


def effective_weights(config, ctx) -> list[dict[str, Any]]:
  """The weight each (loss term, CLS token, view) pair has in `loss/total`: `config.loss.<term>` times the
  term's inner weights (tipsito/objective/terms.py: `contrastive_pair_weights`, `dino_student_views` with
  `loss_opts.dino_reduction`). Rows {'pair', 'weight', 'note'}, in the order the total sums the terms.

  Why: a term's config weight is not what a CLS token or a view gets (TIPSv2's L_CLIP halves each caption,
  ITO's L_align halves each view, DINO's mean divides by the crops); this says it per pair.
  """
  w = ctx.weights
  two_cls = int(config.model.image.num_cls_tokens) > 1
  rows: list[dict[str, Any]] = []

  def row(pair: str, weight: float, note: str = "") -> None:
    rows.append({"pair": pair, "weight": round(float(weight), 6), "note": note})

  pairs = terms_lib.contrastive_pair_weights(ctx, two_cls)
  two_views = terms_lib.CLIP in w and terms_lib.CLIP_VIEW2 in w
  for name in terms_lib.TERMS:
    if name not in w:
      continue
    if name in (terms_lib.CLIP, terms_lib.CLIP_VIEW2):
      for p, inner in pairs.items():
        if p.term == name:
          row(
            f"{name} {p.cls} x {p.caption}, view {p.view}",
            w[name] * inner,
            f"loss_opts.view_weighting={ctx.view_weighting}" if two_views and p.cls == "CLS1" else "",
          )
    elif name == terms_lib.SIGLIP:
      row("siglip CLS1 x alt-text, view 1", w[name])
    elif name == terms_lib.FUSION:
      a = terms_lib.alignment_weight(ctx, two_cls)
      row(
        f"fusion (view 1 CLS{ctx.fusion_cls + 1} + alt-text) x (view 2 + alt-text)",
        w[name] * a,
        f"loss.fusion={w[name]:g} = ITO's lambda x alt-text alignment {a:g}",
      )
    elif name == terms_lib.KOLEO:
      row("koleo CLS1, view 1", w[name])
    elif name == terms_lib.DINO:
      n_local = batch_lib.BatchLayout.from_config(config).num_local
      n = terms_lib.dino_student_views(ctx, n_local)
      views = "view 1"
      if n_local:
        views = f"each of {n_local} local crops" + (" and the global crop" if n > n_local else "")
      per = w[name] / n if ctx.dino_reduction == "mean" else w[name]
      row(
        f"dino CLS1 of {views} x teacher CLS1, global image",
        per,
        f"loss_opts.dino_reduction={ctx.dino_reduction} over {n} student views: {per * n:g} in all",
      )
    elif name == terms_lib.IBOT:
      which = (
        "all patches, iBOT++"
        if ctx.ibot_all_patches or not ctx.masks_student_view
        else "masked patches, iBOT"
      )
      row(
        f"ibot patches of view 1 ({which}) x teacher patches, global image",
        w[name],
        f"token_norm={ctx.ibot_token_norm}, mean per image",
      )
    elif name == terms_lib.FEATURE:
      row("feature CLS1 + patches of view 1 x frozen teacher", w[name], "1/2 each")
  return rows


def compute_info(
  config, *, with_sharding: bool = False, devices: int = 0, processes: int = 1
) -> dict[str, Any]:
  """All numbers as a JSON-friendly dict (see module docstring)."""
  config_validation.validate(config)  # sizes only: nothing is tokenized
  mesh = sharding_lib.make_mesh({"data": 1, "fsdp": 1, "model": 1}, jax.devices()[:1])
  setup = _setup(config, mesh)
  params = setup.state_shapes.params
  towers = {
    "image": _count({k: v for k, v in params["image"].items() if k != "mask_token"}),
    "text": _count(params.get("text", {})),
  }
  parts = {k: _count(v) for k, v in params.items() if k not in ("image", "text")}
  if "mask_token" in params["image"]:
    parts["mask_token"] = _count(params["image"]["mask_token"])
  student = _count(params)
  st = setup.state_shapes
  out: dict[str, Any] = {
    "recipe": config.recipe,
    "image_variant": {
      k: config.model.image[k] for k in ("width", "depth", "num_heads", "mlp_dim", "patch_size", "ffn")
    },
    "training_crops": crop_geometry(config),
    "towers": towers,
    "towers_M": {k: round(v / 1e6, 1) for k, v in towers.items()},
    "parts": parts,
    "student_params": student,
    "ema_mode": config.ema.mode,
    "ema_params": _count(st.ema),
    "optimizer": config.optim.name,
    "optimizer_convention": optimizer_convention(config.optim),
    "optimizer_state_params": _count(st.opt_state),
    "train_state_bytes": _bytes(st),
    "train_state_GiB": round(_bytes(st) / 2**30, 3),
  }
  if {"dino_head", "ibot_head"} & set(params):
    out["ema_comparison"] = _ema_comparison(config, mesh, towers, parts, student)
  out["effective_weights"] = effective_weights(config, setup.ctx)
  if with_sharding:
    plan = sharding_plan(config, setup, int(devices or jax.device_count()), int(processes))
    out["sharding"] = plan.pop("rows")
    out["sharding_plan"] = plan
  return out
