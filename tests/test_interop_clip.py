"""`--format hf_clip` / `--format open_clip`: a tiny ITO model tipsito trained, opened by transformers'
`CLIPModel` (and by OpenCLIP when it imports), gives tipsito's own embeddings and zero-shot probabilities.

Why: CLIP-style models (clip, ito; siglip to open_clip) leave tipsito through these two formats; both are
a renaming of the OpenCLIP-shaped towers, so the written state dicts are compared with the independent
mapping table of tests/test_models_openclip.py, and the numbers with tipsito's. OpenCLIP needs
torchvision, which does not import beside the CPU torch build CI installs: its numerical test skips then
(see README, "Using a trained model", for how to run it), while the OpenCLIP file is checked here against
the config it ships (every name and shape OpenCLIP's `CLIP(**model_cfg)` has) and run through the numpy
forward written from OpenCLIP's equations (tests/test_models_openclip.py: ref_image, ref_text).
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
from interop_workdir import make_trained_workdir  # noqa: E402
from test_models_openclip import ref_image, ref_text, to_state_dicts  # noqa: E402
from tipsito.interop import clip  # noqa: E402
from tipsito.interop import sources  # noqa: E402
from tipsito.train import exporting  # noqa: E402
from tipsito.interop.tips_npz import NotRepresentableError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # max abs difference allowed (issue 24), as tests/test_interop_hf_tipsv2.py
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
NAMES = ["circle", "square", "triangle", "star"]
TEMPLATES = ["a photo of a {}."]


def _cli(*args, check=True):
  return subprocess.run(
    [sys.executable, "-m", "tipsito.export", *args],
    check=check,
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
  )


def _maxdiff(a, b):
  return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture(scope="module")
def ito(tmp_path_factory):
  """(workdir, tipsito Encoder of its export, source Model, hf_clip folder, open_clip folder) of a tiny
  ITO run (OpenCLIP towers: width 64, 2 layers, 8-px patches on a 4x4 grid, clip tokenizer)."""
  root = tmp_path_factory.mktemp("ito")
  wd = root / "workdir"
  wd.mkdir()
  make_trained_workdir(wd, "ito")
  hf, oc = root / "hf", root / "oc"
  _cli(f"--workdir={wd}", "--format=hf_clip", f"--output={hf}")
  _cli(f"--workdir={wd}", "--format=open_clip", f"--output={oc}")
  enc = tipsito.load(exporting.export_from_workdir(str(wd), str(root / "e")))
  return wd, enc, exporting.model_from_workdir(str(wd)), hf, oc


def _images(n=3, size=32, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _pixels(x, mean, std):
  """NCHW float32 as CLIPImageProcessor / OpenCLIP's Normalize produce them (no resize: native size)."""
  return torch.from_numpy(
    ((x / 255.0 - np.asarray(mean)) / np.asarray(std)).astype(np.float32).transpose(0, 3, 1, 2).copy()
  )


def test_hf_clip_gives_tipsitos_embeddings_and_probabilities(ito):
  _, enc, _, folder, _ = ito
  model, info = transformers.CLIPModel.from_pretrained(
    folder, local_files_only=True, output_loading_info=True
  )
  model.eval()
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  pre = json.loads((folder / "preprocessor_config.json").read_text())
  assert pre["crop_size"] == {"height": 32, "width": 32} and pre["resample"] == 3
  x = _images()
  pixels = _pixels(x, pre["image_mean"], pre["image_std"])
  np.testing.assert_allclose(
    enc.preprocess(x, 32, normalize=True), pixels.numpy().transpose(0, 2, 3, 1), atol=1e-6
  )
  prompts = [t.format(n) for n in NAMES for t in TEMPLATES]
  ids = torch.from_numpy(enc.tokenize(prompts).astype(np.int64))
  with torch.no_grad():
    img = model.get_image_features(pixel_values=pixels).pooler_output.numpy()
    txt = model.get_text_features(input_ids=ids, attention_mask=(ids != 0).long()).pooler_output.numpy()
    out = model(pixel_values=pixels, input_ids=ids, attention_mask=(ids != 0).long())
  diffs = {
    "image": _maxdiff(img, enc.embed_images(x, values=False)["cls"][:, 0]),  # projected (ITO)
    "text": _maxdiff(txt, enc.embed_texts(prompts)),
    "zeroshot_probs": _maxdiff(
      out.logits_per_image.softmax(-1).numpy(), enc.classify(x, NAMES, templates=TEMPLATES)
    ),
  }
  assert float(model.logit_scale.detach().exp()) == pytest.approx(1.0 / enc.temperature, rel=1e-6)
  assert max(diffs.values()) < TOL, diffs
  print({k: f"{v:.1e}" for k, v in diffs.items()})


