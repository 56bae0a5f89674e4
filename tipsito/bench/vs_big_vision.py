"""Side-by-side train step against big_vision's two-tower CLIP:
`python -m tipsito.bench.vs_big_vision --big_vision PATH [--recipes clip,ito] [--variant B/16] [--batch 8]
[--steps 5] [--toggles tanh_gelu,no_ln_pre] [--jsonl F] [--topology v5e:1x1 [--scan]]`.

Why: "as fast and as lean as big_vision" is a claim about a measurement, so this tool makes it in ONE process:
tipsito's jitted train step (`tipsito/train/step.py`, the same build as `tipsito/bench/step_bench.py`) and a step
of big_vision's own model (`big_vision/models/proj/image_text/two_towers.py` with its `vit` image and
`text_transformer` text towers), its softmax contrastive loss (`softmax_loss` of
`big_vision/trainers/proj/image_text/_deprecated_contrastive.py`, the CLIP trainer) and its optimizer
(`big_vision/optax.py: make` with `big_vision.scale_by_adafactor`), at the same shapes, float32, on the same
synthetic batch. Each side's row: FLOPs (XLA cost analysis of the compiled step), the matmul FLOPs the step
executes (`executed_matmul_flops`, from its jaxpr: XLA counts a loop's body once, which makes the FLOPs of
rows with a `scan` inside, marked `*` in docs/performance.md, no measure of the work), compiled temporary
memory (`memory_analysis().temp_size_in_bytes`), the median step time and the median system CPU time of a step;
the steps of all rows are timed interleaved (one step of each row per round), so machine load affects them
alike, and each row's time is also given round by round as a ratio to big_vision's step of the same round,
with the median of those ratios and its distribution-free 95 % interval (`paired_ratio_interval`): how far
this run's rounds put a ratio from a bound such as 1.00x. The JSON line names the machine (processor,
cores, memory) and the allocator the process runs under: XLA:CPU's times are the processor's, and the
allocator's (docs/performance.md: glibc faults a step's temporaries in at every call, jemalloc with freed
memory retained does not).

big_vision is RUN, not copied: PATH is a local checkout (the directory holding the `big_vision` package;
nothing is downloaded). Its model and optimizer modules are imported from there; the loss is read from the
trainer file and only its two loss functions are executed (importing the trainer would define absl flags
and import the input pipeline). Modules those files import that are not installed (e.g. TensorFlow, used
only for file I/O by `big_vision/utils.py`) are replaced by stubs that fail if called.

What each big_vision row computes: the CLIP trainer's `update_fn` (value_and_grad of the softmax loss, the
optimizer update, the gradient / parameter / update norms it logs), under `shard_map` on a one-device mesh
with axis 'batch' (the loss all-gathers over it); params and optimizer state donated. For `ito` the image
tower runs on both views and the loss is the mean of the two views' softmax losses (ITO's L_align); ITO's
fusion module has no big_vision counterpart, so its cost is part of the `ito` gap (row `ito -fusion`
removes it on our side; with nothing reading the towers' tokens, that row's towers then also compute only
the rows the contrastive losses read, as `clip`'s do: tipsito/objective/features.py). big_vision's towers
compute every row of their last block whatever is read.

`--topology T` (libtpu, the `tpu-plan` extra): the same rows compiled ahead of time for the TPU topology T,
as `python -m tipsito.plan` compiles (nothing runs; deterministic numbers): per-chip FLOPs, temporaries and
total bytes live at the peak, side by side. `--scan`: both sides' towers under `scan` with blocks
rematerialised (nothing_saveable, what big_vision's vit.py does under its `scan`), which compiles each tower's
block once instead of once per layer.

Toggles (`--toggles`, each one extra row of tipsito's `clip`, one thing changed; see docs/performance.md):
  tanh_gelu    both towers' MLP GELU is flax's tanh approximation (big_vision's) instead of exact erf
  no_ln_pre    no `norm_pre` (OpenCLIP's ln_pre) in the image tower
  tips_image   the TIPS / big_vision-style image tower (tanh GELU, no ln_pre, patch bias, eps 1e-6)
  adamw        AdamW instead of Adafactor
  bv_exact_gelu  big_vision's rows with exact-erf GELU (its towers' `nn.gelu(approximate=False)`); tipsito's
               rows of that recipe are then also timed round by round against it (the GELU ours must
               have, OpenCLIP's, on both sides: the rest of the step compared like for like)
  bv_fusion    (with `--recipes ito`, timed on this machine) a big_vision `ito` row with exact-erf GELU
               towers and ITO's fusion loss through `ReferenceFusion`, the same fusion function written
               from flax's stock layers; tipsito's `ito` rows get their executed matmul FLOPs and their
               time round by round as ratios to it as well
  remat_P      both towers' blocks rematerialised with policy P (`model.{image,text}.remat_policy`:
               nothing_saveable, dots_saveable, dots_with_no_batch_dims_saveable; tipsito/models/layers.py)
  fusion_remat_P  the ITO fusion module's blocks rematerialised with policy P (`model.fusion.remat_policy`;
               with `--recipes ito`)
  fusion_chunks_K  the ITO fusion module over K groups of examples in turn, each rematerialised
               (`model.fusion.chunks`; the `ito` rows use the paper config's 2; K = 1, 4, 8; with
               `--recipes ito`)
  keep_attention_probs  the towers' (and the fusion module's) 'xla' attention core keeps its probabilities
               for the backward pass instead of computing them again (`model.*.attention_recompute=False`)
  jax_nn_attention  the 'xla' attention core is `jax.nn.dot_product_attention` itself (what
               `layers._xla_core` computes, under jax.nn's vmap over grouped-query groups; not a config
               value: the core is swapped while the step is traced)
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import json
import math
import pathlib
import resource
import sys
import time
import types
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import optax
from absl import app
from absl import flags
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tipsito import command
from tipsito import distributed
from tipsito.config import defaults
from tipsito.config import paper
from tipsito.config import validation as config_validation
from tipsito.data import batch as batch_lib
from tipsito.data.synthetic import synthetic_batch
from tipsito.losses import contrastive
from tipsito.models import fusion as fusion_lib
from tipsito.models import layers
from tipsito.studies import provenance
from tipsito.train import assembly
from tipsito.train import observability
from tipsito.train import sharding
from tipsito.train import step as step_lib

FLAGS = flags.FLAGS

# The text tower of each image variant, as the paper configs set it (configs/clip_b16.py, configs/ito_b16.py:
# OpenCLIP ViT-B-16's text tower), plus a tiny one for the quick test.
TEXT_SHAPES = {
  "B/16": dict(width=512, depth=12, num_heads=8, mlp_dim=2048, vocab_size=49408, max_len=77, out_dim=512),
  "tiny/16": dict(width=64, depth=2, num_heads=4, mlp_dim=128, vocab_size=1000, max_len=16, out_dim=64),
}
RECIPES = ("clip", "ito")
TOGGLES = (
  "tanh_gelu",
  "no_ln_pre",
  "tips_image",
  "adamw",
  "bv_exact_gelu",
  "bv_fusion",
  "remat_nothing_saveable",
  "remat_dots_saveable",
  "remat_dots_with_no_batch_dims_saveable",
  "fusion_remat_nothing_saveable",
  "fusion_remat_dots_saveable",
  "fusion_remat_dots_with_no_batch_dims_saveable",
  "fusion_chunks_1",
  "fusion_chunks_4",
  "fusion_chunks_8",
  "keep_attention_probs",
  "jax_nn_attention",
)
REMAT_PREFIX = "remat_"
FUSION_REMAT_PREFIX = "fusion_remat_"
FUSION_CHUNKS_PREFIX = "fusion_chunks_"
FUSION_ROW = "big_vision ito +exact_gelu +fusion"  # toggle bv_fusion
# big_vision's Adafactor settings (`big_vision/optax.py: scale_by_adafactor` defaults), given to both sides.
ADAFACTOR = dict(momentum=0.9, momentum_dtype="bfloat16", decay_rate=0.8, beta2_cap=0.999, eps=1e-30)
# The modules big_vision's model/optimizer files import that this tool may replace by stubs when they are
# not installed: they serve checkpoint I/O and logging only, never the numerics measured here.
STUBBABLE = ("tensorflow", "tensorflow.io", "tensorflow.io.gfile", "einops", "clu", "clu.parameter_overview")
CONTRASTIVE_TRAINER = "big_vision/trainers/proj/image_text/_deprecated_contrastive.py"


# ---------------------------------------------------------------------------------------------------------
# big_vision, imported from a local checkout


def big_vision_root(path: Optional[str]) -> pathlib.Path:
  """The directory that holds the `big_vision` package (PATH itself or its parent), or a clear error."""
  if not path:
    raise app.UsageError(
      "--big_vision is required: the path of a local big_vision checkout (git clone "
      "https://github.com/google-research/big_vision, or any copy holding big_vision/models/vit.py). "
      "This tool runs big_vision's own code next to tipsito's and downloads nothing."
    )
  p = pathlib.Path(path).expanduser().resolve()
  for root in (p, p.parent):
    if (root / "big_vision" / "models" / "proj" / "image_text" / "two_towers.py").is_file():
      return root
  raise app.UsageError(
    f"--big_vision={path}: no big_vision/models/proj/image_text/two_towers.py under it or its parent; "
    "pass the checkout's root (the directory holding the big_vision package)."
  )


def _stub(name: str) -> None:
  """A module `name` whose attributes fail when used (see STUBBABLE)."""

  class _Missing(types.ModuleType):
    def __getattr__(self, attr):
      if attr.startswith("__"):
        raise AttributeError(attr)
      raise RuntimeError(f"{name}.{attr}: not installed (a stub of tipsito/bench/vs_big_vision.py)")

  sys.modules[name] = _Missing(name)
  parent, _, child = name.rpartition(".")
  if parent in sys.modules:
    setattr(sys.modules[parent], child, sys.modules[name])


def import_big_vision(root: pathlib.Path) -> types.SimpleNamespace:
  """big_vision's two-tower model, ViT and text modules, optimizer module and softmax loss from `root`."""
  for name in STUBBABLE:
    top = name.split(".")[0]
    if name not in sys.modules and importlib.util.find_spec(top) is None:
      _stub(name)
  if str(root) not in sys.path:
    sys.path.insert(0, str(root))
  bv = types.SimpleNamespace(
    root=root,
    two_towers=importlib.import_module("big_vision.models.proj.image_text.two_towers"),
    vit=importlib.import_module("big_vision.models.vit"),
    text=importlib.import_module("big_vision.models.proj.image_text.text_transformer"),
    optax=importlib.import_module("big_vision.optax"),
  )
  bv.softmax_loss = _trainer_functions(root / CONTRASTIVE_TRAINER, ("all_gather", "softmax_loss"))[
    "softmax_loss"
  ]
  return bv


