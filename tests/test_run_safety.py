"""Run safety: the resume guard, the non-finite guard, collapse metrics and errors that name the fix.

Why: each case here used to cost a user a run (or a day): a resume that silently took a changed batch
size or broke the workdir, one NaN step poisoning the params and the next checkpoint, and errors that
pointed nowhere (TFDS's "No examples were yielded", a converter that does not exist, "unsupported export
format_version None", `AttributeError: 'mesh'`, a 57-line traceback for a typo). Runs are tiny CLIP
configs on 32 px shapes so that they compile in seconds.
"""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from tipsito.config import defaults
from tipsito.config import validation as config_validation
from tipsito.data.synthetic import synthetic_batch
from tipsito.train import exporting
from tipsito.train import loop
from tipsito.train import nonfinite
from tipsito.train import resume_guard
from tipsito.train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  from tipsito.data import convert

  d = str(tmp_path_factory.mktemp("data"))
  convert.convert(
    "shapes", d, split_sizes={"train": 32, "test": 8}, image_size=32, verbose=False, num_workers=1
  )
  return d


def tiny(data_dir, **kw):
  c = defaults.tiny_config("clip", batch_size=8, total_steps=kw.pop("steps", 2))
  c.max_len = 16
  c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
  c.model.image.update(dict(depth=1, posemb_grid=4))
  c.data = defaults.data_config("shapes", data_dir=data_dir, caption_keys=("caption_detailed",))
  c.ckpt.update(dict(every_steps=1, keep=3, async_save=False))
  for k, v in kw.items():
    node = c
    *path, last = k.split("__")
    for p in path:
      node = node[p]
    node[last] = v
  return c


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
  """A finished 2-step run: W/config.json, W/checkpoints/{1,2}, W/export."""
  w = str(tmp_path_factory.mktemp("run"))
  loop.train_and_evaluate(tiny(data_dir), w)
  return w


def _snapshot(w):
  out = {}
  for root, _, files in os.walk(w):
    for f in files:
      p = os.path.join(root, f)
      out[os.path.relpath(p, w)] = os.path.getsize(p)
  return out


# --- resume guard ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "change,key",
  [
    (dict(input__batch_size=16), "input.batch_size: 8 -> 16"),
    (dict(steps=3), "total_steps: 2 -> 3"),
    (dict(optim__lr=0.5), "optim.lr: 0.001 -> 0.5"),
    (dict(model__image__depth=2), "model.image.depth: 1 -> 2"),
  ],
)
def test_resume_refuses_unsafe_change_before_writing(trained, data_dir, change, key):
  before = _snapshot(trained)
  cfg_json = open(os.path.join(trained, "config.json")).read()
  with pytest.raises(resume_guard.ResumeConfigError) as e:
    loop.train_and_evaluate(tiny(data_dir, **change), trained)
  msg = str(e.value)
  assert f"config.{key}" in msg, msg
  assert "new --workdir" in msg and f"--config.init_from={trained}" in msg and "Nothing was written" in msg
  assert _snapshot(trained) == before
  assert open(os.path.join(trained, "config.json")).read() == cfg_json


def test_resume_refuses_changed_recipe(trained, data_dir):
  c = defaults.tiny_config("siglip", batch_size=8, total_steps=2)
  c.data = tiny(data_dir).data
  with pytest.raises(resume_guard.ResumeConfigError, match=r"config.recipe: 'clip' -> 'siglip'"):
    loop.train_and_evaluate(c, trained)
  exporting.export_from_workdir(trained, os.path.join(trained, "export_again"))  # workdir still usable


def test_resume_accepts_safe_changes_and_keeps_history(trained, data_dir):
  loop.train_and_evaluate(tiny(data_dir, log_every_steps=5, ckpt__keep=4), trained)
  saved = json.load(open(os.path.join(trained, "config.json")))
  assert saved["log_every_steps"] == 5 and saved["ckpt"]["keep"] == 4
  hist = saved[resume_guard.HISTORY_KEY]
  assert hist[-1]["changes"] == {"ckpt.keep": [3, 4], "log_every_steps": [1, 5]}
  assert hist[-1]["resumed_at_step"] == 2
  # load_config (export, evaluate) does not see the history key, and validation accepts the result.
  config_validation.validate(workdir_lib.load_config(trained))


def test_resume_guard_classification():
  a = defaults.tiny_config("clip")
  b = defaults.tiny_config("clip")
  b.evals.x = dict(type="knn", dataset="shapes")
  b.ckpt.every_steps = 7
  b.data.data_dir = "gs://bucket/tfds"
  b.mesh.fsdp = 4
  assert set(resume_guard.check(a.to_dict(), b, "W")) == {
    "evals.x.type",
    "evals.x.dataset",
    "ckpt.every_steps",
    "data.data_dir",
    "mesh.fsdp",
  }
  for key, value in (
    ("seed", 1),
    ("tokenizer", "/x.model"),
    ("input.views", "two_views"),
    ("data.name", "table/x"),
    ("input.num_workers", 3),
    ("optim.name", "adafactor"),
  ):
    c = defaults.tiny_config("clip")
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
    with pytest.raises(resume_guard.ResumeConfigError, match=f"config.{key}:"):
      resume_guard.check(a.to_dict(), c, "W")