def test_hf_clip_config_makes_hf_compute_tipsitos_towers(ito):
  """Exact GELU, LayerNorm 1e-5, the clip tokenizer's EOT as eos_token_id, the native image size."""
  _, enc, _, folder, _ = ito
  cfg = json.loads((folder / "config.json").read_text())
  v, t = cfg["vision_config"], cfg["text_config"]
  assert (v["hidden_act"], t["hidden_act"]) == ("gelu", "gelu")
  assert v["layer_norm_eps"] == t["layer_norm_eps"] == 1e-5
  assert (t["eos_token_id"], t["bos_token_id"]) == (enc.tokenizer.eot_id, enc.tokenizer.sot_id)
  assert t["eos_token_id"] != 2  # else HF would pool at argmax (legacy branch), not at the first EOT
  assert v["image_size"] == 32 and v["patch_size"] == 8 and cfg["projection_dim"] == 64
  assert (folder / "tokenizer.model").read_bytes() == open(enc.tokenizer.model_path, "rb").read()


def test_written_state_dicts_are_the_mapping_table(ito):
  """Both files hold exactly tests/test_models_openclip.py's mapping of the export tree, bit for bit,
  plus logit_scale = ln(1 / T)."""
  from safetensors.numpy import load_file

  _, enc, model, hf, oc = ito
  want_oc, want_hf = to_state_dicts(model.params, 2, 2)
  for got, want in (
    (load_file(str(oc / clip.OPEN_CLIP_WEIGHTS_FILE)), want_oc),
    (load_file(str(hf / clip.HF_WEIGHTS_FILE)), want_hf),
  ):
    scale = got.pop("logit_scale")
    assert scale.shape == () and float(scale) == pytest.approx(np.log(1 / enc.temperature), rel=1e-6)
    assert sorted(got) == sorted(want)
    for k in want:
      assert got[k].dtype == np.float32 and got[k].shape == want[k].shape, k
      assert got[k].tobytes() == np.ascontiguousarray(want[k], np.float32).tobytes(), k


def _openclip_names_from_config(model_cfg):
  """{name: shape} of OpenCLIP's `CLIP(**model_cfg)` state dict for a ViT with learnable positions,
  class-token pooling, ln_pre, no layer scale, a linear text projection without bias (OpenCLIP's
  VisionTransformer / TextTransformer / CLIP attributes), derived from the config alone."""
  v, t, e = model_cfg["vision_cfg"], model_cfg["text_cfg"], model_cfg["embed_dim"]
  d, p, g = v["width"], v["patch_size"], v["image_size"] // v["patch_size"]
  out = {
    "visual.conv1.weight": (d, 3, p, p),
    "visual.class_embedding": (d,),
    "visual.positional_embedding": (g * g + 1, d),
    "visual.proj": (d, e),
    "token_embedding.weight": (t["vocab_size"], t["width"]),
    "positional_embedding": (t["context_length"], t["width"]),
    "text_projection": (t["width"], e),
    "logit_scale": (),
  }
  for n in ("ln_pre", "ln_post"):
    out[f"visual.{n}.weight"] = out[f"visual.{n}.bias"] = (d,)
  out["ln_final.weight"] = out["ln_final.bias"] = (t["width"],)
  for pre, w, layers in (
    ("visual.transformer.resblocks.", d, v["layers"]),
    ("transformer.resblocks.", t["width"], t["layers"]),
  ):
    m = int(w * (v if pre.startswith("visual") else t)["mlp_ratio"])
    for i in range(layers):
      o = f"{pre}{i}."
      out.update(
        {
          o + "ln_1.weight": (w,),
          o + "ln_1.bias": (w,),
          o + "ln_2.weight": (w,),
          o + "ln_2.bias": (w,),
          o + "attn.in_proj_weight": (3 * w, w),
          o + "attn.in_proj_bias": (3 * w,),
          o + "attn.out_proj.weight": (w, w),
          o + "attn.out_proj.bias": (w,),
          o + "mlp.c_fc.weight": (m, w),
          o + "mlp.c_fc.bias": (m,),
          o + "mlp.c_proj.weight": (w, m),
          o + "mlp.c_proj.bias": (w,),
        }
      )
  if "init_logit_bias" in model_cfg:
    out["logit_bias"] = ()
  return out


