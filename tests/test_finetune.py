"""Continuing pretraining from released weights (docs/finetuning.md): every `config.init_from` kind loads
the towers bit for bit, a wrong one is refused before anything is written, and the whole path runs on the
tiny conformance weights (tests/data/tips_model/): import, continue with the tipsv2 recipe (CLIP, DINO,
iBOT++), evals, export, reload.

Why: the path used to break at its second command (an export, the format the importer writes, was not
accepted as `init_from`), and a run from released weights must start exactly from them: the towers at
step 0 are compared with the imported ones bit for bit, not approximately. The tiny text tower has the
official 32,000-row embedding but no tokenizer ships with it, so the tests pad the scenes SentencePiece
model to 32,000 pieces (`padded_tokenizer`): the ids the captions get are the scenes model's, the rows
above them are never used.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors")

import tipsito  # noqa: E402
from tipsito.config import init_source  # noqa: E402
from tipsito.config import validation as config_validation  # noqa: E402
from tipsito.data import prepare as data_prepare  # noqa: E402
from tipsito.data import tokenizer as tok_lib  # noqa: E402
from tipsito.interop import sources  # noqa: E402
from tipsito.models import kwargs as kwargs_lib  # noqa: E402
from tipsito.train import assembly  # noqa: E402
from tipsito.train import loop  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIPS = ROOT / "tests" / "data" / "tips_model"
VISION, TEXT = TIPS / "tiny_vit_mlp_vision.npz", TIPS / "tiny_text.npz"
SIZE = 28  # two patches of 14: the smallest global crop of the tiny towers


def _finetune_module():
  spec = importlib.util.spec_from_file_location("_test_finetune_cfg", ROOT / "configs" / "finetune.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _flat(tree) -> dict:
  from flax import traverse_util

  flat = traverse_util.flatten_dict(dict(jax.device_get(tree)), sep="/")
  return {k: np.asarray(v) for k, v in flat.items()}


def _bitwise(a, b, drop=("mask_token",)) -> bool:
  fa = {k: v for k, v in _flat(a).items() if k not in drop}
  fb = {k: v for k, v in _flat(b).items() if k not in drop}
  return sorted(fa) == sorted(fb) and all(
    fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape and fa[k].tobytes() == fb[k].tobytes()
    for k in fa
  )


@pytest.fixture(scope="module")
def padded_tokenizer(tmp_path_factory) -> str:
  """The scenes SentencePiece model with unused pieces up to the tiny text tower's 32,000 rows."""
  from sentencepiece import sentencepiece_model_pb2 as pb

  m = pb.ModelProto()
  m.ParseFromString(pathlib.Path(tok_lib.ASSETS_DIR, "scenes_sp.model").read_bytes())
  for i in range(32000 - len(m.pieces)):
    p = m.pieces.add()
    p.piece, p.score, p.type = f"<unused{i}>", -1e9, pb.ModelProto.SentencePiece.UNUSED
  out = tmp_path_factory.mktemp("tok") / "tokenizer.model"
  out.write_bytes(m.SerializeToString())
  return str(out)


@pytest.fixture(scope="module")
def imported(tmp_path_factory, padded_tokenizer):
  """(export E of the tiny official weights, as `python -m tipsito.export --tips_image_npz V
  --tips_text_npz T --output E` writes it, the imported params)."""
  e = str(tmp_path_factory.mktemp("imported") / "E")
  sources.export_tips_npz(str(VISION), str(TEXT), e, tokenizer=padded_tokenizer)
  return e, sources.from_tips_npz(str(VISION), str(TEXT)).params


def tiny(source, **args):
  """configs/finetune.py from `source` at CPU size: small heads, two local crops, few eval images."""
  a = dict(recipe="tipsv2", steps=2, batch=8, size=SIZE, warmup=1, data="scenes")
  a.update(args)
  c = _finetune_module().get_config(",".join([f"from={source}"] + [f"{k}={v}" for k, v in a.items()]))
  c.model.heads.update(dict(num_prototypes=64, hidden_dim=32, bottleneck_dim=16))
  c.input.num_local = 2
  c.data.build_options = dict(split_sizes={"train": 16, "validation": 8, "test": 8}, image_size=SIZE)
  c.evals = {k: dict(c.evals[k], batch_size=8, num_pictures=0) for k in ("segmentation", "zeroshot")}
  c.ckpt.update(dict(every_steps=1, keep=3, async_save=False))
  c.log_every_steps = 1
  return c


