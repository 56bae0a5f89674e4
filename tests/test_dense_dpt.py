"""DPT heads (tipsito/models/dpt.py) against transformers' `Tipsv2Dpt*`, and the `tipsv2_dpt` folder round trip.

Why: a head trained in tipsito is only useful elsewhere if transformers computes the same function from the
exported folder, and a released head only if tipsito reads it exactly. Random weights everywhere (every
bias and kernel drawn, none left at its zero init) so that a transposed kernel, a swapped fusion input,
a wrong interpolation mode or a missing readout shows as a large difference; pixel values are fed to HF
directly (its image processor needs torchvision).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tipsito.models import dpt  # noqa: E402
from tipsito.interop import hf_dpt  # noqa: E402
from tipsito.models import kwargs as kwargs_lib  # noqa: E402
from tipsito.models.vit import VisionTransformer  # noqa: E402
from dense_fixtures import CFG, TOWER, random_head, random_tower  # noqa: E402

# Max abs difference HF vs tipsito, float32 on CPU: depth in metres (0.001-10 m bins), normals and logits
# of unit scale. Measured: ~1e-6 (depth) and ~1e-6 (normals / logits); the bound leaves float headroom.
TOL = {"depth": 1e-4, "normals": 1e-4, "segmentation": 1e-4}
HF_CLASSES = {
  "depth": "Tipsv2DptForDepthEstimation",
  "normals": "Tipsv2DptForNormalEstimation",
  "segmentation": "Tipsv2DptForSemanticSegmentation",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """A random tower, three random heads, their outputs in tipsito, and the exported folder."""
  icfg, _ = kwargs_lib.complete_tower_config(TOWER, "image", "test")
  vit = VisionTransformer(**kwargs_lib.module_kwargs(icfg, VisionTransformer))
  images = np.random.default_rng(0).integers(0, 256, (2, 40, 48, 3), dtype=np.uint8)  # 5 x 6 patches
  tower = random_tower(vit, images, 1)
  blocks = vit.apply({"params": tower}, jnp.asarray(images), return_blocks=CFG.stages(4))["blocks"]
  heads, ours = {}, {}
  for i, task in enumerate(dpt.TASKS):
    heads[task] = random_head(CFG, task, blocks, 10 + i)
    ours[task] = np.asarray(dpt.predict(CFG, task, heads[task], blocks))
  folder = tmp_path_factory.mktemp("dpt") / "hf"
  hf_dpt.write_hf_dpt(folder, image_config=icfg, image_params=tower, cfg=CFG, heads=heads)
  pixels = np.asarray(vit.apply({"params": tower}, jnp.asarray(images), method=vit.preprocess))
  return dict(icfg=icfg, tower=tower, heads=heads, ours=ours, folder=folder, pixels=pixels)


def _hf(cls_name, folder, pixels):
  m, info = getattr(transformers, cls_name).from_pretrained(
    folder, local_files_only=True, output_loading_info=True
  )
  assert not info["missing_keys"], info["missing_keys"]
  assert not info["mismatched_keys"], info["mismatched_keys"]
  x = torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)))
  with torch.no_grad():
    return m.eval()(pixel_values=x)


def _hf_task_output(task, out):
  """HF outputs in tipsito's layout: depth (B,H,W); normals / logits NCHW -> NHWC."""
  if task == "depth":
    return out.predicted_depth.numpy()
  t = out.normals if task == "normals" else out.logits
  return t.numpy().transpose(0, 2, 3, 1)


@pytest.mark.parametrize("task", dpt.TASKS)
def test_parity_per_task_class(model, task):
  out = _hf_task_output(task, _hf(HF_CLASSES[task], model["folder"], model["pixels"]))
  ours = model["ours"][task]
  # 5 x 6 patches: the 0.5x map has ceil(5 / 2) = 3 rows, upsampled to 6 > 5, so the map is 48 x 48.
  assert out.shape == ours.shape == ((2, 48, 48) if task == "depth" else (2, 48, 48, ours.shape[-1]))
  assert np.abs(out).max() > 1e-2 and np.abs(out).max() < 1e3  # a real signal of a sane scale
  np.testing.assert_allclose(ours, out, atol=TOL[task], rtol=0)


