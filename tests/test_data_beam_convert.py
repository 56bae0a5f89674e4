"""Conversion on Apache Beam (tipsito/data/beam_convert.py) against the single-machine conversion.

Why: at pod scale the converter runs on Beam workers; the dataset it writes must be the one the
single-machine path writes (same records in the same shards and order, same skip report), a killed
job must resume without redoing or duplicating finished units, and none of this may depend on
which worker ran what. The inputs are the planted-fault webdataset tars and caption table of
tests/test_data_builders_generic.py. Beam runs as DirectRunner (Beam's FnApiRunner) with 2 worker
processes (multi_processing), the mode closest to a real runner that this machine has.
"""

import collections
import glob
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from tipsito import paths
from tipsito.data import convert
from tipsito.data.builders import _common

from test_data_builders_generic import _add, _corrupt_png, _jpeg, _png, table_dir, wds_dir  # noqa: F401  pylint: disable=unused-import

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# .ci/run runs this file a second time in its Beam environment with TIPSITO_REQUIRE_BEAM=1: there a
# missing Beam is a failure, not a skip.
beam = (
  __import__("apache_beam") if os.environ.get("TIPSITO_REQUIRE_BEAM") else pytest.importorskip("apache_beam")
)
BEAM_2_WORKERS = ["--beam_runner", "DirectRunner", "--num_workers", "2"]


