"""A distilled student exports without its teacher (issue 34 item 4): `export --workdir` reads the
encoders' part of the checkpoint by its own metadata (tipsito/train/exporting.py `read_workdir`), so the
teacher named in the student's config.json need not exist on the exporting machine.

Why a real distillation workdir: the student's state layout depends on its teacher (the distillation
projection's width, the EMA heads), which is why rebuilding the whole run read the teacher; the export
must be the one the old path (the run rebuilt with its teacher, `assembly.restore_latest`) wrote.
"""

import json
import shutil

import jax
import numpy as np
import pytest

import tipsito
from tipsito import evaluate
from conftest import run_synthetic_steps
from test_recipes_distill import TIPS, tiny_student
from tipsito.train import assembly
from tipsito.train import checkpointing
from tipsito.train import exporting
from tipsito.train import workdir as workdir_lib


def _assert_same_params(a, b):
  pa, pb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(pa, pb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def student(tmp_path_factory):
  """(workdir, teacher file) of a tiny distillation run (official-weights teacher, 2 steps saved)."""
  root = tmp_path_factory.mktemp("distilled")
  teacher = root / "teacher" / "vision.npz"
  teacher.parent.mkdir()
  shutil.copy(TIPS / "tiny_vit_mlp_vision.npz", teacher)
  c = tiny_student(npz=True)
  c.distill.teacher_image_npz = str(teacher)
  c.model.text.vocab_size = 100  # what the run trains with (run_synthetic_steps), for the rebuild
  _, state, _, _ = run_synthetic_steps(c, 2)
  wd = root / "workdir"
  workdir_lib.save_config(c, str(wd))
  ckpt = checkpointing.Checkpointer(str(wd / "checkpoints"), every_steps=1, keep=1, async_save=False)
  ckpt.save(2, state, force=True)
  ckpt.close()
  return wd, teacher


def test_a_distilled_student_exports_without_its_teacher(student, tmp_path):
  wd, teacher = student
  setup, state = assembly.restore_latest(str(wd), what="test")  # the run rebuilt with its teacher
  assert setup.ctx.frozen_teacher and "distill_proj" in state.params
  reference = exporting.write_training_export(
    setup, state.params, str(tmp_path / "ref"), step=int(state.step)
  )

  teacher.rename(teacher.with_suffix(".gone"))
  try:
    with pytest.raises(FileNotFoundError):  # the teacher is really gone: the run cannot be rebuilt
      assembly.restore_latest(str(wd), what="test")
    out = exporting.export_from_workdir(str(wd), str(tmp_path / "export"))
    model = exporting.model_from_workdir(str(wd))
    encoder = exporting.encoder_from_workdir(str(wd))
    evaluated, kind = evaluate.load_encoder(None, str(wd))  # `evaluate --checkpoint W`
  finally:
    teacher.with_suffix(".gone").rename(teacher)

  ref_cfg = json.loads((tmp_path / "ref" / "config.json").read_text())
  assert json.loads((tmp_path / "export" / "config.json").read_text()) == ref_cfg
  assert ref_cfg["extra"]["step"] == 2
  ref = tipsito.load(reference)
  _assert_same_params(tipsito.load(out).params, ref.params)
  _assert_same_params(model.params, ref.params)
  _assert_same_params(encoder.params, ref.params)
  assert kind == "train"
  _assert_same_params(evaluated.params, ref.params)
  assert model.temperature == ref_cfg["temperature"] and model.extra["step"] == 2
