"""Fidelity of the objective to the papers (issue 20, items 4, 5, 9, 10): DINO's reduction over the student
crops, tipsito's contrastive weight per (term, CLS token, view), the stage-2 teacher, distillation's DINO
student views.

Why: each of these is a weight or a state that trains fine either way, so only a test that measures it
(gradients of the total with respect to each loss call, the arguments a loss receives, the restored
arrays) can tell what the run does. Tiny depth-1 towers; the stage-2 tests drive the real loop.
"""

import dataclasses
import importlib.util
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito import info
from tipsito import objective
from tipsito.config import defaults
from tipsito.config import validation as config_validation
from tipsito.config.validation import ConfigError
from tipsito.losses import contrastive as con_lib
from tipsito.losses import dino as dino_lib
from tipsito.objective.features import unit
from tipsito.objective.model import TrainModel
from tipsito.data.synthetic import synthetic_batch
from tipsito.train import assembly
from tipsito.train import checkpointing
from tipsito.train import loop
from tipsito.train import sharding
from tipsito.train import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIPS = pathlib.Path(__file__).parent / "data" / "tips_model"


def tiny(recipe, **kw):
  c = defaults.tiny_config(recipe, **kw)
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.model.text.depth = 1
  return c


def build(c):
  """(setup, state, batch) on one device; the EMA heads are perturbed so teacher != student heads."""
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  setup = assembly.build(c, mesh, vocab_size=100)  # with config.distill's teacher, if any
  state = setup.init_state()
  state = state.replace(ema=jax.tree.map(lambda x: x * 1.5 + 0.01, state.ema))
  batch = jax.tree.map(jnp.asarray, synthetic_batch(c, seed=1))
  return setup, state, batch


def run_losses(setup, state, batch, ctx=None, frozen=None):
  """(total, metrics) of compute_losses, jitted."""
  ctx = ctx or setup.ctx

  def f(params):
    total, (metrics, _) = objective.compute_losses(
      ctx, params, state.ema, state.centers, frozen or {}, batch, state.step, jax.random.PRNGKey(0)
    )
    return total, metrics

  return jax.jit(f)(state.params)


def apply(setup, params, *args, method, **kw):
  return setup.model.apply({"params": params}, *args, method=method, **kw)


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def load_config(name, arg=None):
  spec = importlib.util.spec_from_file_location(f"cfg_{name[:-3]}", ROOT / "configs" / name)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


# --- item 4: DINO reduction over the local crops ----------------------------------------------------


def test_dino_loss_sum_is_m_times_mean_on_a_fixed_example():
  rs = np.random.RandomState(0)
  m, b, k = 6, 4, 16
  s = jnp.asarray(rs.normal(size=(m, b, k)), jnp.float32)
  t = jnp.asarray(rs.normal(size=(1, b, k)), jnp.float32)
  c = jnp.asarray(rs.normal(size=(k,)) * 0.1, jnp.float32)
  mean = dino_lib.dino_loss(s, t, c, 0.1, 0.04, reduction="mean")
  total = dino_lib.dino_loss(s, t, c, 0.1, 0.04, reduction="sum")
  close(total, m * mean, 1e-6)
  assert float(mean) > 0


def test_dino_reduction_key_reaches_the_term():
  """`loss_opts.dino_reduction='sum'` makes loss/dino M times the default 'mean' (M = 2 local crops)."""
  c = tiny("tipsv2")
  assert c.loss_opts.dino_reduction == "mean"
  setup, state, batch = build(c)
  m = batch["local_crops"].shape[1]
  assert m == 2
  ctx = dataclasses.replace(setup.ctx, weights={"dino": 1.0})
  _, mean = run_losses(setup, state, batch, ctx)
  _, summed = run_losses(setup, state, batch, dataclasses.replace(ctx, dino_reduction="sum"))
  close(summed["loss/dino"], m * mean["loss/dino"], 1e-5)
  assert abs(float(summed["loss/dino"]) - float(mean["loss/dino"])) > 1e-3
  c.loss_opts.dino_reduction = "max"
  with pytest.raises(ConfigError, match=r"loss_opts\.dino_reduction='max'.*\['mean', 'sum'\]"):
    config_validation.validate(c)


# --- item 5: contrastive weight per (term, CLS token, caption, view) --------------------------------