def _shard_records(dataset_dir):
  """{shard file: [record as {feature: values}, in file order]} of every array_record shard.

  Records are compared parsed: tf.train.Example's serialized map order follows the writing process's
  hash seed, so two single-machine conversions already differ in bytes (not in content).
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from array_record.python import array_record_data_source as ards  # pylint: disable=import-outside-toplevel

  out = {}
  for path in sorted(glob.glob(os.path.join(dataset_dir, "*.array_record-*"))):
    src = ards.ArrayRecordDataSource([path])
    recs = []
    for i in range(len(src)):
      feats = tf.train.Example.FromString(src[i]).features.feature
      recs.append(
        {k: tuple(feats[k].bytes_list.value) + tuple(feats[k].int64_list.value) for k in sorted(feats)}
      )
    out[os.path.basename(path)] = recs
  return out


def _report(result):
  """The conversion_report.json of a ConvertResult."""
  with open(result.report_path, encoding="utf-8") as f:
    return json.load(f)


def _assert_same_dataset(single, on_beam):
  """Same shards holding the same records in the same order, same skip report, same split sizes."""
  a, b = _shard_records(single.dataset_dir), _shard_records(on_beam.dataset_dir)
  assert list(a) == list(b) and len(a) >= 2
  assert a == b
  ids = lambda shards: {(r["id"][0], r["image"][0]) for recs in shards.values() for r in recs}  # noqa: E731
  assert ids(a) == ids(b) and len(ids(b)) == single.split_sizes["train"]
  assert _report(on_beam) == _report(single)
  assert on_beam.split_sizes == single.split_sizes
  assert not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(on_beam.dataset_dir)), "_units"))


def test_webdataset_on_beam_equals_single_machine(wds_dir, tmp_path):  # noqa: F811
  """The planted-fault tars through 2 Beam workers: the single-machine dataset and report, each fault once."""
  args = ["webdataset", "--input", str(wds_dir), "--num_shards", "2"]
  single = convert.main(args + ["--data_dir", str(tmp_path / "single"), "--num_workers", "2"])
  on_beam = convert.main(args + ["--data_dir", str(tmp_path / "beam")] + BEAM_2_WORKERS)
  _assert_same_dataset(single, on_beam)
  skipped = _report(on_beam)["skipped"]
  assert collections.Counter((s["item"], s["reason"]) for s in skipped) == {
    ("shard-000000/0003", "zero-byte"): 1,
    ("shard-000000/0004", "corrupt image"): 1,
    ("shard-000000/0005", "non-UTF-8 caption"): 1,
    ("shard-000001/0006", "missing image"): 1,
    ("shard-000001/0007", "bad json"): 1,
    ("shard-000001/0008", "missing caption"): 1,
  }


def test_table_on_beam_equals_single_machine(table_dir, tmp_path):  # noqa: F811
  """The planted-fault caption table in units of 3 rows (4 units) through 2 Beam workers."""
  args = [
    "table",
    "--input",
    str(table_dir / "caps.tsv"),
    "--num_shards",
    "2",
    "--config_name",
    "mycaps",
    "--label_column",
    "label",
  ]
  single = convert.main(args + ["--data_dir", str(tmp_path / "single"), "--num_workers", "2"])
  on_beam = convert.main(
    args + ["--data_dir", str(tmp_path / "beam"), "--rows_per_unit", "3"] + BEAM_2_WORKERS
  )
  _assert_same_dataset(single, on_beam)
  skipped = _report(on_beam)["skipped"]
  assert sorted((os.path.basename(s["item"]), s["reason"]) for s in skipped) == [
    ("corrupt.png", "corrupt image"),
    ("gray.gif", "missing caption"),
    ("missing.png", "missing image"),
    ("ok1.png", "non-UTF-8 caption"),
    ("zero.png", "zero-byte"),
  ]


def test_exact_shards_many_boundaries(tmp_path):
  """60 rows into 7 shards (6 boundaries, in-memory runner, units of 9 rows): every shard is the
  single-machine writer's slice of the key-sorted records; the boundary search agrees with a sort."""
  import random  # pylint: disable=import-outside-toplevel
  from tipsito.data import beam_convert  # pylint: disable=import-outside-toplevel

  (tmp_path / "img").mkdir()
  rows = ["image\tcaption"]
  for i in range(60):
    (tmp_path / "img" / f"{i}.png").write_bytes(_png(i * 4, size=(4 + i % 5, 6)))
    rows.append(f"img/{i}.png\tcaption {i}")
  (tmp_path / "t.tsv").write_text("\n".join(rows) + "\n")
  args = ["table", "--input", str(tmp_path / "t.tsv"), "--num_shards", "7"]
  single = convert.main(args + ["--data_dir", str(tmp_path / "single"), "--num_workers", "1"])
  on_beam = convert.main(
    args
    + [
      "--data_dir",
      str(tmp_path / "beam"),
      "--rows_per_unit",
      "9",
      "--beam_runner",
      "DirectRunner",
      "--num_workers",
      "1",
    ]
  )
  _assert_same_dataset(single, on_beam)
  assert [len(r) for r in _shard_records(on_beam.dataset_dir).values()] == [9, 8, 9, 8, 9, 8, 9]

  rng = random.Random(0)
  writer = beam_convert.ExactShardBeamWriter
  for n, shards in ((60, 7), (1000, 13), (5, 5), (17, 1)):
    keys = sorted(rng.getrandbits(128) for _ in range(n))
    plan = {
      "num_shards": shards,
      "boundaries": [round(n * i / shards) for i in range(1, shards + 1)],
      "buckets": beam_convert.FINE_BUCKETS_PER_SHARD * shards,
    }
    by_bucket = collections.defaultdict(list)
    for k in keys:
      by_bucket[writer._bucket(k, plan)].append(k)
    needed = writer._needed(plan, {b: len(v) for b, v in by_bucket.items()})
    picked = sorted(jk for b in needed for jk in writer._pick((b, by_bucket[b]), needed))
    assert [k for _, k in picked] == [keys[r] for r in plan["boundaries"][:-1]]


def _tar(path, index, bad=False):
  """A webdataset tar of 3 samples (the second one corrupt if `bad`)."""
  with tarfile.open(path, "w") as t:
    for j in range(3):
      _add(t, f"{index:02d}{j}.png", _corrupt_png() if bad and j == 1 else _png(10 * index + j))
      _add(
        t,
        f"{index:02d}{j}.json",
        json.dumps({"caption": f"shard {index} sample {j}", "gemini": f"g {index}{j}"}).encode(),
      )


