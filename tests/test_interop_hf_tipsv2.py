"""`--format hf_tipsv2`: `transformers.Tipsv2Model.from_pretrained(DIR)` (offline) computes what tipsito
computes, and tipsito reads such folders back exactly.

Why: the HF port differs from the official towers in ways that are silent at load time (register token
instead of a second CLS, a CLS row in the position embedding, layer scale, exact GELU and text LayerNorm
eps 1e-5 by default, fused q/k/v); each is either written so that the outputs agree or folded on read.
The references are the official outputs (tests/data/tips_model, computed by running the official code)
and tipsito's own outputs for a model it trained (tests/interop_workdir.py). Pixel values are fed
directly (the HF image processor needs torchvision, which does not import beside the CPU torch build).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import tipsito  # noqa: E402
from interop_workdir import trained_workdir  # noqa: E402,F401  (session fixture)
from tipsito.train import exporting  # noqa: E402
from tipsito import inference  # noqa: E402
from tipsito import tips_import  # noqa: E402
from tipsito.interop import hf_tipsv2  # noqa: E402
from tipsito.interop import sources  # noqa: E402
from tipsito.interop import tips_npz  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # max abs difference allowed between HF and the reference (issue 24)
MODELS = ("vit_mlp", "vit_swiglu")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


def _cli(*args):
  subprocess.run(
    [sys.executable, "-m", "tipsito.export", *args], check=True, cwd=ROOT, env=ENV, capture_output=True
  )


def _load_hf(folder):
  model, info = transformers.Tipsv2Model.from_pretrained(
    folder, local_files_only=True, output_loading_info=True
  )
  return model.eval(), info


def _hf_image(model, nhwc):
  """(cls1, cls2, patches (B,h,w,D)) of HF's vision tower on normalised NHWC pixels."""
  x = torch.from_numpy(np.ascontiguousarray(np.asarray(nhwc, np.float32).transpose(0, 3, 1, 2)))
  with torch.no_grad():
    seq = model.get_image_features(pixel_values=x).last_hidden_state.numpy()
  b, _, h, w = x.shape
  p = model.config.vision_config.patch_size
  return seq[:, 0], seq[:, 1], seq[:, 2:].reshape(b, h // p, w // p, -1)


def _hf_text(model, ids):
  ids = torch.from_numpy(np.asarray(ids, np.int64))
  with torch.no_grad():
    return model.get_text_features(input_ids=ids, attention_mask=(ids != 0).long()).pooler_output.numpy()


def _maxdiff(a, b):
  return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture(scope="module")
def tips_dir(conformance_dir):
  return conformance_dir / "tips_model"


@pytest.fixture(scope="module")
def vectors(tips_dir):
  return dict(np.load(tips_dir / "tips_vectors.npz"))


@pytest.fixture(scope="module")
def official_hf(tips_dir, tmp_path_factory):
  """{model: HF folder} of the official-format conformance weights (the CLI for one, the library for the
  other)."""
  out = {}
  for m in MODELS:
    d = tmp_path_factory.mktemp(f"hf_{m}")
    vision, text = tips_dir / f"tiny_{m}_vision.npz", tips_dir / "tiny_text.npz"
    if m == "vit_mlp":
      _cli(f"--tips_image_npz={vision}", f"--tips_text_npz={text}", "--format=hf_tipsv2", f"--output={d}")
    else:
      sources.write(sources.from_tips_npz(vision, text), d, "hf_tipsv2")
    out[m] = d
  return out


@pytest.mark.parametrize("m", MODELS)
def test_official_weights_through_hf_give_the_official_outputs(official_hf, vectors, m):
  model, info = _load_hf(official_hf[m])
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  diffs = {}
  for size, key in (("224", "images_224"), ("448", "image_448")):
    cls1, cls2, patches = _hf_image(model, vectors[key])  # TIPS pixels: [0, 1], no mean/std
    diffs[f"cls1_{size}"] = _maxdiff(cls1, vectors[f"{m}_cls_{size}"][:, 0])
    diffs[f"cls2_{size}"] = _maxdiff(cls2, vectors[f"{m}_cls_{size}"][:, 1])
    diffs[f"patches_{size}"] = _maxdiff(patches, vectors[f"{m}_patch_{size}"])
  diffs["text"] = _maxdiff(_hf_text(model, vectors["text_ids"]), vectors["text_emb"])
  ids = torch.from_numpy(vectors["text_ids"].astype(np.int64))
  with torch.no_grad():
    logits = model(
      input_ids=ids,
      attention_mask=(ids != 0).long(),
      pixel_values=torch.from_numpy(vectors["images_224"].transpose(0, 3, 1, 2).copy()),
    ).logits_per_image
  diffs["zeroshot_probs"] = _maxdiff(logits.softmax(-1).numpy(), vectors[f"{m}_zeroshot_probs_224"])
  assert float(model.temperature) == pytest.approx(float(vectors["temperature"]), abs=1e-9)
  assert max(diffs.values()) < TOL, diffs
  print(m, {k: f"{v:.1e}" for k, v in diffs.items()})


def test_written_layout_and_config(official_hf):
  """The hub key layout (the one every transformers 5.x renames at load time) and the config that makes
  HF compute tipsito's GELU and LayerNorm."""
  from safetensors.numpy import load_file

  d = official_hf["vit_swiglu"]
  keys = set(load_file(str(d / "model.safetensors")))
  assert all(k.startswith(("vision_encoder.", "text_encoder.")) for k in keys)
  for k in (
    "vision_encoder.blocks.1.attn.qkv.weight",
    "vision_encoder.blocks.1.mlp.w12.weight",
    "vision_encoder.blocks.1.mlp.w3.bias",
    "vision_encoder.blocks.0.ls1.gamma",
    "vision_encoder.register_tokens",
    "vision_encoder.pos_embed",
    "text_encoder.transformer.resblocks.1.attn.in_proj_weight",
    "text_encoder.ln_final.bias",
  ):
    assert k in keys, k
  cfg = json.loads((d / "config.json").read_text())
  assert cfg["model_type"] == "tipsv2" and cfg["temperature_init_value"] == pytest.approx(0.0125)
  v, t = cfg["vision_config"], cfg["text_config"]
  assert (v["hidden_act"], v["layer_norm_eps"], t["layer_norm_eps"]) == ("gelu_pytorch_tanh", 1e-6, 1e-6)
  assert v["use_swiglu_ffn"] and v["num_register_tokens"] == 1 and v["image_size"] == 448
  state = load_file(str(d / "model.safetensors"))
  assert not state["vision_encoder.pos_embed"][:, 0].any()  # the CLS row: tipsito adds no posemb to CLS
  assert (state["vision_encoder.blocks.0.ls2.gamma"] == 1).all()


def test_hf_defaults_would_not_reproduce_the_official_outputs(official_hf, vectors, tmp_path):
  """Control for the written config: HF's default exact GELU moves the patches by more than TOL."""
  d = tmp_path / "exact_gelu"
  d.mkdir()
  (d / "model.safetensors").write_bytes((official_hf["vit_mlp"] / "model.safetensors").read_bytes())
  cfg = json.loads((official_hf["vit_mlp"] / "config.json").read_text())
  cfg["vision_config"]["hidden_act"] = "gelu"
  (d / "config.json").write_text(json.dumps(cfg))
  model, _ = _load_hf(d)
  _, _, patches = _hf_image(model, vectors["images_224"])
  assert _maxdiff(patches, vectors["vit_mlp_patch_224"]) > 2 * TOL


@pytest.fixture(scope="module")
def trained_hf(trained_workdir, tmp_path_factory):
  """(tipsito Encoder of the workdir's export, HF folder written by `export --workdir W --format
  hf_tipsv2`)."""
  wd, _, _ = trained_workdir
  out = tmp_path_factory.mktemp("hf_trained")
  _cli(f"--workdir={wd}", "--format=hf_tipsv2", f"--output={out}")
  enc = tipsito.load(exporting.export_from_workdir(str(wd), str(tmp_path_factory.mktemp("e"))))
  return enc, out


def test_trained_model_through_hf_gives_tipsitos_embeddings_and_probabilities(trained_hf):
  enc, folder = trained_hf
  model, info = _load_hf(folder)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  pre = json.loads((folder / "preprocessor_config.json").read_text())
  assert pre["do_normalize"] and pre["size"] == {"height": 32, "width": 32}  # trained at 32 px
  assert pre["resample"] == 3  # PIL bicubic, tipsito's eval resize
  mean, std = np.asarray(pre["image_mean"]), np.asarray(pre["image_std"])
  rng = np.random.default_rng(0)
  diffs = {}
  for size in (32, 48, 24):  # the native 4x4 grid, then HF's position-embedding interpolation up and down
    x = rng.integers(0, 256, (3, size, size, 3), dtype=np.uint8)
    pixel_values = (x / 255.0 - mean) / std  # what preprocessor_config.json tells HF's processor to do
    np.testing.assert_allclose(enc.preprocess(x, size, normalize=True), pixel_values, atol=1e-6)
    ref = enc.embed_images(x, values=False)
    cls1, cls2, patches = _hf_image(model, pixel_values)
    diffs[f"cls1_{size}"] = _maxdiff(cls1, ref["cls"][:, 0])
    diffs[f"cls2_{size}"] = _maxdiff(cls2, ref["cls"][:, 1])
    diffs[f"patches_{size}"] = _maxdiff(patches, ref["patches"])
  names = ["circle", "square", "triangle", "star"]
  tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
  prompts = [f"a photo of a {n}." for n in names]
  batch = tok(
    prompts, padding="max_length", max_length=enc.tokenizer.max_len, truncation=True, return_tensors="pt"
  )
  np.testing.assert_array_equal(batch["input_ids"].numpy(), enc.tokenize(prompts))
  diffs["text"] = _maxdiff(_hf_text(model, batch["input_ids"].numpy()), enc.embed_texts(prompts))
  x = rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
  with torch.no_grad():
    logits = model(
      pixel_values=torch.from_numpy(
        ((x / 255.0 - mean) / std).astype(np.float32).transpose(0, 3, 1, 2).copy()
      ),
      **batch,
    ).logits_per_image
  probs = enc.classify(x, names, templates=["a photo of a {}."])
  diffs["zeroshot_probs"] = _maxdiff(logits.softmax(-1).numpy(), probs)
  assert float(model.temperature) == pytest.approx(enc.temperature, rel=1e-6)
  assert max(diffs.values()) < TOL, diffs
  print({k: f"{v:.1e}" for k, v in diffs.items()})


def test_tokenizer_files_give_tipsitos_ids(trained_hf):
  enc, folder = trained_hf
  tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
  assert type(tok).__name__ == "Tipsv2Tokenizer"
  texts = ["a photo of a cat", "A Red SQUARE on a blue background!", "two  spaces", "a big " * 20, ""]
  got = tok(texts, padding="max_length", max_length=enc.tokenizer.max_len, truncation=True)["input_ids"]
  np.testing.assert_array_equal(np.asarray(got), enc.tokenize(texts))


def _flat(tree):
  from flax import traverse_util

  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(dict(tree), sep="/").items()}


