"""Data on gs://, against the loopback GCS emulator of tests/test_gcs_emulator.py (fixture `gcs_env`).

Why: at pod scale the inputs, the converted dataset and the training reads all live in a bucket.
Conversion reads tars / tables / images from gs:// (etils epath over gcsfs), writes the dataset into
a gs:// data_dir (array_record's writer opens local files only, so each shard is written locally and
uploaded: tipsito/data/builders/_storage.py), single-machine and on Beam; training reads the
array_record shards from gs:// with grain. array_record's reader (C++, google-cloud-cpp) reaches the
emulator through `CLOUD_STORAGE_EMULATOR_ENDPOINT`; without it, it goes to the real endpoint and a
read hangs (tests/test_gcs_emulator.py's run reads a local copy for that reason).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_data_builders_generic import _add, _corrupt_png, _jpeg, _png, table_dir, wds_dir  # noqa: F401  pylint: disable=unused-import
from test_gcs_emulator import BUCKET, ROOT, gcs_env  # noqa: F401  pylint: disable=unused-import


def _run(script, env, *args, timeout=900):
  """Runs `script` in a subprocess with the emulator environment; returns its RESULT json."""
  env = {**env, "CLOUD_STORAGE_EMULATOR_ENDPOINT": env["STORAGE_EMULATOR_HOST"]}
  r = subprocess.run(
    [sys.executable, "-c", script, *map(str, args)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  lines = [s for s in r.stdout.splitlines() if s.startswith("RESULT ")]
  assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-5000:]
  return json.loads(lines[-1][len("RESULT ") :])


CONVERT = textwrap.dedent("""\
    import glob, json, logging, os, sys
    from etils import epath
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    import tensorflow as tf
    from array_record.python import array_record_data_source as ards
    from tipsito.data import convert
    wds, table, local, G = sys.argv[1], sys.argv[2], sys.argv[3], f"gs://{sys.argv[4]}/{sys.argv[5]}"
    beam = sys.argv[5] == "beam"
    folder = os.path.join(local, "folder")  # image-folder mode: sidecar captions, one missing, one zero-byte
    os.makedirs(os.path.join(folder, "sub"))
    from PIL import Image
    Image.new("RGB", (12, 9), (200, 10, 10)).save(os.path.join(folder, "a.png"))
    open(os.path.join(folder, "a.txt"), "w").write("a red thing")
    Image.new("RGB", (8, 8), (10, 200, 10)).save(os.path.join(folder, "sub", "b.jpg"))
    open(os.path.join(folder, "sub", "b.txt"), "w").write("b caption")
    Image.new("RGB", (8, 8)).save(os.path.join(folder, "c.png"))
    open(os.path.join(folder, "z.png"), "wb").close()
    open(os.path.join(folder, "z.txt"), "w").write("zero")
    for src, dst in ((wds, f"{G}/in/wds"), (table, f"{G}/in/table"), (folder, f"{G}/in/folder")):
      for root, _, files in os.walk(src):
        for f in files:
          p = os.path.join(root, f)
          (epath.Path(dst) / os.path.relpath(p, src)).write_bytes(open(p, "rb").read())

    def shards(dataset_dir):  # records per shard file, parsed, read with array_record (gs:// or local)
      names = sorted(os.path.basename(os.fspath(p)) for p in epath.Path(dataset_dir).glob("*.array_record-*"))
      out = {}
      for n in names:
        src = ards.ArrayRecordDataSource([os.path.join(dataset_dir, n)])
        recs = []
        for i in range(len(src)):
          f = tf.train.Example.FromString(src[i]).features.feature
          recs.append({k: [v.hex() for v in f[k].bytes_list.value] + list(f[k].int64_list.value) for k in sorted(f)})
        out[n] = recs
      return out

    def report(r):
      d = json.loads(epath.Path(r.report_path).read_text())
      d["skipped"] = sorted((os.path.basename(s["item"]), s["reason"]) for s in d["skipped"])
      return d

    runs = {
        "wds": (["webdataset", "--input", os.path.join(wds, "shard-{000000..000001}.tar")],
                ["webdataset", "--input", f"{G}/in/wds/shard-{{000000..000001}}.tar"]),
        "wds_dir": (["webdataset", "--input", wds], ["webdataset", "--input", f"{G}/in/wds"]),
        "table": (["table", "--input", os.path.join(table, "caps.tsv"), "--label_column", "label"],
                  ["table", "--input", f"{G}/in/table/caps.tsv", "--label_column", "label"]),
        "folder": (["table", "--input", folder, "--config_name", "folder"],
                   ["table", "--input", f"{G}/in/folder", "--config_name", "folder"]),
    }
    extra = ["--beam_runner", "DirectRunner", "--num_workers", "2", "--rows_per_unit", "4"] if beam else []
    out = {}
    for key, (local_args, gs_args) in runs.items():
      a = convert.main(local_args + ["--data_dir", os.path.join(local, key), "--num_shards", "2"])
      b = convert.main(gs_args + ["--data_dir", f"{G}/tfds_{key}", "--num_shards", "2"] + extra)
      out[key] = {"dataset_dir": b.dataset_dir, "sizes": [a.split_sizes, b.split_sizes],
                  "same_records": shards(a.dataset_dir) == shards(b.dataset_dir),
                  "num_shards": len(shards(b.dataset_dir)), "same_report": report(a) == report(b),
                  "report": report(b), "units_left": epath.Path(f"{G}/tfds_{key}/_units").exists()}
    print("RESULT " + json.dumps(out))
    """)


@pytest.mark.parametrize("mode", ["single", "beam"])
def test_conversion_from_and_to_gs(gcs_env, wds_dir, table_dir, tmp_path, mode):  # noqa: F811
  """Tars (brace range and folder), a caption table whose images are relative to a gs:// table, and an
  image folder with sidecar captions, converted into gs:// data dirs: the records, shards and report
  of the same local conversion."""
  if mode == "beam" and not os.environ.get("TIPSITO_REQUIRE_BEAM"):  # .ci/run's Beam environment sets it
    pytest.importorskip("apache_beam")
  out = _run(CONVERT, gcs_env, wds_dir, table_dir, tmp_path / "local", BUCKET, mode)
  for key, res in out.items():
    assert res["dataset_dir"].startswith(f"gs://{BUCKET}/{mode}/tfds_{key}/"), res
    assert res["sizes"][0] == res["sizes"][1] and res["same_records"] and res["num_shards"] == 2, (key, res)
    assert res["report"]["written"] >= 2, (key, res)
    assert res["same_report"] and not res["units_left"], (key, res)
  assert out["wds"]["report"]["by_reason"] == {
    "zero-byte": 1,
    "corrupt image": 1,
    "non-UTF-8 caption": 1,
    "missing image": 1,
    "bad json": 1,
    "missing caption": 1,
  }
  assert out["folder"]["report"]["skipped"] == [["c.png", "missing caption"], ["z.png", "zero-byte"]]
  assert out["table"]["report"]["skipped"] == [
    ["corrupt.png", "corrupt image"],
    ["gray.gif", "missing caption"],
    ["missing.png", "missing image"],
    ["ok1.png", "non-UTF-8 caption"],
    ["zero.png", "zero-byte"],
  ]


TRAIN = textwrap.dedent("""\
    import json, logging, os, sys
    import jax, numpy as np
    from etils import epath
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    from tipsito.config import defaults
    from tipsito.data import convert, sources
    from tipsito.train import checkpointing, loop, step as step_lib
    local, G = sys.argv[1], "gs://" + sys.argv[2]
    data = os.path.join(local, "data")
    convert.convert("shapes", data, split_sizes={"train": 32, "test": 8}, image_size=32, verbose=False,
                    num_workers=1)
    for root, _, files in os.walk(data):
      for f in files:
        p = os.path.join(root, f)
        (epath.Path(G) / "tfds" / os.path.relpath(p, data)).write_bytes(open(p, "rb").read())

    def cfg(data_dir):
      c = defaults.tiny_config("clip", batch_size=8, total_steps=4)
      c.max_len = 16
      c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
      c.model.image.update(dict(depth=1, posemb_grid=4))
      c.data = defaults.data_config("shapes", data_dir=data_dir, caption_keys=("caption_detailed",))
      c.ckpt.update(dict(every_steps=1, keep=3, async_save=False))
      c.export.dir = None
      return c

    src, info = sources.open_source({"name": "shapes", "split": "train", "data_dir": f"{G}/tfds"})
    ref, _ = sources.open_source({"name": "shapes", "split": "train", "data_dir": data})
    out = {"dataset_dir": info.dataset_dir, "len": len(src),
           "records_equal": [src[i]["image"] for i in range(len(src))] == [ref[i]["image"] for i in range(len(ref))]}
    on_gs, on_local = os.path.join(local, "run_gs"), os.path.join(local, "run_local")
    loop.train_and_evaluate(cfg(f"{G}/tfds"), on_gs, max_steps=2)          # stopped after 2 steps
    loop.train_and_evaluate(cfg(f"{G}/tfds"), on_gs)                       # resumed, reads gs:// again
    loop.train_and_evaluate(cfg(data), on_local)                           # uninterrupted, local files

    def final_state(workdir):
      setup = step_lib.build(cfg(data))
      abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
      ck = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0, keep=1, async_save=False)
      state, _ = ck.restore(abstract)
      ck.close()
      return [np.asarray(x) for x in jax.tree.leaves(state)], int(state.step)

    (a, step_a), (b, step_b) = final_state(on_gs), final_state(on_local)
    out["steps"] = [step_a, step_b]
    out["bitwise_equal"] = len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))
    print("RESULT " + json.dumps(out))
    """)


def test_training_reads_gs_dataset_resumed_equals_local(gcs_env, tmp_path):
  """A run whose dataset is in the emulator's bucket, stopped after 2 steps and resumed to 4, ends in
  the same TrainState, bitwise, as an uninterrupted 4-step run on the local files."""
  out = _run(TRAIN, gcs_env, tmp_path, BUCKET)
  assert out["dataset_dir"] == f"gs://{BUCKET}/tfds/shapes/default/1.0.0" and out["len"] == 32
  assert out["records_equal"]
  assert out["steps"] == [4, 4]
  assert out["bitwise_equal"]
