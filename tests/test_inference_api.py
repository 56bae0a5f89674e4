"""The load API around `tipsito.load`: `preprocess` (files, PIL images, arrays, single images), the default
of `project`, and `classify` (zero-shot probabilities).

Why: these are what a new user types first; each must compute what the evals compute (the eval decoder
and resize, the zero-shot protocol, the same projection default), or numbers from a notebook and from
`tipsito.evaluate` would disagree.
"""

import io

import numpy as np
import pytest
from PIL import Image

from tipsito import inference
from tipsito import tips_import
from tipsito.data import tokenizer as tok_lib
from tipsito.data import transforms as T
from tipsito.evals.registry import make_evaluator
from tipsito.config import presets

NAMES = ["circle", "square", "triangle"]


@pytest.fixture(scope="module")
def tips(conformance_dir):
  """(image config, text config, params, temperature) of the official-format conformance model."""
  d = conformance_dir / "tips_model"
  return tips_import.import_tips_npz(d / "tiny_vit_mlp_vision.npz", d / "tiny_text.npz")


def _encoder(tips, **image_overrides):
  icfg, tcfg, params, temp = tips
  return inference.Encoder.from_params(
    dict(icfg, **image_overrides), tcfg, params, temp, tok_lib.Tokenizer(None, max_len=16)
  )


@pytest.fixture(scope="module")
def enc(tips):
  return _encoder(tips)


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
  """A 50x70 RGB picture as PIL image and as PNG file."""
  rng = np.random.default_rng(5)
  arr = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
  img = Image.fromarray(arr)
  path = tmp_path_factory.mktemp("img") / "photo.png"
  img.save(path)
  return img, path, arr


def test_preprocess_is_the_eval_decoder_and_resize(enc, photo):
  img, path, arr = photo
  want = T.fixed_size_image(T.open_image(path.read_bytes()), 28, "center_crop").astype(np.float32) / 255
  for given in (path, str(path), img, arr, path.read_bytes()):  # one image of each kind -> a batch of 1
    got = enc.preprocess(given, 28)
    assert got.shape == (1, 28, 28, 3) and got.dtype == np.float32
    np.testing.assert_array_equal(got[0], want)
  both = enc.preprocess([path, img], 28)
  assert both.shape == (2, 28, 28, 3) and (both[0] == both[1]).all()
  squashed = enc.preprocess(img, 28, resize="resize")
  assert not np.array_equal(squashed[0], want)  # the other eval resize really is another resize
  assert enc.preprocess(img).shape == (1, 448, 448, 3)  # default: posemb grid 32 x patch 14
  with pytest.raises(FileNotFoundError, match="nope.png"):
    enc.preprocess(path.parent / "nope.png", 28)


def test_preprocess_normalize_gives_what_the_patch_embedding_sees(tips, photo):
  img, _, _ = photo
  enc = _encoder(tips, pixel_mean=list(presets.CLIP_PIXEL_MEAN), pixel_std=list(presets.CLIP_PIXEL_STD))
  x = enc.preprocess(img, 30)
  y = enc.preprocess(img, 30, normalize=True)
  assert y.shape == (1, 42, 42, 3)  # 30 px centre zero-padded to 3 patches of 14: 6 top/left, 6 bottom/right
  np.testing.assert_allclose(
    y[0, 6:36, 6:36],
    (x[0] - np.asarray(presets.CLIP_PIXEL_MEAN)) / np.asarray(presets.CLIP_PIXEL_STD),
    atol=1e-6,
  )
  assert not y[0, :6].any() and not y[0, 36:].any() and not y[0, :, :6].any()


def test_single_images_and_files_are_accepted_everywhere(enc, photo):
  img, path, _ = photo
  x = enc.preprocess([img, img], 28)
  one = enc.embed_images(x[0])
  assert one["cls"].shape == (1, 2, 64)
  np.testing.assert_array_equal(one["cls"], enc.embed_images(x[:1])["cls"])
  np.testing.assert_array_equal(enc.embed_images(path, size=28)["cls"], one["cls"])
  assert enc.classify(path, NAMES, size=28, templates="simple").shape == (1, 3)
  mixed = enc.embed_images([np.zeros((28, 28, 3)), np.zeros((14, 14, 3))], size=28)  # a list: resized
  assert mixed["cls"].shape == (2, 2, 64)
  np.testing.assert_allclose(mixed["cls"][0], mixed["cls"][1], atol=1e-6)  # both all-black at 28 px


def test_project_defaults_to_what_the_model_was_trained_with(tips):
  icfg, tcfg, params, temp = tips
  kernel = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
  clip_like = inference.Encoder.from_params(icfg, tcfg, dict(params, image_proj={"kernel": kernel}), temp)
  tips_like = inference.Encoder.from_params(icfg, tcfg, params, temp)
  assert clip_like.default_project and not tips_like.default_project
  x = np.random.default_rng(1).uniform(size=(2, 28, 28, 3)).astype(np.float32)
  np.testing.assert_array_equal(
    clip_like.embed_images(x)["cls"], clip_like.embed_images(x, project=True)["cls"]
  )
  assert clip_like.embed_images(x)["cls"].shape[-1] == 8
  assert clip_like.embed_images(x, project=False)["cls"].shape[-1] == 64

  class Recorder:
    def __init__(self, default):
      self.default_project, self.calls = default, []

    def embed_images(self, images, project=False):
      self.calls.append(project)
      return {"cls": np.zeros((len(images), 1, 4), np.float32)}

  for default in (False, True):  # the evals take the same default ...
    rec = Recorder(default)
    make_evaluator("zs", dict(type="zeroshot", dataset="fake")).embed_images(rec, x)
    assert rec.calls == [default]
  rec = Recorder(True)  # ... unless the eval says otherwise (kNN: backbone features)
  make_evaluator("knn", dict(type="knn", dataset="fake")).embed_images(rec, x)
  assert rec.calls == [False]


def test_classify_is_the_zeroshot_protocol(enc):
  x = np.random.default_rng(2).uniform(size=(4, 28, 28, 3)).astype(np.float32)
  templates = ["a photo of a {}.", "a drawing of a {}."]
  probs = enc.classify(x, NAMES, templates=templates)
  assert probs.shape == (4, 3) and probs.dtype == np.float32
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)
  ev = make_evaluator("zs", dict(type="zeroshot", dataset="fake", class_names=NAMES, templates=templates))
  class_emb = ev.class_text_embeddings(enc, NAMES, ev.templates())  # the eval's own class embeddings
  cls = np.asarray(enc.embed_images(x)["cls"][:, 0], np.float64)
  cls /= np.linalg.norm(cls, axis=-1, keepdims=True)
  logits = cls @ class_emb.T.astype(np.float64) / enc.temperature
  want = np.exp(logits - logits.max(-1, keepdims=True))
  np.testing.assert_allclose(probs, want / want.sum(-1, keepdims=True), atol=1e-5)
  np.testing.assert_array_equal(enc.classify(x, NAMES), enc.classify(x, NAMES, templates="imagenet80"))
  cls2 = enc.classify(x, NAMES, templates=templates, cls_index=1)
  assert not np.allclose(cls2, probs)  # the second CLS token is another embedding
  with pytest.raises(TypeError, match="list of names"):
    enc.classify(x, "circle")