def measured_contrastive_weights(setup, state, batch, weights):
  """{(cls, caption, view): d loss/total / d InfoNCE} for every `clip_loss` call, measured by replacing
  each call's value with a probe scalar and differentiating the total; which CLS token, caption and view
  a call reads is recognised from its arguments (recomputed from the model's own methods)."""
  ctx = dataclasses.replace(setup.ctx, weights=weights)
  real = con_lib.clip_loss

  def total_of(probes):
    args = []

    def probe(img, txt, *a, **kw):
      del a, kw
      args.append((img, txt))
      return probes[len(args) - 1]

    con_lib.clip_loss = probe
    try:
      total, _ = objective.compute_losses(
        ctx, state.params, state.ema, state.centers, {}, batch, state.step, jax.random.PRNGKey(0)
      )
    finally:
      con_lib.clip_loss = real
    return total, args

  grads, args = jax.jit(jax.grad(total_of, has_aux=True))(jnp.zeros((4,), jnp.float32))
  p = state.params
  v1 = apply(setup, p, batch["image"], train=True, method=TrainModel.encode_image)["cls"]
  v2 = apply(setup, p, batch["image2"], train=True, method=TrainModel.encode_image)["cls"]
  t1 = unit(apply(setup, p, batch["text"], train=True, method=TrainModel.encode_text)["pooled"])
  t2 = unit(apply(setup, p, batch["text2"], train=True, method=TrainModel.encode_text)["pooled"])

  def emb(x):
    return unit(apply(setup, p, x, method=TrainModel.project))

  known = {("CLS1", "alt-text", 1): (emb(v1[:, 0]), t1), ("CLS1", "alt-text", 2): (emb(v2[:, 0]), t1)}
  if v1.shape[1] > 1:
    known[("CLS2", "synthetic", 1)] = (emb(v1[:, 1]), t2)
  out = {}
  for i, (img, txt) in enumerate(args):
    (name,) = [
      n for n, (a, b) in known.items() if np.allclose(img, a, atol=1e-5) and np.allclose(txt, b, atol=1e-5)
    ]
    assert name not in out
    out[name] = float(grads[i])
  assert not np.any(np.asarray(grads[len(args) :]))
  return out


# The weights documented in tipsito/config/recipes.py (tipsito recipe) and README "Recipes".
TIPSITO_DOCUMENTED = {
  ("CLS1", "alt-text", 1): 0.25,
  ("CLS2", "synthetic", 1): 0.5,
  ("CLS1", "alt-text", 2): 0.25,
}


def test_tipsito_effective_contrastive_weights_are_the_documented_ones():
  """TIPSv2's L_CLIP (mean over the two captions) with ITO's L_align (mean over the two views) for the
  alt-text: 1/4 + 1/4 for CLS1 x alt-text, 1/2 for CLS2 x synthetic, total 1. `info` prints the same."""
  c = tiny("tipsito")
  setup, state, batch = build(c)
  contrastive = {k: v for k, v in setup.ctx.weights.items() if k in ("clip", "clip_view2")}
  assert contrastive == {"clip": 1.0, "clip_view2": 1.0}  # the recipe's weights
  got = measured_contrastive_weights(setup, state, batch, contrastive)
  assert got == pytest.approx(TIPSITO_DOCUMENTED, abs=1e-6)
  assert sum(got.values()) == pytest.approx(1.0)
  rows = {r["pair"]: r["weight"] for r in info.effective_weights(c, setup.ctx)}
  printed = {
    ("CLS1", "alt-text", 1): rows["clip CLS1 x alt-text, view 1"],
    ("CLS2", "synthetic", 1): rows["clip CLS2 x synthetic, view 1"],
    ("CLS1", "alt-text", 2): rows["clip_view2 CLS1 x alt-text, view 2"],
  }
  assert printed == pytest.approx(got, abs=1e-6)
  # view_weighting='sum': the weights as written (tipsito before the key), 1/2 each, total 1.5.
  setup.ctx = dataclasses.replace(setup.ctx, view_weighting="sum")
  got = measured_contrastive_weights(setup, state, batch, contrastive)
  assert got == pytest.approx({k: 0.5 for k in TIPSITO_DOCUMENTED}, abs=1e-6)


def test_ito_keeps_its_weights():
  """ITO: L_align = mean over the two views of (CLS, caption), 0.5 + 0.5, whatever tipsito does."""
  c = tiny("ito")
  assert c.loss_opts.view_weighting == "sum"
  setup, state, batch = build(c)
  got = measured_contrastive_weights(setup, state, batch, {"clip": 0.5, "clip_view2": 0.5})
  assert got == pytest.approx({("CLS1", "alt-text", 1): 0.5, ("CLS1", "alt-text", 2): 0.5}, abs=1e-6)


# --- item 10: distillation's DINO student views ----------------------------------------------------


def distill_build(**distill):
  c = tiny("distill", image_size=28)
  c.model.image.update(dict(patch_size=14))
  c.distill.teacher_image_npz = str(TIPS / "tiny_vit_mlp_vision.npz")
  c.distill.update(distill)
  config_validation.validate(c)
  setup, state, batch = build(c)
  return setup, state, batch, setup.frozen()


