"""A workdir's config.json written by an older tipsito (keys missing) is upgraded in one place,
tipsito/config/run_file.py, and every reader of it works: export, evaluate, the resume guard, `init_from`.

Why: readers outside tipsito/config/ read keys directly (tests/test_config_reads.py), so a config.json
saved before a key existed must gain that key, with its schema default, before any of them sees it.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from tipsito.config import defaults
from tipsito.config import recipes
from tipsito.config import run_file
from tipsito.config import schema
from tipsito.train import loop
from tipsito.train import workdir as workdir_lib

# Keys a config.json of an older tipsito lacks (each was added to the schema after the first config.json).
DROPPED = ("input.microbatches", "loss_opts.view_weighting", "model.image.attention", "distill.init_image")


def _drop(tree: dict, path: str) -> None:
  *head, leaf = path.split(".")
  for part in head:
    tree = tree[part]
  del tree[leaf]


def _lookup(tree: dict, path: str):
  for part in path.split("."):
    tree = tree[part]
  return tree


def _assert_same(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
  """(workdir whose config.json lacks DROPPED, the config it was trained with, export of the untouched run)."""
  from tipsito.data import convert
  from tipsito.train import exporting

  data = str(tmp_path_factory.mktemp("data"))
  convert.convert(
    "shapes", data, split_sizes={"train": 16, "test": 8}, image_size=32, verbose=False, num_workers=1
  )
  c = defaults.tiny_config("clip", batch_size=8, total_steps=1)
  c.max_len = 16
  c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.data = defaults.data_config("shapes", data_dir=data, caption_keys=("caption_detailed",))
  c.ckpt.update(dict(every_steps=1, keep=1, async_save=False))
  c.export.enabled = False
  w = str(tmp_path_factory.mktemp("run"))
  loop.train_and_evaluate(c, w)
  reference = exporting.export_from_workdir(w, str(tmp_path_factory.mktemp("ref")))
  f = os.path.join(w, run_file.CONFIG_FILE)
  saved = json.loads(open(f).read())
  for k in DROPPED:
    _drop(saved, k)
  with open(f, "w") as out:
    json.dump(saved, out)
  return w, c, reference


def test_old_config_json_gains_the_schema_defaults_and_says_so(old_run, caplog):
  w, config, _ = old_run
  raw = json.loads(open(os.path.join(w, run_file.CONFIG_FILE)).read())
  with pytest.raises(KeyError):
    _lookup(raw, "input.microbatches")  # the file is old
  with caplog.at_level(logging.INFO):
    loaded = workdir_lib.load_config(w)
  ctx = schema.Ctx(
    recipe=recipes.get_recipe("clip"),
    variant="tiny/16",
    text_variant="tiny/16",
    total_steps=1,
    batch_size=8,
  )
  for k in DROPPED:
    assert _lookup(loaded.to_dict(), k) == schema.BY_PATH[k].default_for(ctx) == _lookup(config.to_dict(), k)
  log = "\n".join(r.getMessage() for r in caplog.records)
  assert "written by an older tipsito" in log and all(k in log for k in DROPPED), log
  # init_from reads it through the same upgrade (validation checks the EMA mode against it).
  assert _lookup(run_file.init_run_config(w), "input.microbatches") == 1


def test_export_and_evaluate_of_the_old_workdir_work_and_match(old_run, tmp_path):
  from tipsito import evaluate
  from tipsito import inference
  from tipsito.train import exporting

  w, _, reference = old_run
  out = exporting.export_from_workdir(w, str(tmp_path / "export"))
  a, b = inference.load(out), inference.load(reference)
  images = np.random.default_rng(0).integers(0, 255, (2, 32, 32, 3), np.uint8)
  want = b.embed_images(images)
  _assert_same(a.embed_images(images), want)
  encoder, kind = evaluate.load_encoder(defaults.tiny_config("clip"), w)  # the workdir itself
  assert kind == "train"
  _assert_same(encoder.embed_images(images), want)


def test_resume_guard_compares_against_the_upgraded_config(old_run):
  """Resuming with the run's own config is accepted: the keys the file lacks hold their defaults, which
  are the values the run trained with, so nothing changed (before the upgrade they read as '<absent>')."""
  w, config, _ = old_run
  assert loop.guard_resume(config, w) == []
  changed = config.copy_and_resolve_references()
  changed.input.microbatches = 2  # a safe change is still seen and recorded
  (entry,) = loop.guard_resume(changed, w)
  assert entry["changes"] == {"input.microbatches": [1, 2]}


def test_a_missing_variant_dependent_key_is_a_clear_error():
  saved = json.loads(defaults.tiny_config("clip").to_json_best_effort())
  del saved["model"]["image"]["width"]
  with pytest.raises(run_file.SavedConfigError, match=r"W/config.json has no 'model.image.width'.*add"):
    run_file.upgrade(saved, "W/config.json")
  saved["recipe"] = "gone"
  with pytest.raises(run_file.SavedConfigError, match="recipe 'gone'"):
    run_file.upgrade(saved, "W/config.json")


def test_upgrade_moves_a_renamed_key(monkeypatch):
  saved = json.loads(defaults.tiny_config("clip").to_json_best_effort())
  saved["input"]["accumulation_steps"] = 4
  del saved["input"]["microbatches"]
  monkeypatch.setattr(run_file, "RENAMED", {"input.accumulation_steps": "input.microbatches"})
  out = run_file.upgrade(saved, "W/config.json")
  assert out["input"]["microbatches"] == 4 and "accumulation_steps" not in out["input"]
  assert "accumulation_steps" in saved["input"]  # the caller's dict is left as it was
