"""Every shipped config loads and validates; wrong keys/values fail before compiling, naming the key and
what is allowed.

Why: config mistakes must cost seconds on a laptop, never a pod allocation.
"""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tipsito.config import validation as config_validation
from tipsito.data import prepare as data_prepare
from tipsito.config.validation import ConfigError

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
PAPER = {
  "demo.py": [None, "recipe=tipsv2", "recipe=clip", "data=scenes", "data=shapes", "data=scenes,recipe=clip"],
  "tipsv2_g14.py": [None, "variant=B/14", "variant=B/14,ema=full"],
  "tipsv2_g14_hires.py": [None, "init=/tmp/stage1"],
  "tipsv2_distill.py": ["student=B", "student=L", "student=So400m"],
  "tipsv2_distill_hires.py": ["student=B,init=/tmp/distill1", "student=L"],
  "ito_b16.py": [f"data={d}" for d in ("cc3m", "cc12m", "yfcc15m", "laion100m", "datacomp1b")],
  "ito_l16.py": [None],
  "clip_b16.py": [None],
  "siglip_b16.py": [None],
  "tipsito_b16.py": [None],
}


def load(name, arg=None):
  spec = importlib.util.spec_from_file_location(f"cfg_{name[:-3]}", CONFIGS / name)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


@pytest.mark.parametrize("name,arg", [(n, a) for n, args in PAPER.items() for a in args])
def test_config_validates(name, arg):
  c = load(name, arg)
  config_validation.validate(c)
  if name == "demo.py":  # the paper configs need the tokenizer they are sized for (not shipped): see below
    data_prepare.check_tokenizer(c)


@pytest.mark.parametrize(
  "name,vocab",
  [
    ("tipsv2_g14.py", 32000),
    ("tipsv2_distill.py", 32000),
    ("ito_b16.py", 49408),
    ("clip_b16.py", 49408),
    ("siglip_b16.py", 32000),
    ("tipsito_b16.py", 32000),
  ],
)
def test_paper_config_refuses_the_demo_tokenizer(name, vocab):
  """The paper configs size the text embedding for the official tokenizers; left at the 2k demo model
  they fail the checks before training (tipsito/data/prepare.py `check_tokenizer`) with both numbers instead
  of training on 2k of the rows."""
  from tipsito.data import tokenizer as tok_lib

  c = load(name)
  demo = tok_lib.Tokenizer(None, flavour=c.model.text.flavour).vocab_size  # 'clip': + SOT/EOT
  assert c.tokenizer is None and c.model.text.vocab_size == vocab
  with pytest.raises(
    ConfigError,
    match=rf"config\.tokenizer=None.*vocabulary of {demo}\b.* but "
    rf"config\.model\.text\.vocab_size={vocab}",
  ):
    data_prepare.check_tokenizer(c)
  c.model.text.vocab_size = None  # ... or take the size from the tokenizer
  data_prepare.check_tokenizer(c)
  c.tokenizer = "/nonexistent/sp32k.model"
  with pytest.raises(ConfigError, match=r"config\.tokenizer='/nonexistent/sp32k.model'.*not found"):
    data_prepare.check_tokenizer(c)


def test_paper_settings():
  c = load("tipsv2_g14.py")
  assert c.recipe == "tipsv2" and c.ema.mode == "head" and c.optim.name == "adafactor"
  assert dict(c.loss) == {"clip": 1.0, "dino": 1.0, "ibot": 2.0, "koleo": 0.0}
  assert c.loss_opts.ibot_all_patches and c.input.mask_ratio == 0.75
  assert (c.input.global_size, c.input.local_size, c.input.num_local) == (224, 98, 6)
  assert (c.total_steps, c.input.batch_size) == (90000, 8192)
  assert c.model.image.num_cls_tokens == 2 and c.model.image.ffn == "swiglu"
  h = load("tipsv2_g14_hires.py", "init=/x")
  assert (h.input.global_size, h.input.local_size, h.total_steps, h.input.batch_size) == (
    448,
    140,
    9000,
    4096,
  )
  assert h.init_from == "/x"
  i = load("ito_b16.py", "data=cc3m")
  assert dict(i.loss) == {"clip": 0.5, "clip_view2": 0.5, "fusion": 2.0} and i.optim.name == "adamw"
  assert (i.optim.b1, i.optim.b2, i.optim.eps, i.optim.weight_decay) == (0.9, 0.98, 1e-6, 0.1)
  d = load("tipsv2_distill.py", "student=L")
  assert d.input.mask_ratio == 0.0 and d.model.image.width == 1024
  assert d.loss.feature == 0.0 and d.optim.name == "adafactor" and d.optim.momentum_dtype == "bfloat16"
  dh = load("tipsv2_distill_hires.py", "student=L,init=/d1,teacher=/t")
  assert (dh.input.global_size, dh.input.local_size, dh.total_steps, dh.input.batch_size) == (
    448,
    140,
    9000,
    4096,
  )
  assert dh.init_from == "/d1" and dh.distill.teacher == "/t" and dh.recipe == "distill"
  assert dh.model.image.width == 1024 and dh.optim.lr == 2e-4


