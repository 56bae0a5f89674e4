"""Generic converters (caption table, image folder, webdataset tars) with planted bad inputs.

Why: real corpora contain broken files; the converter must skip exactly the bad ones, say why
(report JSON next to the data), shard the output, and keep every caption column.
"""

import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from tipsito.data import convert
from tipsito.data import sources


def _png(value, size=(12, 16)):
  """Encoded constant-colour PNG (test input)."""
  buf = io.BytesIO()
  Image.fromarray(np.full((*size, 3), value, np.uint8)).save(buf, "PNG")
  return buf.getvalue()


def _jpeg(value):
  """Encoded constant-colour JPEG (test input)."""
  buf = io.BytesIO()
  Image.fromarray(np.full((10, 10, 3), value, np.uint8)).save(buf, "JPEG")
  return buf.getvalue()


def _corrupt_png():
  """A noise PNG truncated mid-IDAT: the header opens, full decoding fails."""
  rng = np.random.default_rng(0)
  buf = io.BytesIO()
  Image.fromarray(rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)).save(buf, "PNG")
  data = buf.getvalue()
  return data[: len(data) // 2]  # truncated mid-IDAT


def _bad_report(result):
  """The conversion_report.json written next to the dataset."""
  with open(result.report_path, encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture
def table_dir(tmp_path):
  """A TSV table with 6 good rows and planted bad ones (zero-byte, corrupt, missing, empty, non-UTF-8)."""
  img = tmp_path / "images"
  img.mkdir()
  for i in range(5):
    (img / f"ok{i}.png").write_bytes(_png(i * 30))
  (img / "ok5.jpg").write_bytes(_jpeg(200))
  (img / "gray.gif").write_bytes(_png(5))  # a PNG with a .gif name is still fine
  (img / "zero.png").write_bytes(b"")
  (img / "corrupt.png").write_bytes(_corrupt_png())
  lines = [b"image\talt_text\tpaligemma\tgemini\tlabel"]
  for i in range(5):
    lines.append(
      f"images/ok{i}.png\tPicture {i}\tpg caption {i}\tgemini caption {i}\t{'cat' if i % 2 else 'dog'}".encode()
    )
  lines.append("images/ok5.jpg\t\u201cA jpeg\u201d\t\tgemini 5\tcat".encode())
  lines.append(b"images/zero.png\tzero\tx\tx\tdog")
  lines.append(b"images/corrupt.png\tcorrupt\tx\tx\tdog")
  lines.append(b"images/missing.png\tmissing\tx\tx\tdog")
  lines.append(b"images/gray.gif\t\tx\tx\tdog")  # empty alt-text
  lines.append(b"images/ok1.png\tbad \xff\xfe bytes\tx\tx\tdog")  # non-UTF-8 caption
  (tmp_path / "caps.tsv").write_bytes(b"\n".join(lines) + b"\n")
  return tmp_path


def test_table_skips_and_reports(table_dir, tmp_path):
  """Exactly the planted bad rows are skipped, per reason; caption columns and labels survive."""
  out = tmp_path / "tfds"
  result = convert.main(
    [
      "table",
      "--data_dir",
      str(out),
      "--input",
      str(table_dir / "caps.tsv"),
      "--num_workers",
      "2",
      "--num_shards",
      "2",
      "--config_name",
      "mycaps",
      "--label_column",
      "label",
    ]
  )
  rep = _bad_report(result)
  assert rep["total"] == 11 and rep["written"] == 6 and rep["num_skipped"] == 5
  assert rep["by_reason"] == {
    "zero-byte": 1,
    "corrupt image": 1,
    "missing image": 1,
    "missing caption": 1,
    "non-UTF-8 caption": 1,
  }
  assert result.split_sizes == {"train": 6}
  shards = [f for f in os.listdir(result.dataset_dir) if ".array_record-" in f]
  assert len(shards) == 2

  import tensorflow_datasets as tfds

  ds = tfds.data_source("table/mycaps", data_dir=str(out), decoders={"image": tfds.decode.SkipDecoding()})
  assert len(ds["train"]) == 6
  src, info = sources.open_source(
    {
      "name": "table/mycaps",
      "split": "train",
      "data_dir": str(out),
      "caption_keys": ("caption_paligemma", "caption_gemini"),
      "label_key": "label",
    }
  )
  assert info.label_names == ("cat", "dog")
  recs = sorted((src[i] for i in range(len(src))), key=lambda r: r["id"])
  alts = [r["alt_text"] for r in recs]
  assert sorted(alts) == ["A jpeg", "Picture 0", "Picture 1", "Picture 2", "Picture 3", "Picture 4"]
  by_alt = {r["alt_text"]: r for r in recs}
  assert by_alt["Picture 3"]["caption_paligemma"] == "pg caption 3"
  assert by_alt["Picture 3"]["captions"] == ("pg caption 3", "gemini caption 3")
  assert by_alt["Picture 3"]["label"] == 0 and by_alt["Picture 2"]["label"] == 1
  assert by_alt["A jpeg"]["image"][:2] == b"\xff\xd8"  # original JPEG bytes kept
  assert by_alt["A jpeg"]["caption_paligemma"] == ""


def test_image_folder_with_sidecar_captions(tmp_path):
  """Folder mode: images with .txt captions, missing/zero-byte ones reported."""
  d = tmp_path / "folder"
  (d / "sub").mkdir(parents=True)
  (d / "a.png").write_bytes(_png(1))
  (d / "a.txt").write_text("  A   red\tthing  \nsecond line\n")
  (d / "sub" / "b.jpg").write_bytes(_jpeg(9))
  (d / "sub" / "b.txt").write_text("b caption")
  (d / "c.png").write_bytes(_png(3))  # no caption
  (d / "z.png").write_bytes(b"")
  (d / "z.txt").write_text("zero")
  result = convert.convert("table", str(tmp_path / "out"), input_path=str(d), num_workers=1, verbose=False)
  assert result.report.by_reason == {"missing caption": 1, "zero-byte": 1}
  src, info = sources.open_source({"name": "table", "data_dir": str(tmp_path / "out"), "split": "train"})
  assert info.caption_keys == ()
  assert sorted(src[i]["alt_text"] for i in range(len(src))) == ["A red thing", "b caption"]


def _add(tar, name, data):
  """Adds an in-memory member to a tar."""
  ti = tarfile.TarInfo(name)
  ti.size = len(data)
  tar.addfile(ti, io.BytesIO(data))


@pytest.fixture
def wds_dir(tmp_path):
  """Two tar shards: 5 good samples and 6 planted bad ones."""
  d = tmp_path / "wds"
  d.mkdir()
  with tarfile.open(d / "shard-000000.tar", "w") as t:
    _add(t, "0001.png", _png(10))
    _add(t, "0001.txt", b"first caption")
    _add(t, "0001.json", json.dumps({"gemini": "gemini one", "url": "http://x"}).encode())
    _add(t, "0002.jpg", _jpeg(20))
    _add(t, "0002.json", json.dumps({"caption": "caption from json", "paligemma": "pg two"}).encode())
    _add(t, "0003.png", b"")
    _add(t, "0003.txt", b"zero-byte image")
    _add(t, "0004.png", _corrupt_png())
    _add(t, "0004.txt", b"corrupt image")
    _add(t, "0005.png", _png(50))
    _add(t, "0005.txt", b"bad \xff caption")
  with tarfile.open(d / "shard-000001.tar", "w") as t:
    _add(t, "sub/0001.png", _png(60))
    _add(t, "sub/0001.txt", "caf\u00e9 \u201cquoted\u201d".encode())
    _add(t, "0006.txt", b"caption without image")
    _add(t, "0007.png", _png(70))
    _add(t, "0007.json", b"{not json")
    _add(t, "0008.png", _png(80))
    _add(t, "0008.txt", b"   ")
    _add(t, "0009.png", _png(90, size=(7, 300)))
    _add(t, "0009.txt", b"extreme aspect ratio")
    _add(t, "0010.webp.png", _png(100))  # multi-dot extension: key 0010
    _add(t, "0010.txt", b"tenth")
  return d


def test_webdataset_skips_and_reports(wds_dir, tmp_path):
  """Exactly the planted bad samples are skipped, per reason; json captions become fields."""
  out = tmp_path / "tfds"
  result = convert.main(["webdataset", "--data_dir", str(out), "--input", str(wds_dir), "--num_workers", "2"])
  rep = _bad_report(result)
  assert rep["total"] == 11 and rep["written"] == 5, rep
  assert rep["by_reason"] == {
    "zero-byte": 1,
    "corrupt image": 1,
    "non-UTF-8 caption": 1,
    "missing image": 1,
    "bad json": 1,
    "missing caption": 1,
  }
  import tensorflow_datasets as tfds

  ds = tfds.data_source("webdataset", data_dir=str(out), decoders={"image": tfds.decode.SkipDecoding()})
  assert len(ds["train"]) == 5
  src, info = sources.open_source({"name": "webdataset", "data_dir": str(out), "split": "train"})
  assert info.caption_keys == ("caption_gemini", "caption_paligemma")
  recs = {src[i]["id"]: src[i] for i in range(len(src))}
  assert set(recs) == {
    "shard-000000/0001",
    "shard-000000/0002",
    "shard-000001/sub/0001",
    "shard-000001/0009",
    "shard-000001/0010",
  }
  assert recs["shard-000000/0001"]["caption_gemini"] == "gemini one"
  assert recs["shard-000000/0002"]["alt_text"] == "caption from json"
  assert recs["shard-000000/0002"]["caption_paligemma"] == "pg two"
  assert recs["shard-000001/sub/0001"]["alt_text"] == 'caf\u00e9 "quoted"'
  img = Image.open(io.BytesIO(recs["shard-000001/0009"]["image"]))
  assert img.size == (300, 7)


def test_cli_module_runs(tmp_path):
  """`python -m tipsito.data.convert` works as a process (argument parsing, exit code)."""
  out = tmp_path / "cli"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "tipsito.data.convert",
      "shapes",
      "--data_dir",
      str(out),
      "--config_name",
      "cli",
      "--image_size",
      "24",
      "--split_sizes",
      "train=6,test=2",
      "--num_workers",
      "1",
    ],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "{'train': 6, 'test': 2}" in proc.stdout
  src, _ = sources.open_source({"name": "shapes/cli", "data_dir": str(out), "split": "test"})
  assert len(src) == 2


def test_missing_input_errors(tmp_path):
  """Clear errors when the input is missing."""
  with pytest.raises(ValueError, match="--input"):
    convert.convert("table", str(tmp_path), verbose=False)
  with pytest.raises(FileNotFoundError, match="webdataset"):
    convert.convert("webdataset", str(tmp_path), input_path=str(tmp_path / "none*.tar"), verbose=False)


def test_num_shards_choice():
  """~4096 records per shard in the largest split, never more shards than the smallest split has."""

  class Fake:
    """Minimal stand-in for a builder."""

    def __init__(self, sizes):
      """Holds the fixed split sizes."""
      self.sizes = sizes

    def split_size_estimates(self):
      """Fixed sizes for the test."""
      return self.sizes

  assert convert.choose_num_shards(Fake({"train": 60000, "test": 10000})) == 15
  assert convert.choose_num_shards(Fake({"train": 60000, "test": 3})) == 3
  assert convert.choose_num_shards(Fake({"train": 100})) == 1
  assert convert.choose_num_shards(Fake({})) == 1
