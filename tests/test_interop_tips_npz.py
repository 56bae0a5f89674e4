"""`--format tips_npz` is the exact inverse of the TIPS importer: official `.npz` -> import -> export ->
`.npz` gives the same arrays, bit for bit (tests/data/tips_model holds official-format files).

Why: the official code reads these files by key; a renamed key, a transposed kernel or a changed dtype
would load wrong or not at all there, and nothing else would notice.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from tipsito import export_format
from tipsito import tips_import
from tipsito.interop import sources
from tipsito.interop import tips_npz

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tips_dir(conformance_dir):
  return conformance_dir / "tips_model"


def _assert_same_npz(got_path, want_path):
  """Same keys, dtypes, shapes and bytes (0-d temperature included)."""
  with np.load(got_path, allow_pickle=False) as g, np.load(want_path, allow_pickle=False) as w:
    assert sorted(g.files) == sorted(w.files)
    for k in w.files:
      a, b = g[k], w[k]
      assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, a.shape, b.dtype, b.shape)
      assert a.tobytes() == b.tobytes(), k


def test_round_trip_is_bitwise_through_an_export(tips_dir, tmp_path):
  """official .npz -> tipsito export on disk -> `export --from E --format tips_npz` (the CLI) -> the same
  files."""
  for m in ("vit_mlp", "vit_swiglu"):
    vision, text = tips_dir / f"tiny_{m}_vision.npz", tips_dir / "tiny_text.npz"
    exp = tmp_path / f"export_{m}"
    sources.write(sources.from_tips_npz(vision, text), exp, "tipsito")
    out = tmp_path / f"npz_{m}"
    if m == "vit_mlp":  # the command line once; the library call for the other model
      subprocess.run(
        [sys.executable, "-m", "tipsito.export", f"--from={exp}", "--format=tips_npz", f"--output={out}"],
        check=True,
        cwd=ROOT,
        capture_output=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
      )
    else:
      sources.write(sources.load_source(exp), out, "tips_npz")
    assert sorted(os.listdir(out)) == ["text.npz", "vision.npz"]
    _assert_same_npz(out / "vision.npz", vision)
    _assert_same_npz(out / "text.npz", text)


def test_tokenizer_travels_with_the_weights(tips_dir, tmp_path):
  from tipsito.data import tokenizer as tok_lib

  model = sources.from_tips_npz(
    tips_dir / "tiny_vit_mlp_vision.npz", tips_dir / "tiny_text.npz", tok_lib.DEFAULT_TOKENIZER
  )
  sources.write(model, tmp_path / "n", "tips_npz")
  with open(tok_lib.DEFAULT_TOKENIZER, "rb") as f:
    assert (tmp_path / "n" / "tokenizer.model").read_bytes() == f.read()


def test_refuses_what_the_official_format_cannot_hold(tips_dir, tmp_path):
  icfg, tcfg, params, temp = tips_import.import_tips_npz(
    tips_dir / "tiny_vit_mlp_vision.npz", tips_dir / "tiny_text.npz"
  )
  kw = dict(text_config=tcfg, temperature=temp)
  clip_px = dict(icfg, pixel_mean=[0.48, 0.46, 0.41], pixel_std=[0.27, 0.26, 0.28])
  with pytest.raises(tips_npz.NotRepresentableError, match="pixel statistics.*hf_tipsv2"):
    tips_npz.write_tips_npz(tmp_path / "a", image_config=clip_px, params=params, **kw)
  proj = dict(params, image_proj={"kernel": np.zeros((64, 8), np.float32)})
  with pytest.raises(tips_npz.NotRepresentableError, match="image projection"):
    tips_npz.write_tips_npz(tmp_path / "b", image_config=icfg, params=proj, **kw)
  with pytest.raises(tips_npz.NotRepresentableError, match="flavour 'tips'"):
    tips_npz.write_tips_npz(
      tmp_path / "c",
      image_config=icfg,
      params=params,
      text_config=dict(tcfg, flavour="clip"),
      temperature=temp,
    )
  assert not any((tmp_path / d).exists() for d in "abc")  # refused before anything is written


def test_a_leaf_the_format_has_no_name_for_is_refused(tips_dir):
  icfg, _, params, temp = tips_import.import_tips_npz(
    tips_dir / "tiny_vit_mlp_vision.npz", tips_dir / "tiny_text.npz"
  )
  bad = dict(params, image=dict(params["image"], extra_leaf=np.zeros(3, np.float32)))
  with pytest.raises(tips_npz.NotRepresentableError, match="extra_leaf"):
    tips_npz.to_official(icfg, bad, temp)


def test_from_refuses_what_is_not_an_export(tmp_path):
  (tmp_path / "w" / "checkpoints").mkdir(parents=True)
  (tmp_path / "w" / "config.json").write_text('{"recipe": "tips"}')
  with pytest.raises(export_format.NotAnExportError, match="training workdir.*Tipsv2Model folder"):
    sources.load_source(tmp_path / "w")


def test_text_temperature_may_be_named_temperature(tips_dir, tmp_path):
  """The upstream loader accepts `temperature` for `temperature_contrastive` (its commit d0f55cb); so does
  the importer, and the exporter still writes the released name."""
  with np.load(tips_dir / "tiny_text.npz", allow_pickle=False) as f:
    flat = {k: f[k] for k in f.files}
  want_cfg, want_params, want_temp = tips_import.import_tips_text(dict(flat))
  renamed = dict(flat)
  renamed["temperature"] = renamed.pop("temperature_contrastive")
  np.savez(tmp_path / "text.npz", **renamed)
  cfg, params, temp = tips_import.import_tips_text(tmp_path / "text.npz")
  assert temp == want_temp and cfg == want_cfg
  import jax  # pylint: disable=g-import-not-at-top

  assert jax.tree.all(jax.tree.map(np.array_equal, params, want_params))
  both = dict(flat, temperature=np.asarray(float(want_temp) * 2, np.float32))
  with pytest.raises(tips_import.CheckpointFormatError, match="two different temperatures"):
    tips_import.import_tips_text(both)
  same = dict(flat, temperature=flat["temperature_contrastive"])
  assert tips_import.import_tips_text(same)[2] == want_temp
