"""Training views as the papers describe them: crops of whole patches, the global-view scale of the paper
configs, ITO's crop scale on the second view, ITO's schedule length.

Why: each of these was silently off without failing anything. A patch-16 tower on TIPSv2's 98 px local
crops zero-padded them to 112 px (a black frame the teacher never sees in every DINO student input),
tipsito's "ITO view" was cropped at TIPS's 0.32-1.0 instead of ITO's 0.5-1.0, and the ITO LAION-100M
preset ran a third of the epochs of ITO's "30 epochs unless noted".
"""

import importlib.util
import pathlib

import pytest

from tipsito.config import defaults
from tipsito.config import validation as config_validation
from tipsito.config.validation import ConfigError
from tipsito.config import recipes as recipes_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
DATA = ROOT / "tests" / "data" / "tips_model"

# Every training config in configs/ with every documented argument value (eval_*.py have no training
# crops). Each must validate and have whole-patch training crops.
SHIPPED = {
  "demo.py": [None, "size=32", "size=48", "size=72", "size=96", "size=128"]
  + [f"recipe={r}" for r in ("clip", "siglip", "ito", "tips", "tipsv2", "tipsito")]
  + ["optim=adafactor,pixels=tips", "evals=False", "data=scenes", "data=shapes", "data=scenes,size=96"],
  "tipsv2_g14.py": [f"variant={v}" for v in ("g/14", "So400m/14", "L/14", "B/14", "S/14")] + ["ema=full"],
  "tipsv2_g14_hires.py": [f"variant={v},init=/x" for v in ("g/14", "So400m/14", "L/14", "B/14", "S/14")],
  "tipsv2_distill.py": [f"student={s}" for s in ("B", "L", "So400m")],
  "tipsv2_distill_hires.py": [f"student={s},init=/x" for s in ("B", "L", "So400m")],
  "ito_b16.py": [
    f"data={d},variant={v}"
    for d in ("cc3m", "cc12m", "yfcc15m", "laion100m", "datacomp1b")
    for v in ("B/16", "L/16")
  ],
  "ito_l16.py": [f"data={d}" for d in ("cc3m", "cc12m", "yfcc15m", "laion100m", "datacomp1b")],
  "clip_b16.py": [f"data={d}" for d in ("cc3m", "cc12m", "yfcc15m", "laion100m", "datacomp1b")],
  "siglip_b16.py": [None],
  "tipsito_b16.py": [None, "data=cc12m"],
}


def load(name, arg=None):
  spec = importlib.util.spec_from_file_location(f"cfg_fid_{name[:-3]}", CONFIGS / name)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def test_every_config_file_is_covered():
  # finetune.py takes its towers from a model (`from=`): tests/test_finetune.py builds and trains it.
  assert set(SHIPPED) | {"eval_shapes.py", "eval_scenes.py", "ablations.py", "finetune.py"} == {
    p.name for p in CONFIGS.glob("*.py")
  }


def _training_crops(c):
  """(key, px) of every crop the training pipeline cuts for `c` (view 2 is drawn at input.global_size)."""
  inp = c.input
  crops = [("input.global_size", int(inp.global_size))]
  if "multicrop" in inp.views and int(inp.num_local):
    crops.append(("input.local_size", int(inp.local_size)))
  return crops


@pytest.mark.parametrize("name,arg", [(n, a) for n, args in SHIPPED.items() for a in args])
def test_shipped_config_crops_are_whole_patches(name, arg):
  c = load(name, arg)
  config_validation.validate(c)
  p = int(c.model.image.patch_size)
  for key, px in _training_crops(c):
    assert px % p == 0, (name, arg, key, px, p)


@pytest.mark.parametrize("recipe", list(recipes_lib.RECIPES))
def test_tiny_configs_validate(recipe):
  c = defaults.tiny_config(recipe)
  if recipe == "distill":
    c.distill.teacher_image_npz = str(DATA / "tiny_vit_mlp_vision.npz")
  config_validation.validate(c)
  for _, px in _training_crops(c):
    assert px % int(c.model.image.patch_size) == 0


def test_tipsito_b16_local_crops_are_six_patches():
  c = load("tipsito_b16.py")
  assert c.model.image.patch_size == 16
  assert (c.input.global_size, c.input.local_size, c.input.num_local) == (224, 96, 6)