def test_killed_beam_conversion_resumes_without_redoing_finished_units(tmp_path):
  """A 2-worker Beam job over 4 tars, one of them a FIFO that blocks its reader, is SIGKILLed once
  units have committed. The finished units' tars are then deleted and the FIFO replaced by its real
  tar: the rerun of the same command equals the single-machine conversion, so the finished units
  were read back from the unit cache (not redone: their inputs are gone) and not written twice."""
  ref, job = tmp_path / "ref", tmp_path / "job"
  ref.mkdir()
  job.mkdir()
  for i in range(4):
    _tar(ref / f"shard-{i:06d}.tar", i, bad=(i == 1))
    if i != 2:
      shutil.copy(ref / f"shard-{i:06d}.tar", job / f"shard-{i:06d}.tar")
  os.mkfifo(job / "shard-000002.tar")
  common = ["--caption_columns", "gemini", "--num_shards", "2"]
  single = convert.main(
    ["webdataset", "--input", str(ref / "shard-{000000..000003}.tar"), "--data_dir", str(tmp_path / "single")]
    + common
  )
  out = tmp_path / "beam"
  cmd = (
    [
      sys.executable,
      "-m",
      "tipsito.data.convert",
      "webdataset",
      "--input",
      str(job / "shard-{000000..000003}.tar"),
      "--data_dir",
      str(out),
    ]
    + common
    + BEAM_2_WORKERS
  )
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
  log = open(tmp_path / "killed.log", "w")
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
  )
  marks = os.path.join(out, "_units", "webdataset", "default", "1.0.0", "train-*", "unit-*.json")
  try:
    deadline = time.time() + 300
    while not glob.glob(marks) and proc.poll() is None and time.time() < deadline:
      time.sleep(0.5)
    time.sleep(3)  # let the other worker commit what it can; the FIFO's unit never can
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
  done = sorted(int(os.path.basename(p)[5:11]) for p in glob.glob(marks))
  assert done and 2 not in done, (done, open(tmp_path / "killed.log").read()[-3000:])
  assert not os.path.exists(os.path.join(out, "webdataset", "1.0.0"))  # the job did not finish
  os.remove(job / "shard-000002.tar")
  shutil.copy(ref / "shard-000002.tar", job / "shard-000002.tar")
  for i in done:
    os.remove(job / f"shard-{i:06d}.tar")
  rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
  assert f"{len(done)} of 4 units already converted" in rerun.stdout
  on_beam = convert.convert(
    "webdataset",
    str(out),
    input_path=str(job / "shard-{000000..000003}.tar"),
    caption_columns=["gemini"],
    num_shards=2,
    verbose=False,
  )  # already prepared
  assert on_beam.report is None
  with open(os.path.join(on_beam.dataset_dir, _common.REPORT_FILENAME), encoding="utf-8") as f:
    assert json.load(f) == _report(single)
  assert _shard_records(on_beam.dataset_dir) == _shard_records(single.dataset_dir)
  assert _report(single)["by_reason"] == {"corrupt image": 1} and _report(single)["written"] == 11
  assert not os.path.exists(os.path.join(out, "_units"))


def test_unit_commits_only_when_complete_and_is_read_back(tmp_path):
  """A unit abandoned mid-way (a worker that died) leaves no commit mark and no records under the
  final name; converted to the end it commits; converted again it is read back, input untouched."""
  from tipsito.data import beam_convert  # pylint: disable=import-outside-toplevel
  from tipsito.data.builders import webdataset  # pylint: disable=import-outside-toplevel

  _tar(tmp_path / "s.tar", 0, bad=True)
  reader, cache = webdataset.ShardReader(["gemini"]), str(tmp_path / "cache")
  unit = pickle.dumps((str(tmp_path / "s.tar"), None))
  gen = beam_convert.convert_unit(reader, cache, 0, unit)
  first = next(gen)
  next(gen)  # the unit's last record: the worker dies before the unit ends
  gen.close()
  assert not glob.glob(os.path.join(cache, "unit-000000.json")) and not glob.glob(
    os.path.join(cache, "*.records")
  )
  records = list(beam_convert.convert_unit(reader, cache, 0, unit))
  assert records[0] == first and [k for k, _ in records] == ["s/000", "s/002"]
  report, missing = beam_convert.merge_reports(cache, 2, "webdataset")
  assert missing == [1] and (report.total, report.written) == (3, 2)
  assert [(s["item"], s["reason"]) for s in report.skipped] == [("s/001", "corrupt image")]
  os.remove(tmp_path / "s.tar")
  assert list(beam_convert.convert_unit(reader, cache, 0, unit)) == records
  small = (0, [{"image": "x.png", "caption": "bad \udcff byte"}])  # a non-UTF-8 row: str with a surrogate
  big = (1, [{"image": f"{i}.png", "caption": f"caption {i}"} for i in range(5000)])
  (i0, blob0), (i1, blob1) = beam_convert.unit_elements([small, big], cache)
  assert (i0, pickle.loads(blob0)) == (0, small)
  tag, path = pickle.loads(blob1)
  assert i1 == 1 and tag == "@file" and len(blob1) < 1000
  with open(path, "rb") as f:
    assert pickle.load(f) == big


