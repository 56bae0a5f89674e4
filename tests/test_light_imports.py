"""What each entry point imports: a config builds without JAX, Flax, grain, Orbax or TensorFlow; the step
benchmark and `tipsito.load` run without TensorFlow, TensorFlow Datasets, grain or clu; and the names the
schema checks against (tipsito/choices.py, `schema.module_fields`) are those of the code that acts on them.

Why in fresh interpreters: `sys.modules` of the test process holds whatever earlier tests imported. The
second test hides the packages the way an environment without them would (`importlib.util.find_spec`
returns None and `import` raises ModuleNotFoundError), so code that checks for an optional package
(etils asks whether TensorFlow is installed) takes its no-package path, as it would on such a machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np

from tipsito import choices
from tipsito.config import schema

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG_HEAVY = ("jax", "flax", "grain", "orbax", "tensorflow", "tensorflow_datasets", "optax", "clu")
MODEL_PATH_ABSENT = ("tensorflow", "tensorflow_datasets", "grain", "clu")

# Makes the packages in HIDDEN unimportable for the interpreter that runs it (every meta-path finder
# answers None for them), then reports what is loaded at exit.
_PRELUDE = """
import atexit, json, sys
HIDDEN = {hidden!r}

class _Hide:
  def __init__(self, finder):
    self.finder = finder

  def find_spec(self, name, path=None, target=None):
    if name.partition(".")[0] in HIDDEN:
      return None
    find = getattr(self.finder, "find_spec", None)
    return find(name, path, target) if find else None

  def invalidate_caches(self):
    if hasattr(self.finder, "invalidate_caches"):
      self.finder.invalidate_caches()

sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]

def _report():
  tops = sorted({{m.partition(".")[0] for m in sys.modules}})
  ours = sorted(m for m in sys.modules if m == "tipsito" or m.startswith("tipsito."))
  print("MODULES " + json.dumps({{"top": tops, "tipsito": ours}}), flush=True)

