"""Using what tipsito trains, training side: `export --step N`, `evaluate` on a step folder, and a Hugging
Face Tipsv2Model folder as `config.init_from` and as `distill.teacher`.

Why: a step other than the latest must give that step's weights (not the latest's), and a Tipsv2 folder
must start a run from exactly its towers (with the run's own mask token and heads) and give a teacher
that normalises pixels as the model was trained to.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors")

import tipsito  # noqa: E402
from interop_workdir import tiny_config, trained_workdir  # noqa: E402,F401  (session fixture)
from tipsito import evaluate  # noqa: E402
from tipsito.train import exporting  # noqa: E402
from tipsito.config import defaults  # noqa: E402
from tipsito.interop import hf_tipsv2  # noqa: E402
from tipsito.interop import sources  # noqa: E402
from tipsito.config import presets  # noqa: E402
from tipsito.train import assembly  # noqa: E402
from tipsito.train import checkpointing  # noqa: E402
from tipsito.train import loop  # noqa: E402
from tipsito.train import sharding  # noqa: E402
from tipsito.train import step as step_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flat(tree):
  from flax import traverse_util

  flat = traverse_util.flatten_dict(dict(jax.device_get(tree)), sep="/")
  return {k: np.asarray(v) for k, v in flat.items()}


def _same(a, b, drop=("mask_token",)):
  fa = {k: v for k, v in _flat(a).items() if k not in drop}
  fb = {k: v for k, v in _flat(b).items() if k not in drop}
  return sorted(fa) == sorted(fb) and all(fa[k].tobytes() == fb[k].tobytes() for k in fa)


def test_export_step_n_holds_that_step(trained_workdir, tmp_path):
  wd, _, params = trained_workdir
  assert not _same(params[1]["image"], params[2]["image"])  # the steps differ, so the test can tell
  enc = tipsito.load(exporting.export_from_workdir(str(wd), str(tmp_path / "e1"), step=1))
  assert enc.config["extra"]["step"] == 1 and enc.config["extra"]["image_size"] == 32
  assert _same(enc.params["image"], params[1]["image"]) and _same(enc.params["text"], params[1]["text"])
  hf = tmp_path / "hf1"  # the command line, another format
  subprocess.run(
    [
      sys.executable,
      "-m",
      "tipsito.export",
      f"--workdir={wd}",
      "--step=1",
      "--format=hf_tipsv2",
      f"--output={hf}",
    ],
    check=True,
    cwd=ROOT,
    capture_output=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
  )
  back = hf_tipsv2.read_hf_tipsv2(hf)
  assert _same(back["params"]["image"], params[1]["image"])
  assert _same(back["params"]["text"], params[1]["text"])
  with pytest.raises(FileNotFoundError, match=r"step 7.*\[1, 2\]"):
    exporting.export_from_workdir(str(wd), str(tmp_path / "e7"), step=7)


def test_evaluate_on_a_step_folder(trained_workdir, tmp_path):
  import ml_collections as mlc
  from tipsito.data import convert
  from tipsito.evals import registry

  wd, _, params = trained_workdir
  enc, kind = evaluate.load_encoder(None, str(wd / "checkpoints" / "1"))
  assert kind == "train" and _same(enc.params["image"], params[1]["image"])
  latest, _ = evaluate.load_encoder(None, str(wd / "checkpoints"))
  assert _same(latest.params["image"], params[2]["image"])
  data = tmp_path / "data"
  convert.convert(
    "shapes",
    str(data),
    config_name="tiny",
    image_size=32,
    split_sizes={"train": 8, "test": 8},
    num_workers=1,
    verbose=False,
  )
  cfg = mlc.ConfigDict(
    {
      "evals": registry.builtin_evals(
        "shapes/tiny", data_dir=str(data), image_size=32, batch_size=8, num_pictures=0
      ),
      "tokenizer": None,
    }
  )
  quiet = lambda *a: None  # noqa: E731
  step1 = evaluate.evaluate(cfg, str(wd / "checkpoints" / "1"), only=["shapes_zeroshot"], print_fn=quiet)
  export1 = exporting.export_from_workdir(str(wd), str(tmp_path / "e1"), step=1)
  same = evaluate.evaluate(cfg, export1, only=["shapes_zeroshot"], print_fn=quiet)
  assert step1["kind"] == "train" and same["kind"] == "export"
  assert step1["metrics"] == same["metrics"] and "shapes_zeroshot/top1" in step1["metrics"]


@pytest.fixture(scope="module")
def trained_hf(trained_workdir, tmp_path_factory):
  wd, _, _ = trained_workdir
  out = tmp_path_factory.mktemp("hf")
  sources.write(exporting.model_from_workdir(str(wd)), out, "hf_tipsv2")
  return out


@pytest.mark.parametrize("scan", [False, True])
def test_init_from_a_tipsv2_folder(trained_workdir, trained_hf, tmp_path, scan):
  _, _, params = trained_workdir
  c = tiny_config()
  c.init_from = str(trained_hf)
  c.model.image.scan = scan
  setup = step_lib.build(c, sharding.make_mesh(c.mesh, jax.devices()[:1]))
  fresh = setup.init_state().params
  ckpt = checkpointing.Checkpointer(
    str(tmp_path / "w" / "checkpoints"), every_steps=1, keep=1, async_save=False
  )
  state, _ = loop.restore_or_init(setup, ckpt)
  ckpt.close()
  got = jax.device_get(state.params)
  if scan:  # the run's layout: per-layer weights stacked
    from tipsito.models import layer_stack

    assert layer_stack.is_stacked(got["image"])
    got = dict(got, image=layer_stack.unstack_tower(got["image"]))
  assert _same(got["image"], params[2]["image"]) and _same(got["text"], params[2]["text"])
  np.testing.assert_array_equal(got["image"]["mask_token"], jax.device_get(fresh["image"]["mask_token"]))
  assert _same(got["dino_head"], fresh["dino_head"]) and not _same(got["dino_head"], params[2]["dino_head"])
  temperature = 1.0 / np.exp(np.float64(params[2]["logit_scale"]))
  np.testing.assert_allclose(float(got["logit_scale"]), np.log(1.0 / temperature), rtol=1e-6)


def test_init_from_a_tipsv2_folder_of_another_architecture_fails(trained_hf):
  c = tiny_config()
  c.init_from = str(trained_hf)
  c.model.image.mlp_dim = 96
  setup = step_lib.build(c, sharding.make_mesh(c.mesh, jax.devices()[:1]))
  abstract = setup.state_shapes.params  # fails on the shapes, before any array is made
  with pytest.raises(
    hf_tipsv2.CheckpointFormatError,
    match=r"image/block_0/mlp/Dense_0/\w+ has shape \((64, )?128,?\) in the folder, "
    r"\((64, )?96,?\) in this run",
  ):
    hf_tipsv2.init_train_params(c.init_from, abstract, abstract)


def test_distillation_teacher_from_a_tipsv2_folder(trained_workdir, trained_hf):
  _, _, params = trained_workdir
  c = defaults.tiny_config("distill", image_size=32)
  c.model.image.update(dict(patch_size=8, depth=1, posemb_grid=4))
  c.distill.teacher = str(trained_hf)
  setup = assembly.build(c, sharding.make_mesh(c.mesh, jax.devices()[:1]))
  t = setup.teacher
  assert "Tipsv2" in t.source and t.heads is None  # encoders only: the heads are the EMA fallback
  assert _same(t.params, params[2]["image"]) and _same(t.text_params, params[2]["text"])
  # The teacher normalises pixels as the model was trained (the statistics of preprocessor_config.json).
  np.testing.assert_allclose(t.image_config["pixel_mean"], presets.CLIP_PIXEL_MEAN, rtol=1e-7)
  np.testing.assert_allclose(t.image_config["pixel_std"], presets.CLIP_PIXEL_STD, rtol=1e-7)
  geometry = tuple(t.image_config[k] for k in ("patch_size", "posemb_grid", "num_cls_tokens"))
  assert geometry == (8, 4, 2)
