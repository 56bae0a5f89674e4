"""`python -m tipsito.dense.train` (tipsito/dense/train.py): a DPT head learns a separable toy far above
chance on a frozen random tower, a resumed run equals the uninterrupted one bitwise, and the export opens
in transformers with the trained head's outputs.

Why a toy: every 8 x 8 cell is red or blue (tipsito/dense/data.py toy_split), one patch of the tower, so
any working readout -> reassemble -> fusion -> decoder path can separate it; a head that does not train
(or reads the wrong tokens) stays at chance (50% pixel accuracy).
"""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors")

from dense_fixtures import CFG, TOWER, random_head, random_tower  # noqa: E402
from tipsito.dense import train
from tipsito.models import dpt  # noqa: E402
from tipsito.interop import hf_dpt  # noqa: E402
from tipsito.models import kwargs as kwargs_lib  # noqa: E402
from tipsito.models.vit import VisionTransformer  # noqa: E402

import dataclasses  # noqa: E402
import jax.numpy as jnp  # noqa: E402

SMALL = dataclasses.replace(CFG, num_labels=2, num_depth_bins=16)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
  """A random tower with a random depth head, as a tipsv2_dpt folder (the released heads' format)."""
  icfg, _ = kwargs_lib.complete_tower_config(TOWER, "image", "test")
  vit = VisionTransformer(**kwargs_lib.module_kwargs(icfg, VisionTransformer))
  x = jnp.zeros((1, 32, 32, 3), jnp.uint8)
  tower = random_tower(vit, x, 1)
  blocks = vit.apply({"params": tower}, x, return_blocks=SMALL.stages(4))["blocks"]
  head = random_head(SMALL, "depth", blocks, 2)
  folder = tmp_path_factory.mktemp("enc")
  hf_dpt.write_hf_dpt(folder, image_config=icfg, image_params=tower, cfg=SMALL, heads={"depth": head})
  return str(folder)


def _args(encoder, workdir, *extra):
  return train.parse_args(
    [
      "--encoder",
      encoder,
      "--workdir",
      str(workdir),
      "--data",
      "toy",
      "--image_size",
      "32",
      "--train_examples",
      "64",
      "--eval_examples",
      "16",
      "--batch_size",
      "8",
      "--log_every",
      "10",
      "--lr",
      "3e-3",
      *extra,
    ]
  )


def test_learns_separable_toy_far_above_chance(encoder, tmp_path, capsys):
  final = train.train(
    _args(encoder, tmp_path, "--task", "segmentation", "--steps", "60", "--ckpt_every", "0")
  )
  assert final["pixel_acc"] > 95.0, final  # chance 50%
  out = capsys.readouterr().out
  assert "step 60/60 |" in out and "it/s" in out and "loss" in out
  assert json.loads((tmp_path / "eval.json").read_text())["final"]["pixel_acc"] == final["pixel_acc"]


def test_resume_equals_uninterrupted(encoder, tmp_path):
  common = ("--task", "depth", "--steps", "6", "--ckpt_every", "3")
  a = train.train(_args(encoder, tmp_path / "a", *common))
  assert train.train(_args(encoder, tmp_path / "b", *common, "--stop_at", "3")) == {}
  b = train.train(_args(encoder, tmp_path / "b", *common))
  assert a == b  # every metric equal: the resumed run computed the same head
  with pytest.raises(SystemExit, match="lr"):
    train.train(_args(encoder, tmp_path / "b", *common, "--lr", "1e-2"))
