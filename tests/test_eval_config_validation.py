"""Every eval setting is refused before training, naming the key (issue 44 item 1).

Why: an eval reads its settings only at the end of a run, so a value it cannot use used to cost the whole
training run. The settings are declared in tipsito/config/schema.py (`EVAL_KEYS`) and checked by
tipsito/config/validation.py (`eval_settings`, with the rules that relate them to the model), and what
needs the data on disk by tipsito/evals/config_checks.py (`check_evals_on_disk`) in tipsito/train/loop.py's
checks before anything is written. Most cases run the validation in process (fast); one runs the real
training command and checks that it exits before writing a checkpoint.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tipsito import choices
from tipsito.config import schema
from tipsito.config import validation
from tipsito.config.validation import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def demo():
  """The demo config (patch 8, two CLS tokens): its evals are the scenes suite."""
  return importlib.import_module("configs.demo").get_config("steps=2")


def _with_eval(typ: str, **kw):
  c = demo()
  c.evals.bad = dict(type=typ, dataset="scenes", image_size=64, **kw)
  return c


# (eval type, key, bad value, words the message must hold)
BAD = [
  *(
    (typ, "batch_size", v, ["config.evals.bad.batch_size", "out of range", ">= 1"])
    for typ in choices.EVAL_TYPES
    for v in (0, -3)
  ),
  *((typ, "every_steps", -1, ["config.evals.bad.every_steps", ">= 0"]) for typ in choices.EVAL_TYPES),
  *((typ, "resize", "squash", ["config.evals.bad.resize", "center_crop"]) for typ in choices.EVAL_TYPES),
  *(
    (typ, "templates", [], ["config.evals.bad.templates", "non-empty"])
    for typ in ("zeroshot", "segmentation")
  ),
  ("zeroshot", "templates", ["no slot"], ["config.evals.bad.templates", "exactly one"]),
  ("zeroshot", "templates", "imagenet81", ["config.evals.bad.templates", "imagenet80"]),
  ("zeroshot", "topk", (), ["config.evals.bad.topk", "non-empty"]),
  ("zeroshot", "topk", (0,), ["config.evals.bad.topk", "out of range"]),
  ("zeroshot", "present_class", "yes", ["config.evals.bad.present_class", "False"]),
  ("retrieval", "ks", (1, -5), ["config.evals.bad.ks", "out of range"]),
  ("retrieval", "chunk_size", 0, ["config.evals.bad.chunk_size", ">= 1"]),
  ("retrieval", "max_captions_per_image", 0, ["config.evals.bad.max_captions_per_image"]),
  ("segmentation", "protocol", "sliding", ["config.evals.bad.protocol", "whole", "slide"]),
  ("segmentation", "benchmark", "ade20k", ["config.evals.bad.benchmark", "ade150"]),
  ("segmentation", "stride", 0, ["config.evals.bad.stride", ">= 1"]),
  ("segmentation", "mask_source", "png", ["config.evals.bad.mask_source", "alpha"]),
  ("segmentation", "patch_tokens", 1, ["config.evals.bad.patch_tokens", "[False, True]"]),
  ("segmentation", "bootstrap", -1, ["config.evals.bad.bootstrap", ">= 0"]),
  ("knn", "k", 0, ["config.evals.bad.k", ">= 1"]),
  ("knn", "temperature", 0.0, ["config.evals.bad.temperature", "> 0"]),
  ("knn", "max_train_examples", 0, ["config.evals.bad.max_train_examples"]),
  ("linear_segmentation", "steps", 0, ["config.evals.bad.steps", ">= 1"]),
  ("linear_segmentation", "raw_pixel_probe", None, ["config.evals.bad.raw_pixel_probe", "not optional"]),
  ("linear_depth", "lr", 0.0, ["config.evals.bad.lr", "> 0"]),
  ("linear_depth", "depth_scale", -1.0, ["config.evals.bad.depth_scale"]),
  ("linear_depth", "min_depth", 20.0, ["config.evals.bad.min_depth", "max_depth"]),
  ("linear_classification", "probe_batch_size", 0, ["config.evals.bad.probe_batch_size", ">= 1"]),
  ("linear_classification", "weight_decay", -1e-4, ["config.evals.bad.weight_decay", ">= 0"]),
  # keys another type reads, and typos, are refused by name with the type's valid keys
  ("zeroshot", "ks", (1,), ["config.evals.bad", "'ks'", "'zeroshot'", "valid keys"]),
  ("knn", "topk_", (1,), ["config.evals.bad", "'topk_'", "valid keys"]),
]


@pytest.mark.parametrize("typ,key,value,words", BAD, ids=lambda x: str(x) if not isinstance(x, list) else "")
def test_a_bad_eval_setting_is_refused_naming_the_key(typ, key, value, words):
  c = _with_eval(typ, **{key: value})
  with pytest.raises(ConfigError) as e:
    validation.validate(c)
  for w in words:
    assert w in str(e.value), (w, str(e.value))
  c.evals.bad.enabled = False  # a disabled eval is neither built nor checked
  validation.validate(c)


def test_every_eval_key_of_every_type_is_checked_from_the_schema():
  """Each declared key of each type: its default validates, a value of the wrong type is refused."""
  for typ in choices.EVAL_TYPES:
    defaults = schema.eval_defaults(typ)
    assert validation.eval_settings("e", {"type": typ, "dataset": "d"}) == {
      **defaults,
      "type": typ,
      "dataset": "d",
    }
    for key in schema.eval_keys(typ):
      name = key.path.rpartition(".")[2]
      if name in ("type", "templates"):
        continue
      wrong = "x" if key.type is not str else 3
      with pytest.raises(ConfigError, match=rf"config\.evals\.e\.{name}="):
        validation.eval_settings("e", {"type": typ, "dataset": "d", name: wrong})


@pytest.mark.parametrize(
  "kw,words",
  [
    (dict(image_size=60), ["config.evals.bad.image_size=60", "patch_size=8", "56 or 64"]),
    (dict(cls_index=2), ["config.evals.bad.cls_index=2", "num_cls_tokens=2", "[0, 1]"]),
    (dict(type="nope"), ["config.evals.bad.type='nope'", "zeroshot"]),
    (dict(dataset=None), ["config.evals.bad.dataset=None"]),
  ],
)
def test_cross_key_rules(kw, words):
  c = _with_eval("zeroshot")
  c.evals.bad.update(kw)
  with pytest.raises(ConfigError) as e:
    validation.validate(c)
  for w in words:
    assert w in str(e.value), (w, str(e.value))


def test_segmentation_benchmark_rules():
  c = _with_eval("segmentation")
  c.evals.bad.update(benchmark="ade150", bg_threshold=0.3)
  with pytest.raises(ConfigError, match=r"config\.evals\.bad\.bg_threshold=0\.3 .*no background class"):
    validation.validate(c)
  c = _with_eval("segmentation", benchmark="voc21", resize="resize")
  with pytest.raises(ConfigError, match=r"config\.evals\.bad: benchmark='voc21' defines \['resize'\]"):
    validation.validate(c)
  # a benchmark's sizes where the eval leaves them unset (448 is 56 patches of 8)
  s = validation.eval_settings("b", dict(type="segmentation", dataset="d", benchmark="pc59"))
  assert (s["image_size"], s["crop_size"], s["stride"]) == (448, 448, 336)


def _fake_tfds(root: pathlib.Path, name="toy", splits=("train", "test"), fields=("image", "label")):
  d = root / name / "default" / "1.0.0"
  d.mkdir(parents=True)
  (d / "dataset_info.json").write_text(json.dumps({"name": name, "splits": [{"name": s} for s in splits]}))
  feats = {"featuresDict": {"features": {f: {} for f in fields}}}
  (d / "features.json").write_text(json.dumps(feats))
  return root


@pytest.mark.parametrize(
  "typ,kw,words",
  [
    ("zeroshot", dict(split="validation"), ["config.evals.bad.split='validation'", "['test', 'train']"]),
    ("knn", dict(train_split="val"), ["config.evals.bad.train_split='val'", "['test', 'train']"]),
    ("zeroshot", dict(label_key="class"), ["config.evals.bad.label_key='class'", "'label'"]),
    ("retrieval", dict(caption_keys=("caption_x",)), ["config.evals.bad.caption_keys", "caption_x"]),
    ("segmentation", dict(mask_source="segmentation"), ["config.evals.bad.segmentation_key"]),
  ],
)
def test_splits_and_fields_against_the_dataset_on_disk(tmp_path, typ, kw, words):
  from tipsito.evals import config_checks  # pylint: disable=g-import-not-at-top

  root = _fake_tfds(tmp_path)
  c = _with_eval(typ, data_dir=str(root), **kw)
  c.evals.bad.dataset = "toy"
  validation.validate(c)  # the config itself is fine: only the files say otherwise
  with pytest.raises(ConfigError) as e:
    config_checks.check_evals_on_disk(c)
  for w in words:
    assert w in str(e.value), (w, str(e.value))
  c.evals.bad.update({k: schema.eval_default(schema.BY_PATH[f"evals.*.{k}"], typ) for k in kw})
  config_checks.check_evals_on_disk(c)  # the defaults fit the files (a missing dataset is skipped)


def test_dense_benchmark_kind_and_split():
  from tipsito.evals import config_checks  # pylint: disable=g-import-not-at-top

  c = _with_eval("linear_segmentation")
  c.evals.bad.dataset = "nyuv2"
  with pytest.raises(ConfigError, match=r"config\.evals\.bad\.dataset='nyuv2' is a depth benchmark"):
    config_checks.check_evals_on_disk(c)
  c.evals.bad.type = "linear_depth"
  c.evals.bad.split = "validation"
  with pytest.raises(ConfigError, match=r"config\.evals\.bad\.split='validation' is not a split of nyuv2"):
    config_checks.check_evals_on_disk(c)


def test_the_leaf_tables_match_the_modules_that_act_on_them():
  from tipsito.data import eval_input, transforms  # pylint: disable=g-import-not-at-top
  from tipsito.evals import config_checks, registry, templates  # pylint: disable=g-import-not-at-top

  assert tuple(registry.EVALUATOR_TYPES) == choices.EVAL_TYPES
  assert eval_input.RESIZE_MODES[:2] == tuple(transforms.FIXED_RESIZE_MODES)
  assert tuple(config_checks.BENCHMARKS) == tuple(choices.SEGMENTATION_BENCHMARKS)
  for name, b in config_checks.BENCHMARKS.items():
    assert choices.SEGMENTATION_BENCHMARKS[name] == (b.background_index is not None)
  assert tuple(templates.TEMPLATE_SETS) == choices.TEMPLATE_SET_NAMES
  assert tuple(config_checks.PROBE_KINDS) == choices.PROBE_TYPES


def test_the_training_command_refuses_a_bad_eval_before_writing_a_checkpoint(tmp_path):
  """The real CLI: a zero eval batch size exits non-zero, naming the key, and writes no checkpoint."""
  workdir = tmp_path / "w"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  cmd = [
    sys.executable,
    "-m",
    "tipsito.train",
    "--config",
    str(ROOT / "configs" / "demo.py"),
    "--workdir",
    str(workdir),
    "--config.evals.zeroshot.batch_size=0",
  ]
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert r.returncode != 0
  assert "config.evals.zeroshot.batch_size=0" in r.stderr + r.stdout, r.stderr[-2000:]
  assert not (workdir / "checkpoints").exists()


def test_validating_the_demo_config_loads_17_tipsito_modules_and_no_pil():
  """Config validation is a leaf: the demo config (which imports the tokenizer and the eval suites itself)
  validates with 17 tipsito modules loaded (13 for a config built from base_config) and without PIL."""
  code = (
    "import importlib, sys\n"
    "from tipsito.config import defaults, validation\n"
    "validation.validate(defaults.base_config('clip', 'tiny/16', total_steps=10, batch_size=8))\n"
    "n0 = len([m for m in sys.modules if m.startswith('tipsito')])\n"
    "validation.validate(importlib.import_module('configs.demo').get_config('steps=2'))\n"
    "n = len([m for m in sys.modules if m.startswith('tipsito')])\n"
    "print(n0, n, 'PIL' in sys.modules, 'jax' in sys.modules)\n"
  )
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  r = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == ["13", "17", "False", "False"], r.stdout


def test_eval_defaults_equal_the_evaluators_dicts_of_main():
  """Each type's completed defaults equal what its evaluator merged before the schema held them
  (COMMON_DEFAULTS, SEGMENTATION_DEFAULTS and the evaluators' DEFAULTS of main 0bea7e5, written by
  `git archive 0bea7e5 tipsito` and those dicts into tests/data/eval_defaults_main_0bea7e5.json)."""
  snap = json.loads((ROOT / "tests" / "data" / "eval_defaults_main_0bea7e5.json").read_text())
  assert sorted(snap) == sorted(choices.EVAL_TYPES)
  for typ, old in snap.items():
    new = {k: list(v) if isinstance(v, tuple) else v for k, v in schema.eval_defaults(typ).items()}
    assert new == old, typ
