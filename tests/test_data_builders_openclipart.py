"""The `openclipart` converter on a small tree of real package files plus planted faults.

Why: the converter joins two packages (PNG <-> SVG by path), parses RDF metadata, derives captions, masks
and a fixed split; these tests pin each of those rules on files whose metadata is known, and that every
planted fault (broken PNG, PNG without SVG, SVG without PNG, malformed SVG, file outside the category
folders) and the package's fully transparent PNGs is skipped and reported once with its reason, while an SVG without metadata is kept with the
title taken from the file name. The split is recomputed here from the rule the builder's docstring states.
"""

import hashlib
import io
import json
import os
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from tipsito.data import convert
from tipsito.data import sources

PKG = "/usr/share/openclipart"
pytestmark = pytest.mark.skipif(
  not (os.path.isdir(f"{PKG}/png") and os.path.isdir(f"{PKG}/svg")),
  reason="openclipart-png / openclipart-svg not installed",
)

MAX_SIDE = 160
# Real drawings copied as they are (relative paths without extension).
REAL = (
  "food/fries_ganson",  # 155x130 RGBA, title = description
  "geography/map_of_poland_guziec_",  # LA, a byte copy of the next one
  "signs_and_symbols/map_symbols/map_of_poland_guziec_",
  "signs_and_symbols/flags/europe/vatican",  # RGB: no transparency
  "food/beverages/apple_juice_box",  # 'test' by its name
  "computer/icons/atom_button_roman_bertle_01",  # P with tRNS, 50x20, noisy title
  "food/desserts/cone_alt1_bw",
  "food/vegetables/onion_joerg_rosenbauer_01",  # description 'HASH(0x...)', keyword '11'
  "shapes/stars/star_34pt05step",
)  # faint lines: alpha <= 72 everywhere
COPY = "containers/juice_box_copy"  # apple_juice_box's bytes under another name ('train' by its own name)
NO_META = "food/fruit/lime_slice_ganson"  # SVG with its <metadata> removed
BROKEN_PNG = "animals/crawfish2_bw_ganson"  # PNG truncated to 300 bytes
PNG_ONLY = "plants/albero_architetto_france_01"
SVG_ONLY = "animals/2_dead_frogs_lumen_desig_01"
BAD_SVG = "plants/acorn_jonathan_dietrich_01"  # SVG truncated mid-tag
STRAY = "stray"  # at the top, in no category folder
BLANK = "special/gradients/gradient-americana"  # real package PNG, alpha 0 everywhere
# The label order: the package's 22 category folders, sorted (as the builder's CATEGORIES lists them),
# read from the installed package rather than repeated here, so a reordered builder list fails below.
CATEGORIES = (
  tuple(sorted(e.name for e in os.scandir(f"{PKG}/png") if e.is_dir())) if os.path.isdir(PKG) else ()
)


def _rule(key: str) -> str:
  """The split rule of the builder's docstring, written out independently."""
  h = int(hashlib.sha256(("openclipart/" + key).encode()).hexdigest(), 16)
  return "test" if h % 100 < 10 else "train"


def _copy(src_rel, tree, dst_rel=None, kinds=("png", "svg")):
  """Copies the package's PNG and/or SVG of `src_rel` into `tree` (as `dst_rel`)."""
  for kind in kinds:
    dst = os.path.join(tree, kind, (dst_rel or src_rel) + "." + kind)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy(os.path.join(PKG, kind, src_rel + "." + kind), dst)
  rel = dst_rel or src_rel
  return os.path.join(tree, "png", rel + ".png"), os.path.join(tree, "svg", rel + ".svg")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """(tree, data_dir, ConvertResult, records by id with their split) of one conversion via the CLI."""
  tree = str(tmp_path_factory.mktemp("openclipart_tree"))
  for rel in REAL:
    _copy(rel, tree)
  _copy("food/beverages/apple_juice_box", tree, COPY)
  _, svg = _copy(NO_META, tree)
  with open(svg, encoding="utf-8") as f:
    text = re.sub(r"<metadata.*?</metadata>", "", f.read(), flags=re.S)
  assert "dc:title" not in text
  with open(svg, "w", encoding="utf-8") as f:
    f.write(text)
  png, _ = _copy(BROKEN_PNG, tree)
  with open(png, "r+b") as f:
    f.truncate(300)
  _copy(PNG_ONLY, tree, kinds=("png",))
  _copy(SVG_ONLY, tree, kinds=("svg",))
  _, svg = _copy(BAD_SVG, tree)
  with open(svg, "r+b") as f:
    f.truncate(500)
  _copy("food/fries_ganson", tree, STRAY)
  _copy(BLANK, tree)
  data_dir = str(tmp_path_factory.mktemp("openclipart_data"))
  result = convert.main(
    [
      "openclipart",
      "--data_dir",
      data_dir,
      "--input",
      tree,
      "--num_workers",
      "1",
      "--image_size",
      str(MAX_SIDE),
    ]
  )
  records = {}
  for split in result.split_sizes:
    src, _ = sources.open_source(
      {"name": "openclipart", "split": split, "data_dir": data_dir, "label_key": "label"}
    )
    for i in range(len(src)):
      r = src[i]
      records[r["id"]] = dict(r, split=split)
  return tree, data_dir, result, records