def dino_student_logits(setup, state, batch, frozen):
  """The student logits `dino_loss` receives (spied), and the reference logits of the local crops and of
  the global crop, from the model's methods."""
  ctx = dataclasses.replace(setup.ctx, weights={"dino": 1.0})
  real = dino_lib.dino_loss

  def f(params):
    seen = []

    def spy(s, *a, **kw):
      seen.append(s)
      return real(s, *a, **kw)

    dino_lib.dino_loss = spy
    try:
      objective.compute_losses(
        ctx, params, state.ema, state.centers, frozen, batch, state.step, jax.random.PRNGKey(0)
      )
    finally:
      dino_lib.dino_loss = real
    return seen[0]

  got = jax.jit(f)(state.params)
  p = state.params
  loc = batch["local_crops"]
  b, m = loc.shape[:2]
  l_cls = (
    apply(setup, p, loc.reshape((b * m,) + loc.shape[2:]), train=True, method=TrainModel.encode_image)["cls"][
      :, 0
    ]
    .reshape(b, m, -1)
    .swapaxes(0, 1)
  )
  g_cls = apply(setup, p, batch["image"], train=True, method=TrainModel.encode_image)["cls"][:, 0]
  local = apply(setup, p, apply(setup, p, l_cls, method=TrainModel.to_teacher_width), method=TrainModel.dino)
  glob = apply(setup, p, apply(setup, p, g_cls, method=TrainModel.to_teacher_width), method=TrainModel.dino)
  return got, local, glob


def test_distill_dino_student_views_exclude_the_global_crop_by_default():
  """TIPSv2 §3.1: distillation changes the teacher and the mask only; DINO's students stay the local crops."""
  setup, state, batch, frozen = distill_build()
  assert setup.config.distill.dino_global_crop is False
  got, local, _ = dino_student_logits(setup, state, batch, frozen)
  assert got.shape == local.shape
  close(got, local, 1e-4)


def test_distill_dino_global_crop_option_adds_it():
  setup, state, batch, frozen = distill_build(dino_global_crop=True)
  got, local, glob = dino_student_logits(setup, state, batch, frozen)
  assert got.shape == (local.shape[0] + 1,) + local.shape[1:]
  close(got[0], glob, 1e-4)
  close(got[1:], local, 1e-4)
  rows = [r for r in info.effective_weights(setup.config, setup.ctx) if r["pair"].startswith("dino")]
  assert "and the global crop" in rows[0]["pair"] and rows[0]["weight"] == pytest.approx(1 / 3, abs=1e-6)


def test_dino_global_crop_is_a_distillation_option():
  c = tiny("tipsv2")
  c.distill.dino_global_crop = True
  with pytest.raises(ConfigError, match=r"distill\.dino_global_crop=True is for recipe 'distill'"):
    config_validation.validate(c)


# --- item 9: stage 2 continues stage 1's teacher ---------------------------------------------------


def stage_config(data_dir, ema_mode, steps=2):
  c = tiny("tipsv2", batch_size=8, total_steps=steps)
  c.tokenizer = None
  c.max_len = 16
  c.model.text.update(dict(vocab_size=None, max_len=16))
  c.ema.mode = ema_mode
  c.data = defaults.data_config("shapes", data_dir=data_dir, caption_keys=("caption_detailed",))
  c.ckpt.update(dict(every_steps=steps, keep=1, async_save=False))
  c.export.enabled = False
  return c


@pytest.fixture(scope="module")
def stage1(tmp_path_factory, data_dir):
  """Two finished 2-step tipsv2 stage-1 workdirs: {'head': W, 'full': W}."""
  out = {}
  for mode in ("head", "full"):
    w = str(tmp_path_factory.mktemp(f"stage1_{mode}"))
    loop.train_and_evaluate(stage_config(data_dir, mode), w)
    out[mode] = w
  return out


def stage2_state(tmp_path, data_dir, init, ema_mode, init_teacher="continue"):
  """The state a stage-2 run starts from (the loop's restore_or_init on an empty workdir), at a higher
  resolution, as configs/tipsv2_g14_hires.py sets it up."""
  from tipsito.config import paper  # pylint: disable=import-outside-toplevel

  c = stage_config(data_dir, ema_mode)
  c = paper.high_resolution_stage(c, init=init, init_teacher=init_teacher)
  c.input.update(dict(global_size=64, local_size=32))  # 2x stage 1, whole patches
  config_validation.validate(c, num_devices=1)
  setup = step_lib.build(c)
  ckpt = checkpointing.Checkpointer(
    os.path.join(str(tmp_path), "checkpoints"), every_steps=0, keep=1, async_save=False
  )
  try:
    state, _ = loop.restore_or_init(setup, ckpt)
  finally:
    ckpt.close()
  return jax.device_get(state)


