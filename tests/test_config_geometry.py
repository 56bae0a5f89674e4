"""Model and input geometry is validated before anything compiles, naming the key and the allowed values.

Why: these settings used to be accepted and then failed deep inside Flax or Orbax (patch size 0, a width
the heads do not divide, a global or local training crop that is not whole patches, negative counts,
keeping 0 checkpoints).
"""

import importlib.util
import pathlib

import pytest

from tipsito.config import validation as config_validation
from tipsito.config.validation import ConfigError

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def demo(arg="steps=2"):
  spec = importlib.util.spec_from_file_location("cfg_demo_geometry", CONFIGS / "demo.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def _set(c, key, value):
  *path, last = key.split(".")
  node = c
  for p in path:
    node = node[p]
  node[last] = value


# (key, bad value, a good value, words the message must contain). The first five are the cases.
CASES = [
  ("model.image.patch_size", 0, 8, ["config.model.image.patch_size=0", "integer >= 1"]),
  (
    "model.image.width",
    63,
    64,
    ["config.model.image.width=63", "config.model.image.num_heads=4", "60 or 64"],
  ),
  (
    "input.global_size",
    30,
    32,
    ["config.input.global_size=30", "config.model.image.patch_size=8", "24 or 32"],
  ),
  ("input.num_local", -1, 0, ["config.input.num_local=-1", "integer >= 0"]),
  ("ckpt.keep", 0, 1, ["config.ckpt.keep=0", "integer >= 1"]),
  ("model.image.depth", 0, 1, ["config.model.image.depth=0", "integer >= 1"]),
  ("model.text.width", 66, 64, ["config.model.text.width=66", "num_heads"]),
  ("model.fusion.width", 30, 32, ["config.model.fusion.width=30", "model.fusion.num_heads=4"]),
  ("model.heads.num_prototypes", 0, 16, ["config.model.heads.num_prototypes=0"]),
  ("input.local_size", 4, 16, ["config.input.local_size=4", "integer >= 8"]),
  ("input.num_workers", -2, 0, ["config.input.num_workers=-2", "integer >= 0"]),
  ("input.num_epochs", 0, 1, ["config.input.num_epochs=0", "None or an integer >= 1"]),
  ("log_every_steps", 0, 1, ["config.log_every_steps=0"]),
  ("ckpt.every_steps", -1, 0, ["config.ckpt.every_steps=-1"]),
]


@pytest.mark.parametrize("key,bad,good,words", CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_bad_geometry_names_key_and_allowed_values(key, bad, good, words):
  c = demo()
  _set(c, key, good)
  config_validation.validate(c, num_devices=1)  # the good value is accepted
  c = demo()
  _set(c, key, bad)
  with pytest.raises(ConfigError) as e:
    config_validation.validate(c, num_devices=1)
  for w in words:
    assert w in str(e.value), (w, str(e.value))


def test_local_crops_must_be_whole_patches():
  """A local crop the ViT would centre zero-pad (20 px at patch 8 -> 24 px, a black frame the teacher never
  sees) is refused like the global crop; so, since issue 44, is an eval image size that is not whole
  patches (tests/test_eval_config_validation.py)."""
  c = demo()
  c.input.local_size = 20  # patch 8
  with pytest.raises(
    ConfigError,
    match=r"config\.input\.local_size=20 must be a multiple of "
    r"config\.model\.image\.patch_size=8.*16 or 24",
  ):
    config_validation.validate(c, num_devices=1)
  c.input.local_size = 24
  config_validation.validate(c, num_devices=1)
  c.evals.zeroshot.image_size = 60  # an eval size that is not whole patches: refused before training
  with pytest.raises(ConfigError, match=r"config\.evals\.zeroshot\.image_size=60"):
    config_validation.validate(c, num_devices=1)