@pytest.fixture(scope="module")
def initial(imported):
  """`initial(c)`: the state a run of `c` starts from (step 0), without training. One Setup serves every
  `c` of the tiny architecture (its jitted init is compiled once); `init_from` reads `c.init_from`."""
  base = assembly.build(tiny(imported[0]))

  def start(c):
    setup = dataclasses.replace(base, config=c)
    return assembly.init_from(setup, setup.init_state())

  return start


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, imported):
  """The end-to-end run: (workdir, its final metrics, the log records of its start)."""
  e, _ = imported
  w = str(tmp_path_factory.mktemp("ft") / "W")
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logger = logging.getLogger("absl")
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  try:
    metrics = loop.train_and_evaluate(tiny(e), w)
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  return w, metrics, [r.getMessage() for r in records]


def test_finetune_config_copies_the_sources_architecture(imported, padded_tokenizer):
  e, _ = imported
  c = _finetune_module().get_config(f"from={e},recipe=tipsv2")
  want = sources.from_export(e)
  for k in kwargs_lib.PARAM_KEYS["image"]:
    assert c.model.image[k] == want.image_config[k], k
  for k in ("vocab_size", "width", "depth", "num_heads", "mlp_dim", "flavour", "max_len"):
    assert c.model.text[k] == want.text_config[k], k
  assert c.tokenizer == os.path.join(e, "tokenizer.model") and c.init_from == e
  # The adaptation defaults the docs list: lr 2e-4, 500 warm-up steps, the fresh heads at 5x.
  assert (c.optim.lr, c.optim.warmup_steps, dict(c.optim.lr_mults)) == (
    2e-4,
    500,
    {r"^(dino_head|ibot_head|fusion)/": 5.0},
  )
  config_validation.validate(c)
  data_prepare.check_tokenizer(c)  # the copied tokenizer fits the copied vocabulary


def test_end_to_end_import_continue_export_reload(finetuned, imported, initial, tmp_path):
  """Import, continue 2 steps with CLIP + DINO + iBOT++, evals, export, reload."""
  e, params = imported
  c = tiny(e)
  assert c.loss.dino > 0 and c.loss.ibot > 0 and c.loss_opts.ibot_all_patches  # every term on
  start = initial(c)
  assert _bitwise(start.params["image"], params["image"]) and _bitwise(start.params["text"], params["text"])
  temperature = sources.from_export(e).temperature
  assert float(np.exp(-np.asarray(start.params["logit_scale"]))) == pytest.approx(temperature, rel=1e-6)
  w, metrics, logs = finetuned
  fresh = [m for m in logs if "start fresh" in m]
  assert len(fresh) == 1 and all(p in fresh[0] for p in ("dino_head", "ibot_head", "mask_token", "centres"))
  evals = {k: v for k, v in metrics.items() if k.endswith(("segmentation/miou", "zeroshot/top1"))}
  assert len(evals) == 2 and all(0.0 <= v <= 100.0 for v in evals.values()), metrics  # percent
  assert np.isfinite(metrics["loss/dino"]) and np.isfinite(metrics["loss/ibot"])
  enc = tipsito.load(os.path.join(w, "export"))  # reload
  assert not _bitwise(enc.params["image"], params["image"])  # the run moved the towers
  hf = sources.write(sources.from_export(os.path.join(w, "export")), str(tmp_path / "hf"), "hf_tipsv2")
  again = initial(tiny(hf))  # and the Hugging Face export of the run starts a run of its own
  assert _bitwise(again.params["image"], enc.params["image"]) and _bitwise(
    again.params["text"], enc.params["text"]
  )


def _sources(kind, imported, request, tmp_path):
  """(init_from path of `kind`, the towers it must load); the workdir kinds are the end-to-end run's."""
  e, params = imported
  if kind.startswith("workdir"):
    w = request.getfixturevalue("finetuned")[0]
    path = {"workdir": w, "workdir_checkpoints": os.path.join(w, "checkpoints")}.get(kind)
    path = path or os.path.join(w, "checkpoints", "2")
    return path, tipsito.load(os.path.join(w, "export")).params
  if kind == "export":
    return e, params
  if kind == "hf_tipsv2":
    return sources.write(sources.from_export(e), str(tmp_path / "hf"), "hf_tipsv2"), params
  if kind == "tips_npz_folder":  # what `--format tips_npz` writes: vision.npz, text.npz, tokenizer.model
    return sources.write(sources.from_export(e), str(tmp_path / "npz"), "tips_npz"), params
  return str(VISION), params  # the released vision file, its text file found beside it


