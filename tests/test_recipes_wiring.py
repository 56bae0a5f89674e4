"""Which tensor feeds which loss term, and where gradients may flow, inside `compute_losses`.

Why: the losses themselves are pinned against dinov2 / big_vision / ITO vectors (tests/test_losses_*), but a
term fed the wrong view, the wrong CLS token, the wrong caption or an undetached teacher would still train
and lower its loss. These tests pin the wiring: the arguments each loss function receives are recomputed
here from the model's own methods on the intended inputs (spies on the loss functions record them), and
gradients are checked to reach only the parts they should. Tiny depth-1 towers, eager forward, one batch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito.train import exporting
from tipsito import objective
from tipsito.config import defaults
from tipsito.losses import contrastive as con_lib
from tipsito.losses import dino as dino_lib
from tipsito.losses import ibot as ibot_lib
from tipsito.objective.features import unit
from tipsito.objective.model import TrainModel
from tipsito.data.synthetic import synthetic_batch
from tipsito.train import assembly
from tipsito.train import sharding
from tipsito.train import step as step_lib


def build(recipe="tipsv2", ema_mode=None, **loss_opts):
  """(setup, state, batch) of a depth-1 tiny config; CLS tokens and the EMA teacher are perturbed so that
  CLS1 != CLS2 and teacher heads != student heads (at init they are equal, which would hide swaps)."""
  c = defaults.tiny_config(recipe)
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.model.text.depth = 1
  if ema_mode:
    c.ema.mode = ema_mode
  c.loss_opts.update(loss_opts)
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  setup = step_lib.build(c, mesh, vocab_size=100)
  state = setup.init_state()
  rs = np.random.RandomState(0)
  params = jax.tree.map(jnp.asarray, jax.device_get(state.params))
  cls = params["image"]["cls"]
  params["image"]["cls"] = cls + jnp.asarray(rs.normal(size=cls.shape), cls.dtype)
  ema = jax.tree.map(lambda x: x * 1.5 + 0.01, jax.device_get(state.ema))
  state = state.replace(
    params=params,
    ema=jax.tree.map(jnp.asarray, ema),
    centers=jax.device_get(state.centers),
    step=jnp.int32(0),
  )
  batch = jax.tree.map(jnp.asarray, synthetic_batch(c, seed=1))
  return setup, state, batch


_JITTED = {}


@pytest.fixture(autouse=True)
def _fresh_jit_cache():
  """The cache is keyed by object ids, which Python reuses once a test's setup is gone."""
  _JITTED.clear()
  yield
  _JITTED.clear()


def losses(
  setup, state, batch, weights, *, params=None, ema=None, frozen=None, step=None, record=(), cache=True
):
  """Jitted compute_losses with `weights`; returns (total, metrics, recorded) where `recorded` holds the
  positional array arguments of every call of the spied loss functions (`record`: [(module, name)]).
  Compiled once per (setup, weights, record) unless `cache=False` (a test patched a loss function)."""
  ctx = dataclasses.replace(setup.ctx, weights=weights)
  key = (id(setup), id(setup.ctx), tuple(sorted(weights.items())), tuple((id(m), n) for m, n in record))
  if not cache or key not in _JITTED:
    names = []
    saved = [(m, n, getattr(m, n)) for m, n in record]

    def run(params, ema, centers, frozen, batch, step):
      names.clear()
      recorded = []
      for m, n, orig in saved:

        def rec(*args, _orig=orig, _n=n, **kw):
          names.append(_n)
          recorded.append([a for a in args if isinstance(a, jax.Array)])
          return _orig(*args, **kw)

        setattr(m, n, rec)
      try:
        total, (metrics, _) = objective.compute_losses(
          ctx, params, ema, centers, frozen, batch, step, jax.random.PRNGKey(0)
        )
      finally:
        for m, n, orig in saved:
          setattr(m, n, orig)
      return total, metrics, recorded

    _JITTED[key] = (jax.jit(run), names)
  fn, names = _JITTED[key]
  out = fn(
    state.params if params is None else params,
    state.ema if ema is None else ema,
    state.centers,
    {} if frozen is None else frozen,
    batch,
    state.step if step is None else jnp.int32(step),
  )
  if not cache:
    del _JITTED[key]
  return out[0], out[1], list(zip(names, out[2]))