# (config file, arg, key, bad px, words the error must contain: the key, the patch, the nearest valid sizes)
REFUSED = [
  (
    "tipsito_b16.py",
    None,
    "input.local_size",
    98,
    ["config.input.local_size=98", "config.model.image.patch_size=16", "local crops", "96 or 112"],
  ),
  (
    "tipsito_b16.py",
    None,
    "input.global_size",
    230,
    ["config.input.global_size=230", "patch_size=16", "global crop and view 2", "224 or 240"],
  ),
  (
    "ito_b16.py",
    None,
    "input.global_size",
    200,  # view 2 of ITO's two views
    ["config.input.global_size=200", "patch_size=16", "view 2", "192 or 208"],
  ),
  (
    "tipsv2_g14.py",
    "variant=B/14",
    "input.local_size",
    96,
    ["config.input.local_size=96", "patch_size=14", "84 or 98"],
  ),
  (
    "tipsv2_g14.py",
    "variant=B/14",
    "input.global_size",
    220,
    ["config.input.global_size=220", "patch_size=14", "210 or 224"],
  ),
  ("demo.py", None, "input.local_size", 36, ["config.input.local_size=36", "patch_size=8", "32 or 40"]),
]


@pytest.mark.parametrize("name,arg,key,px,words", REFUSED, ids=[f"{r[0]}:{r[2]}={r[3]}" for r in REFUSED])
def test_training_crop_that_is_not_whole_patches_is_refused(name, arg, key, px, words):
  c = load(name, arg)
  c.input[key.split(".")[1]] = px
  with pytest.raises(ConfigError) as e:
    config_validation.validate(c)
  for w in words:
    assert w in str(e.value), (w, str(e.value))


def test_single_view_global_message_does_not_mention_view_2():
  c = load("clip_b16.py")
  c.input.global_size = 200
  with pytest.raises(ConfigError, match=r"global_size=200") as e:
    config_validation.validate(c)
  assert "view 2" not in str(e.value)
  c.input.global_size = 224
  c.input.local_size = 98  # a single-view config cuts no local crops: local_size is not used
  config_validation.validate(c)


def test_evaluation_sizes_are_whole_patches_too():
  """Since issue 44 an eval at a size the ViT would zero-pad (230 px at patch 14) is refused before
  training, naming the key and the nearest valid sizes; the paper config's own eval sizes are whole
  patches (an encoder called directly, `tipsito.load`, still pads as the release does)."""
  c = load("tipsv2_g14.py", "variant=B/14")
  config_validation.validate(c)
  c.evals.zeroshot.image_size = 230
  with pytest.raises(config_validation.ConfigError, match=r"image_size=230.*224 or 238"):
    config_validation.validate(c)


def _jpeg(seed, h=96, w=128):
  import io  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel

  buf = io.BytesIO()
  Image.fromarray(np.random.RandomState(seed).randint(0, 255, (h, w, 3), np.uint8)).save(buf, "JPEG")
  return buf.getvalue()


def _drawn_areas(config, n=150):
  """Area fractions of the crops the pipeline's view transform draws for `config` over `n` images:
  (view 1, view 2), realised boxes of the non-fallback draws (what the ViT is fed)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tipsito.data import pipeline  # pylint: disable=import-outside-toplevel
  from tipsito.data import transforms as T  # pylint: disable=import-outside-toplevel

  tr = pipeline.ExampleSpec.from_config(config).view_transform()
  rng = np.random.default_rng(0)
  v1, v2 = [], []
  for i in range(n):
    trace = []
    img = T.open_image(_jpeg(i % 8))
    tr.random_map({"image": img}, rng, trace=trace)
    for out, view in ((v1, trace[0]), (v2, trace[1])):
      if not view.crop.fallback:
        out.append((view.crop.scale, view.crop.height * view.crop.width / (img.height * img.width)))
  return np.asarray(v1), np.asarray(v2)


def test_tipsito_view2_is_cropped_at_ito_scale():
  """multicrop_two_views: view 2 ('image2') draws its crop area from ITO's 0.5-1.0 while view 1 keeps the
  DINO global range 0.32-1.0 (tiny_config: global_crop_scale None)."""
  c = defaults.tiny_config("tipsito")
  assert c.input.views == "multicrop_two_views" and c.input.view2_crop_scale == (0.5, 1.0)
  v1, v2 = _drawn_areas(c)
  assert len(v2) > 100
  tol = 0.03  # integer rounding of the box on a 96 x 128 image
  assert v2[:, 0].min() >= 0.5 and v2[:, 1].min() >= 0.5 - tol and v2[:, 0].max() <= 1.0
  assert v2[:, 0].min() < 0.55  # the whole range is drawn, from its lower end
  assert (v1[:, 0] < 0.5).mean() > 0.1 and v1[:, 0].min() >= 0.32  # view 1: its own, wider range


def test_view2_crop_scale_is_its_own_key():
  """The key moves view 2 only, in both two-view modes; None means ITO's (0.5, 1.0); ranges validated."""
  c = defaults.tiny_config("tipsito")
  c.input.view2_crop_scale = (0.1, 0.2)
  config_validation.validate(c)
  v1, v2 = _drawn_areas(c, n=60)
  assert v2[:, 0].min() >= 0.1 and v2[:, 0].max() <= 0.2 and v1[:, 0].max() > 0.5
  c = defaults.tiny_config("ito")
  c.input.global_crop_scale = (0.2, 0.3)
  v1, v2 = _drawn_areas(c, n=60)
  assert v1[:, 0].max() <= 0.3 and v2[:, 0].min() >= 0.5
  from tipsito.data import pipeline  # pylint: disable=import-outside-toplevel

  c.input.view2_crop_scale = None
  assert pipeline.ExampleSpec.from_config(c).view2_scale == (0.5, 1.0)
  c.input.view2_crop_scale = (0.8, 0.5)
  with pytest.raises(ConfigError, match=r"config\.input\.view2_crop_scale=\(0\.8, 0\.5\).*\(lo, hi\)"):
    config_validation.validate(c)