atexit.register(_report)
"""


def _run(body: str, hidden=(), timeout: int = 600) -> tuple[str, dict]:
  """Runs `body` in a fresh interpreter (PYTHONPATH = this checkout); returns (stdout, loaded modules)."""
  code = _PRELUDE.format(hidden=tuple(hidden)) + textwrap.dedent(body)
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  p = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
  )
  assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
  line = [x for x in p.stdout.splitlines() if x.startswith("MODULES ")][-1]
  return p.stdout, json.loads(line[len("MODULES ") :])


def test_every_config_builds_and_validates_without_jax_flax_grain_orbax_or_tensorflow():
  """Every configs/*.py builds, and every shipped training config validates with its documented args
  (tests/test_configs.py `PAPER`, as that test validates them), in an interpreter that imports no heavy
  package: `import tipsito.config.validation` included."""
  from test_configs import PAPER  # pylint: disable=import-outside-toplevel

  out, mods = _run(
    f"""
    import importlib, importlib.util, pathlib
    import tipsito.config
    for m in ("args", "defaults", "mesh", "paper", "presets", "recipes", "run_file", "schema", "validation"):
      importlib.import_module("tipsito.config." + m)
    from tipsito.config import validation
    modules = {{}}
    for f in sorted(pathlib.Path("configs").glob("*.py")):
      spec = importlib.util.spec_from_file_location("cfg_" + f.stem, f)
      module = modules[f.name] = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      module.get_config()
      print("built", f.name)
    for name, args in {PAPER!r}.items():
      for arg in args:
        validation.validate(modules[name].get_config(arg))
        print("validated", name, arg)
    """
  )
  heavy = sorted(set(mods["top"]) & set(CONFIG_HEAVY))
  assert not heavy, f"building the configs imported {heavy}; tipsito modules loaded: {mods['tipsito']}"
  validated = [line for line in out.splitlines() if line.startswith("validated ")]
  assert len(validated) == sum(len(args) for args in PAPER.values()) > 0


def test_step_bench_and_load_run_without_tensorflow_grain_or_clu(tmp_path, conformance_dir):
  """The model path on a machine without the data packages: a step benchmark of a tiny config, then an
  export loaded with `tipsito.load` that embeds an image and a caption."""
  from tipsito import export_format, tips_import  # pylint: disable=import-outside-toplevel

  d = conformance_dir / "tips_model"
  icfg, tcfg, params, temp = tips_import.import_tips_npz(d / "tiny_vit_mlp_vision.npz", d / "tiny_text.npz")
  export = export_format.write_export(
    tmp_path / "export", image_config=icfg, text_config=tcfg, params=params, temperature=temp
  )
  out, mods = _run(
    f"""
    import numpy as np, runpy
    import tipsito
    enc = tipsito.load({export!r})
    image = np.arange(28 * 28 * 3, dtype=np.uint8).reshape(1, 28, 28, 3)
    print("EMBED " + json.dumps(np.asarray(enc.embed_images(image)["cls"], np.float64).tolist()))
    sys.argv = ["step_bench", "--config", "configs/demo.py:recipe=clip,size=32,batch=4,evals=False",
                "--steps", "1"]
    try:
      runpy.run_module("tipsito.bench.step_bench", run_name="__main__", alter_sys=True)
    except SystemExit as e:
      assert not e.code, e.code
    """,
    hidden=MODEL_PATH_ABSENT,
  )
  from tipsito import inference  # pylint: disable=import-outside-toplevel

  image = np.arange(28 * 28 * 3, dtype=np.uint8).reshape(1, 28, 28, 3)
  want = inference.Encoder.from_params(icfg, tcfg, params, temp, None).embed_images(image)["cls"]
  got = json.loads([x for x in out.splitlines() if x.startswith("EMBED ")][-1][len("EMBED ") :])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float64), rtol=1e-6, atol=1e-6)
  bench = json.loads([x for x in out.splitlines() if x.startswith('{"bench"')][-1])["bench"]
  assert [r["recipe"] for r in bench] == ["clip"] and np.isfinite(bench[0]["step_s"])
  assert not set(mods["top"]) & set(MODEL_PATH_ABSENT), mods["top"]


def test_load_imports_no_data_pipeline_and_no_training_module():
  _, mods = _run("from tipsito import inference\n")
  unwanted = [
    m
    for m in mods["tipsito"]
    if m.startswith(("tipsito.train", "tipsito.objective", "tipsito.losses", "tipsito.data.pipeline"))
    or m in ("tipsito.data.grain_ops", "tipsito.evals.registry", "tipsito.data.eval_input")
  ]
  assert not unwanted, unwanted


# ------------------------------------------------------------------------------------------------------
# The names in tipsito/choices.py and the schema are those of the code that acts on them
# ------------------------------------------------------------------------------------------------------


def test_term_names_and_fields_are_those_of_terms():
  from tipsito.data.batch import IMAGE2  # pylint: disable=import-outside-toplevel
  from tipsito.objective.terms import TERMS  # pylint: disable=import-outside-toplevel

  assert tuple(TERMS) == choices.TERM_NAMES  # the summation order of loss/total
  assert tuple(t for t, term in TERMS.items() if IMAGE2 in term.fields) == choices.SECOND_VIEW_TERMS


def test_activation_and_remat_names_are_those_of_the_layers():
  from tipsito.models import layers  # pylint: disable=import-outside-toplevel

  assert tuple(layers.ACTIVATIONS) == choices.ACTIVATIONS
  assert tuple(layers.REMAT_POLICIES) == choices.REMAT_POLICIES


def test_schema_module_fields_are_the_modules_dataclass_fields():
  from tipsito import models  # pylint: disable=import-outside-toplevel

  for tree, name in schema.MODULE_TREES.items():
    fields = {f.name for f in dataclasses.fields(getattr(models, name))} - {"parent", "name"}
    assert set(schema.module_fields(tree)) == fields, (
      f"{tree}: declare the module's new fields as keys in tipsito/config/schema.py, or list them in "
      f"UNDECLARED_MODULE_FIELDS (missing: {sorted(fields - set(schema.module_fields(tree)))}, "
      f"not fields: {sorted(set(schema.module_fields(tree)) - fields)})"
    )


# ------------------------------------------------------------------------------------------------------
# Written once
# ------------------------------------------------------------------------------------------------------


def test_fashion_mnist_prompts_name_the_builders_labels():
  from tipsito.data.builders import fashion_mnist  # pylint: disable=import-outside-toplevel
  from tipsito.evals import templates  # pylint: disable=import-outside-toplevel

  names = templates.class_names_for("fashion_mnist/full")
  assert names == fashion_mnist.CLASS_NAMES and names[0] == "t-shirt" and names[-1] == "ankle boot"


def test_every_export_format_has_one_writer():
  from tipsito.interop import sources  # pylint: disable=import-outside-toplevel

  assert sources.FORMATS == ("tipsito", "hf_tipsv2", "tips_npz", "hf_clip", "open_clip")
  try:
    sources.write(None, "/nonexistent", "onnx")
  except ValueError as e:
    assert "unknown --format 'onnx'" in str(e) and "open_clip" in str(e)
  else:
    raise AssertionError("an unknown format was accepted")