def grad_of(setup, state, batch, weights, key="total", argnums=(0,), **kw):
  """Jitted gradient of the total (or of metrics[key]; a tuple of keys gives one gradient per key, in one
  compile) w.r.t. (params, ema, frozen, image)[argnums]."""
  ctx = dataclasses.replace(setup.ctx, weights=weights)

  def f(params, ema, frozen, image):
    total, (metrics, _) = objective.compute_losses(
      ctx, params, ema, state.centers, frozen, dict(batch, image=image), state.step, jax.random.PRNGKey(0)
    )
    if isinstance(key, tuple):
      return jnp.stack([metrics[k] for k in key])
    return total if key == "total" else metrics[key]

  args = (kw.get("params", state.params), kw.get("ema", state.ema), kw.get("frozen", {}), batch["image"])
  diff = jax.jacrev if isinstance(key, tuple) else jax.grad
  return jax.jit(diff(f, argnums=argnums))(*args)


def apply(setup, params, *args, method, **kw):
  return setup.model.apply({"params": params}, *args, method=method, **kw)


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def nonzero(tree):
  return any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(tree))


def all_zero(tree):
  return all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(tree))


# --- teacher: no gradient --------------------------------------------------------------------------


@pytest.mark.parametrize("ema_mode", ["head", "full"])
def test_no_gradient_reaches_teacher_features_or_heads(ema_mode):
  """DINO + iBOT with every patch masked: the student never sees the global image's pixels (mask tokens
  only; DINO reads the local crops), so any gradient w.r.t. those pixels or the EMA tree is a leak through
  the teacher."""
  setup, state, batch = build("tipsv2", ema_mode)
  assert set(state.ema) == ({"dino_head", "ibot_head"} | ({"image"} if ema_mode == "full" else set()))
  batch = dict(batch, image=batch["image"].astype(jnp.float32) / 255.0, mask=jnp.ones_like(batch["mask"]))
  gp, ge, gi = grad_of(setup, state, batch, {"dino": 1.0, "ibot": 2.0}, argnums=(0, 1, 3))
  assert all_zero(ge), "gradient reached the EMA teacher"
  assert all_zero(gi), "gradient reached the teacher's input through the teacher features"
  assert nonzero(gp["dino_head"]) and nonzero(gp["ibot_head"]) and nonzero(gp["image"])


def test_distill_no_gradient_reaches_frozen_teacher():
  """Distillation: the frozen teacher's params and the EMA heads get no gradient; the student does."""
  setup, state, batch, frozen = distill_setup(feature=1.0)
  gp, ge, gf = grad_of(
    setup, state, batch, {"dino": 1.0, "ibot": 2.0, "feature": 1.0}, argnums=(0, 1, 2), frozen=frozen
  )
  assert all_zero(ge) and all_zero(gf)
  assert nonzero(gp["image"]) and nonzero(gp["distill_proj"]) and nonzero(gp["dino_head"])


# --- contrastive: CLS1 <- alt-text, CLS2 <- synthetic caption, view 2 <- alt-text ----------------------


def test_contrastive_terms_read_the_right_cls_caption_and_view():
  """tipsito: clip = InfoNCE(CLS1 of unmasked view 1, 'text') and InfoNCE(CLS2, 'text2'), clip_view2 =
  InfoNCE(CLS1 of 'image2', 'text'), weighted as tipsito/objective/terms.py contrastive_pair_weights says
  (view_weighting 'mean': CLS1 x 'text' 1/4 + 1/4 over the two views, CLS2 x 'text2' 1/2). The arguments
  each InfoNCE receives, the values and the per-term gradients equal a reference written from the model's
  methods: CLS2 gets gradient only through the synthetic-caption term, CLS1 only through the alt-text
  terms."""
  setup, state, batch = build("tipsito")
  w = {"clip": 1.0, "clip_view2": 1.0}
  total, metrics, calls = losses(setup, state, batch, w, record=[(con_lib, "clip_loss")])
  p = state.params

  def ref(p):
    v1 = apply(setup, p, batch["image"], train=True, method=TrainModel.encode_image)["cls"]
    v2 = apply(setup, p, batch["image2"], train=True, method=TrainModel.encode_image)["cls"]
    t1 = unit(apply(setup, p, batch["text"], train=True, method=TrainModel.encode_text)["pooled"])
    t2 = unit(apply(setup, p, batch["text2"], train=True, method=TrainModel.encode_text)["pooled"])
    s = jnp.exp(p["logit_scale"])
    pairs = [(unit(v1[:, 0]), t1), (unit(v1[:, 1]), t2), (unit(v2[:, 0]), t1)]
    terms = [con_lib.clip_loss(a, b, s) for a, b in pairs]
    return 0.25 * terms[0] + 0.5 * terms[1] + 0.25 * terms[2], (pairs, terms)

  want, (pairs, terms) = jax.jit(ref)(p)
  assert len(calls) == 3
  for (_, args), (img, txt) in zip(calls, pairs):
    close(args[0], img)
    close(args[1], txt)
  close(metrics["clip/cls1"], terms[0])
  close(metrics["clip/cls2"], terms[1])
  close(metrics["clip_view2/cls1"], terms[2])
  close(metrics["loss/clip_view2"], 0.25 * terms[2])
  close(total, want)
  # Per term: the gradient of CLS2's term is that of (CLS2, 'text2') alone, CLS1's that of (CLS1, 'text').
  g = grad_of(setup, state, batch, w, key=("clip/cls1", "clip/cls2", "clip_view2/cls1"))[0]
  g_ref = jax.jit(jax.jacrev(lambda q: jnp.stack(ref(q)[1][1])))(p)
  jax.tree.map(lambda a, b: close(a, b, 1e-4), g, g_ref)


