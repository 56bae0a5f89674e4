"""`python -m tipsito.evaluate` end to end on an export imported from the official-format TIPS weights.

Why: the issue requires that evaluate runs on imported official checkpoints; this exercises the real
chain (TIPS .npz import -> export -> tipsito.load -> built-in `shapes` data -> all four evals ->
table + JSON + PNG pictures) at tiny size. The export has no tokenizer, so the evals' fallback
tokenization (shipped demo model, vocab checked against the text tower) is exercised too.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tipsito.inference")
pytest.importorskip("tipsito.export")
convert = pytest.importorskip("tipsito.data.convert")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIPS = os.path.join(ROOT, "tests", "data", "tips_model")


def _env():
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
  return env


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("data")
  convert.convert(
    "shapes",
    str(d),
    config_name="tiny",
    image_size=56,
    split_sizes={"train": 40, "test": 12},
    num_workers=1,
    verbose=False,
  )
  return str(d)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("export") / "tips_tiny")
  subprocess.run(
    [
      sys.executable,
      "-m",
      "tipsito.export",
      "--tips_image_npz",
      os.path.join(TIPS, "tiny_vit_mlp_vision.npz"),
      "--tips_text_npz",
      os.path.join(TIPS, "tiny_text.npz"),
      "--output",
      out,
    ],
    check=True,
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    timeout=300,
  )
  return out


def test_evaluate_cli_on_imported_tips_export(shapes_dir, export_dir, tmp_path):
  out_json = tmp_path / "res" / "results.json"
  cfg = (
    f"{ROOT}/configs/eval_shapes.py:datasets=shapes/tiny,data_dir={shapes_dir},image_size=56,"
    "batch_size=8,num_pictures=2"
  )
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "tipsito.evaluate",
      "--config",
      cfg,
      "--checkpoint",
      export_dir,
      "--output",
      str(out_json),
    ],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  # The table is printed.
  assert "shapes_zeroshot" in proc.stdout and "miou" in proc.stdout and "i2t_r1" in proc.stdout
  res = json.loads(out_json.read_text())
  m = res["metrics"]
  assert res["kind"] == "export"
  for key in (
    "shapes_zeroshot/top1",
    "shapes_zeroshot/top5",
    "shapes_retrieval/i2t_r1",
    "shapes_retrieval/t2i_r10",
    "shapes_segmentation/miou",
    "shapes_knn/top1",
  ):
    assert key in m and 0.0 <= m[key] <= 100.0, key
  assert m["shapes_zeroshot/num_examples"] == 12 and m["shapes_knn/num_train"] == 40
  assert m["shapes_retrieval/num_texts"] == 36  # alt_text + 2 synthetic captions per image
  assert m["shapes_segmentation/num_classes"] == 9  # background + 8 shapes
  names = sorted(os.path.basename(p) for p in res["pictures"])
  assert names == ["shapes_segmentation_overlay_00000000.png", "shapes_segmentation_pca_00000000.png"]
  for p in res["pictures"]:
    assert os.path.getsize(p) > 0


def test_real_encoder_in_process_matches_conformance_zeroshot(export_dir):
  """The evaluators' cosine (normalised CLS1 vs normalised text) is the official zero-shot cosine."""
  from tipsito import inference
  from tipsito.evals import metrics

  vec = np.load(os.path.join(TIPS, "tips_vectors.npz"))
  enc = inference.load(export_dir)
  out = enc.embed_images(vec["images_224"], project=True)
  img = metrics.l2_normalize(np.asarray(out["cls"])[:, 0])
  txt = metrics.l2_normalize(np.asarray(enc.embed_texts(vec["text_ids"])))
  np.testing.assert_allclose(img @ txt.T, vec["vit_mlp_zeroshot_cos_224"], rtol=1e-4, atol=5e-5)


def test_not_a_checkpoint_is_reported(tmp_path):
  from tipsito import evaluate

  assert evaluate.is_export(str(tmp_path)) is False
  with pytest.raises((ValueError, FileNotFoundError)):
    evaluate.load_encoder(None, str(tmp_path))
