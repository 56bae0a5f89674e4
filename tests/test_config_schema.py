"""The config schema (tipsito/config/schema.py) is the one declaration of every key: the defaults, the typed
optional keys, validation's types / choices / ranges, the resume guard's safe keys and `info --schema` all
come from it.

Why: the config used to be described in four places (defaults, OPTIONAL_KEYS, validation, `.get(key,
default)` reads), so a missing key was never caught and a default could differ between two places; and some
numeric keys had no range (a zero temperature trained on NaN). A new key is now one line of schema.py.
"""

import importlib
import json
import math
import pathlib
import subprocess
import sys

import ml_collections as mlc
import pytest
from ml_collections import config_dict

from tipsito import info
from tipsito.config import defaults, schema
from tipsito.config import validation
from tipsito.config.validation import ConfigError
from tipsito.config import recipes
from tipsito.train import optim, resume_guard

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Made by tests/data/config_schema/make_snapshot.py on main 3803a2d, before the schema existed; keys added
# since then are inserted with their default (input.microbatches = 1, exact accumulation;
# loss_opts.ibot_visible_weight = 1.0; data.alt_text_key became a typed optional str, None drawing 'text'
# from data.caption_keys; model.fusion.remat = False with remat_policy 'nothing_saveable', and
# model.{image,text,fusion}.attention_recompute = True, issue 43); tipsito's
# loss.clip_view2 is 1.0 since its pair weight carries the
# per-caption 1/2 (tipsito/objective/terms.py: contrastive_pair_weights).
SNAPSHOT = ROOT / "tests" / "data" / "config_schema" / "defaults_snapshot.json"


def _leaves(c, prefix=""):
  """[path, repr(value), typed-field type] of every node, as the snapshot script writes them."""
  out = []
  for k in c.keys():
    path = prefix + k
    field = c._fields[k]  # pylint: disable=protected-access
    v = c[k]
    if isinstance(v, mlc.ConfigDict) and not isinstance(field, config_dict.FieldReference):
      out.append([path, "<dict>", None])
      out.extend(_leaves(v, path + "."))
    else:
      ft = field._field_type.__name__ if isinstance(field, config_dict.FieldReference) else None  # pylint: disable=protected-access
      out.append([path, repr(v.to_dict() if isinstance(v, mlc.ConfigDict) else v), ft])
  return out


def _build(name: str) -> mlc.ConfigDict:
  kind, _, rest = name.partition("/")
  if kind == "base_config":
    parts = rest.split("/")
    recipe, variant = parts[0], "/".join(parts[1:3])
    if len(parts) == 3:
      return defaults.base_config(recipe, variant)
    kw = dict(total_steps=int(parts[3]), batch_size=int(parts[4]))
    if len(parts) > 5:
      kw["text_variant"] = parts[5]
    return defaults.base_config(recipe, variant, **kw)
  if kind == "tiny_config":
    return defaults.tiny_config(rest)
  file, _, arg = rest.partition(":")
  return importlib.import_module(f"configs.{file[:-3]}").get_config(arg or None)


SNAP = json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize("name", sorted(SNAP))
def test_defaults_equal_the_snapshot_of_main(name):
  """Every default of every recipe (tiny, B/16 + L text, g/14), tiny_config and every shipped config: the
  same keys, values (with their Python types) and typed optional fields as before the schema."""
  got = _leaves(_build(name))
  assert got == SNAP[name]


def test_every_default_key_is_declared():
  for r in recipes.RECIPES:
    c = defaults.base_config(r, "tiny/16")
    declared = {k.path for k in schema.keys_for(recipes.get_recipe(r))}
    leaves = {p for p, v, _ in _leaves(c) if v != "<dict>"}
    assert leaves == declared, (r, leaves ^ declared)


def _numeric_keys():
  return [k for k in schema.KEYS if k.range is not None]


def _boundary_cases(key):
  """(value, ok) at each bound of the key's range, and just beyond it."""
  r = key.range
  cases = []
  step_down = (lambda x: x - 1) if key.type is int else (lambda x: math.nextafter(x, -math.inf))
  step_up = (lambda x: x + 1) if key.type is int else (lambda x: math.nextafter(x, math.inf))
  if r.lo is not None:
    cases += [(r.lo, not r.lo_open), (step_up(r.lo), True), (step_down(r.lo), False)]
  if r.hi is not None:
    cases += [(r.hi, not r.hi_open), (step_down(r.hi), True), (step_up(r.hi), False)]
  if r.lo is None and r.hi is None:
    cases += [(0.0, True), (-1e6, True), (1e6, True)]
  cases += [(math.nan, False), (math.inf, False)] if key.type is not int else []
  return cases


def _wrap(key, v):
  if key.type is tuple:
    return (v, v) if key.pair else (v,) * (key.length or 2)
  return v


@pytest.mark.parametrize("key", _numeric_keys(), ids=lambda k: k.path)
def test_every_declared_range_at_its_boundaries(key):
  for v, ok in _boundary_cases(key):
    value = _wrap(key, v)
    if ok:
      validation.check_value(key, value)
    else:
      with pytest.raises(ConfigError) as e:
        validation.check_value(key, value)
      msg = str(e.value)
      assert f"config.{key.path}=" in msg and str(key.range) in msg and "--config." in msg, msg


def test_every_numeric_default_has_a_range():
  for k in schema.KEYS:
    if k.type in (int, float) and k.choices is None:
      assert k.range is not None, k.path