def test_open_clip_file_matches_its_config_and_the_reference_forward(ito):
  from safetensors.numpy import load_file

  _, enc, _, _, oc = ito
  cfg = json.loads((oc / clip.OPEN_CLIP_CONFIG_FILE).read_text())
  m, pre = cfg["model_cfg"], cfg["preprocess_cfg"]
  v, t = m["vision_cfg"], m["text_cfg"]
  assert (v["width"] // v["head_width"], t["heads"]) == (4, 4)
  assert "quick_gelu" not in m and "norm_kwargs" not in v and "act_kwargs" not in t  # nn.GELU, eps 1e-5
  assert t["pool_type"] == "argmax" and t["eos_id"] == enc.tokenizer.eot_id == t["vocab_size"] - 1
  assert pre["size"] == 32 and pre["interpolation"] == "bicubic"
  assert m["init_logit_scale"] == pytest.approx(np.log(1 / enc.temperature))
  sd = {k: a.astype(np.float64) for k, a in load_file(str(oc / clip.OPEN_CLIP_WEIGHTS_FILE)).items()}
  assert {k: a.shape for k, a in sd.items()} == _openclip_names_from_config(m)
  x = _images(seed=1)
  img, _ = ref_image(
    sd, x, hf=False, depth=v["layers"], heads=v["width"] // v["head_width"], mean=pre["mean"], std=pre["std"]
  )
  prompts = [f"a photo of a {n}." for n in NAMES]
  ids = enc.tokenize(prompts)
  txt, _ = ref_text(sd, ids, hf=False, depth=t["layers"], heads=t["heads"])
  diffs = {
    "image": _maxdiff(img, enc.embed_images(x, values=False)["cls"][:, 0]),
    "text": _maxdiff(txt, enc.embed_texts(prompts)),
  }
  assert max(diffs.values()) < TOL, diffs


def test_open_clip_opens_the_folder(ito):
  """OpenCLIP itself (optional: needs torchvision; see the README's "Using a trained model")."""
  try:
    import open_clip  # pylint: disable=import-outside-toplevel
  except Exception as e:  # noqa: BLE001 (torchvision beside the CPU torch fails with a RuntimeError)
    pytest.skip(
      f"open_clip does not import here ({type(e).__name__}: {str(e)[:80]}); "
      "pip install open_clip_torch with a torch + torchvision pair that import together"
    )
  _, enc, _, _, oc = ito
  model = open_clip.create_model(f"local-dir:{oc}").eval()
  pre = json.loads((oc / clip.OPEN_CLIP_CONFIG_FILE).read_text())["preprocess_cfg"]
  x = _images(seed=2)
  prompts = [t.format(n) for n in NAMES for t in TEMPLATES]
  ids = torch.from_numpy(enc.tokenize(prompts).astype(np.int64))
  with torch.no_grad():
    img = model.encode_image(_pixels(x, pre["mean"], pre["std"])).numpy()
    txt = model.encode_text(ids).numpy()
    scale = float(model.logit_scale.detach().exp())
  imn = img / np.linalg.norm(img, axis=-1, keepdims=True)
  txn = txt / np.linalg.norm(txt, axis=-1, keepdims=True)
  logits = scale * imn @ txn.T
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  diffs = {
    "image": _maxdiff(img, enc.embed_images(x, values=False)["cls"][:, 0]),
    "text": _maxdiff(txt, enc.embed_texts(prompts)),
    "zeroshot_probs": _maxdiff(probs, enc.classify(x, NAMES, templates=TEMPLATES)),
  }
  assert scale == pytest.approx(1.0 / enc.temperature, rel=1e-5)
  assert max(diffs.values()) < TOL, diffs
  print({k: f"{v:.1e}" for k, v in diffs.items()})


def test_tips_style_models_are_refused_before_anything_is_written(conformance_dir, tmp_path):
  """A TIPS model (two CLS tokens, TIPS text tower) names the reason and the TIPS formats, via the CLI."""
  d = conformance_dir / "tips_model"
  for fmt in ("hf_clip", "open_clip"):
    out = tmp_path / fmt
    r = _cli(
      f"--tips_image_npz={d / 'tiny_vit_mlp_vision.npz'}",
      f"--tips_text_npz={d / 'tiny_text.npz'}",
      f"--format={fmt}",
      f"--output={out}",
      check=False,
    )
    assert r.returncode != 0
    assert f"--format {fmt}: the image tower has 2 CLS tokens" in r.stderr and "hf_tipsv2" in r.stderr
    assert not out.exists()


def test_siglip_goes_to_open_clip_with_its_bias_and_not_to_hf_clip(ito, tmp_path):
  _, _, model, _, _ = ito
  siglip = sources.Model(
    model.image_config,
    model.text_config,
    model.params,
    model.temperature,
    model.tokenizer_path,
    dict(model.extra, recipe="siglip"),
  )
  with pytest.raises(NotRepresentableError, match=r"--format hf_clip: this is a SigLIP model.*open_clip"):
    sources.write(siglip, tmp_path / "hf", "hf_clip")
  with pytest.raises(NotRepresentableError, match=r"logit bias is not known.*--workdir W"):
    sources.write(siglip, tmp_path / "oc", "open_clip")  # an export without the bias
  assert not (tmp_path / "hf").exists() and not (tmp_path / "oc").exists()
  siglip.extra["logit_bias"] = -9.5
  from safetensors.numpy import load_file

  out = sources.write(siglip, tmp_path / "oc", "open_clip")
  sd = load_file(os.path.join(out, clip.OPEN_CLIP_WEIGHTS_FILE))
  cfg = json.loads(open(os.path.join(out, clip.OPEN_CLIP_CONFIG_FILE)).read())["model_cfg"]
  assert float(sd["logit_bias"]) == -9.5 and cfg["init_logit_bias"] == -9.5
  assert {k: a.shape for k, a in sd.items()} == _openclip_names_from_config(cfg)


def test_siglip_workdir_carries_its_bias(tmp_path):
  """`--workdir` of a SigLIP run knows the trained bias (the export keeps the towers only)."""
  from tipsito.config import defaults
  from tipsito.train import checkpointing, step as step_lib, workdir as workdir_lib

  c = defaults.tiny_config("siglip", image_size=32)
  setup = step_lib.build(c)
  state = setup.init_state()
  workdir_lib.save_config(c, str(tmp_path))
  ckpt = checkpointing.Checkpointer(str(tmp_path / "checkpoints"), every_steps=1, keep=1, async_save=False)
  ckpt.save(1, state, force=True)
  ckpt.close()
  m = exporting.model_from_workdir(str(tmp_path))
  assert m.extra["recipe"] == "siglip" and m.extra["logit_bias"] == pytest.approx(-10.0)


@pytest.mark.parametrize("fmt", ["hf_tipsv2", "tips_npz"])
def test_tips_formats_point_clip_models_here(ito, tmp_path, fmt):
  _, _, model, _, _ = ito
  with pytest.raises(
    NotRepresentableError, match=rf"--format {fmt}: .*image projection.*hf_clip or open_clip"
  ):
    sources.write(model, tmp_path / fmt, fmt)
  assert not (tmp_path / fmt).exists()