def test_wrong_key_names_key_and_valid_keys():
  c = load("demo.py")
  c.unlock()
  c.loss_typo = 1
  with pytest.raises(ConfigError, match=r"loss_typo.*valid keys.*recipe"):
    config_validation.validate(c)
  c = load("demo.py")
  c.optim.unlock()
  c.optim.learning_rate = 1.0
  with pytest.raises(ConfigError, match=r"optim\.learning_rate.*valid keys.*'lr'"):
    config_validation.validate(c)


@pytest.mark.parametrize(
  "key,value,match",
  [
    ("recipe", "tipsv3", r"config\.recipe='tipsv3'.*valid values.*'tipsv2'"),
    ("input.views", "multicrops", r"config\.input\.views='multicrops'.*'multicrop_two_views'"),
    ("ema.mode", "encoder", r"config\.ema\.mode='encoder'.*\['head', 'full', 'none'\]"),
    ("optim.name", "lamb", r"config\.optim\.name='lamb'.*'adafactor'"),
    ("input.mask_type", "grid", r"mask_type='grid'.*\['random', 'block'\]"),
    ("model.image.ffn", "geglu", r"ffn='geglu'.*\['mlp', 'swiglu'\]"),
  ],
)
def test_wrong_value_names_key_and_allowed(key, value, match):
  c = load("demo.py")
  node = c
  *path, last = key.split(".")
  for p in path:
    node = node[p]
  with node.ignore_type():
    node[last] = value
  with pytest.raises(ConfigError, match=match):
    config_validation.validate(c)


def test_loss_term_not_in_recipe():
  c = load("demo.py", "recipe=clip")
  c.loss.unlock()
  c.loss.ibot = 1.0
  with pytest.raises(ConfigError, match=r"loss\.ibot.*recipe 'clip'.*\['clip'\]"):
    config_validation.validate(c)


def test_two_view_terms_need_two_views():
  c = load("demo.py")
  c.input.views = "multicrop"
  with pytest.raises(ConfigError, match=r"views='multicrop'.*second view"):
    config_validation.validate(c)


def test_mesh_and_batch_checked():
  c = load("demo.py")
  c.input.batch_size = 30
  c.mesh.update(dict(data=1, fsdp=-1))
  with pytest.raises(ConfigError, match=r"batch_size=30.*divisible"):
    config_validation.validate(c, num_devices=8)


def test_config_arg_errors():
  with pytest.raises(ValueError, match=r"student='H'.*\['B', 'L', 'So400m'\]"):
    load("tipsv2_distill.py", "student=H")
  with pytest.raises(ValueError, match=r"key 'stepz' unknown.*'steps'"):
    load("demo.py", "stepz=3")


def test_pipeline_keys_are_declared_and_reach_the_pipeline():
  """Every knob the input pipeline reads is a declared config key (so validation accepts it) and is used."""
  from tipsito.data import pipeline

  c = load("demo.py")
  c.input.global_crop_scale = (0.6, 1.0)
  c.input.local_crop_scale = (0.1, 0.4)
  c.input.crop_ratio = (0.9, 1.1)
  c.input.mask_prob = 0.5
  c.data.max_pixels = 1024 * 1024
  c.data.min_side = 8
  c.data.background = (0, 0, 0)
  config_validation.validate(c)
  spec = pipeline.ExampleSpec.from_config(c)
  assert spec.global_scale == (0.6, 1.0) and spec.local_scale == (0.1, 0.4) and spec.ratio == (0.9, 1.1)
  assert spec.mask_prob == 0.5
  assert spec.limits.max_pixels == 1024 * 1024 and spec.limits.min_side == 8
  assert spec.limits.background == (0, 0, 0)


@pytest.mark.parametrize("value", [(0.6,), (0.0, 1.0), (0.8, 0.5), (0.5, 1.5)])
def test_bad_crop_scale_names_key(value):
  c = load("demo.py")
  c.input.global_crop_scale = value
  with pytest.raises(ConfigError, match=r"config\.input\.global_crop_scale=.*\(lo, hi\)"):
    config_validation.validate(c)


def test_installed_package_validates_a_config_file(tmp_path):
  """An installed tipsito (setup.py's packages; no checkout of configs/) loads a paper config file from
  anywhere and validates it: the defaults, the paper families and the validation are in the package."""
  root = CONFIGS.parent
  src = tmp_path / "src"
  shutil.copytree(root / "tipsito", src / "tipsito", ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(root / "setup.py", src / "setup.py")
  site = tmp_path / "site"
  subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "install",
      "-q",
      "--no-deps",
      "--no-build-isolation",
      "--target",
      str(site),
      str(src),
    ],
    check=True,
    capture_output=True,
  )
  shutil.copy(CONFIGS / "tipsv2_g14_hires.py", tmp_path / "my_config.py")
  script = (
    "import importlib.util, tipsito\n"
    "assert tipsito.__file__.startswith(sys.argv[1]), tipsito.__file__\n"
    "spec = importlib.util.spec_from_file_location('my_config', 'my_config.py')\n"
    "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
    "from tipsito.config import validation\n"
    "validation.validate(mod.get_config('variant=B/14,init=/x'))\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = str(site)
  subprocess.run(
    [sys.executable, "-c", "import sys\n" + script, str(site)], cwd=tmp_path, env=env, check=True
  )
