"""An export written by an older tipsito, whose config.json lacks tower keys that did not exist then, reads
as the same model: `tipsito.load` and every `--format` writer give what the untouched export gives.

Why: the export reader fills such keys once with the tower modules' defaults (tipsito/export_format.py:
upgrade_config, tipsito/models/kwargs.py: complete_tower_config) and every reader reads keys directly
(tests/test_config_reads.py), so a key filled wrong, or a reader that no longer finds a key, shows here. An
older export is simulated the way it came about: the keys a newer tipsito added are the ones an older model
had at their default, so the test deletes the tower keys whose value is the module's default. Keys that fix
the parameter shapes have no default: their absence is refused, naming the file and key.
"""

import json
import logging
import shutil

import jax
import numpy as np
import pytest

import tipsito
from tipsito import export_format
from tipsito.config import defaults
from tipsito.interop import sources
from tipsito.models import kwargs as kwargs_lib

# recipe -> the formats its towers can be written to (TIPS-style: hf_tipsv2, tips_npz; CLIP-style: hf_clip,
# open_clip), the tipsito export itself in both.
FORMATS = {"tipsv2": ("tipsito", "hf_tipsv2", "tips_npz"), "ito": ("tipsito", "hf_clip", "open_clip")}


def _tiny_export(recipe, out):
  """A current export of the freshly initialised tiny `recipe` model (no training step is needed: the
  test compares two readings of the same weights). The position grid, text length and pixel statistics
  are the modules' defaults, so that an older export may lack them too."""
  from tipsito.train import exporting, sharding, step as step_lib  # pylint: disable=import-outside-toplevel

  c = defaults.tiny_config(recipe, image_size=32)
  c.model.image.update(dict(patch_size=8, posemb_grid=32))
  c.model.text.max_len = 64
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  setup = step_lib.build(c, mesh)
  state = setup.init_state()
  return exporting.write_training_export(setup, state.params, str(out), step=0)


def _age(export_dir, old_dir, drop=None):
  """Copies `export_dir` to `old_dir` without the keys an older tipsito had not written: every tower key at
  its module's default (but the shape keys) and the top-level pixel statistics; or, with `drop`, the
  (tower, key) pairs given. Returns the dropped keys as 'tower.key'."""
  shutil.copytree(export_dir, old_dir)
  cfg = json.loads((old_dir / "config.json").read_text())
  dropped = []
  for tower in ("image", "text"):
    default = kwargs_lib.tower_defaults(tower)
    for k in list(cfg[tower]):
      stale = (
        (tower, k) in drop
        if drop is not None
        else (k in default and cfg[tower][k] == default[k] and k not in kwargs_lib.SHAPE_KEYS[tower])
      )
      if stale:
        del cfg[tower][k]
        dropped.append(f"{tower}.{k}")
  if drop is None:
    for k in ("pixel_mean", "pixel_std"):
      del cfg[k]
      dropped.append(k)
  (old_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
  return dropped


def _files(folder):
  return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def exports(request, tmp_path_factory):
  """(recipe, current export, the same export as an older tipsito wrote it, the keys it lacks)."""
  root = tmp_path_factory.mktemp(f"upgrade_{request.param}")
  new = root / "new"
  _tiny_export(request.param, new)
  old = root / "old"
  return request.param, new, old, _age(new, old)


def test_an_older_export_loads_as_the_same_model(exports, caplog):
  recipe, new, old, dropped = exports
  want = {"image.ffn", "image.dtype", "image.scan", "text.dtype", "pixel_mean"}
  want |= {"image.posemb_grid", "text.max_len", "image.pixel_mean"} if recipe == "tipsv2" else set()
  assert want <= set(dropped), dropped  # the keys the fallback reads of the interop writers used to fill
  with caplog.at_level(logging.INFO):
    got = tipsito.load(old)
  filled = [r.getMessage() for r in caplog.records if "older tipsito" in r.getMessage()]
  assert len(filled) == 1 and str(old / "config.json") in filled[0], filled
  assert all(k in filled[0] for k in dropped), filled[0]
  ref = tipsito.load(new)
  assert got.image_config == ref.image_config and got.text_config == ref.text_config
  assert {k: v for k, v in got.config.items()} == ref.config
  rng = np.random.default_rng(0)
  images = rng.uniform(0, 1, (2, 32, 32, 3)).astype(np.float32)
  ids = rng.integers(1, 100, (2, 64)).astype(np.int32)
  for a, b in (
    (got.embed_images(images), ref.embed_images(images)),
    (got.embed_texts(ids), ref.embed_texts(ids)),
  ):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_a_current_export_is_read_without_filling(exports, caplog):
  _, new, _, _ = exports
  with caplog.at_level(logging.INFO):
    cfg, _ = export_format.read_export(new)
  assert not [r for r in caplog.records if "older tipsito" in r.getMessage()]
  assert cfg == json.loads((new / "config.json").read_text()) | {"image_proj": cfg["image_proj"]}


def test_an_older_export_converts_to_the_same_files(exports, tmp_path):
  """`python -m tipsito.export --from OLD --format F` writes what `--from NEW` writes, in every format the
  model allows (the tipsito export: the same config.json, but for the path it came from)."""
  recipe, new, old, _ = exports
  for fmt in FORMATS[recipe]:
    sources.write(sources.load_source(new), tmp_path / f"new_{fmt}", fmt)
    sources.write(sources.load_source(old), tmp_path / f"old_{fmt}", fmt)
    fa, fb = _files(tmp_path / f"new_{fmt}"), _files(tmp_path / f"old_{fmt}")
    if fmt == "tipsito":
      ca, cb = (json.loads(f.pop("config.json")) for f in (fa, fb))
      assert ca["extra"].pop("from") == str(new) and cb["extra"].pop("from") == str(old)
      assert ca == cb
      fa = {k: v for k, v in fa.items() if not k.startswith("params/")}  # Orbax metadata holds times
      fb = {k: v for k, v in fb.items() if not k.startswith("params/")}
    assert fa == fb, fmt


@pytest.mark.parametrize("tower,key", [("image", "width"), ("text", "vocab_size"), ("image", "patch_size")])
def test_a_key_without_a_default_is_refused(exports, tmp_path, tower, key):
  _, new, _, _ = exports
  old = tmp_path / "old"
  _age(new, old, drop={(tower, key)})
  with pytest.raises(export_format.ExportConfigError, match=rf"{old / 'config.json'}.*'{tower}\.{key}'"):
    tipsito.load(old)


def test_an_export_without_a_temperature_is_refused(exports, tmp_path):
  _, new, _, _ = exports
  old = tmp_path / "old"
  shutil.copytree(new, old)
  cfg = json.loads((old / "config.json").read_text())
  del cfg["temperature"]
  (old / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(export_format.ExportConfigError, match=r"config\.json: no \['temperature'\]"):
    tipsito.load(old)