def assert_trees_equal(a, b):
  pa = jax.tree_util.tree_flatten_with_path(a)[0]
  lb = jax.tree.leaves(b)
  assert len(pa) == len(lb) and jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(pa, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def last_checkpoint(workdir):
  return jax.device_get(assembly.restore_latest(workdir, what="test")[1])


@pytest.mark.parametrize("mode", ["head", "full"])
def test_stage2_continues_the_stage1_teacher_bitwise(stage1, tmp_path, data_dir, mode):
  s1 = last_checkpoint(stage1[mode])
  want_keys = {"dino_head", "ibot_head"} | ({"image"} if mode == "full" else set())
  assert set(s1.ema) == want_keys
  # Stage 1's teacher is not a copy of its student and its centres are not zero: 'reset' would differ.
  assert any(
    not np.array_equal(x, y)
    for x, y in zip(jax.tree.leaves(s1.ema["dino_head"]), jax.tree.leaves(s1.params["dino_head"]))
  )
  assert all(np.any(c != 0) for c in s1.centers.values())
  s2 = stage2_state(tmp_path, data_dir, stage1[mode], mode)
  assert int(s2.step) == 0
  assert_trees_equal(s2.params, s1.params)
  assert_trees_equal(s2.ema, s1.ema)  # full-EMA stage 1 gives a full-EMA stage 2, EMA encoder included
  assert_trees_equal(s2.centers, s1.centers)


def test_stage2_reset_rebuilds_the_teacher_from_the_params(stage1, tmp_path, data_dir):
  s1 = last_checkpoint(stage1["head"])
  s2 = stage2_state(tmp_path, data_dir, stage1["head"], "head", init_teacher="reset")
  assert_trees_equal(s2.params, s1.params)
  assert_trees_equal(s2.ema, {k: s1.params[k] for k in ("dino_head", "ibot_head")})
  assert all(not np.any(c) for c in s2.centers.values())


def test_stage2_refuses_an_ema_mode_other_than_stage1s(stage1, data_dir):
  """The shipped stage-2 config after a full-EMA stage 1: `ema=head` (its default) is refused naming
  stage 1's mode; `ema=full` or `init_teacher=reset` validate."""
  w = stage1["full"]
  with pytest.raises(
    ConfigError,
    match=r"config\.ema\.mode='head'.*trained with ema\.mode='full'.*"
    r"--config\.ema\.mode=full.*ema=full.*init_teacher=reset",
  ):
    config_validation.validate(load_config("tipsv2_g14_hires.py", f"variant=B/14,init={w}"))
  for arg in (f"variant=B/14,init={w},ema=full", f"variant=B/14,init={w},init_teacher=reset"):
    config_validation.validate(load_config("tipsv2_g14_hires.py", arg))
  c = stage_config(data_dir, "full")
  c.init_from = stage1["head"]
  with pytest.raises(ConfigError, match=r"config\.ema\.mode='full'.*trained with ema\.mode='head'"):
    config_validation.validate(c)


# --- distillation ablation: the student image encoder initialised from the teacher -------------------


def test_distill_init_image_starts_the_student_from_the_teacher():
  """`distill.init_image` (TIPSv2 Table 2's pretrained-init ablation): the student's image params at step 0
  are the frozen teacher's, leaf for leaf; off (the paper's default), they are a random init."""
  probe, _, _, _ = distill_build()
  t_cfg = probe.teacher.image_config
  arch = {
    k: t_cfg[k]
    for k in ("width", "depth", "num_heads", "mlp_dim", "ffn", "patch_size", "num_cls_tokens", "posemb_grid")
  }
  teacher = jax.tree.map(np.asarray, dict(probe.teacher.params))

  def student(init_image):
    c = tiny("distill", image_size=28)
    c.model.image.update(arch)
    c.distill.teacher_image_npz = str(TIPS / "tiny_vit_mlp_vision.npz")
    c.distill.init_image = init_image
    config_validation.validate(c)
    setup, state, _ = build(c)
    return jax.tree.map(np.asarray, {k: v for k, v in state.params["image"].items() if k != "mask_token"})

  assert_trees_equal(student(True), teacher)
  random = student(False)
  assert jax.tree.structure(random) == jax.tree.structure(teacher)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(random), jax.tree.leaves(teacher)))


def test_distill_init_image_is_a_distillation_option():
  c = tiny("tipsv2")
  c.distill.init_image = True
  with pytest.raises(ConfigError, match=r"distill\.init_image=True is for recipe 'distill'"):
    config_validation.validate(c)
