"""The procedural `scenes` testbed: determinism, the record contract, class/depth maps against the object
list and occlusion, captions against the objects present, and its tokenizer.

Why: every dense metric, probe and study on scenes trusts these per-pixel truths; a class map that let a
farther object win, a depth map off its object, or a caption naming an absent object would silently
corrupt all of them.
"""

import io
import re
import sys
import zlib

import numpy as np
import pytest
import sentencepiece as spm
from PIL import Image

from tipsito.data import convert
from tipsito.data import sources
from tipsito.data import tokenizer as tok_lib
from tipsito.data.builders import scenes_gen

TINY = dict(image_size=32, split_sizes={"train": 12, "validation": 4, "test": 4}, verbose=False)
SPLITS = ("train", "validation", "test")
SCENES_TOKENIZER = tok_lib.ASSETS_DIR + "/scenes_sp.model"


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
  """The same tiny scenes build twice into separate data dirs (one with 2 workers)."""
  a, b = tmp_path_factory.mktemp("scenes_a"), tmp_path_factory.mktemp("scenes_b")
  convert.convert("scenes", str(a), num_workers=1, **TINY)
  convert.convert("scenes", str(b), num_workers=2, **TINY)
  return a, b


def _raw_records(data_dir, split):
  """Every record of a split as {field: bytes | int | list} (the raw tf.train.Example, no TFDS decoding:
  what the stored bytes are, byte for byte)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  builder = tfds.builder_from_directory(sources.resolve_dataset_dir("scenes", str(data_dir)))
  src = builder.as_data_source(split=split, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
  proto = sources._example_proto()  # pylint: disable=protected-access
  out = []
  for i in range(len(src)):
    fmap = proto.FromString(src[i]).features.feature
    rec = {}
    for key, feat in fmap.items():
      kind = feat.WhichOneof("kind")
      rec[key] = list(getattr(feat, kind).value) if kind else []
    out.append(rec)
  return out


def _png(value):
  """Decoded PNG bytes (one-element list of a raw record) -> numpy array in its stored dtype."""
  return np.asarray(Image.open(io.BytesIO(value[0])))


def test_two_builds_are_byte_identical(two_builds):
  """1 and 2 workers, two data dirs: the same records in the same order, byte for byte, in every split."""
  a, b = two_builds
  for split in SPLITS:
    ra, rb = _raw_records(a, split), _raw_records(b, split)
    assert len(ra) == TINY["split_sizes"][split]
    assert ra == rb


def test_generator_is_a_pure_function_of_seed_split_index():
  """The same (seed, split, index) gives equal arrays; another split, index or seed gives another image."""
  x = scenes_gen.generate(3, split="test", image_size=32)
  y = scenes_gen.generate(3, split="test", image_size=32)
  assert all(np.array_equal(x[k], y[k]) for k in ("image", "segmentation", "depth"))
  assert x["caption_detailed"] == y["caption_detailed"]
  for other in (dict(split="train"), dict(split="validation"), dict(seed=1)):
    z = scenes_gen.generate(3, image_size=32, **{"split": "test", **other})
    assert not np.array_equal(x["image"], z["image"])
  assert not np.array_equal(x["image"], scenes_gen.generate(4, split="test", image_size=32)["image"])


def test_records_hold_the_generator_output(two_builds):
  """Every field of the contract, decoded, equals the generator's example (PNG dtypes: uint8 RGB image,
  uint8 class map; the depth a zlib-compressed uint16 (S,S,1) Tensor in mm). TFDS orders records by a hash
  of their key: the id names the index."""
  a, _ = two_builds
  for split in SPLITS:
    recs = _raw_records(a, split)
    ids = sorted(int(r["id"][0].decode().rsplit("-", 1)[1]) for r in recs)
    assert ids == list(range(TINY["split_sizes"][split]))
    for rec in recs:
      i = int(rec["id"][0].decode().rsplit("-", 1)[1])
      ex = scenes_gen.generate(i, split=split, image_size=32)
      image, seg = _png(rec["image"]), _png(rec["segmentation"])
      depth = np.frombuffer(zlib.decompress(rec["depth"][0]), "<u2").reshape(32, 32, 1)
      assert image.dtype == np.uint8 and image.shape == (32, 32, 3)
      assert seg.dtype == np.uint8 and depth.dtype == np.uint16
      np.testing.assert_array_equal(image, ex["image"])
      np.testing.assert_array_equal(seg, ex["segmentation"])
      np.testing.assert_array_equal(depth[..., 0], ex["depth"])
      assert rec["label"] == [ex["label"]] and rec["labels"] == ex["labels"]
      assert rec["objects/label"] == [o["label"] for o in ex["objects"]]
      assert rec["objects/visible_pixels"] == [o["visible_pixels"] for o in ex["objects"]]
      np.testing.assert_allclose(rec["objects/depth"], [o["depth_m"] for o in ex["objects"]], rtol=1e-6)
      assert len(rec["objects/bbox"]) == 4 * len(ex["objects"])
      for key in ("alt_text", "caption", "caption_detailed", "id"):
        assert rec[key] == [ex[key].encode()]


def test_plain_tfds_reads_every_field_without_opencv(two_builds, monkeypatch):
  """`sources.data_source("scenes")` (plain `tfds.builder_from_directory(...).as_data_source()`) decodes
  every field of every record with OpenCV unimportable, and the depth it returns holds the values the
  pipeline decoded from the former 16-bit PNG storage (`eval_input.decode_depth`), pixel for pixel."""
  from tipsito.data import eval_input

  monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` raises ImportError, installed or not
  with pytest.raises(ImportError):
    import cv2  # noqa: F401
  a, _ = two_builds
  for split in SPLITS:
    src = sources.data_source("scenes", split=split, data_dir=str(a))
    assert len(src) == TINY["split_sizes"][split]
    for i in range(len(src)):
      rec = src[i]
      n = int(rec["id"].decode().rsplit("-", 1)[1])
      ex = scenes_gen.generate(n, split=split, image_size=32)
      np.testing.assert_array_equal(rec["image"], ex["image"])
      np.testing.assert_array_equal(rec["segmentation"][..., 0], ex["segmentation"])
      assert rec["depth"].dtype == np.uint16 and rec["depth"].shape == (32, 32, 1)
      np.testing.assert_array_equal(rec["depth"][..., 0], ex["depth"].reshape(32, 32))
      old = io.BytesIO()  # the former storage: a 16-bit greyscale PNG of the same map
      Image.fromarray(np.ascontiguousarray(ex["depth"].reshape(32, 32).astype(np.uint16))).save(old, "PNG")
      before = eval_input.decode_depth(old.getvalue())
      after = eval_input.decode_depth(rec["depth"])
      assert after.dtype == before.dtype == np.float32
      np.testing.assert_array_equal(after, before)
      assert rec["caption_detailed"].decode() == ex["caption_detailed"]
      assert list(rec["labels"]) == ex["labels"] and int(rec["label"]) == ex["label"]
      np.testing.assert_allclose(rec["objects"]["depth"], [o["depth_m"] for o in ex["objects"]], rtol=1e-6)


def test_every_converted_image_field_is_one_pil_decodes():
  """Every image field of every builder `tipsito.data.convert` offers is 8-bit (TFDS decodes those with
  PIL; a 16-bit one needs OpenCV, which is no dependency). `table` and `webdataset` take their features
  from `_common.make_features`, checked through `scenes`."""
  import tempfile

  import tensorflow_datasets as tfds

  from tipsito.data import builders

  seen = 0
  for name in builders.BUILDERS:
    if name in ("table", "webdataset"):
      continue
    feats = builders.builder_class(name)(data_dir=tempfile.mkdtemp()).info.features
    for key, f in feats.items():
      if isinstance(f, tfds.features.Image):
        assert f.np_dtype == np.uint8, f"{name}.{key}: {f.np_dtype} images need OpenCV to decode"
        seen += 1
  assert seen >= 6


def _examples(n=60, size=48):
  """n generator examples of the test split (the maps' checks need no TFDS)."""
  return [scenes_gen.generate(i, split="test", image_size=size) for i in range(n)]


def test_class_map_is_the_nearest_object_and_counts_match():
  """Each pixel's class is that of the nearest object covering it (0 where none): recomputed here from the
  object list with a z-buffer; visible_pixels, label (most pixels, ties to the lower class) and labels agree."""
  for ex in _examples():
    s = ex["image"].shape[0]
    objs = ex["objects"]
    assert scenes_gen.MIN_OBJECTS <= len(objs) <= scenes_gen.MAX_OBJECTS
    assert len({o["label"] for o in objs}) == len(objs)  # different classes
    zbuf = np.full((s, s), np.inf)
    expect = np.zeros((s, s), np.uint8)
    for o in objs:
      m = scenes_gen.object_mask(o, s)
      nearer = m & (o["depth_m"] < zbuf)
      zbuf[nearer] = o["depth_m"]
      expect[nearer] = o["label"] + 1
    np.testing.assert_array_equal(ex["segmentation"], expect)
    counts = np.bincount(ex["segmentation"].ravel(), minlength=len(scenes_gen.CLASSES) + 1)[1:]
    for o in objs:
      assert o["visible_pixels"] == counts[o["label"]] > 0
      assert o["visible_pixels"] >= scenes_gen.MIN_VISIBLE * scenes_gen.object_mask(o, s).sum()
    assert ex["label"] == int(np.argmax(counts))  # argmax: the first (lower) class on ties
    assert ex["labels"] == sorted(int(c) for c in np.flatnonzero(counts))


def test_occlusion_happens_and_the_nearer_object_wins():
  """Some objects overlap; wherever two overlap, the farther one's class never shows."""
  overlaps = 0
  for ex in _examples():
    s = ex["image"].shape[0]
    objs = ex["objects"]
    for i, p in enumerate(objs):
      for q in objs[i + 1 :]:
        both = scenes_gen.object_mask(p, s) & scenes_gen.object_mask(q, s)
        if both.any():
          overlaps += 1
          far = p if p["depth_m"] > q["depth_m"] else q
          assert not np.any(ex["segmentation"][both] == far["label"] + 1)
  assert overlaps >= 20


def test_depth_map_follows_objects_and_ground():
  """Depth (uint16 mm, never 0) is the object's depth on its pixels and the ground gradient elsewhere
  (rows farther up are farther away); object depths lie within the ground's range."""
  for ex in _examples():
    s = ex["image"].shape[0]
    depth, seg = ex["depth"], ex["segmentation"]
    assert depth.dtype == np.uint16 and depth.min() > 0
    ground_mm = np.round(scenes_gen.ground_depth_m(s) * 1000)
    assert np.all(np.diff(ground_mm) < 0)  # top row farthest
    rows = np.broadcast_to(ground_mm[:, None], (s, s))
    np.testing.assert_array_equal(depth[seg == 0], rows[seg == 0])
    for o in ex["objects"]:
      assert np.all(depth[seg == o["label"] + 1] == round(o["depth_m"] * 1000))
      assert scenes_gen.NEAR_DEPTH_M <= o["depth_m"] <= scenes_gen.FAR_DEPTH_M
    assert 0 <= seg.min() and seg.max() <= len(scenes_gen.CLASSES)


def _named(text):
  """The class names a caption mentions, in order."""
  pattern = "|".join(re.escape(c) for c in scenes_gen.CLASSES)
  return re.findall(pattern, text)


def test_captions_name_exactly_the_objects_present():
  """caption and caption_detailed name every object once, largest first; alt_text names one or two of them."""
  for ex in _examples(200, 32):
    present = [scenes_gen.CLASSES[o["label"]] for o in ex["objects"]]  # largest first
    assert _named(ex["caption"]) == present
    assert _named(ex["caption_detailed"]) == present
    alt = _named(ex["alt_text"])
    assert 1 <= len(alt) <= 2 and len(set(alt)) == len(alt) and set(alt) <= set(present)
    assert scenes_gen.CLASSES[ex["label"]] == present[0]


def test_tokenizer_keeps_class_words_whole_and_never_cuts_a_caption():
  """The shipped scenes tokenizer: every class and prompt word one piece; every caption of 1,000 test
  examples within max_len 32 tokens, counting the 'clip' flavour's SOT and EOT."""
  sp = spm.SentencePieceProcessor(model_file=SCENES_TOKENIZER)
  for word in set(" ".join(scenes_gen.CLASSES).split()):
    assert sp.encode_as_pieces(word) == ["\u2581" + word]
  assert sp.unk_id() not in sp.encode(" ".join(p.format("background") for p in scenes_gen.PROMPTS))
  longest = 0
  for i in range(1000):
    ex = scenes_gen.generate(i, split="test", image_size=32)
    for key in ("alt_text", "caption", "caption_detailed"):
      ids = sp.encode(ex[key].lower())
      assert sp.unk_id() not in ids, ex[key]
      longest = max(longest, len(ids))
  assert longest + 2 <= 32, longest


def test_conversion_refuses_options_scenes_does_not_have(tmp_path):
  """Unknown splits, shapes-only options and a bad max_objects fail naming the option, writing nothing."""
  with pytest.raises(ValueError, match="unknown splits.*train, validation, test"):
    convert.convert("scenes", str(tmp_path), split_sizes={"dev": 4}, verbose=False)
  with pytest.raises(ValueError, match="colours only apply to shapes"):
    convert.convert("scenes", str(tmp_path), colours=("red",), verbose=False)
  with pytest.raises(ValueError, match="max_objects=99"):
    convert.convert("scenes", str(tmp_path), max_objects=99, verbose=False)
  assert not any(tmp_path.iterdir())


def test_eval_suite_and_configs_read_scenes_with_its_tokenizer():
  """The scenes suite has the four evals on held-out 'test' (kNN bank 'train'), prompts in the scenes
  words, retrieval on the one-per-image detailed captions; configs/eval_scenes.py and the demo's
  data=scenes use the scenes tokenizer and validate."""
  import importlib.util  # pylint: disable=g-import-not-at-top

  from tipsito.config import validation  # pylint: disable=g-import-not-at-top
  from tipsito.evals import registry  # pylint: disable=g-import-not-at-top

  suite = registry.builtin_evals("scenes", image_size=64)
  assert {e["type"] for e in suite.values()} == {"zeroshot", "retrieval", "segmentation", "knn"}
  assert all(e["split"] == "test" for e in suite.values()) and suite["scenes_knn"]["train_split"] == "train"
  assert (
    suite["scenes_zeroshot"]["templates"] == suite["scenes_segmentation"]["templates"] == scenes_gen.PROMPTS
  )
  assert suite["scenes_retrieval"]["caption_keys"] == ("caption_detailed",)
  root = __import__("pathlib").Path(__file__).resolve().parent.parent / "configs"
  for name, arg in (("eval_scenes.py", None), ("demo.py", "data=scenes,recipe=clip")):
    spec = importlib.util.spec_from_file_location(f"cfg_scenes_{name[:-3]}", root / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config(arg)
    assert c.tokenizer == SCENES_TOKENIZER
    if name == "demo.py":
      validation.validate(c)
      from tipsito.data import prepare  # pylint: disable=g-import-not-at-top

      prepare.check_tokenizer(c)  # the scenes tokenizer fits the demo's text tower
      assert c.data.name == "scenes" and c.evals.segmentation.templates == scenes_gen.PROMPTS


def test_default_build_has_2000_test_scenes_and_the_same_train_split(tmp_path):
  """Issue 42: the default build holds 2,000 test scenes (a dense metric's sampling error ~1 point), train
  and validation unchanged (examples are pure functions of (seed, split, index), so test scenes 0-199 are
  those of the 200-scene build 1.0.0). Only the split sizes are read: nothing is generated."""
  from tipsito.data.builders import scenes  # pylint: disable=g-import-not-at-top

  builder = scenes.Scenes(data_dir=str(tmp_path))
  assert builder.split_size_estimates() == {"train": 10000, "validation": 200, "test": 2000}
  assert str(builder.VERSION) == "1.1.0" and "1.0.0" in builder.RELEASE_NOTES