# Paper configs and the global-view crop scale each sets explicitly (sources in their docstrings).
GLOBAL_SCALE = {
  ("tipsv2_g14.py", "variant=B/14"): (1.0, 1.0),
  ("tipsv2_g14.py", None): (1.0, 1.0),
  ("tipsv2_g14_hires.py", "init=/x"): (1.0, 1.0),
  ("tipsv2_distill.py", "student=B"): (1.0, 1.0),
  ("tipsv2_distill_hires.py", "student=L,init=/x"): (1.0, 1.0),
  ("tipsito_b16.py", None): (1.0, 1.0),
  ("ito_b16.py", "data=laion100m"): (0.5, 1.0),
  ("ito_l16.py", None): (0.5, 1.0),
}


@pytest.mark.parametrize("name,arg", list(GLOBAL_SCALE))
def test_paper_configs_set_the_global_crop_scale(name, arg):
  c = load(name, arg)
  assert c.input.global_crop_scale == GLOBAL_SCALE[name, arg]
  if "two_views" in c.input.views:
    assert c.input.view2_crop_scale == (0.5, 1.0)


@pytest.mark.parametrize("name", ["tipsv2_g14.py", "tipsito_b16.py"])
def test_global_scale_sources_are_quoted(name):
  """The config docstring quotes the sources and names the alternative's override."""
  import ast  # pylint: disable=import-outside-toplevel

  doc = ast.get_docstring(ast.parse((CONFIGS / name).read_text()))
  assert "global_crop_scale=(1.0, 1.0)" in doc and "processes the original image I" in doc
  assert "only random resizes, crops and\nflips" in doc or "only random resizes, crops and flips" in doc
  assert "--config.input.global_crop_scale='(0.32," in doc