def _trainer_functions(path: pathlib.Path, names: Sequence[str]) -> dict[str, Callable]:
  """The top-level functions `names` of big_vision's trainer file, executed alone (the module's own import
  would define absl flags and import the input pipeline)."""
  tree = ast.parse(path.read_text(), filename=str(path))
  defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
  missing = set(names) - {d.name for d in defs}
  if missing:
    raise app.UsageError(f"{path}: no function(s) {sorted(missing)}; is this a big_vision checkout?")
  ns: dict[str, Any] = {"jax": _JaxWithTreeMap(), "jnp": jnp}
  exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), ns)  # pylint: disable=exec-used
  return {n: ns[n] for n in names}


class _JaxWithTreeMap:
  """`jax` with the `jax.tree_map` the trainer file calls (removed in JAX 0.6; it is `jax.tree.map`)."""

  tree_map = staticmethod(jax.tree.map)

  def __getattr__(self, name):
    return getattr(jax, name)


def _exact_gelu_namespace(nn_module: types.ModuleType) -> types.SimpleNamespace:
  """flax.linen as big_vision's vit.py sees it, with `gelu` exact erf (toggle bv_exact_gelu)."""
  ns = types.SimpleNamespace(**{k: getattr(nn_module, k) for k in dir(nn_module) if not k.startswith("__")})
  ns.gelu = functools.partial(nn_module.gelu, approximate=False)
  return ns