KINDS = {  # test case -> the kind detected
  "workdir": "workdir",
  "workdir_checkpoints": "workdir",
  "workdir_step": "workdir",
  "export": "export",
  "hf_tipsv2": "hf_tipsv2",
  "tips_npz_folder": "tips_npz",
  "tips_npz_file": "tips_npz",
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_init_from_kind_loads_the_towers_bit_for_bit(
  kind, imported, initial, padded_tokenizer, request, tmp_path
):
  path, want = _sources(kind, imported, request, tmp_path)
  assert init_source.detect(path).kind == KINDS[kind]
  c = tiny(path, tokenizer=padded_tokenizer)
  assembly.check_init_from(c)
  state = initial(c)
  assert _bitwise(state.params["image"], want["image"]) and _bitwise(state.params["text"], want["text"])


def _refused(c, tmp_path, match):
  w = tmp_path / "W"
  with pytest.raises(config_validation.ConfigError, match=match):
    loop.train_and_evaluate(c, str(w))
  assert not w.exists() or not any(w.iterdir()), "something was written before the refusal"


def test_towers_of_another_architecture_are_refused_before_writing(imported, tmp_path):
  c = tiny(imported[0])
  c.model.image.depth = 1
  _refused(c, tmp_path, r"its image tower has depth=2 but this run's config.model.image.depth=1")


def test_a_path_that_is_no_kind_is_refused_before_writing(imported, tmp_path):
  junk = tmp_path / "junk"
  junk.mkdir()
  (junk / "weights.bin").write_bytes(b"0")
  c = tiny(imported[0])
  c.init_from = str(junk)
  _refused(c, tmp_path, r"it is a folder holding \[weights.bin\]; init_from takes")
  c.init_from = str(tmp_path / "missing")
  _refused(c, tmp_path, r"missing'?: it does not exist")


def test_a_broken_hugging_face_folder_is_refused_before_writing(imported, tmp_path):
  clip = tmp_path / "clip"
  clip.mkdir()
  (clip / "config.json").write_text(json.dumps({"model_type": "clip"}))
  (clip / "pytorch_model.bin").write_bytes(b"0")
  c = tiny(imported[0])
  c.init_from = str(clip)
  _refused(c, tmp_path, r"is a Hugging Face CLIP folder .*, but it cannot be read: .*pytorch_model.bin")


def test_a_hugging_face_clip_folder_loads_the_towers_bit_for_bit(tmp_path):
  """A CLIP-style model (recipe clip) through `--format hf_clip` and back, image projection included."""
  from tipsito.config import defaults
  from tipsito.interop import clip
  from tipsito.train import exporting

  c = defaults.tiny_config("clip")
  setup = assembly.build(c)
  state = setup.init_state()
  image_config, text_config = exporting.export_configs(setup)
  params = exporting.export_params(state.params)
  hf = clip.write_hf_clip(
    str(tmp_path / "clip"),
    image_config=image_config,
    text_config=text_config,
    params=params,
    temperature=exporting.temperature_of(state.params),
    tokenizer_path=exporting.tokenizer_path(c),
  )
  assert init_source.detect(hf).kind == "hf_clip"
  c2 = defaults.tiny_config("clip")
  c2.seed, c2.init_from = 1, hf
  assembly.check_init_from(c2)
  setup2 = dataclasses.replace(setup, config=c2)
  fresh = setup2.init_state()
  assert not _bitwise(fresh.params["image"], params["image"])  # another init: the test can tell
  loaded = assembly.init_from(setup2, fresh)
  for part in ("image", "text", "image_proj"):
    assert _bitwise(loaded.params[part], params[part]), part
  assert np.asarray(loaded.params["logit_scale"]) == np.asarray(state.params["logit_scale"])


def test_an_export_is_not_taken_for_a_run_whose_teacher_continues(imported):
  """The first break of the issue: an export's config.json was read as a training run's and refused
  ("was trained with ema.mode=None"); an export has no teacher, so `init_teacher` is moot for it."""
  c = tiny(imported[0])
  assert c.init_teacher == "continue"
  config_validation.validate(c)


def test_npz_file_without_its_text_file_is_named(tmp_path):
  v = tmp_path / "tips_oss_b14_vision.npz"
  shutil.copy(VISION, v)
  with pytest.raises(init_source.InitSourceError, match="tips_oss_b14_text.npz"):
    init_source.detect(str(v))
