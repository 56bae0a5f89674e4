"""Scanned towers (`model.*.scan`) equal the unrolled ones; checkpoints convert both ways.

Why: scanning is only a compile-time change (one block body instead of `depth`), so a scanned tower fed
the stacked params of an unrolled one must give the same outputs and the same gradients (stacked), for
every remat policy; and the per-layer formats (export, TIPS import) must round-trip exactly through
`tipsito.models.layer_stack`.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tipsito.config import validation as config_validation
from tipsito.models import TextEncoder, VisionTransformer, layer_stack, text_config, vit_config

KEY = jax.random.PRNGKey(0)


def _fill(shapes):
  """Random non-trivial params of the given abstract tree (no compiled init)."""
  rng = np.random.default_rng(0)
  return jax.tree_util.tree_map_with_path(
    lambda p, s: jnp.asarray(rng.normal(0.0, 0.1, s.shape) + ("'scale'" in jax.tree_util.keystr(p)), s.dtype),
    shapes,
  )


def _params(m, *args, **kw):
  return _fill(jax.eval_shape(lambda k, *a: m.init(k, *a, **kw), KEY, *args))["params"]


def _images(b=2, h=32, w=48):
  return jax.random.randint(jax.random.PRNGKey(1), (b, h, w, 3), 0, 256).astype(jnp.uint8)


@pytest.mark.parametrize(
  "remat,policy", [(False, "nothing_saveable"), (True, "nothing_saveable"), (True, "dots_saveable")]
)
def test_vit_scan_forward_and_grads_equal_unrolled(remat, policy):
  cfg = vit_config("tiny/16", depth=3, num_cls_tokens=2, posemb_grid=4, use_mask_token=True)
  x = _images()
  mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.5, (2, 2, 3))
  unrolled = VisionTransformer(**cfg)
  scanned = VisionTransformer(**dict(cfg, scan=True, remat=remat, remat_policy=policy))
  p = _params(unrolled, x, mask=mask)
  ps = layer_stack.stack_tower(p)
  # The stacked tree is exactly the tree the scanned module creates.
  assert jax.tree.structure(ps) == jax.tree.structure(_params(scanned, x, mask=mask))
  assert ps["blocks"]["attn"]["query"]["kernel"].shape == (3, 64, 4, 16)

  def loss(params, mod):
    o = mod.apply({"params": params}, x, mask=mask, return_values=True)
    return jnp.sum(o["cls"] ** 2) + jnp.sum(o["values"] * o["patches"]), o

  vg = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (l1, o1), g1 = vg(p, unrolled)
  (l2, o2), g2 = vg(ps, scanned)
  chex.assert_trees_all_close(o1, o2, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  chex.assert_trees_all_close(layer_stack.stack_tower(g1), g2, rtol=1e-4, atol=1e-5)
  # The gradient really differs per layer (a broadcast or shared-layer bug would make them equal).
  gq = np.asarray(g2["blocks"]["attn"]["query"]["kernel"])
  assert not np.allclose(gq[0], gq[1])


@pytest.mark.parametrize("flavour", ["tips", "clip"])
def test_text_scan_forward_and_grads_equal_unrolled(flavour):
  cfg = text_config(
    "tiny", flavour=flavour, vocab_size=50, max_len=8, depth=3, out_dim=32 if flavour == "clip" else None
  )
  ids = jnp.array([[3, 4, 5, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
  unrolled, scanned = TextEncoder(**cfg), TextEncoder(**dict(cfg, scan=True, remat=True))
  p = _params(unrolled, ids)
  ps = layer_stack.stack_tower(p)

  def loss(params, mod):
    o = mod.apply({"params": params}, ids)
    return jnp.sum(o["pooled"] ** 2) + jnp.sum(o["tokens"][:, :, :4]), o["pooled"]

  vg = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (l1, o1), g1 = vg(p, unrolled)
  (l2, o2), g2 = vg(ps, scanned)
  np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  chex.assert_trees_all_close(layer_stack.stack_tower(g1), g2, rtol=1e-4, atol=1e-5)


def test_scan_stochastic_depth_rates_per_layer():
  """Scanned stochastic depth: per-layer rates 0..max as in the unrolled tower (layer 0 never dropped)."""
  cfg = vit_config("tiny/16", depth=2, posemb_grid=2, stochastic_depth=0.999)
  x = _images(8, 32, 32)
  m = VisionTransformer(**dict(cfg, scan=True))
  p = _params(m, x)
  eval_out = m.apply({"params": p}, x)["cls"]
  train_out = m.apply({"params": p}, x, train=True, rngs={"dropout": jax.random.PRNGKey(5)})["cls"]
  # Rate 0.999 on the last layer: its residual branches are (almost surely) dropped for every example,
  # so train output = output of block 0 only, != eval output.
  assert not np.allclose(eval_out, train_out, atol=1e-4)
  p1 = dict(p, blocks=jax.tree.map(lambda a: a[:1], p["blocks"]))
  one = VisionTransformer(**dict(cfg, scan=True, depth=1)).apply({"params": p1}, x)["cls"]
  np.testing.assert_allclose(train_out, one, rtol=1e-5, atol=1e-5)


def test_layer_stack_round_trip_and_errors():
  rng = np.random.default_rng(0)
  tower = {
    f"block_{i}": {"attn": {"kernel": rng.normal(size=(4, 3))}, "norm1": {"scale": rng.normal(size=3)}}
    for i in range(3)
  }
  tower["norm"] = {"scale": np.ones(3)}
  st = layer_stack.stack_tower(tower)
  assert set(st) == {"blocks", "norm"} and st["blocks"]["attn"]["kernel"].shape == (3, 4, 3)
  back = layer_stack.unstack_tower(st)
  chex.assert_trees_all_equal(back, tower)
  # Whole-model helpers only touch the towers, and are idempotent.
  full = {"image": tower, "text": tower, "dino_head": {"w": np.ones(2)}}
  stacked = layer_stack.to_layout(full, {"image": True, "text": False})
  assert layer_stack.is_stacked(stacked["image"]) and not layer_stack.is_stacked(stacked["text"])
  chex.assert_trees_all_equal(layer_stack.to_layout(stacked, {"image": True}), stacked)
  chex.assert_trees_all_equal(layer_stack.to_per_layer(stacked), full)
  with pytest.raises(ValueError, match="0..1"):
    layer_stack.stack_tower({"block_0": tower["block_0"], "block_2": tower["block_2"]})
  with pytest.raises(ValueError, match="no block_"):
    layer_stack.stack_tower({"norm": {}})


def test_scanned_training_model_exports_per_layer(tmp_path):
  """A scanned recipe trains with stacked params; its export is per-layer (same tree as an unrolled
  model's), loads into the plain inference encoder and gives the training model's outputs."""
  from tipsito import export_format, inference
  from tipsito.train import exporting
  from tipsito.train import step as step_lib
  from tipsito.config import defaults

  c = defaults.tiny_config("clip", image_size=32)
  for tower in ("image", "text"):
    c.model[tower].update(dict(scan=True, remat=True, remat_policy="dots_saveable"))
  config_validation.validate(c)
  setup = step_lib.build(c)
  params = _fill(setup.state_shapes.params)
  assert layer_stack.is_stacked(params["image"]) and layer_stack.is_stacked(params["text"])
  exported = exporting.export_params(params)
  c.model.image.scan = c.model.text.scan = False
  plain = step_lib.build(c).state_shapes.params
  assert jax.tree.structure(exported) == jax.tree.structure(
    {k: plain[k] for k in export_format.ALLOWED_EXPORT_KEYS}
  )
  img_cfg, txt_cfg = exporting.export_configs(setup)
  assert img_cfg["scan"] is False and txt_cfg["scan"] is False
  enc = inference.Encoder.from_params(img_cfg, txt_cfg, exported, 1.0)
  x = _images(2, 32, 32)
  want = setup.model.apply({"params": params}, x, method=setup.model.encode_image)
  got = enc.embed_images(x, values=False, project=False)  # raw tower output (CLIP-style default: projected)
  np.testing.assert_allclose(got["cls"], want["cls"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["patches"], want["patches"], rtol=1e-5, atol=1e-5)
  # And back: the per-layer export loads into the scanned training layout bit-exactly.
  again = layer_stack.to_layout(exported, {"image": True, "text": True})
  chex.assert_trees_all_equal(again["text"], jax.device_get(params["text"]))


def test_remat_policy_is_validated():
  with pytest.raises(ValueError, match="dots_saveable"):
    VisionTransformer(**vit_config("tiny/16", remat=True, remat_policy="dots")).init(KEY, _images(1, 16, 16))
  from tipsito.config import defaults

  c = defaults.tiny_config("clip")
  c.model.image.remat_policy = "dots"
  with pytest.raises(config_validation.ConfigError, match="model.image.remat_policy"):
    config_validation.validate(c)