def _big_vision_model(bv, config, *, scan: bool = False):
  """big_vision's two-tower model with the shapes of tipsito's `config` (`scan`: its towers' blocks under
  `nn.scan`, which big_vision's vit.py rematerialises with policy nothing_saveable)."""
  img, txt = config.model.image, config.model.text
  return bv.two_towers.Model(
    image=dict(
      patch_size=(img.patch_size, img.patch_size),
      width=img.width,
      depth=img.depth,
      num_heads=img.num_heads,
      mlp_dim=img.mlp_dim,
      pool_type="tok",  # a class token, as OpenCLIP's and tipsito's CLIP image tower
      posemb="learn",
      scan=scan,
    ),
    text=dict(
      width=txt.width,
      depth=txt.depth,
      num_heads=txt.num_heads,
      mlp_dim=txt.mlp_dim,
      vocab_size=txt.vocab_size,
      pool_type="last",
      scan=scan,
    ),
    out_dim=int(config.model.embed_dim),
    temperature_init=10.0,
  )


def _big_vision_optimizer(bv, config, params, batch_size: int):
  """big_vision's optimizer (`big_vision/optax.py: make`) with tipsito's `config.optim` values."""
  o = config.optim
  bv_config = mlc.ConfigDict(
    dict(
      optax_name="big_vision.scale_by_adafactor",
      optax=dict(
        momentum=float(o.momentum),
        dtype_momentum=jnp.dtype(o.momentum_dtype),
        decay_rate=float(o.decay_rate),
        beta2_cap=float(o.beta2_cap),
        eps=float(o.eps),
        min_dim_size_to_factor=int(o.min_dim_size_to_factor),
      ),
      lr=float(o.lr),
      wd=float(o.weight_decay),
      grad_clip_norm=float(o.clip_norm),
      schedule=dict(decay_type="cosine", warmup_steps=int(o.warmup_steps)),
    )
  )
  tx, _ = bv.optax.make(
    bv_config, params, sched_kw=dict(total_steps=int(config.total_steps), batch_size=batch_size)
  )
  return tx


def _big_vision_step(bv, model, tx, mesh: Mesh, two_views: bool, fusion: Optional[dict] = None):
  """big_vision's CLIP trainer `update_fn` under `shard_map` over `mesh` (axis 'batch'), jitted, with params
  and optimizer state donated. `fusion` (toggle bv_fusion, `ito`): {'module': a `ReferenceFusion`,
  'weight': ITO's lambda}; params are then {'towers': big_vision's, 'fusion': the module's} and the loss
  adds lambda x ITO's NT-Xent between the two views' fused embeddings (tipsito/losses/contrastive.py
  `ntxent_loss`, the loss our `ito` rows run)."""

  def update_fn(params, opt, images, images2, text):
    def loss_fn(params):
      towers = params["towers"] if fusion else params
      zimg, ztxt, extras = model.apply({"params": towers}, images, text, train=True)
      loss, _ = bv.softmax_loss(zimg, ztxt, extras["t"])
      if images2 is not None:  # ITO's L_align: the mean over the two views
        zimg2, _, extras2 = model.apply({"params": towers}, images2, None, train=True)
        loss = 0.5 * loss + 0.5 * bv.softmax_loss(zimg2, ztxt, extras["t"])[0]
        if fusion:  # ITO's L_fusion: [view 1; view 2], each with the caption's tokens
          tokens, valid = extras["txt/transformed"], text != 0
          z = fusion["module"].apply(
            {"params": params["fusion"]},
            jnp.concatenate([extras["img/encoded"], extras2["img/encoded"]]),
            jnp.concatenate([tokens, tokens]),
            jnp.concatenate([valid, valid]),
          )
          z1, z2 = jnp.split(z, 2)
          loss = loss + fusion["weight"] * contrastive.ntxent_loss(z1, z2, extras["t"])
      return loss, {"t": extras["t"], "train/nimg": jnp.mean(extras["img/norm"])}

    (loss, measurements), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    loss, measurements, grads = jax.lax.pmean((loss, measurements, grads), axis_name="batch")
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
    measurements["l2_grads"] = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
    measurements["l2_params"] = jnp.sqrt(sum(jnp.vdot(p, p) for p in jax.tree.leaves(params)))
    measurements["l2_updates"] = jnp.sqrt(sum(jnp.vdot(u, u) for u in jax.tree.leaves(updates)))
    return params, opt, loss, measurements

  data = P("batch")
  return jax.jit(
    jax.shard_map(
      update_fn,
      mesh=mesh,
      in_specs=(P(), P(), data, data if two_views else None, data),
      out_specs=(P(), P(), P(), P()),
      check_vma=False,
    ),
    donate_argnums=(0, 1),
  )


class _ReferenceMlp(nn.Module):
  """Dense -> flax's tanh GELU -> Dense (the fusion module's MLP, tipsito/models/fusion.py)."""

  mlp_dim: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(x.shape[-1], name="Dense_1")(nn.gelu(nn.Dense(self.mlp_dim, name="Dense_0")(x)))


class _ReferenceBlock(nn.Module):
  """Pre-LN block of flax's stock layers: x += MHA(LN x, key mask); x += MLP(LN x); every row computed."""

  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x, mask):
    y = nn.LayerNorm(name="norm1")(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads, name="attn")(y, mask=mask)
    return x + _ReferenceMlp(self.mlp_dim, name="mlp")(nn.LayerNorm(name="norm2")(x))