def test_report_names_each_planted_fault_once(built):
  """Each planted fault is skipped exactly once with its reason; the SVG without metadata is kept."""
  tree, _, result, _ = built
  rep = result.report
  assert rep.by_reason == {
    "corrupt image": 1,
    "missing caption": 1,
    "missing image": 1,
    "bad svg": 1,
    "unknown category": 1,
    "blank image": 1,
  }
  skipped = {s["item"]: s["reason"] for s in rep.skipped}
  assert skipped == {
    os.path.join(tree, "png", BROKEN_PNG + ".png"): "corrupt image",
    os.path.join(tree, "png", PNG_ONLY + ".png"): "missing caption",
    os.path.join(tree, "svg", SVG_ONLY + ".svg"): "missing image",
    os.path.join(tree, "svg", BAD_SVG + ".svg"): "bad svg",
    os.path.join(tree, "png", STRAY + ".png"): "unknown category",
    os.path.join(tree, "png", BLANK + ".png"): "blank image",
  }
  assert len(rep.skipped) == 6 and rep.total == 17 and rep.written == 11
  assert rep.notes["title from file name"] == 1  # NO_META only
  assert rep.notes["no object pixel"] == 1 and rep.notes["opaque"] == 1  # the star; vatican
  on_disk = json.load(open(result.report_path, encoding="utf-8"))
  assert on_disk["by_reason"] == rep.by_reason and on_disk["stats"]["notes"] == rep.notes
  assert sum(sum(c.values()) for c in on_disk["stats"]["per_split"].values()) == 11
  assert on_disk["stats"]["per_split"]["train"]["food"] == sum(
    1 for r in built[3].values() if r["split"] == "train" and r["id"].startswith("openclipart/food/")
  )


def test_records_ids_labels_and_captions(built):
  """Ids, labels (top folder), alt-texts (dc:title or the stem) and both caption granularities."""
  records = built[3]
  assert set(records) == {f"openclipart/{r}" for r in REAL + (COPY, NO_META)}
  for rid, r in records.items():
    assert r["label"] == CATEGORIES.index(rid.split("/")[1])
    assert set(r["captions"]) == {r["caption_short"], r["caption_detailed"]}
    assert len(r["caption_detailed"]) > len(r["caption_short"])
  fries = records["openclipart/food/fries_ganson"]
  assert fries["alt_text"] == "Fries"
  assert fries["caption_short"] == "a drawing of a food item: food, fries, menu"
  assert fries["caption_detailed"] == "Fries. A clip art drawing of a food item, tagged food, fries, menu."
  atom = records["openclipart/computer/icons/atom_button_roman_bertle_01"]
  assert atom["alt_text"] == "atom_button"  # titles are kept as written (noisy, like web alt-text)
  assert atom["caption_short"] == "a drawing of a computer icon: web, icon, atom"
  assert atom["caption_detailed"] == (
    "Button to indicate a link to an Atom feed on the web. A clip art "
    "drawing of a computer icon, tagged web, icon, atom, button."
  )
  onion = records["openclipart/food/vegetables/onion_joerg_rosenbauer_01"]  # 'HASH(0x...)' dropped
  assert onion["caption_detailed"] == (
    "Onion. A clip art drawing of a food item, tagged onion, food, 11, "
    "plants, plantsvegetablesonion, vegetable, vegetables."
  )
  lime = records[f"openclipart/{NO_META}"]
  assert lime["alt_text"] == "lime slice ganson"
  assert lime["caption_short"] == "a drawing of a food item"
  assert lime["caption_detailed"] == "lime slice ganson. A clip art drawing of a food item."


def _alpha(rel):
  """(H, W) alpha of a package PNG (255 without transparency)."""
  return np.asarray(Image.open(os.path.join(PKG, "png", rel + ".png")).convert("RGBA"))[..., 3]