# --- non-finite guard ------------------------------------------------------------------------------


def test_nonfinite_step_leaves_state_unchanged(data_dir):
  from tipsito.train import step as step_lib

  c = tiny(data_dir)
  setup = step_lib.build(c)
  state = setup.init_state()
  batch = synthetic_batch(c, vocab_size=100)
  step_fn = jax.jit(lambda s, b: step_lib.train_step(setup, s, b, {}))
  good, m_good = step_fn(state, batch)
  assert int(m_good[nonfinite.FLAG]) == 0
  assert any(
    not np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(good.params), jax.tree.leaves(state.params))
  )
  poisoned = state.replace(
    params={**state.params, "logit_scale": jnp.full_like(state.params["logit_scale"], jnp.nan)}
  )
  new, m = step_fn(poisoned, batch)
  assert int(m[nonfinite.FLAG]) == 1 and int(new.step) == int(state.step) + 1
  assert "loss/clip=nan" in nonfinite.nonfinite_terms(m)
  same = jax.tree.map(
    lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)),
    (new.params, new.opt_state, new.ema, new.centers, new.rng),
    (poisoned.params, poisoned.opt_state, poisoned.ema, poisoned.centers, poisoned.rng),
  )
  assert all(jax.tree.leaves(same))
  assert not bool(step_lib.all_finite(new.params)) and bool(step_lib.all_finite(good.params))


def test_nonfinite_run_stops_and_checkpoints_stay_finite(tmp_path, data_dir):
  from tipsito.train import checkpointing, step as step_lib

  w = str(tmp_path / "w")
  c = tiny(data_dir, steps=6, optim__lr=1e30, nonfinite__max_consecutive=2)
  with pytest.raises(nonfinite.NonFiniteError) as e:
    loop.train_and_evaluate(c, w)
  msg = str(e.value)
  assert "Stopping at step 2: 2 consecutive steps" in msg and "update_norm=inf" in msg
  assert "config.nonfinite.max_consecutive=2" in msg
  setup = step_lib.build(workdir_lib.load_config(w))
  ck = checkpointing.Checkpointer(os.path.join(w, "checkpoints"), every_steps=0, keep=1, async_save=False)
  assert ck.latest_step() == 1
  state, _ = ck.restore(checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings))
  ck.close()
  init = setup.init_state()
  assert int(state.step) == 1  # the step counter moves, nothing else does
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(init.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_monitor_counts_consecutive_steps():
  mon = nonfinite.NonFiniteMonitor(3)
  flags = [0, 1, 1, 0, 1, 1]
  for i, f in enumerate(flags, 1):
    mon.push(i, {nonfinite.FLAG: np.int32(f), "loss/total": np.float32(np.nan if f else 1.0)})
  mon.flush()
  assert (mon.total, mon.consecutive) == (4, 2)
  with pytest.raises(nonfinite.NonFiniteError, match=r"step 7: 3 consecutive .* loss/total=nan"):
    mon.push(7, {nonfinite.FLAG: np.int32(1), "loss/total": np.float32(np.nan)})
    mon.flush()


# --- collapse metrics ------------------------------------------------------------------------------


def test_collapse_signal_values():
  from tipsito.objective import collapse

  k = 16
  assert math.isclose(float(collapse.entropy(jnp.full((4, k), 1.0 / k))), math.log(k), rel_tol=1e-6)
  assert float(collapse.entropy(jax.nn.one_hot(jnp.arange(4), k))) == 0.0
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 32))
  # Rank 1: the seven zero eigenvalues of x x^T come out of eigvalsh as float32 rounding (~1e-7), whose
  # square roots (~3e-4) add ~2e-3 to the rank on some processors' LAPACK; rank 2 would read 2.
  assert math.isclose(float(collapse.effective_rank(jnp.tile(x, (8, 1)))), 1.0, rel_tol=5e-3)
  assert math.isclose(float(collapse.effective_rank(jnp.eye(8, 32))), 8.0, rel_tol=1e-4)


def test_self_distillation_recipes_log_collapse_metrics():
  from tipsito.train import step as step_lib

  c = defaults.tiny_config("tipsv2", batch_size=4)
  setup = step_lib.build(c, vocab_size=100)
  batch = jax.tree.map(jnp.asarray, synthetic_batch(c))
  _, metrics, _, _ = jax.eval_shape(
    lambda s, b: step_lib.loss_and_grads(setup, s, b, {}), setup.state_shapes, batch
  )
  for k in (
    "collapse/dino_teacher_entropy",
    "collapse/ibot_teacher_entropy",
    "collapse/dino_center_norm",
    "collapse/ibot_center_norm",
    "collapse/cls_effective_rank",
  ):
    assert k in metrics, sorted(metrics)