class ReferenceFusion(nn.Module):
  """ITO's fusion module, the function of tipsito/models/fusion.py, written plainly from flax's stock layers
  as a big_vision user would next to its towers (toggle bv_fusion): `nn.Dense` projections to `width`,
  the same fixed sin-cos position embedding (zero at the image CLS) and learned text one, pre-LN blocks of
  `nn.LayerNorm`, `nn.MultiHeadDotProductAttention` with the text padding as a key mask and a
  Dense-GELU-Dense MLP, a final LayerNorm, the CLS row L2-normalised. Every row of every block is computed,
  all examples in one group, nothing rematerialised. The parameter names are ours, so our module's
  parameters run here unchanged (tests/test_bench_vs_big_vision.py holds the outputs equal).

  Why: big_vision has no fusion module, so issue 43's `ito` bound sets our step against big_vision's
  towers at the executed FLOP ratio, which assumes the module runs as fast per FLOP as the towers do. At
  its shapes (width 512, 274 tokens at B/16) it need not on any implementation; this row runs the same
  function on big_vision's side, so our module is timed against a plain one instead of against that
  assumption (docs/performance.md)."""

  width: int = 512
  depth: int = 2
  num_heads: int = 8
  mlp_ratio: int = 4
  max_text_len: int = 77

  @nn.compact
  def __call__(self, image_tokens: jax.Array, text_tokens: jax.Array, text_valid: jax.Array) -> jax.Array:
    """(B, 1 + h w, D_i) [CLS; patches], (B, L, D_t), (B, L) bool -> (B, width) unit norm."""
    b, n, _ = image_tokens.shape
    side = math.isqrt(n - 1)
    pos = np.concatenate(
      [np.zeros((1, self.width), np.float32), fusion_lib.sincos_2d(side, side, self.width)]
    )
    img = nn.Dense(self.width, name="image_proj")(image_tokens) + pos[None]
    tpos = self.param("text_posemb", nn.initializers.normal(0.02), (self.max_text_len, self.width))
    txt = nn.Dense(self.width, name="text_proj")(text_tokens) + tpos[: text_tokens.shape[1]]
    x = jnp.concatenate([img, txt], axis=1)
    mask = jnp.concatenate([jnp.ones((b, n), bool), text_valid], axis=1)[:, None, None, :]
    for i in range(self.depth):
      x = _ReferenceBlock(self.num_heads, self.mlp_ratio * self.width, name=f"block_{i}")(x, mask)
    return layers.l2_normalize(nn.LayerNorm(name="norm")(x)[:, 0])


@contextlib.contextmanager
def _gelu_of(bv, exact_gelu: bool):
  """big_vision's vit.py with exact-erf GELU inside the block (toggle bv_exact_gelu), restored after."""
  saved_nn = bv.vit.nn
  if exact_gelu:
    bv.vit.nn = _exact_gelu_namespace(saved_nn)
  try:
    yield
  finally:
    bv.vit.nn = saved_nn


def _jax_nn_core(q, k, v, mask, lengths, is_causal: bool, scale: float):
  """`layers._xla_core`'s computation as jax.nn runs it (toggle jax_nn_attention)."""
  return jax.nn.dot_product_attention(
    q, k, v, mask=mask, is_causal=is_causal, scale=scale, key_value_seq_lengths=lengths
  )


@contextlib.contextmanager
def _attention_of(toggles: Sequence[str]):
  """tipsito's 'xla' attention core as `jax.nn.dot_product_attention` while a step is traced (toggle
  jax_nn_attention), restored after."""
  saved = layers._xla_core, layers._xla_core_recomputed
  if "jax_nn_attention" in toggles:
    layers._xla_core = _jax_nn_core
    layers._xla_core_recomputed = layers.recomputed_core(_jax_nn_core)
  try:
    yield
  finally:
    layers._xla_core, layers._xla_core_recomputed = saved


def reference_fusion(config) -> ReferenceFusion:
  """`ReferenceFusion` with the shapes of `config.model.fusion` (toggle bv_fusion)."""
  f = fusion_lib.FusionTransformer(**config.model.fusion)  # the module our step builds (its defaults too)
  return ReferenceFusion(
    width=f.width, depth=f.depth, num_heads=f.num_heads, mlp_ratio=f.mlp_ratio, max_text_len=f.max_text_len
  )


def big_vision_entry(bv, config, batch: dict, *, exact_gelu: bool = False, fusion: bool = False) -> dict:
  """big_vision's CLIP trainer step (its update_fn) for the shapes of tipsito's `config`, compiled;
  `fusion` (toggle bv_fusion, two views): with ITO's fusion loss through a `ReferenceFusion`."""
  model = _big_vision_model(bv, config)
  two_views = batch_lib.IMAGE2 in batch
  images = jnp.asarray(
    np.asarray(batch[batch_lib.IMAGE], np.float32) / 127.5 - 1.0
  )  # big_vision's value_range(-1, 1)
  images2 = jnp.asarray(np.asarray(batch[batch_lib.IMAGE2], np.float32) / 127.5 - 1.0) if two_views else None
  text = jnp.asarray(batch[batch_lib.TEXT])
  with _gelu_of(bv, exact_gelu):
    params = jax.jit(lambda: model.init(jax.random.PRNGKey(0), images[:1], text[:1])["params"])()
    head = None
    if fusion:
      head = {"module": reference_fusion(config), "weight": float(config.loss.fusion)}
      img, txt = config.model.image, config.model.text
      tokens = 1 + (images.shape[1] // img.patch_size) ** 2
      params = {
        "towers": params,
        "fusion": jax.jit(
          lambda: head["module"].init(
            jax.random.PRNGKey(1),
            jnp.zeros((1, tokens, img.width)),
            jnp.zeros((1, text.shape[1], txt.width)),
            jnp.ones((1, text.shape[1]), bool),
          )["params"]
        )(),
      }
    tx = _big_vision_optimizer(bv, config, params, images.shape[0])
    opt = jax.jit(tx.init)(params)
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("batch",))
    traced = _big_vision_step(bv, model, tx, mesh, two_views, head).trace(params, opt, images, images2, text)
    compiled = traced.lower().compile()
  carry = {"state": (params, opt)}

  def run():
    p, s = carry["state"]
    p, s, loss, _ = compiled(p, s, images, images2, text)
    carry["state"] = (p, s)
    return loss

  return dict(compiled=compiled, run=run, matmul_flops=executed_matmul_flops(traced.jaxpr))