def test_tipsv2_teacher_sees_the_whole_image():
  """TIPSv2 §3.1's 'original image I': the global crop box is the whole (4:3) image on every draw (DINOv2's
  0.32-1.0 would cut a random third to all of it); the local crops are crops."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tipsito.data import pipeline  # pylint: disable=import-outside-toplevel
  from tipsito.data import transforms as T  # pylint: disable=import-outside-toplevel

  c = load("tipsv2_g14.py", "variant=B/14")
  tr = pipeline.ExampleSpec.from_config(c).view_transform()
  rng = np.random.default_rng(0)
  for i in range(20):
    trace = []
    out = tr.random_map({"image": T.open_image(_jpeg(i))}, rng, trace=trace)
    g = trace[0].crop  # the whole image, up to a pixel of rounding when a drawn ratio is 4:3
    assert g.height * g.width >= 96 * 127 and g.top <= 1 and g.left <= 1
    assert all(t.crop.height * t.crop.width <= 0.33 * 96 * 128 for t in trace[1:])
    assert out["image"].shape == (224, 224, 3) and out["local_crops"].shape == (6, 98, 98, 3)


def test_dino_global_scale_is_one_override_away():
  """The ablation's alternative is a single command-line override of a paper config."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  from tipsito.data import pipeline  # pylint: disable=import-outside-toplevel

  for name, arg in (("tipsv2_g14.py", "variant=B/14"), ("tipsito_b16.py", None)):
    path = str(CONFIGS / name) + (f":{arg}" if arg else "")
    argv = ["prog", f"--config={path}", "--config.input.global_crop_scale=(0.32, 1.0)"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
    fv(argv)
    c = fv.config
    config_validation.validate(c)
    assert pipeline.ExampleSpec.from_config(c).global_scale == (0.32, 1.0)


def test_ito_laion100m_runs_thirty_epochs():
  """ITO's table: "ViT-B/16, 30 epochs unless noted"; LAION-100M is not noted (DataComp-1B is: 1 epoch)."""
  from tipsito.config import paper  # pylint: disable=import-outside-toplevel

  c = load("ito_b16.py", "data=laion100m")
  assert c.total_steps == paper.ITO_STEPS["laion100m"]
  epochs = c.total_steps * c.input.batch_size / 100e6
  assert 29.5 <= epochs <= 30.5, epochs
  assert 0.9 <= paper.ITO_STEPS["datacomp1b"] * 8192 / 1.4e9 <= 1.1  # "DataComp-1B, 1 epoch" (~1.4B pairs)


# Lines `python -m tipsito.info` prints for each paper config's training crops.
INFO_LINES = {
  ("tipsito_b16.py", None): [
    "global 224 px = 14 x 16 px patches (grid 14 x 14), crop area (1.0, 1.0) of the image",
    "view 2 224 px = 14 x 16 px patches (grid 14 x 14), crop area (0.5, 1.0) of the image",
    "local  6 x 96 px = 6 x 16 px patches (grid 6 x 6), crop area (0.05, 0.32) of the image",
  ],
  ("tipsv2_g14.py", None): ["global 224 px = 16 x 14 px patches", "local  6 x 98 px = 7 x 14 px patches"],
  ("tipsv2_g14_hires.py", "init=/x"): [
    "global 448 px = 32 x 14 px patches",
    "local  6 x 140 px = 10 x 14 px patches",
  ],
  ("tipsv2_distill.py", "student=B"): [
    "global 224 px = 16 x 14 px patches",
    "local  6 x 98 px = 7 x 14 px patches",
  ],
  ("ito_b16.py", None): [
    "global 224 px = 14 x 16 px patches (grid 14 x 14), crop area (0.5, 1.0)",
    "view 2 224 px = 14 x 16 px patches (grid 14 x 14), crop area (0.5, 1.0)",
  ],
  ("clip_b16.py", None): ["global 224 px = 14 x 16 px patches"],
}


@pytest.mark.parametrize("name,arg", list(INFO_LINES))
def test_info_prints_training_crops_in_patches(name, arg):
  from tipsito import info  # pylint: disable=import-outside-toplevel

  geo = info.crop_geometry(load(name, arg))
  text = "\n".join(geo["lines"])
  for want in INFO_LINES[name, arg]:
    assert want in text, (want, text)
  assert "NOT WHOLE PATCHES" not in text and all(c["padding_fraction"] == 0 for c in geo["crops"])
  assert ("view 2" in text) == ("two_views" in load(name, arg).input.views)


def test_info_flags_padded_crops():
  """A crop the ViT would pad (the old tipsito_b16 local crop) is flagged with the padding it costs."""
  from tipsito import info  # pylint: disable=import-outside-toplevel

  c = load("tipsito_b16.py")
  c.input.local_size = 98
  geo = info.crop_geometry(c)
  local = [x for x in geo["crops"] if x["name"] == "local"][0]
  assert local["padded_px"] == 112 and local["padding_fraction"] == pytest.approx(
    1 - 98**2 / 112**2, abs=1e-4
  )
  assert (
    "local  6 x 98 px = 6.125 x 16 px patches (grid 7 x 7), crop area (0.05, 0.32) of the image; "
    "NOT WHOLE PATCHES: zero-padded to 112 px (23.4% of the input is padding)"
  ) in geo["lines"][-1]


def test_info_table_has_the_crop_section():
  """`python -m tipsito.info` output (table and JSON) carries the section, under the recipe line."""
  from tipsito import info  # pylint: disable=import-outside-toplevel

  out = info.compute_info(load("demo.py", "evals=False"))
  table = info._table(out).splitlines()  # pylint: disable=protected-access
  assert table[1] == "  training crops (patch 8 px):"
  assert table[2].strip().startswith("global 64 px = 8 x 8 px patches (grid 8 x 8), crop area (0.7, 1.0)")
  assert table[4].strip().startswith("local  2 x 32 px = 4 x 8 px patches")
  assert out["training_crops"]["crops"][1]["name"] == "view 2"