def test_fusion_module_only_from_fusion_term_and_not_exported():
  """The fusion module gets gradient from the fusion term only (and gives none to the heads); the export
  holds neither it nor any head."""
  setup, state, batch = build("tipsito")
  others = {"clip": 1.0, "clip_view2": 1.0, "dino": 1.0, "ibot": 2.0, "koleo": 0.1}
  g = grad_of(setup, state, batch, others)[0]
  assert all_zero(g["fusion"]), "a non-fusion term reached the fusion module"
  # The NT-Xent alone (`fusion/ntxent`; the term's weight is relative to the alignment, so it needs one).
  g = grad_of(setup, state, batch, {"clip": 1.0, "fusion": 2.0}, key="fusion/ntxent")[0]
  assert nonzero(g["fusion"]) and nonzero(g["image"]) and nonzero(g["text"])
  assert all_zero(g["dino_head"]) and all_zero(g["ibot_head"])
  exported = exporting.export_params(state.params)
  paths = [sharding.path_str(k) for k, _ in jax.tree_util.tree_leaves_with_path(exported)]
  assert paths and not [q for q in paths if "fusion" in q or "head" in q]


# --- self-distillation inputs ----------------------------------------------------------------------


def test_dino_reads_local_crops_and_teacher_global_view():
  """Student DINO logits = student head on the local crops' CLS1 (M, B, K); teacher logits = EMA head on
  CLS1 of the unmasked global view (head-only EMA: the student encoder's features)."""
  setup, state, batch = build("tipsv2")
  _, _, calls = losses(setup, state, batch, {"dino": 1.0}, record=[(dino_lib, "dino_loss")])
  ((_, args),) = calls
  p, t = state.params, {**state.params, **state.ema}
  loc = batch["local_crops"]
  b, m = loc.shape[:2]

  @jax.jit
  def ref():
    l_cls = (
      apply(setup, p, loc.reshape((b * m,) + loc.shape[2:]), train=True, method=TrainModel.encode_image)[
        "cls"
      ][:, 0]
      .reshape(b, m, -1)
      .swapaxes(0, 1)
    )
    g_cls = apply(setup, p, batch["image"], method=TrainModel.encode_image)["cls"][:, 0]
    return (
      apply(setup, p, l_cls, method=TrainModel.dino),
      apply(setup, t, g_cls, method=TrainModel.dino)[None],
    )

  s_want, t_want = ref()
  close(args[0], s_want)
  close(args[1], t_want)