def test_parity_dense_prediction(model):
  """`Tipsv2DptForDensePrediction` runs all three heads of the same folder."""
  out = _hf("Tipsv2DptForDensePrediction", model["folder"], model["pixels"])
  np.testing.assert_allclose(model["ours"]["depth"], out.predicted_depth.numpy(), atol=TOL["depth"], rtol=0)
  np.testing.assert_allclose(
    model["ours"]["normals"], out.normals.numpy().transpose(0, 2, 3, 1), atol=TOL["normals"], rtol=0
  )
  np.testing.assert_allclose(
    model["ours"]["segmentation"],
    out.segmentation_logits.numpy().transpose(0, 2, 3, 1),
    atol=TOL["segmentation"],
    rtol=0,
  )


def test_round_trip_bit_exact(model, tmp_path):
  r = hf_dpt.read_hf_dpt(model["folder"])
  assert r["dpt_config"] == CFG
  for k in TOWER:
    assert r["image_config"][k] == model["icfg"][k], k
  flat = lambda t: {"/".join(map(str, p)): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(t)}
  for ours, back in [(model["tower"], r["image_params"])] + [
    (model["heads"][t], r["heads"][t]) for t in dpt.TASKS
  ]:
    a, b = flat(ours), flat(back)
    assert sorted(a) == sorted(b)
    for k in a:
      assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
  # ... and writing what was read gives the same bytes.
  hf_dpt.write_hf_dpt(
    tmp_path,
    image_config=r["image_config"],
    image_params=r["image_params"],
    cfg=r["dpt_config"],
    heads=r["heads"],
  )
  assert (tmp_path / "model.safetensors").read_bytes() == (model["folder"] / "model.safetensors").read_bytes()


def test_strict_reading(model, tmp_path):
  """A tensor too many or a head of the wrong shape is refused with its name."""
  import safetensors.numpy as st

  state = st.load_file(str(model["folder"] / "model.safetensors"))
  cfg = json.loads((model["folder"] / "config.json").read_text())
  bad = dict(state, **{"depth_head.extra.weight": np.zeros(3, np.float32)})
  st.save_file(bad, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf_dpt.CheckpointFormatError, match="depth_head.extra.weight"):
    hf_dpt.read_hf_dpt(tmp_path)
  cfg["fusion_hidden_size"] = 8
  st.save_file(state, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf_dpt.CheckpointFormatError, match="expected"):
    hf_dpt.read_hf_dpt(tmp_path)


def test_interp_matrix_matches_torch():
  """The bilinear resampling of both modes the decoder uses, against torch.nn.functional.interpolate."""
  x = np.random.default_rng(0).normal(size=(1, 5, 7, 2)).astype(np.float32)
  for size, ac in (((10, 14), True), ((6, 9), False), ((3, 4), False)):
    ref = torch.nn.functional.interpolate(
      torch.from_numpy(x.transpose(0, 3, 1, 2)), size=size, mode="bilinear", align_corners=ac
    )
    got = np.asarray(dpt.resize(jnp.asarray(x), size, ac))
    np.testing.assert_allclose(got, ref.numpy().transpose(0, 2, 3, 1), atol=1e-6)


def test_return_blocks_leaves_outputs_unchanged():
  icfg, _ = kwargs_lib.complete_tower_config(TOWER, "image", "test")
  vit = VisionTransformer(**kwargs_lib.module_kwargs(icfg, VisionTransformer))
  x = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8))
  p = random_tower(vit, x, 3)
  plain = vit.apply({"params": p}, x)
  both = vit.apply({"params": p}, x, return_blocks=(0, 4))
  np.testing.assert_array_equal(plain["patches"], both["patches"])
  np.testing.assert_array_equal(plain["patches"], both["blocks"][1]["patches"])  # stage 4 = the last block
  with pytest.raises(ValueError, match="stages in 0..4"):
    vit.apply({"params": p}, x, return_blocks=(5,))


def test_config_errors_name_the_fix():
  with pytest.raises(ValueError, match="repeat a stage"):
    dpt.DPTConfig().stages(2)  # 4 inputs from a 2-block tower: (0, 1, 2, 2), which transformers refuses
  assert dpt.DPTConfig().stages(12) == (3, 6, 9, 12)
  with pytest.raises(ValueError, match="reassemble_factors"):
    dpt.DPTConfig(neck_hidden_sizes=(8, 16, 32))
  with pytest.raises(hf_dpt.NotRepresentableError, match="cls_posemb"):
    hf_dpt.tower_to_hub(dict(TOWER, cls_posemb=True), {})