def _assert_params_bitwise(a, b):
  fa, fb = _flat(a), _flat(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
    assert fa[k].tobytes() == fb[k].tobytes(), k


def test_reading_back_is_exact_in_every_layout(official_hf, tips_dir, tmp_path):
  """Our folder, a folder transformers saved (it adds the learned `temperature`) and a raw state dict in
  transformers' own parameter names all read back to the imported params, bit for bit."""
  from safetensors.torch import save_file

  _, _, want, temp = tips_import.import_tips_npz(
    tips_dir / "tiny_vit_swiglu_vision.npz", tips_dir / "tiny_text.npz"
  )
  src = official_hf["vit_swiglu"]
  mine = hf_tipsv2.read_hf_tipsv2(src)
  _assert_params_bitwise(mine["params"], want)
  assert mine["temperature"] == temp and mine["layout"] == "hub"
  assert mine["image_config"]["ffn"] == "swiglu" and mine["image_config"]["num_cls_tokens"] == 2
  model, _ = _load_hf(src)
  with torch.no_grad():
    model.temperature.fill_(0.02)
  model.save_pretrained(tmp_path / "saved")
  saved = hf_tipsv2.read_hf_tipsv2(tmp_path / "saved")
  _assert_params_bitwise(saved["params"], want)
  assert saved["temperature"] == pytest.approx(0.02)
  native = tmp_path / "native"
  native.mkdir()
  (native / "config.json").write_text((src / "config.json").read_text())
  sd = {k: v.contiguous() for k, v in model.state_dict().items()}
  assert any(".attention.q_proj." in k or ".attention.attention.query." in k for k in sd)  # native names
  save_file(sd, str(native / "model.safetensors"))
  back = hf_tipsv2.read_hf_tipsv2(native)
  assert back["layout"] == "native"
  _assert_params_bitwise(back["params"], want)


def test_reading_folds_layer_scale_and_a_cls_position_embedding(official_hf, tmp_path):
  """A Tipsv2 model with non-trivial layer scale and CLS position row (as other ports may have) gives the
  same outputs through tipsito as through HF."""
  from safetensors.numpy import load_file, save_file

  src = official_hf["vit_mlp"]
  state = load_file(str(src / "model.safetensors"))
  rng = np.random.default_rng(3)
  for k in state:
    if k.endswith(("ls1.gamma", "ls2.gamma")):
      state[k] = rng.uniform(0.2, 2.0, state[k].shape).astype(np.float32)
  state["vision_encoder.pos_embed"][:, 0] = rng.normal(size=64).astype(np.float32)
  d = tmp_path / "scaled"
  d.mkdir()
  save_file(state, str(d / "model.safetensors"))
  (d / "config.json").write_text((src / "config.json").read_text())
  model, _ = _load_hf(d)
  r = hf_tipsv2.read_hf_tipsv2(d)
  enc = inference.Encoder.from_params(r["image_config"], r["text_config"], r["params"], r["temperature"])
  x = rng.uniform(0, 1, (2, 56, 56, 3)).astype(np.float32)
  ref = enc.embed_images(x, values=False)
  cls1, cls2, patches = _hf_image(model, x)
  assert _maxdiff(cls1, ref["cls"][:, 0]) < TOL and _maxdiff(cls2, ref["cls"][:, 1]) < TOL
  assert _maxdiff(patches, ref["patches"]) < TOL
  plain = hf_tipsv2.read_hf_tipsv2(src)
  unscaled = inference.Encoder.from_params(plain["image_config"], plain["text_config"], plain["params"], 1.0)
  assert _maxdiff(patches, unscaled.embed_images(x, values=False)["patches"]) > 100 * TOL  # it mattered


def test_reader_is_strict_and_never_unpickles(official_hf, tmp_path):
  from safetensors.numpy import load_file, save_file

  src = official_hf["vit_mlp"]
  state = load_file(str(src / "model.safetensors"))

  def folder(name, st):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    if st is not None:
      save_file(st, str(d / "model.safetensors"))
    return d

  with pytest.raises(hf_tipsv2.CheckpointFormatError, match="vision_encoder.extra"):
    hf_tipsv2.read_hf_tipsv2(
      folder("extra", dict(state, **{"vision_encoder.extra": np.zeros(3, np.float32)}))
    )
  missing = dict(state)
  del missing["vision_encoder.blocks.1.attn.proj.bias"]
  with pytest.raises(hf_tipsv2.CheckpointFormatError, match=r"blocks\.1\.attn\.proj\.bias.*\(64,\)"):
    hf_tipsv2.read_hf_tipsv2(folder("missing", missing))
  bad = dict(state, **{"text_encoder.ln_final.bias": np.zeros(63, np.float32)})
  with pytest.raises(hf_tipsv2.CheckpointFormatError, match=r"ln_final\.bias.*\(63,\).*\(64,\)"):
    hf_tipsv2.read_hf_tipsv2(folder("misshapen", bad))
  pickled = folder("pickled", None)
  (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04 not a real pickle")
  with pytest.raises(hf_tipsv2.CheckpointFormatError, match="never opened"):
    hf_tipsv2.read_hf_tipsv2(pickled)


def test_clip_style_models_are_refused(tips_dir, tmp_path):
  icfg, tcfg, params, temp = tips_import.import_tips_npz(
    tips_dir / "tiny_vit_mlp_vision.npz", tips_dir / "tiny_text.npz"
  )
  proj = dict(params, image_proj={"kernel": np.zeros((64, 8), np.float32)})
  with pytest.raises(tips_npz.NotRepresentableError, match="image projection"):
    hf_tipsv2.write_hf_tipsv2(
      tmp_path / "x", image_config=icfg, text_config=tcfg, params=proj, temperature=temp
    )
  with pytest.raises(tips_npz.NotRepresentableError, match="not square"):
    hf_tipsv2.write_hf_tipsv2(
      tmp_path / "y",
      image_config=dict(icfg, posemb_grid=[32, 16]),
      text_config=tcfg,
      params=params,
      temperature=temp,
    )
  assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