@pytest.mark.parametrize("all_patches", [False, True])
def test_ibot_vs_ibot_plus_plus_visible_tokens(all_patches):
  """iBOT (`ibot_all_patches=False`): only the masked tokens count; iBOT++ (True): visible ones too.
  The student logits come from the masked view, the teacher's from the unmasked one with the EMA head.
  Shown by shifting the student logits the loss receives at the batch's visible / masked positions."""
  setup, state, batch = build("tipsv2", ibot_all_patches=all_patches)
  flat = batch["mask"].reshape(batch["mask"].shape[0], -1)
  assert 0 < int(flat.sum()) < flat.size
  _, metrics, calls = losses(setup, state, batch, {"ibot": 1.0}, record=[(ibot_lib, "ibot_loss")])
  ((_, args),) = calls
  p, t = state.params, {**state.params, **state.ema}
  b = flat.shape[0]

  @jax.jit
  def ref():
    s_feat = apply(setup, p, batch["image"], mask=batch["mask"], train=True, method=TrainModel.encode_image)
    t_feat = apply(setup, p, batch["image"], method=TrainModel.encode_image)
    d = s_feat["patches"].shape[-1]
    return (
      apply(setup, p, s_feat["patches"].reshape(b, -1, d), method=TrainModel.ibot),
      apply(setup, t, t_feat["patches"].reshape(b, -1, d), method=TrainModel.ibot),
    )

  s_want, t_want = ref()
  close(args[0], s_want)
  close(args[1], t_want)
  base_loss = float(metrics["loss/ibot"])
  real = ibot_lib.ibot_loss
  bump = jnp.asarray(np.random.RandomState(3).normal(size=s_want.shape[-1]), jnp.float32)

  def shifted(where):
    def patched(sp, *a, **kw):
      return real(sp + 3.0 * jnp.where(where[..., None], bump, 0.0), *a, **kw)

    ibot_lib.ibot_loss = patched
    try:
      return float(losses(setup, state, batch, {"ibot": 1.0}, cache=False)[1]["loss/ibot"])
    finally:
      ibot_lib.ibot_loss = real

  visible, masked = shifted(~flat), shifted(flat)
  assert abs(masked - base_loss) > 1e-4
  if all_patches:
    assert abs(visible - base_loss) > 1e-4, "iBOT++ ignores the visible tokens"
  else:
    assert abs(visible - base_loss) < 1e-6, "iBOT counts visible tokens"


def test_teacher_temperature_schedule():
  """Linear warmup warmup_teacher_temp -> teacher_temp over teacher_temp_warmup_steps, then constant; the
  value reaches the DINO and iBOT losses and the metrics."""
  setup, state, batch = build("tipsv2")
  setup.ctx = dataclasses.replace(
    setup.ctx, teacher_temp_warmup_steps=10, warmup_teacher_temp=0.04, teacher_temp=0.07
  )
  for step, want in [(0, 0.04), (5, 0.055), (10, 0.07), (30, 0.07)]:
    _, metrics, calls = losses(
      setup,
      state,
      batch,
      {"dino": 1.0, "ibot": 1.0},
      step=step,
      record=[(dino_lib, "dino_loss"), (ibot_lib, "ibot_loss")],
    )
    assert float(metrics["teacher_temp"]) == pytest.approx(want, abs=1e-7)
    temps = {name: float(args[-1]) for name, args in calls}  # the last array argument is tau_t
    assert temps == pytest.approx({"dino_loss": want, "ibot_loss": want}, abs=1e-7)


# --- EMA update inside the train step -------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 1.0])
def test_ema_momentum_extremes_in_train_step(momentum):
  """momentum 0: after the optimizer step the teacher heads equal the (updated) student heads;
  momentum 1: the teacher heads never change."""
  setup, state, batch = build("tipsv2")
  setup.config.ema.momentum = momentum
  fn = step_lib.jit_train_step(setup)
  ema0 = jax.device_get(state.ema)
  heads0 = jax.device_get({k: state.params[k] for k in ema0})
  batch = sharding.global_batch(jax.device_get(batch), setup.mesh)
  for _ in range(2):
    state, _ = fn(state, batch, {})
  ema = jax.device_get(state.ema)
  heads = jax.device_get({k: state.params[k] for k in ema})
  assert not jax.tree.all(jax.tree.map(np.allclose, heads, heads0)), "student heads did not move"
  want = heads if momentum == 0.0 else ema0
  jax.tree.map(np.testing.assert_array_equal, ema, want)


def distill_setup(**loss):
  """Tiny distillation from the official-format tiny TIPS teacher in tests/data/tips_model."""
  import pathlib  # pylint: disable=import-outside-toplevel

  data = pathlib.Path(__file__).parent / "data" / "tips_model"
  c = defaults.tiny_config("distill", image_size=28)
  c.model.image.update(dict(patch_size=14, depth=1, posemb_grid=4))
  c.model.text.depth = 1
  c.distill.teacher_image_npz = str(data / "tiny_vit_mlp_vision.npz")
  c.loss.update(loss)
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  setup = assembly.build(c, mesh, vocab_size=100)  # loads config.distill's teacher
  state = setup.init_state()
  state = state.replace(ema=jax.tree.map(lambda x: x * 1.5 + 0.01, state.ema))
  batch = jax.tree.map(jnp.asarray, synthetic_batch(c, seed=1))
  return setup, state, batch, setup.frozen()