def big_vision_topology_compile(bv, config, devices: list, *, exact_gelu: bool = False, scan: bool = False):
  """big_vision's CLIP trainer step compiled ahead of time for compile-only TPU `devices` (a topology,
  tipsito/planning/pod.py `topology_devices`): abstract params and optimizer state replicated (big_vision's CLIP
  trainer default), the batch split over the devices' 'batch' axis; float images, as its input pipeline
  hands them over."""
  model = _big_vision_model(bv, config, scan=scan)
  mesh = Mesh(np.asarray(devices), ("batch",))
  spec = batch_lib.shape_spec(config)  # tipsito's batch: big_vision gets the same shapes, images as float
  data = jax.sharding.NamedSharding(mesh, P("batch"))
  image = jax.ShapeDtypeStruct(spec[batch_lib.IMAGE].shape, jnp.float32, sharding=data)
  two_views = batch_lib.IMAGE2 in spec
  text = jax.ShapeDtypeStruct(spec[batch_lib.TEXT].shape, jnp.int32, sharding=data)
  b, size = image.shape[0], image.shape[1]
  with _gelu_of(bv, exact_gelu):
    init = lambda: model.init(  # noqa: E731
      jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)), jnp.zeros((1, text.shape[1]), jnp.int32)
    )["params"]
    params = jax.eval_shape(init)
    tx = _big_vision_optimizer(bv, config, params, b)
    opt = jax.eval_shape(tx.init, params)
    rep = jax.sharding.NamedSharding(mesh, P())
    params, opt = (
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), t) for t in (params, opt)
    )
    step = _big_vision_step(bv, model, tx, mesh, two_views)
    return step.lower(params, opt, image, image if two_views else None, text).compile()


# ---------------------------------------------------------------------------------------------------------
# tipsito


def tipsito_config(
  recipe: str, variant: str, batch: int, *, toggles: Sequence[str] = (), scan: bool = False
) -> mlc.ConfigDict:
  """The paper config's towers (configs/clip_b16.py, configs/ito_b16.py) in float32 with big_vision's
  Adafactor, at `batch`; `toggles` (TOGGLES) change one thing each; `scan`: both towers' blocks scanned and
  rematerialised with policy nothing_saveable, as big_vision's vit.py does under its `scan`."""
  if variant not in TEXT_SHAPES:
    raise app.UsageError(f"--variant={variant!r}: one of {sorted(TEXT_SHAPES)}")
  c = defaults.base_config(recipe, variant, total_steps=1000, batch_size=batch)
  shape = TEXT_SHAPES[variant]
  c.model.embed_dim = shape["out_dim"]
  c.model.text.update(dict(shape, dtype="float32"))
  c.max_len = shape["max_len"]
  c.model.image.dtype = "float32"
  if recipe == "ito":
    c.model.fusion.update(dict(max_text_len=shape["max_len"], chunks=paper.FUSION_CHUNKS))
    c.input.update(dict(views="two_views", num_local=0))
  c.optim.update(
    dict(name="adafactor", lr=1e-3, weight_decay=1e-4, clip_norm=1.0, warmup_steps=100, **ADAFACTOR)
  )
  if scan:
    for tower in ("image", "text"):
      c.model[tower].update(dict(scan=True, remat=True, remat_policy="nothing_saveable"))
  for t in toggles:
    if t in ("tanh_gelu", "tips_image"):
      c.model.image.activation = "gelu"
      c.model.text.activation = "gelu" if t == "tanh_gelu" else c.model.text.activation
    if t in ("no_ln_pre", "tips_image"):
      c.model.image.pre_norm = False
    if t == "tips_image":
      c.model.image.update(dict(patch_bias=True, cls_posemb=False, ln_eps=1e-6))
    if t == "adamw":
      c.optim.update(dict(name="adamw", eps=1e-6, momentum_dtype="float32"))
    if t == "no_fusion":
      c.loss.fusion = 0.0
    if t.startswith(REMAT_PREFIX):  # both towers' blocks rematerialised with that policy
      for tower in ("image", "text"):
        c.model[tower].update(dict(remat=True, remat_policy=t[len(REMAT_PREFIX) :]))
    if t.startswith(FUSION_REMAT_PREFIX):  # the ITO fusion module's blocks rematerialised with that policy
      c.model.fusion.update(dict(remat=True, remat_policy=t[len(FUSION_REMAT_PREFIX) :]))
    if t.startswith(FUSION_CHUNKS_PREFIX):  # the fusion module over K groups of examples in turn
      c.model.fusion.chunks = int(t[len(FUSION_CHUNKS_PREFIX) :])
    if t == "keep_attention_probs":
      for part in ("image", "text", "fusion"):
        c.model[part].attention_recompute = False
  return c


def tipsito_entry(config) -> tuple[dict, dict]:
  """tipsito's jitted train step for `config` (as tipsito/bench/step_bench.py builds it), compiled; and the host
  batch (given to big_vision too)."""
  config_validation.validate(config, num_devices=jax.device_count())  # synthetic ids
  setup = assembly.build(config)
  host = synthetic_batch(
    config, batch_size=int(config.input.batch_size), vocab_size=int(config.model.text.vocab_size)
  )
  batch = sharding.global_batch(host, setup.mesh)
  frozen = setup.frozen()
  carry = {"state": setup.init_state()}
  traced = step_lib.jit_train_step(setup).trace(carry["state"], batch, frozen)
  compiled = traced.lower().compile()

  def run():
    carry["state"], metrics = compiled(carry["state"], batch, frozen)
    return metrics

  return dict(compiled=compiled, run=run, matmul_flops=executed_matmul_flops(traced.jaxpr)), host


# ---------------------------------------------------------------------------------------------------------
# measuring


def executed_matmul_flops(closed_jaxpr) -> float:
  """2 x the multiply-adds of every `dot_general` and convolution a traced step runs, from its jaxpr after
  dead-code elimination (values the step computes and never uses, which XLA drops too): a `scan` body
  times its length, a `cond` by its costliest branch, every other nested jaxpr (jit, shard_map, a
  rematerialised body wherever its recompute appears in the backward pass) once each.

  Why: XLA's cost analysis counts a loop's body once, so the FLOPs it gives a step that runs the ITO
  fusion module in groups (a scan) or scanned towers are not what the step executes, and their ratio to
  big_vision's cannot be set against a time ratio (issue 43's bound `ito` time <= FLOP ratio;
  docs/performance.md). Only matmuls, on both sides: the element-wise work XLA also counts is left out.
  Counted before XLA's own simplifications (a recompute that XLA:CPU merges with the forward's value counts
  twice here); a `while` of unknown trip count counts once."""
  return observability.matmul_flops(observability.live_jaxpr(closed_jaxpr))[0]  # the train loop's count