def test_runner_and_options():
  """DirectRunner is Beam's FnApiRunner (no Prism download); --num_workers sets its worker processes."""
  from apache_beam.options import pipeline_options  # pylint: disable=import-outside-toplevel
  from apache_beam.runners.portability.fn_api_runner import fn_runner  # pylint: disable=import-outside-toplevel
  from tipsito.data import beam_convert  # pylint: disable=import-outside-toplevel

  runner, options = beam_convert.runner_and_options("DirectRunner", None, 2)
  assert isinstance(runner, fn_runner.FnApiRunner)
  direct = options.view_as(pipeline_options.DirectOptions)
  assert (direct.direct_num_workers, direct.direct_running_mode) == (2, "multi_processing")
  runner, options = beam_convert.runner_and_options("DirectRunner", "--direct_num_workers=3", 2)
  assert options.view_as(pipeline_options.DirectOptions).direct_num_workers == 3
  runner, options = beam_convert.runner_and_options("DataflowRunner", "--project=p --region=r", 8)
  assert runner == "DataflowRunner"
  assert options.view_as(pipeline_options.GoogleCloudOptions).project == "p"


def test_brace_ranges_and_unsupported_builder(tmp_path):
  """'{000..002}' keeps its padding, lists multiply; Beam refuses builders without units of work."""
  assert paths.expand_braces("s/{08..10}.tar") == ["s/08.tar", "s/09.tar", "s/10.tar"]
  assert paths.expand_braces("{a,b}-{0..1}") == ["a-0", "a-1", "b-0", "b-1"]
  assert paths.expand_braces("plain.tar") == ["plain.tar"]
  with pytest.raises(ValueError, match="table and webdataset"):
    convert.convert(
      "shapes",
      str(tmp_path),
      split_sizes={"train": 4, "test": 2},
      image_size=16,
      num_workers=1,
      verbose=False,
      beam_runner="DirectRunner",
    )


def test_all_skipped_on_beam_reports_like_single_machine(tmp_path):
  """Every image missing: on Beam too the conversion stops with the merged report and the flag that
  fixes it, and leaves no unit cache behind (nothing to resume)."""
  (tmp_path / "t.tsv").write_text("image\tcaption\n" + "".join(f"img/{i}.png\tc {i}\n" for i in range(5)))
  with pytest.raises(convert.ConversionError) as e:
    convert.convert(
      "table",
      str(tmp_path / "out"),
      input_path=str(tmp_path / "t.tsv"),
      num_workers=1,
      verbose=False,
      beam_runner="DirectRunner",
      rows_per_unit=2,
    )
  msg = str(e.value)
  assert "every input was skipped" in msg and "missing image: 5" in msg and "--image_root" in msg
  with open(tmp_path / "out" / f"table_{_common.REPORT_FILENAME}", encoding="utf-8") as f:
    rep = json.load(f)
  assert (rep["total"], rep["written"], rep["num_skipped"]) == (5, 0, 5)
  assert [os.path.basename(s["item"]) for s in rep["skipped"]] == [f"{i}.png" for i in range(5)]
  assert not os.path.exists(tmp_path / "out" / "_units")