def demo(arg="steps=2"):
  return importlib.import_module("configs.demo").get_config(arg)


def _set(c, path, value):
  *head, last = path.split(".")
  node = c
  for p in head:
    node = node[p]
  with node.ignore_type():
    node[last] = value


@pytest.mark.parametrize(
  "path,value,words",
  [
    ("optim.lr", 0.0, ["config.optim.lr=0.0", "> 0"]),
    ("loss_opts.teacher_temp", 0.0, ["config.loss_opts.teacher_temp=0.0", "> 0"]),
    ("loss_opts.student_temp", -0.1, ["config.loss_opts.student_temp=-0.1", "> 0"]),
    ("input.mask_ratio", 1.0, ["config.input.mask_ratio=1.0", "in [0, 1)"]),
    ("input.mask_prob", 1.5, ["config.input.mask_prob=1.5", "in [0, 1]"]),
    ("ema.momentum", 1.01, ["config.ema.momentum=1.01", "in [0, 1]"]),
    ("loss_opts.center_momentum", -0.5, ["config.loss_opts.center_momentum=-0.5", "in [0, 1]"]),
    ("loss.clip", -1.0, ["config.loss.clip=-1.0", ">= 0"]),
    ("optim.b2", 1.0, ["config.optim.b2=1.0", "in [0, 1)"]),
    ("optim.weight_decay", -1e-4, ["config.optim.weight_decay=-0.0001", ">= 0"]),
    ("total_steps", 0, ["config.total_steps=0", "integer >= 1"]),
    ("input.global_crop_scale", (0.5, 1.5), ["config.input.global_crop_scale=(0.5, 1.5)", "(0, 1]"]),
    ("data.max_skip_fraction", 2.0, ["config.data.max_skip_fraction=2.0", "in [0, 1]"]),
    ("model.image.dropout", 1.0, ["config.model.image.dropout=1.0", "in [0, 1)"]),
    ("input.batch_size", "32", ["config.input.batch_size='32'", "has type str"]),
    ("input.shuffle", 1, ["config.input.shuffle=1", "[False, True]"]),
    ("model.image.num_cls_tokens", True, ["config.model.image.num_cls_tokens=True", "[1, 2]"]),
    ("input.views", "multicrops", ["config.input.views='multicrops'", "'multicrop_two_views'"]),
  ],
)
def test_out_of_range_value_names_key_and_range(path, value, words):
  c = demo()
  _set(c, path, value)
  with pytest.raises(ConfigError) as e:
    validation.validate(c)
  for w in words:
    assert w in str(e.value), (w, str(e.value))
  assert "info --schema" in str(e.value)


def test_missing_key_fails_loudly():
  c = demo()
  validation.validate(c)
  with c.optim.unlocked():
    del c.optim["min_lr_ratio"]
  with pytest.raises(ConfigError, match=r"config\.optim\.min_lr_ratio is missing"):
    validation.validate(c)
  with pytest.raises((AttributeError, KeyError)):  # no fallback default where it is read either
    optim.make_optimizer(c, {"w": __import__("jax").numpy.ones((4, 4))})


def test_validation_builds_no_default_config(monkeypatch):
  def boom(*a, **k):
    raise AssertionError("validation built a default config")

  c = demo()
  monkeypatch.setattr(defaults, "base_config", boom)
  validation.validate(c)


def test_optional_keys_come_from_the_schema():
  assert defaults.OPTIONAL_KEYS == {k.path: k.type for k in schema.KEYS if k.optional and k.typed}
  c = defaults.base_config("tipsito", "tiny/16")
  c.data.data_dir = "/x"  # a typed field reference: overridable after being None
  assert c.data.data_dir == "/x"


def test_resume_guard_classification_comes_from_the_schema():
  assert resume_guard.SAFE_KEYS == schema.safe_keys()
  for r in recipes.RECIPES:
    flat = resume_guard.flatten(defaults.base_config(r, "tiny/16"))
    for key in flat:
      assert resume_guard.is_safe(key) == schema.BY_PATH[key].safe, key
  assert resume_guard.is_safe("evals.zeroshot.batch_size")  # user-named entries of a safe tree
  assert not resume_guard.is_safe("optim.lr_mults.bias$")


def test_info_schema_lists_every_key():
  rows = info.schema_rows(demo())
  keys = [r["key"] for r in rows]
  assert keys == [k.path for k in schema.KEYS] + [t.path + ".*" for t in schema.TREES]
  by = {r["key"]: r for r in rows}
  assert by["optim.lr"]["allowed"] == "a number > 0" and by["optim.lr"]["value"] == "0.003"
  assert by["input.mask_ratio"]["allowed"] == "a number in [0, 1)"
  assert by["log_every_steps"]["safe"] and not by["optim.lr"]["safe"]
  assert all(r["doc"] for r in rows)
  table = info.schema_table(rows)
  for k in schema.KEYS:
    assert k.path in table


def test_info_schema_command():
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "tipsito.info",
      "--config",
      f"{ROOT}/configs/demo.py:steps=10",
      "--schema",
      "--json",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    check=True,
    timeout=300,
  ).stdout
  rows = json.loads(out.strip().splitlines()[-1])
  assert {r["key"] for r in rows} >= {k.path for k in schema.KEYS}
  assert {r["key"]: r for r in rows}["total_steps"]["value"] == "10"