def compiled_numbers(compiled) -> dict[str, Any]:
  """FLOPs (XLA cost analysis) and temporary / argument memory (XLA memory analysis) of a compiled step."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  mem = compiled.memory_analysis()
  flops = float(cost.get("flops", 0.0))
  return {
    "flops": flops,
    "gflop": round(flops / 1e9, 2),
    "temp_MiB": round(mem.temp_size_in_bytes / 2**20, 1),
    "args_MiB": round(mem.argument_size_in_bytes / 2**20, 1),
  }


def topology_numbers(compiled) -> dict[str, Any]:
  """Per-chip numbers of a step compiled for a TPU topology: FLOPs, temporaries and the total live at the
  peak (arguments + outputs not aliased to a donated argument + temporaries + code; as tipsito/planning/pod.py
  counts it)."""
  cost = compiled.cost_analysis()
  cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
  m = compiled.memory_analysis()
  total = (
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
    + m.generated_code_size_in_bytes
  )
  flops = float(cost.get("flops", 0.0))
  return {
    "flops": flops,
    "gflop": round(flops / 1e9, 2),
    "temp_MiB": round(m.temp_size_in_bytes / 2**20, 1),
    "total_MiB": round(total / 2**20, 1),
  }


def tipsito_topology_compile(config, devices: list):
  """tipsito's train step for `config` compiled ahead of time for compile-only TPU `devices`, exactly as
  `python -m tipsito.plan` compiles it (abstract state and batch), on a data-parallel mesh: parameters and
  optimizer state replicated on every chip like big_vision's, so per-chip bytes compare like for like (the
  configs' default FSDP mesh would shard them and lower tipsito's side further)."""
  from tipsito.planning import pod  # pylint: disable=import-outside-toplevel  # the libtpu-only path

  config = config.copy_and_resolve_references()
  config.mesh.update(dict(data=-1, fsdp=1, model=1))
  config_validation.validate(config, num_devices=len(devices))
  mesh = pod.topology_mesh(config.mesh, devices)
  setup = step_lib.build(config, mesh)
  state = jax.tree.map(
    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
    setup.state_shapes,
    setup.state_shardings,
  )
  batch = pod.abstract_batch(config, mesh)
  return step_lib.jit_train_step(setup).trace(state, batch, {}).lower().compile()


def time_interleaved(entries: Sequence[dict], steps: int) -> None:
  """One warmup step per entry, then `steps` rounds of one step per entry; each entry's `step_s` is its
  median (rounds interleave the entries, so load on a shared machine hits all of them alike), and `sys_s`
  the median of the process's system CPU time per step, all threads. Why the second: XLA:CPU allocates a
  step's temporaries at every call, and where the allocator maps them afresh (glibc, for allocations this
  large) the kernel's providing of those pages on first touch is system time that moves with the allocator
  and the machine more than the compute does (docs/performance.md has the measurement); a row whose time
  moves between runs shows here whether that is where it moved.

  The warm-up steps run the entry with the most temporaries first: under an allocator that keeps freed
  memory mapped for reuse (jemalloc with `dirty_decay_ms:-1`, docs/performance.md), each step's temporaries
  then fit in the memory the largest one freed, where in the rows' own order every row larger than all
  before it maps its temporaries anew, and the process ends up holding about the sum of the rows'
  temporaries instead of the largest."""
  for e in sorted(entries, key=lambda e: -e["row"]["temp_MiB"]):
    jax.block_until_ready(e["run"]())
  times: list[list[float]] = [[] for _ in entries]
  system: list[list[float]] = [[] for _ in entries]
  for _ in range(steps):
    for e, ts, ss in zip(entries, times, system):
      s, t = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
      jax.block_until_ready(e["run"]())
      ts.append(time.perf_counter() - t)
      ss.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - s)
  for e, ts, ss in zip(entries, times, system):
    e["times"] = ts
    e["row"]["step_s"] = round(float(np.median(ts)), 4)
    e["row"]["sys_s"] = round(float(np.median(ss)), 3)


def paired_ratio_interval(ours: Sequence[float], ref: Sequence[float], level: float = 0.95) -> dict:
  """The step-time ratio round by round (`ours[i] / ref[i]`: the two steps of one interleaved round saw the
  same machine load), its median, and a distribution-free confidence interval for that median: the order
  statistics r_(k) and r_(n+1-k) with the largest k such that P(Binomial(n, 1/2) < k) <= (1 - level) / 2,
  whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is returned as `level` (at least the one asked). Why: a bound
  like "at most 1.00x big_vision's time" is decided by a ratio that moves about 1 % between runs on a
  2-core machine, so the table says how far this run's rounds put it; no interval (None) below 6 rounds,
  where even the extremes cover less than 95 %."""
  r = np.sort(np.asarray(ours, float) / np.asarray(ref, float))
  n = len(r)
  out = {"rounds": n, "median": round(float(np.median(r)), 4), "lo": None, "hi": None, "level": None}
  tail = lambda k: sum(math.comb(n, i) for i in range(k)) / 2**n  # noqa: E731  P(X < k)
  k = 0
  while k + 1 <= n // 2 and tail(k + 1) <= (1 - level) / 2:
    k += 1
  if k:
    out.update(lo=round(float(r[k - 1]), 4), hi=round(float(r[n - k]), 4), level=round(1 - 2 * tail(k), 4))
  return out


def run_side_by_side(
  bv_path: str,
  recipes: Sequence[str] = RECIPES,
  *,
  variant: str = "B/16",
  batch: int = 8,
  steps: int = 5,
  toggles: Sequence[str] = (),
  topology: Optional[str] = None,
  scan: bool = False,
  log: Callable[[str], None] = print,
) -> list[dict]:
  """The rows: per recipe, tipsito and big_vision (then each toggle on tipsito's `clip`, or big_vision's),
  with FLOPs, temporaries, step time and the ratios of each tipsito row to big_vision's of its recipe.
  With `topology` (e.g. 'v5e:1x1'), every row is instead compiled ahead of time for that TPU topology
  (libtpu, tipsito/planning/pod.py) and nothing runs: per-chip FLOPs, temporaries and total bytes; `batch` is the
  global batch, split over the topology's chips."""
  for r in recipes:
    if r not in RECIPES:
      raise app.UsageError(f"--recipes: {r!r} is not one of {RECIPES}")
  for t in toggles:
    if t not in TOGGLES:
      raise app.UsageError(f"--toggles: {t!r} is not one of {TOGGLES}")
  if "bv_fusion" in toggles and ("ito" not in recipes or topology or not steps):
    raise app.UsageError(
      "--toggles=bv_fusion: a big_vision `ito` row timed on this machine; give it with --recipes "
      "including ito, --steps > 0 and no --topology"
    )
  devices = topology_devices(topology, batch) if topology else None
  bv = import_big_vision(big_vision_root(bv_path))
  entries = []

  def add(side: str, name: str, entry: dict, recipe: str) -> None:
    numbers = topology_numbers if topology else compiled_numbers
    entry["row"] = dict(side=side, row=name, recipe=recipe, **numbers(entry["compiled"]))
    if "matmul_flops" in entry:  # rows run on this machine: the matmul FLOPs the step executes
      entry["row"]["matmul_gflop"] = round(entry["matmul_flops"] / 1e9, 2)
    if topology:
      entry["row"].update(topology=topology, batch_per_chip=batch // len(devices))
    log(f"compiled {name}: {entry['row']}")
    entries.append(entry)

  def ours(config, toggles: Sequence[str] = ()) -> tuple[dict, Optional[dict]]:
    with _attention_of(toggles):
      if topology:
        return {"compiled": tipsito_topology_compile(config, devices)}, None
      return tipsito_entry(config)

  def theirs(config, host, exact_gelu=False, fusion=False) -> dict:
    if topology:
      return {"compiled": big_vision_topology_compile(bv, config, devices, exact_gelu=exact_gelu, scan=scan)}
    return big_vision_entry(bv, config, host, exact_gelu=exact_gelu, fusion=fusion)

  for r in recipes:
    config = tipsito_config(r, variant, batch, scan=scan)
    entry, host = ours(config)
    add("tipsito", r, entry, r)
    add("big_vision", f"big_vision {r}", theirs(config, host), r)
    if r == "ito":
      add(
        "tipsito",
        "ito -fusion",
        ours(tipsito_config(r, variant, batch, toggles=["no_fusion"], scan=scan))[0],
        r,
      )
      if "bv_fusion" in toggles:
        add("big_vision", FUSION_ROW, theirs(config, host, exact_gelu=True, fusion=True), r)
    for t in toggles if r == recipes[0] else ():
      if t == "bv_fusion":
        continue  # the `ito` row above
      if t == "bv_exact_gelu":
        add("big_vision", f"big_vision {r} +exact_gelu", theirs(config, host, exact_gelu=True), r)
      else:
        add("tipsito", f"{r} {t}", ours(tipsito_config(r, variant, batch, toggles=[t], scan=scan), [t])[0], r)
  if not topology and steps:
    time_interleaved(entries, steps)
  rows = [e["row"] for e in entries]
  keys = (
    ("flops", "temp_MiB", "total_MiB")
    if topology
    else ("flops", "matmul_gflop", "temp_MiB") + (("step_s",) if steps else ())
  )
  times = {e["row"]["row"]: e["times"] for e in entries if "times" in e}
  by_name = {x["row"]: x for x in rows}
  fused = by_name.get(FUSION_ROW)  # toggle bv_fusion
  for row in rows:
    ref = by_name[f"big_vision {row['recipe']}"]
    for k in keys:
      row[f"{k}_vs_bv"] = round(row[k] / ref[k], 3) if ref[k] else None
    row["gflop_vs_bv"] = row.pop("flops_vs_bv")
    if row is not ref and row["row"] in times and ref["row"] in times:
      row["step_ratio_paired"] = paired_ratio_interval(times[row["row"]], times[ref["row"]])
    # With toggle bv_exact_gelu, tipsito's rows are also timed against big_vision's towers with the exact
    # GELU that ours must have (OpenCLIP's): the rest of the step compared like for like (docs/performance.md).
    exact = by_name.get(f"big_vision {row['recipe']} +exact_gelu")
    if row["side"] == "tipsito" and exact and row["row"] in times and exact["row"] in times:
      row["step_ratio_paired_exact_gelu"] = paired_ratio_interval(times[row["row"]], times[exact["row"]])
    # With toggle bv_fusion, tipsito's `ito` rows are also set against big_vision's step that has ITO's
    # fusion loss too (`ReferenceFusion`): FLOPs executed and time, both sides running the same function.
    if row["side"] == "tipsito" and row["recipe"] == "ito" and fused:
      row["matmul_gflop_vs_bv_fusion"] = round(row["matmul_gflop"] / fused["matmul_gflop"], 3)
      row["step_ratio_paired_bv_fusion"] = paired_ratio_interval(times[row["row"]], times[fused["row"]])
  return rows


def topology_devices(topology: str, batch: int) -> list:
  """The compile-only devices of `topology` (tipsito/planning/pod.py), refusing before any compile a batch the
  chips do not divide or a topology libtpu does not know, with the flag named."""
  from tipsito.planning import pod  # pylint: disable=import-outside-toplevel  # the libtpu-only path

  try:
    devices = pod.topology_devices(topology)
  except pod.PlanError as e:
    raise app.UsageError(str(e)) from e
  if batch % len(devices):
    raise app.UsageError(
      f"--batch={batch}: not a multiple of the {len(devices)} chips of --topology={topology}; --batch is the "
      "global batch (per-chip batch x chips)"
    )
  return devices


def markdown_table(rows: Sequence[dict]) -> str:
  """The rows as a markdown table (docs/performance.md); rows compiled for a topology get the per-chip one."""
  if rows and "topology" in rows[0]:
    return topology_table(rows)
  exact = any("step_ratio_paired_exact_gelu" in r for r in rows)  # toggle bv_exact_gelu, timed
  fused = any("step_ratio_paired_bv_fusion" in r for r in rows)  # toggle bv_fusion
  lines = [
    "| row | GFLOP/step | temporaries (MiB) | step (s, median) | system CPU (s, median) | FLOPs vs big_vision "
    "| executed matmul FLOPs vs big_vision | temporaries vs big_vision | time vs big_vision "
    "| time vs big_vision per round: median [CI] |"
    + (" time vs big_vision +exact_gelu per round: median [CI] |" if exact else "")
    + (
      f" executed matmul FLOPs vs {FUSION_ROW} | time vs {FUSION_ROW} per round: median [CI] |"
      if fused
      else ""
    ),
    "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if exact else "") + ("---|---|" if fused else ""),
  ]
  for r in rows:
    timed = "step_s" in r  # --steps 0: compiled only, no times
    fusion_cells = ""
    if fused:  # big_vision's own rows have no ratio to the fused row
      fusion_cells = " - | - |"
      if "step_ratio_paired_bv_fusion" in r:
        fusion_cells = (
          f" {r['matmul_gflop_vs_bv_fusion']:.3f} | {paired_cell(r['step_ratio_paired_bv_fusion'])} |"
        )
    step, ratio = (f"{r['step_s']:.3f}", f"{r['step_s_vs_bv']:.3f}") if timed else ("-", "-")
    system = f"{r['sys_s']:.2f}" if "sys_s" in r else "-"  # rows of an older --jsonl have none
    matmul = f"{r['matmul_gflop_vs_bv']:.3f}" if "matmul_gflop_vs_bv" in r else "-"  # nor these
    lines.append(
      f"| {r['row']} | {r['gflop']:.1f} | {r['temp_MiB']:.1f} | {step} | {system} | {r['gflop_vs_bv']:.3f} "
      f"| {matmul} | {r['temp_MiB_vs_bv']:.3f} | {ratio} | {paired_cell(r.get('step_ratio_paired'))} |"
      + (f" {paired_cell(r.get('step_ratio_paired_exact_gelu'))} |" if exact else "")
      + fusion_cells
    )
  return "\n".join(lines)


def paired_cell(p: Optional[dict]) -> str:
  """`paired_ratio_interval`'s numbers as a table cell: '0.944 [0.931, 0.957] 96%, 12 rounds'."""
  if not p:
    return "-"
  if p["lo"] is None:
    return f"{p['median']:.3f} (no interval: {p['rounds']} rounds)"
  return f"{p['median']:.3f} [{p['lo']:.3f}, {p['hi']:.3f}] {100 * p['level']:.0f}%, {p['rounds']} rounds"


def topology_table(rows: Sequence[dict]) -> str:
  """Rows compiled for a TPU topology as a markdown table: per chip, FLOPs, temporaries and total bytes."""
  lines = [
    "| row | topology | batch per chip | GFLOP/step per chip | temporaries (MiB) | total (MiB) "
    "| FLOPs vs big_vision | temporaries vs big_vision | total vs big_vision |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['row']} | {r['topology']} | {r['batch_per_chip']} | {r['gflop']:.1f} | {r['temp_MiB']:.1f} "
      f"| {r['total_MiB']:.1f} | {r['gflop_vs_bv']:.3f} | {r['temp_MiB_vs_bv']:.3f} | {r['total_MiB_vs_bv']:.3f} |"
    )
  return "\n".join(lines)


def _define_flags() -> None:
  if "big_vision" in FLAGS:
    return
  flags.DEFINE_string(
    "big_vision", None, "Path of a local big_vision checkout (the directory holding big_vision/)."
  )
  flags.DEFINE_list("recipes", list(RECIPES), f"tipsito recipes to compare ({', '.join(RECIPES)}).")
  flags.DEFINE_string("variant", "B/16", f"Image tower ({', '.join(TEXT_SHAPES)}); the text tower follows.")
  flags.DEFINE_integer("batch", 8, "Global batch.")
  flags.DEFINE_integer(
    "steps", 5, "Timed steps per row (after one warmup step), interleaved across rows; 0 compiles only."
  )
  flags.DEFINE_list("toggles", [], f"Extra tipsito/big_vision rows, one change each: {', '.join(TOGGLES)}.")
  flags.DEFINE_string("jsonl", None, "Also append every row as one JSON line to this file.")
  flags.DEFINE_string(
    "topology",
    None,
    "Compile every row ahead of time for this TPU topology (e.g. v5e:1x1, v5e:2x2; libtpu from the "
    "tpu-plan extra) and report per-chip FLOPs, temporaries and total bytes instead of timing on this machine.",
  )
  flags.DEFINE_bool(
    "scan",
    False,
    "Both sides' towers scanned, blocks rematerialised with nothing_saveable (big_vision's scan).",
  )


def main(argv: Sequence[str]) -> None:
  """Prints one line per compiled row, the markdown table and one JSON line."""
  del argv
  distributed.configure_jax()  # as every tipsito program: CPU without libtpu probing, partitionable RNG
  rows = run_side_by_side(
    FLAGS.big_vision,
    FLAGS.recipes,
    variant=FLAGS.variant,
    batch=FLAGS.batch,
    steps=FLAGS.steps,
    toggles=FLAGS.toggles,
    topology=FLAGS.topology,
    scan=FLAGS.scan,
  )
  if FLAGS.jsonl:
    with open(FLAGS.jsonl, "a") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
  machine = provenance.machine()  # times on XLA:CPU are the processor's: the same code differs by machine
  alloc = machine["allocator"]
  alloc_text = f"{alloc['name']} allocator" + (f" (MALLOC_CONF={alloc['conf']})" if alloc["conf"] else "")
  print(
    f"machine: {machine['processor']['model']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
    f"{alloc_text}"
  )
  print(markdown_table(rows))
  print(
    json.dumps(
      {"side_by_side": rows, "backend": jax.default_backend(), "jax": jax.__version__, "machine": machine}
    )
  )
  sys.stdout.flush()


run = command.entry_point(_define_flags, main)  # the shared command tail (tipsito/command.py)


if __name__ == "__main__":
  run()