def test_images_and_segmentation_from_alpha(built):
  """RGB on white, max side MAX_SIDE, masks = label + 1 where alpha >= 128, 0 elsewhere."""
  records = built[3]
  for r in records.values():
    img = np.asarray(Image.open(io.BytesIO(r["image"])))
    seg = np.asarray(Image.open(io.BytesIO(r["segmentation"])))
    assert img.ndim == 3 and img.shape[2] == 3 and max(img.shape[:2]) <= MAX_SIDE
    assert seg.shape == img.shape[:2] and set(np.unique(seg)) <= {0, r["label"] + 1}
  # Not downscaled (155x130): exact mask, and the composite on white.
  fries = records["openclipart/food/fries_ganson"]
  rgba = np.asarray(Image.open(os.path.join(PKG, "png/food/fries_ganson.png")).convert("RGBA"))
  rgba = rgba.astype(float)
  seg = np.asarray(Image.open(io.BytesIO(fries["segmentation"])))
  np.testing.assert_array_equal(seg, (rgba[..., 3] >= 128) * (CATEGORIES.index("food") + 1))
  a = rgba[..., 3:] / 255.0
  img = np.asarray(Image.open(io.BytesIO(fries["image"]))).astype(float)
  assert np.abs(img - (rgba[..., :3] * a + 255.0 * (1 - a))).max() <= 1.0
  assert (img[rgba[..., 3] == 0] == 255).all()
  # Downscaled (480x446 -> 160x149): same shape ratio and object fraction as the original's alpha.
  pol = records["openclipart/geography/map_of_poland_guziec_"]
  seg = np.asarray(Image.open(io.BytesIO(pol["segmentation"])))
  assert seg.shape == (149, 160)
  assert abs((seg > 0).mean() - (_alpha("geography/map_of_poland_guziec_") >= 128).mean()) < 0.02
  # Faint lines (alpha < 128 everywhere): drawn in the image, no object pixel in the mask.
  star = records["openclipart/shapes/stars/star_34pt05step"]
  assert (np.asarray(Image.open(io.BytesIO(star["segmentation"]))) == 0).all()
  assert np.asarray(Image.open(io.BytesIO(star["image"]))).min() < 200
  # No transparency: the flag fills its canvas, every pixel is the object.
  vat = records["openclipart/signs_and_symbols/flags/europe/vatican"]
  seg = np.asarray(Image.open(io.BytesIO(vat["segmentation"])))
  assert seg.shape == (MAX_SIDE, MAX_SIDE) and (seg == CATEGORIES.index("signs_and_symbols") + 1).all()


def test_split_is_the_documented_hash_rule(built):
  """Split = hash of the group's smallest file name; byte copies under another name follow their group."""
  records = built[3]
  assert _rule("juice_box_copy.png") == "train" and _rule("apple_juice_box.png") == "test"  # the premise
  for rid, r in records.items():
    name = os.path.basename(rid) + ".png"
    key = "apple_juice_box.png" if name == "juice_box_copy.png" else name
    assert r["split"] == _rule(key), rid
  assert records[f"openclipart/{COPY}"]["split"] == "test"
  assert {r["split"] for r in records.values()} == {"train", "test"}
  sizes = {s: sum(r["split"] == s for r in records.values()) for s in ("train", "test")}
  assert built[2].split_sizes == sizes


def test_eval_suite_and_data_preset():
  """The built-in suite reads 'test' (kNN bank: 'train'); the preset samples both synthetic captions."""
  from tipsito.config import defaults
  from tipsito.evals import registry

  evs = registry.builtin_evals("openclipart", image_size=64)
  assert sorted(evs) == [
    "openclipart_knn",
    "openclipart_retrieval",
    "openclipart_segmentation",
    "openclipart_zeroshot",
  ]
  assert {c["split"] for c in evs.values()} == {"test"}
  assert evs["openclipart_knn"]["train_split"] == "train"
  names = registry.make_evaluator("z", evs["openclipart_zeroshot"]).class_names()
  assert len(names) == 22 and names[CATEGORIES.index("signs_and_symbols")] == "sign or symbol"
  assert tuple(defaults.data_config("openclipart").caption_keys) == ("caption_short", "caption_detailed")
  for name, cfg in evs.items():
    registry.make_evaluator(name, cfg)


def test_preset_caption_keys_exist_in_records(built):
  """config.data.caption_keys of the preset name real fields of the converted records."""
  from tipsito.config import defaults

  d = defaults.data_config("openclipart", data_dir=built[1], label_key="label")
  src, info = sources.open_source(d, split="train")
  assert info.caption_keys == ("caption_short", "caption_detailed") and info.num_classes == 22
  assert all(src[0][k] for k in info.caption_keys)


def test_missing_package_is_a_clear_error(tmp_path):
  """Without the packages the converter names them and the --input flag."""
  with pytest.raises(FileNotFoundError, match="openclipart-png.*--input"):
    convert.main(["openclipart", "--data_dir", str(tmp_path / "d"), "--input", str(tmp_path / "none")])