# --- errors that name the fix ----------------------------------------------------------------------


def test_all_skipped_conversion_names_image_root(tmp_path):
  from tipsito.data import convert

  imgs = tmp_path / "images"
  imgs.mkdir()
  rows = ["path\talt"]
  for i in range(3):
    Image.new("RGB", (8, 8), (80 * i, 0, 0)).save(imgs / f"{i}.png")
    rows.append(f"{i}.png\ta red square number {i}")
  (tmp_path / "caps.tsv").write_text("\n".join(rows) + "\n")
  args = [
    "table",
    "--data_dir",
    str(tmp_path / "d"),
    "--input",
    str(tmp_path / "caps.tsv"),
    "--config_name",
    "mycaps",
    "--num_workers",
    "1",
  ]
  with pytest.raises(convert.ConversionError) as e:
    convert.main(args)
  msg = str(e.value)
  assert "every input was skipped" in msg and "missing image: 3" in msg and "--image_root" in msg
  assert os.path.exists(msg.split("full report: ")[1].split("\n")[0])
  res = convert.main(args + ["--image_root", str(imgs), "--overwrite"])
  assert res.split_sizes == {"train": 3}


def test_missing_dataset_names_the_converter_and_writes_nothing(tmp_path):
  c = tiny(str(tmp_path / "empty"))
  c.data.name = "cc12m"
  w = tmp_path / "w"
  with pytest.raises(FileNotFoundError) as e:
    loop.train_and_evaluate(c, str(w))
  msg = str(e.value)
  assert "'cc12m' is not a tipsito converter" in msg
  assert "python -m tipsito.data.convert table" in msg and "--config.data.name=table/cc12m" in msg
  assert not w.exists()


def test_load_of_a_workdir_says_how_to_export(trained):
  import tipsito
  from tipsito import export_format

  with pytest.raises(export_format.NotAnExportError) as e:
    tipsito.load(trained)
  msg = str(e.value)
  assert "is a training workdir, not an export" in msg
  assert f"python -m tipsito.export --workdir {trained} --output E" in msg
  assert f"tipsito.load('{os.path.join(trained, 'export')}')" in msg
  with pytest.raises(export_format.NotAnExportError, match="training workdir"):
    tipsito.load(os.path.join(trained, "checkpoints"))
  enc = tipsito.load(os.path.join(trained, "export"))
  assert enc.embed_texts(["a red circle"]).shape[0] == 1


def test_export_of_an_export_says_so(trained):
  with pytest.raises(ValueError, match=r"is an export, not a training workdir.*tipsito.load"):
    exporting.export_from_workdir(os.path.join(trained, "export"), os.path.join(trained, "e2"))


def test_unknown_config_key_is_one_line():
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "tipsito.train",
      "--config",
      "configs/demo.py",
      "--workdir",
      "/nonexistent/w",
      "--config.loss.ibott=1",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 1
  err = r.stderr.strip().splitlines()
  assert err[-1] == (
    "FATAL Flags parsing error: --config.loss.ibott: unknown config key 'ibott' under "
    "config.loss; did you mean --config.loss.ibot? Valid keys under config.loss: "
    "['clip', 'clip_view2', 'dino', 'fusion', 'ibot', 'koleo']"
  )
  assert "Traceback" not in r.stderr


@pytest.mark.skipif(
  not os.path.isdir("/usr/share/datasets/fashion-mnist"),
  reason="Debian dataset-fashion-mnist not installed (CI installs it)",
)
def test_fashion_mnist_read_path_never_reaches_the_catalog(tmp_path, monkeypatch):
  """TFDS ships its own `fashion_mnist`; the documented read path resolves ours from the directory."""
  import tensorflow_datasets as tfds
  from tipsito.data import convert, sources

  d = str(tmp_path)
  convert.main(["fashion_mnist", "--data_dir", d, "--limit", "12", "--num_workers", "1"])

  def no_catalog(*a, **k):
    raise AssertionError(f"TFDS catalogue reached: {a} {k}")

  monkeypatch.setattr(tfds, "builder", no_catalog)
  monkeypatch.setattr(tfds, "data_source", no_catalog)
  monkeypatch.setattr(tfds, "load", no_catalog)
  src, info = sources.open_source(
    {"name": "fashion_mnist", "split": "test", "data_dir": d, "label_key": "label"}
  )
  assert len(src) == 12 and info.label_names[0] == "t-shirt"
  ds = sources.data_source("fashion_mnist", split="test", data_dir=d)
  assert len(ds) == 12