@pytest.mark.parametrize("recipe", ["ito", "tipsito"])
def test_student_pass_one_tower_call_per_view(recipe):
  """features.py `_student_pass`: each output is the tower applied to its own view (the student's view 1
  with its mask, the unmasked view 1, view 2; a swapped or mis-sliced view fails), for ITO (no mask: the
  contrastive view 1 is the student's) and tipsito (a masked student pass besides)."""
  from tipsito.objective import features as F  # pylint: disable=import-outside-toplevel

  setup, state, batch = build(recipe)
  fwd = F.Forward(setup.model, jax.random.PRNGKey(0))
  mask, unmasked_v1 = F._student_mask(setup.ctx, frozenset({F.STUDENT_MASK, F.CONTRASTIVE_VIEW}), batch)  # pylint: disable=protected-access
  assert (mask is not None) == (recipe == "tipsito") and unmasked_v1 == (recipe == "tipsito")
  student, contrastive, view2 = F._student_pass(fwd, state.params, batch, mask, unmasked_v1, True)  # pylint: disable=protected-access
  enc = lambda x, m=None: apply(setup, state.params, x, mask=m, train=True, method=TrainModel.encode_image)  # noqa: E731
  jax.tree.map(close, student, enc(batch["image"], mask))
  jax.tree.map(close, contrastive, enc(batch["image"]))
  jax.tree.map(close, view2, enc(batch["image2"]))


# --- towers compute only the rows the terms read ----------------------------------------------------


@pytest.mark.parametrize(
  "recipe, reads_tokens", [("clip", False), ("siglip", False), ("ito", True), ("tipsv2", True)]
)
def test_towers_return_tokens_only_to_terms_that_read_them(recipe, reads_tokens, monkeypatch):
  """features.py PATCH_TOKENS / CAPTION_TOKENS: a step whose terms read no patch tokens and no per-token
  caption outputs (clip, siglip) encodes with `cls_only` / `pooled_only`, so the towers' last blocks
  compute only the CLS and EOT rows: every loss, metric and gradient equals the step with every token
  computed (float tolerance) at fewer compiled FLOPs; recipes whose terms read tokens (ITO's fusion,
  iBOT) compile the same step either way. Break checks: the ibot term without PATCH_TOKENS fails tipsv2;
  features.py encoding every token whatever the needs fails clip's FLOP check."""
  from tipsito.objective import compute as compute_lib  # pylint: disable=import-outside-toplevel
  from tipsito.objective import features as F  # pylint: disable=import-outside-toplevel

  setup, state, batch = build(recipe)
  needs = compute_lib.needed_features(setup.ctx, batch)[1]
  assert (F.PATCH_TOKENS in needs) == reads_tokens
  assert (F.CAPTION_TOKENS in needs) == (recipe == "ito")

  def run():
    def f(params):
      total, (metrics, _) = objective.compute_losses(
        setup.ctx, params, state.ema, state.centers, {}, batch, state.step, jax.random.PRNGKey(0)
      )
      return total, metrics

    fn = jax.jit(jax.value_and_grad(f, has_aux=True))
    (total, metrics), grads = fn(state.params)
    return total, metrics, grads, fn.lower(state.params).compile().cost_analysis()["flops"]

  ours = run()
  real = compute_lib.needed_features
  every = lambda ctx, b: (lambda t, n: (t, n | {F.PATCH_TOKENS, F.CAPTION_TOKENS}))(*real(ctx, b))  # noqa: E731
  monkeypatch.setattr(compute_lib, "needed_features", every)
  every_token = run()
  close(ours[0], every_token[0])
  assert sorted(ours[1]) == sorted(every_token[1])
  jax.tree.map(close, ours[1], every_token[1])
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(every_token[2]))
  jax.tree.map(lambda a, b: close(a, b, 1e-5 * max(scale, 1.0)), ours[2], every_token[2])
  if reads_tokens:
    assert ours[3] == every_token[3], (ours[3], every_token[3])
  else:
    assert ours[3] < every_token[3], (ours[3], every_token[3])


def test_distillation_terms_read_patch_tokens():
  """The distill recipe's ibot / feature terms read the student's patch tokens, so its towers return them."""
  from tipsito.objective import compute as compute_lib  # pylint: disable=import-outside-toplevel
  from tipsito.objective import features as F  # pylint: disable=import-outside-toplevel

  setup, _, batch, _ = distill_setup(feature=1.0)
  assert F.PATCH_TOKENS in compute_lib.needed_features(setup.ctx, batch)[1]
