"""The 'Using a trained model' examples (docs/using.md, and the short one in README.md) run as printed and
give what they say.

Why: the zero-shot example is the first code a new user pastes. The test runs the page's own text (the
two python blocks and the export command between them) and the README's block, with the demo's paths
replaced by a tiny model tipsito trained (tests/interop_workdir.py), and checks the printed answer and that
transformers gives the same probabilities.
"""

import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from interop_workdir import trained_workdir  # noqa: F401  (session fixture)
from tipsito import export
from tipsito.train import exporting

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO_EXPORT, DEMO_HF = "workdirs/demo/export", "exports/demo_hf"


def _section() -> str:
  """The whole of docs/using.md (the routes table, the two examples, the load API, the formats)."""
  text = (ROOT / "docs" / "using.md").read_text()
  assert text.startswith("# Using a trained model\n")
  return text


def _blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", _section(), re.S)


@pytest.fixture(scope="module")
def paths(trained_workdir, tmp_path_factory):
  wd, _, _ = trained_workdir
  return {
    DEMO_EXPORT: exporting.export_from_workdir(str(wd), str(tmp_path_factory.mktemp("e") / "export")),
    DEMO_HF: str(tmp_path_factory.mktemp("hf") / "demo_hf"),
  }


def _swap(code: str, paths) -> str:
  for old, new in paths.items():
    code = code.replace(old, new)
  return code


def _run(code: str, ns: dict) -> str:
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    exec(compile(code, "README.md", "exec"), ns)  # pylint: disable=exec-used
  return buf.getvalue()


def test_readme_example_runs_on_an_image_file(paths, tmp_path):
  """README.md's short example: `tipsito.load` and `classify` on an image file."""
  from PIL import Image, ImageDraw

  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
  assert len(blocks) == 1 and DEMO_EXPORT in blocks[0] and '"photo.png"' in blocks[0]
  photo = tmp_path / "photo.png"
  img = Image.new("RGB", (64, 64), "white")
  ImageDraw.Draw(img).ellipse((8, 8, 56, 56), fill="red")
  img.save(photo)
  ns = {}
  _run(_swap(blocks[0], {**paths, "photo.png": str(photo)}), ns)
  probs, names = ns["probs"], ns["names"]
  assert probs.shape == (1, len(names)) and abs(float(probs.sum()) - 1.0) < 1e-5
  np.testing.assert_allclose(probs, ns["enc"].classify(img, names, templates=ns["templates"]), atol=1e-6)


def test_zero_shot_example_runs_and_prints_the_top_class(paths):
  blocks = _blocks()
  assert len(blocks) == 2 and DEMO_EXPORT in blocks[0] and DEMO_HF in blocks[1]
  ns = {}
  printed = _run(_swap(blocks[0], paths), ns)
  probs, names = ns["probs"], ns["names"]
  assert probs.shape == (1, len(names)) and abs(float(probs.sum()) - 1.0) < 1e-5
  assert printed.split() == [names[int(probs[0].argmax())], str(round(float(probs[0].max()), 3))]
  np.testing.assert_allclose(probs, ns["enc"].classify(ns["img"], names, templates="a {} shape."), atol=1e-7)


def test_transformers_example_gives_the_same_probabilities(paths):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  blocks = _blocks()
  cmd = re.search(
    rf"`(python -m tipsito\.export --from {re.escape(DEMO_EXPORT)} --format hf_tipsv2 "
    rf"--output {re.escape(DEMO_HF)})`",
    _section(),
  )
  argv = shlex.split(_swap(cmd.group(1), paths))
  subprocess.run(
    [sys.executable] + argv[1:],
    check=True,
    cwd=ROOT,
    capture_output=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)),
  )
  ns = {}
  _run(_swap(blocks[0], paths), ns)
  printed = _run(_swap(blocks[1], paths), ns)
  hf_probs = ns["out"].logits_per_image.softmax(-1).numpy()
  assert "tensor" in printed and hf_probs.shape == ns["probs"].shape
  np.testing.assert_allclose(hf_probs, ns["probs"], atol=1e-4)


def test_every_export_command_of_the_section_uses_real_flags_and_formats():
  """The routes table's `python -m tipsito.export ...` commands name flags the CLI defines and formats
  it writes (tests/test_interop_*.py run each format's command from a workdir or an export)."""
  from absl import flags
  from tipsito.interop import sources

  export._define_flags()  # pylint: disable=protected-access
  cmds = re.findall(r"`(python -m tipsito\.export [^`]*)`", _section())
  formats = set()
  for cmd in cmds:
    argv = shlex.split(cmd)[3:]
    for arg in argv:
      if arg.startswith("--"):
        assert arg[2:].split("=")[0] in flags.FLAGS, (cmd, arg)
    if "--format" in argv:
      formats.add(argv[argv.index("--format") + 1])
  assert formats == set(sources.FORMATS) - {"tipsito"}, formats
  assert set(flags.FLAGS["format"].parser.enum_values) == set(sources.FORMATS)
