"""Studies III (issue 46): the designs declared before the runs, the dev sweep's split, the check that
self-distillation trains, and the learning curves a result keeps.

Why: the round's readings rest on these being what docs/results.md says they are: the paper's designs
(distill teacher = plain iBOT, mask ratios under full EMA, ...), a learning-rate choice that never reads
the reported test split, and a rule for "self-distillation trains" that is fixed before any run.
"""

import importlib.util
import math
import pathlib

import pytest

from tipsito.studies import arms
from tipsito.studies import results

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ablations():
  spec = importlib.util.spec_from_file_location("ablations_round3", ROOT / "configs" / "ablations.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _jobs(mod, arg, tmp_path):
  return {j.arm.name: j.config for j in arms.plan(mod.get_config(arg), [0], str(tmp_path))}


def test_round_three_designs_match_the_papers(tmp_path):
  """The arms issue 46 asks for, at 3,200 steps with evals at four points, the family's optimizer and
  CLIP pixels, and the self-distillation margin declared with the study."""
  mod = _ablations()
  optim, lr = mod.ROUND3_OPTIM["tips"]
  for study in ("ibot", "distill", "mask", "captions", "ema", "tipsito", "ito"):
    s = mod.get_config(f"study={study}")
    assert s.self_distillation_margin == mod.SELF_DISTILLATION_MARGIN, study
    for name, c in _jobs(mod, f"study={study}", tmp_path).items():
      assert c.total_steps == 3200, (study, name)
      assert {ev.every_steps for ev in c.evals.values()} == {800}, (study, name)
      assert c.model.image.pixel_mean == pytest.approx((0.48145466, 0.4578275, 0.40821073)), (study, name)
      family = "ito" if study == "ito" else "tips"
      assert (c.optim.name, c.optim.lr) == mod.ROUND3_OPTIM[family], (study, name)
  assert (optim, lr) == mod.ROUND3_OPTIM["tips"]

  ibot = _jobs(mod, "study=ibot", tmp_path)
  assert list(ibot) == ["clip_2cls", "ibot", "ibot_pp"]
  assert (ibot["clip_2cls"].loss.dino, ibot["clip_2cls"].loss.ibot) == (0.0, 0.0)
  assert [ibot[a].loss_opts.ibot_all_patches for a in ("ibot", "ibot_pp")] == [False, True]

  distill = _jobs(mod, "study=distill", tmp_path)
  assert distill["teacher"].loss_opts.ibot_all_patches is False  # Table 2's teacher: plain iBOT
  assert distill["student_mask0"].input.mask_ratio == 0.0
  assert distill["student_mask75"].input.mask_ratio == 0.75
  assert distill["student_mask0_init_teacher"].distill.init_image is True

  mask = _jobs(mod, "study=mask", tmp_path)
  assert {n: (c.input.mask_ratio, c.ema.mode) for n, c in mask.items()} == {
    "mask_00": (0.0, "full"),
    "mask_50": (0.5, "full"),
    "mask_75": (0.75, "full"),
  }

  captions = _jobs(mod, "study=captions", tmp_path)
  got = {
    n: (c.model.image.num_cls_tokens, c.data.alt_text_key, tuple(c.data.caption_keys))
    for n, c in captions.items()
  }
  assert got == {
    "alt_text_1cls": (1, "alt_text", ()),
    "sampled_1cls": (1, None, ("alt_text", "caption", "caption_detailed")),
    "alt_text_2cls": (2, "alt_text", ("alt_text",)),
    "two_cls_one_granularity": (2, "alt_text", ("caption_detailed",)),
    "two_cls_multi_granularity": (2, "alt_text", ("caption", "caption_detailed")),
  }

  tipsito = _jobs(mod, "study=tipsito", tmp_path)
  assert {n: (c.recipe, c.loss.get("fusion")) for n, c in tipsito.items()} == {
    "tipsv2": ("tipsv2", None),
    "tipsito_lambda0": ("tipsito", 0.0),
    "tipsito": ("tipsito", 2.0),
  }
  ito = _jobs(mod, "study=ito", tmp_path)
  assert list(ito) == ["clip", "ito_lambda0", "ito_lambda1", "ito_lambda2"]


def test_round_two_keeps_its_arms_and_budget(tmp_path):
  """round=2 is what Round II ran (its render commands in docs/results.md): 800 steps, Adafactor, final
  evals only, its arms, and no self-distillation margin."""
  mod = _ablations()
  assert list(_jobs(mod, "round=2,study=ibot", tmp_path))[-1] == "ibot_pp_separate"
  mask = _jobs(mod, "round=2,study=mask", tmp_path)
  assert {n: (c.input.mask_ratio, c.ema.mode) for n, c in mask.items()} == {
    "mask_00": (0.0, "head"),
    "mask_40": (0.4, "head"),
    "mask_75": (0.75, "head"),
  }
  for c in mask.values():
    assert (c.total_steps, c.optim.name) == (800, "adafactor")
    assert {ev.every_steps for ev in c.evals.values()} == {0}
  assert "self_distillation_margin" not in mod.get_config("round=2,study=ibot")
  with pytest.raises(ValueError, match="round"):
    mod.get_config("round=4,study=ibot")


def test_dev_sweep_reads_validation_only_and_sweeps_the_baseline_arm(tmp_path):
  """The learning-rate choice: the family's baseline arm only (no DINO / iBOT for the TIPS family, CLIP
  for ITO, AdamW only for ITO), every eval on the validation split, final evals only."""
  mod = _ablations()
  tips = _jobs(mod, "study=dev_lr,family=tips", tmp_path)
  assert sorted({(c.optim.name, c.optim.lr) for c in tips.values()}) == sorted(
    (o, lr) for o, lrs in mod.DEV_LRS.items() for lr in lrs
  )
  ito = _jobs(mod, "study=dev_lr,family=ito", tmp_path)
  assert {c.optim.name for c in ito.values()} == {"adamw"} and {c.recipe for c in ito.values()} == {"clip"}
  for c in list(tips.values()) + list(ito.values()):
    assert {ev.split for ev in c.evals.values()} == {"validation"}
    assert {ev.every_steps for ev in c.evals.values()} == {0}
  for c in tips.values():
    assert (c.recipe, c.loss.dino, c.loss.ibot) == ("tipsv2", 0.0, 0.0)


def _summary(dino, ibot_masked, margin=0.5, k=256):
  runs = {
    str(s): {"metrics": {"loss/dino": d, "ibot/ce_masked": i}, "seconds": 1.0}
    for s, (d, i) in enumerate(zip(dino, ibot_masked))
  }
  arm = {
    "runs": runs,
    "self_distillation": {"weights": {"dino": 1.0, "ibot": 2.0}, "num_prototypes": k},
    "summary": {
      "loss/dino": results._stats(dino),  # pylint: disable=protected-access
      "ibot/ce_masked": results._stats(ibot_masked),  # pylint: disable=protected-access
    },
  }
  base = {"runs": runs, "self_distillation": None, "summary": {}}
  return {"arms": {"clip_2cls": base, "ibot_pp": arm}, "self_distillation_margin": margin}


def test_self_distillation_check_by_hand():
  """ln 256 = 5.545; margin 0.5 -> threshold 5.045: a DINO mean of 5.1 fails, an iBOT mean of 4.9 passes;
  the arm without self-distillation is not checked."""
  sd = results.self_distillation_check(_summary([5.0, 5.2], [4.8, 5.0]))
  assert set(sd["arms"]) == {"ibot_pp"}
  a = sd["arms"]["ibot_pp"]
  assert a["ln_k"] == pytest.approx(math.log(256)) and a["threshold"] == pytest.approx(math.log(256) - 0.5)
  assert a["terms"]["dino"]["mean"] == pytest.approx(5.1) and a["terms"]["dino"]["passed"] is False
  assert a["terms"]["ibot"]["passed"] is True
  assert a["terms"]["ibot"]["below_ln_k"] == pytest.approx(math.log(256) - 4.9)
  assert sd["all_passed"] is False
  assert results.self_distillation_check(_summary([4.0, 4.1], [4.0, 4.2]))["all_passed"] is True
  lines = "\n".join(results.self_distillation_lines({"self_distillation_check": sd}))
  assert "| ibot_pp | `loss/dino` |" in lines and "**no**" in lines
  assert results.self_distillation_check({"arms": {}}) is None  # no margin declared: no check
  mask0 = _summary([4.0, 4.1], [4.0, 4.2])  # a mask-0 arm logs no masked-token CE: not applicable
  mask0["arms"]["ibot_pp"]["summary"].pop("ibot/ce_masked")
  sd0 = results.self_distillation_check(mask0)
  assert sd0["arms"]["ibot_pp"]["terms"]["ibot"]["passed"] is None and sd0["all_passed"] is True
  text0 = "\n".join(results.self_distillation_lines({"self_distillation_check": sd0}))
  assert "**Every arm passes.** (`–`" in text0
  none = results.self_distillation_check({"self_distillation_margin": 0.5, "arms": {}})
  assert none == {"margin": 0.5, "arms": {}, "all_passed": False}  # no self-distillation arm (ITO)
  text = "\n".join(results.self_distillation_lines({"self_distillation_check": none}))
  assert "No arm of this study has a DINO or iBOT term" in text and "Not every arm passes" not in text


def _write_events(run_dir, points):
  from tensorboard.compat.proto import event_pb2, summary_pb2  # pylint: disable=import-outside-toplevel
  from tensorboard.summary.writer import event_file_writer  # pylint: disable=import-outside-toplevel

  w = event_file_writer.EventFileWriter(str(run_dir))
  for step, tag, value in points:
    value_pb = summary_pb2.Summary.Value(tag=tag, simple_value=value)
    w.add_event(
      event_pb2.Event(step=step, wall_time=float(step), summary=summary_pb2.Summary(value=[value_pb]))
    )
  w.close()


def test_eval_curves_keep_every_eval_point_and_drop_intervals(tmp_path):
  """A result's `eval_curves`: each eval metric at every step it was evaluated, not its bootstrap bounds
  or counts, not other evals' or the losses' tags."""
  _write_events(
    tmp_path,
    [
      (800, "segmentation/margin/object_miou", 10.0),
      (800, "segmentation/margin/object_miou_ci_lo", 9.0),
      (800, "segmentation/num_examples", 2000.0),
      (800, "loss/total", 3.0),
      (800, "collapse/dino_teacher_entropy", 5.0),
      (800, "knn/top1", 20.0),
      (1600, "segmentation/margin/object_miou", 12.5),
    ],
  )
  got = results.eval_curves(str(tmp_path), {"segmentation"})
  assert got == {"segmentation/margin/object_miou": [[800, 10.0], [1600, 12.5]]}
  assert results.loss_curves(str(tmp_path)) == {
    "collapse/dino_teacher_entropy": [[800, 5.0]],
    "loss/total": [[800, 3.0]],
  }
