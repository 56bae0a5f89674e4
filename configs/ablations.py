"""Ablation studies: one study per paper claim, each a few arms (named config overrides) on a shared small
base, run for several seeds by `python -m tipsito.sweep` (tipsito/sweep.py, tipsito/studies/).

    python -m tipsito.sweep --config configs/ablations.py:study=ito --seeds 3 --workdir workdirs/ito
    python -m tipsito.sweep --config configs/ablations.py:study=ito --workdir W --dry_run  # the arms

Args (k=v,...): study (one of STUDIES; `smoke` by default), steps (0 = STUDY_STEPS of the data), batch
(32), size (64: global crop px), data ('' = `openclipart` for the paper studies, `shapes` for `smoke`;
the one place to switch data is `_data_and_evals`), data_dir ('' = built into the sweep's W/data),
train_images / test_images (10000 / 200: size of the built `shapes` dataset), eval_examples (0 = every
test example), evals ('+'-joined eval types, default all four), log_every (20), ckpt_every (100; a
multiple of log_every, so that a resumed run logs the same per-step losses), optim / pixels
(configs/demo.py's args: 'adamw' and 'clip' by default, 'adafactor' and 'tips' for the paper's; the
`optimizer` study varies both itself), width / depth (0 = configs/demo.py's tiny tower, width 64 and
depth 2: both towers' width, with head dim 16 and MLP 2 x width as that tower, and their layer count; the
heads and the fusion keep the demo's size).

What a study is (read by tipsito/studies/arms.py):
  study    the name; claim: the sentence the study tests; metrics: the columns of results.md (a metric is
           `<eval>/<metric>` of the final evals, `loss/<term>` the last logged training loss, or
           `state/<what>` from `python -m tipsito.info`);
  bases    complete training configs (name -> config) the arms start from;
  arms     ordered tuple of dicts: name, base, overrides ({'dotted.key': value}: each must be an existing
           key), optionally note and depends_on. An override value may name another arm's run directory
           of the same seed, '{workdir:ARM}' (the distillation teacher): the arm then depends on ARM.

The base is configs/demo.py at the study's budget (its tiny/16 tower with patch 8, AdamW 3e-3 and CLIP
pixel statistics unless a study varies them; see that file for why), on openclipart at 64 px for
STUDY_STEPS steps; docs/results.md says how this budget was chosen.

The open choices of the fidelity review (the global view's crop scale, `loss_opts.dino_reduction`) are
arms of the `ibot` study.
"""

import importlib.util
import pathlib

import ml_collections as mlc

from tipsito.config import args as args_lib
from tipsito.config import defaults
from tipsito.config import paper
from tipsito.evals import suites

# The metrics most studies report (final evals of the trained encoders; see `_data_and_evals`).
GLOBAL = ("zeroshot/top1", "retrieval/i2t_r1", "retrieval/t2i_r1", "knn/top1")
DENSE = ("segmentation/miou",)
EVAL_TYPES = ("zeroshot", "retrieval", "segmentation", "knn")


def _demo(**kw) -> mlc.ConfigDict:
  """configs/demo.py's `get_config` with these args (loaded from this folder: the shared base)."""
  path = pathlib.Path(__file__).with_name("demo.py")
  spec = importlib.util.spec_from_file_location("_ablations_demo", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(",".join(f"{k}={v}" for k, v in kw.items()))


def _data_and_evals(c: mlc.ConfigDict, a: mlc.ConfigDict) -> mlc.ConfigDict:
  """The study data and its final evals, in one place. The evals are the dataset's built-in suite
  (tipsito/evals/suites.py) named by type (`zeroshot`, ...), so that metric names stay the same whatever
  the data.

  `openclipart` (the studies' data): the 7,199 training drawings of Debian's openclipart packages, built
  on first use into the sweep's W/data (or read from `data_dir`); every eval reads the 796 held-out test
  drawings (tipsito/data/builders/openclipart.py: split by a hash of the drawing's copies), so no study
  is judged on images it trained on. Segmentation scores the object pixels among the 22 categories.
  `shapes` (configs/demo.py's one large red shape per image) is the runner's own smoke data.
  """
  args_lib.check_choice("data", a.data, ("openclipart", "shapes"))
  if a.data == "shapes":
    c.data.build_options = dict(
      c.data.build_options, image_size=a.size, split_sizes={"train": a.train_images, "test": a.test_images}
    )
    eval_batch = min(50, a.test_images)
  else:
    c.data = defaults.data_config("openclipart", build_if_missing=True, label_key="label")
    eval_batch = 64
  if a.data_dir:
    c.data.data_dir = a.data_dir
  types = tuple(t for t in a.evals.split("+") if t)
  for t in types:
    args_lib.check_choice("evals", t, EVAL_TYPES)
  suite = suites.builtin_evals(
    a.data,
    types=types,
    data_dir=a.data_dir or None,
    image_size=a.size,
    batch_size=eval_batch,
    max_examples=a.eval_examples or None,
    num_pictures=0,
  )
  c.evals = mlc.ConfigDict({cfg["type"]: cfg for cfg in suite.values()})
  if "knn" in c.evals and not a.eval_examples:
    c.evals.knn.max_train_examples = 1000  # as configs/demo.py
  return defaults.typed_optionals(c)


def _paper_views(c: mlc.ConfigDict) -> None:
  """The papers' crop scales instead of configs/demo.py's (0.7, 1.0), which suits its one large shape:
  TIPS-style recipes see the whole image as the global view (tipsito/config/paper.py,
  TIPSV2_GLOBAL_CROP_SCALE; the ibot study runs DINOv2's (0.32, 1.0) as an arm), ITO's views and
  tipsito's second view take ITO's (0.5, 1.0) with ITO's photometric augmentation on tipsito's view 2."""
  if c.input.views in ("two_views",):
    c.input.global_crop_scale = (0.5, 1.0)
    c.input.view2_crop_scale = (0.5, 1.0)
  elif c.input.views in ("multicrop", "multicrop_two_views"):
    c.input.global_crop_scale = paper.TIPSV2_GLOBAL_CROP_SCALE
    c.input.view2_crop_scale = (0.5, 1.0)
    if c.input.views == "multicrop_two_views":
      c.input.augment_view2 = "ito"
  else:  # single view (clip, siglip): the crop scale of ITO's views, so CLIP and ITO differ in views only
    c.input.global_crop_scale = (0.5, 1.0)


def _base(a: mlc.ConfigDict, recipe: str, *, optim: str = "", pixels: str = "") -> mlc.ConfigDict:
  """configs/demo.py for `recipe` at the study budget, with the study data and evals; its optimizer and
  pixel statistics are the study args' (the demo's AdamW and CLIP pixels by default) unless given."""
  optim, pixels = optim or a.optim, pixels or a.pixels
  if recipe == "distill":  # demo.py has no distill recipe: its tipsv2 config with the distill recipe's keys
    c = _demo(recipe="tipsv2", steps=a.steps, batch=a.batch, size=a.size, optim=optim, pixels=pixels)
    ref = defaults.base_config("distill", "tiny/16")
    c.recipe = "distill"
    c.loss = ref.loss
    c.input.mask_ratio = ref.input.mask_ratio
    c.model.image.use_mask_token = ref.model.image.use_mask_token
  else:
    c = _demo(recipe=recipe, steps=a.steps, batch=a.batch, size=a.size, optim=optim, pixels=pixels)
  if a.data != "shapes":
    _paper_views(c)
  _tower_size(c, a.width, a.depth)
  c.input.num_workers = 0  # several runs may share the machine; grain worker processes only add contention
  c.log_every_steps = a.log_every
  c.ckpt.every_steps = a.ckpt_every
  return _data_and_evals(c, a)


def _tower_size(c: mlc.ConfigDict, width: int, depth: int) -> None:
  """Both towers at `width` and `depth` (0 keeps configs/demo.py's): the lever, with `steps` and `size`,
  for a study at a larger budget than docs/results.md's. Head dim 16 and MLP 2 x width, as the demo's
  tiny tower, so that width alone sets the tower's shape."""
  if width % 16 or width < 0:
    raise ValueError(f"config arg width={width} must be 0 (the demo's 64) or a multiple of 16 (head dim 16)")
  if depth < 0:
    raise ValueError(f"config arg depth={depth} must be 0 (the demo's 2) or a number of layers")
  for tower in (c.model.image, c.model.text):
    if width:
      tower.update(dict(width=width, mlp_dim=2 * width, num_heads=width // 16))
    if depth:
      tower.depth = depth


def _arm(name: str, base: str, overrides: dict | None = None, note: str = "", **kw) -> dict:
  return dict(name=name, base=base, overrides=dict(overrides or {}), note=note, **kw)


def _smoke(a):
  """The runner's own check (tests/test_sweep.py): two CLIP arms that differ in the data augmentation only
  (so that they share one compiled train step)."""
  return dict(
    claim="(no paper claim) the sweep runner itself: two tiny CLIP arms, kill and resume",
    metrics=("zeroshot/top1", "loss/total"),
    bases={"clip": _base(a, "clip")},
    arms=(
      _arm("augment_ito", "clip", {}, "ITO's crop, flip and colour augmentation"),
      _arm("augment_none", "clip", {"input.augment": "none"}, "no augmentation"),
    ),
  )


def _ito(a):
  return dict(
    claim=(
      "ITO: a second augmented view contrasted with the caption plus the training-time fusion "
      "loss (lambda = 2) beat CLIP at the same budget; lambda = 0 (two views, no fusion) separates "
      "the second view from the fusion loss"
    ),
    metrics=GLOBAL + ("loss/clip",),
    bases={"clip": _base(a, "clip"), "ito": _base(a, "ito")},
    arms=(
      _arm("clip", "clip"),
      _arm("ito_lambda0", "ito", {"loss.fusion": 0.0}, "two views, no fusion loss"),
      _arm("ito_lambda2", "ito", {}, "the ITO recipe: fusion weight 2"),
    ),
  )


def _ibot(a):
  return dict(
    claim=(
      "TIPSv2: iBOT++ (the patch loss on every patch, not only the masked ones) improves zero-shot "
      "segmentation over iBOT at the same budget"
    ),
    metrics=DENSE + GLOBAL,
    bases={"tipsv2": _base(a, "tipsv2")},
    arms=(
      _arm("ibot", "tipsv2", {"loss_opts.ibot_all_patches": False}, "masked patches only"),
      _arm("ibot_pp", "tipsv2", {"loss_opts.ibot_all_patches": True}, "every patch (TIPSv2)"),
      # The two open choices of the fidelity review, each one override away from the iBOT++ arm.
      _arm(
        "ibot_pp_global_crop_032",
        "tipsv2",
        {"input.global_crop_scale": (0.32, 1.0)},
        "iBOT++ with DINOv2's global crop (0.32-1.0) instead of the whole image",
      ),
      _arm(
        "ibot_pp_dino_sum",
        "tipsv2",
        {"loss_opts.dino_reduction": "sum"},
        "iBOT++ with DINO summed over the local crops (TIPSv2 Eq. 1 read literally)",
      ),
    ),
  )


def _distill(a):
  teacher = "{workdir:teacher}"
  return dict(
    claim=(
      "TIPSv2 §3.1 / Table 2: distilling from a frozen teacher with no masking (mask ratio 0) into a "
      "randomly initialised student gives the student patch-text alignment beyond the teacher's; "
      "mask 0.75 or a student initialised from the teacher removes the gain"
    ),
    metrics=DENSE + GLOBAL,
    bases={"tipsv2": _base(a, "tipsv2"), "distill": _base(a, "distill")},
    arms=(
      _arm("teacher", "tipsv2", {}, "pretrained teacher (the students' frozen teacher)"),
      _arm("student_mask0", "distill", {"distill.teacher": teacher}, "mask 0, random init (paper)"),
      _arm(
        "student_mask75",
        "distill",
        {"distill.teacher": teacher, "input.mask_ratio": 0.75, "model.image.use_mask_token": True},
        "mask 0.75, random init",
      ),
      _arm(
        "student_mask0_init_teacher",
        "distill",
        {"distill.teacher": teacher, "distill.init_image": True},
        "mask 0, student image encoder initialised from the teacher",
      ),
    ),
  )


def _ema(a):
  return dict(
    claim=(
      "TIPSv2 §3.4: an EMA of the heads only (the teacher encoder is the student's own, under "
      "stop-gradient) matches a full EMA teacher at a smaller train state"
    ),
    metrics=GLOBAL + DENSE + ("state/train_state_MiB", "state/ema_params_M"),
    bases={"tipsv2": _base(a, "tipsv2")},
    arms=(
      _arm("ema_head", "tipsv2", {"ema.mode": "head"}, "TIPSv2"),
      _arm("ema_full", "tipsv2", {"ema.mode": "full"}, "TIPS"),
    ),
  )


def _captions(a):
  return dict(
    claim=(
      "TIPS: two CLS tokens, CLS1 with the alt-text and CLS2 with synthetic captions, beat one CLS "
      "trained on the alt-text only"
    ),
    metrics=GLOBAL + DENSE,
    bases={"tipsv2": _base(a, "tipsv2")},
    arms=(
      _arm(
        "alt_text_1cls",
        "tipsv2",
        {"model.image.num_cls_tokens": 1, "data.caption_keys": ()},
        "one CLS, alt-text only",
      ),
      _arm("synthetic_2cls", "tipsv2", {}, "two CLS: alt-text + synthetic captions (TIPSv2)"),
    ),
  )


def _tipsito(a):
  return dict(
    claim="tipsito: ITO's second view and fusion loss added to TIPSv2 help at the same budget",
    metrics=GLOBAL + DENSE,
    bases={"tipsv2": _base(a, "tipsv2"), "tipsito": _base(a, "tipsito")},
    arms=(_arm("tipsv2", "tipsv2"), _arm("tipsito", "tipsito")),
  )


# Learning rates per optimizer: the one configs/demo.py uses, and a factor ~3 either side.
OPTIMIZER_LRS = {"adamw": (1e-3, 3e-3, 1e-2), "adafactor": (3e-4, 1e-3, 3e-3)}


def _optimizer(a):
  bases, arms = {}, []
  for optim, lrs in OPTIMIZER_LRS.items():
    for pixels in ("clip", "tips"):
      base = f"{optim}_{pixels}px"
      bases[base] = _base(a, "tipsito", optim=optim, pixels=pixels)
      arms += [_arm(f"{base}_lr{lr:.0e}".replace("e-0", "e-"), base, {"optim.lr": lr}) for lr in lrs]
  return dict(
    claim=(
      "configs/demo.py: on the tiny towers AdamW (3e-3, no clipping) with CLIP pixel statistics "
      "learns faster than the paper's Adafactor with TIPS pixels; here at three learning rates each"
    ),
    metrics=GLOBAL + DENSE,
    bases=bases,
    arms=tuple(arms),
  )


# The per-run budget (steps at batch 32, 64 px, configs/demo.py's tiny/16 tower with patch 8; see
# docs/results.md for how it was chosen): every study at 3 seeds in about 4 hours on 2 CPU cores.
STUDY_STEPS = {"openclipart": 500, "shapes": 800}

STUDIES = {
  "smoke": _smoke,
  "ito": _ito,
  "ibot": _ibot,
  "distill": _distill,
  "ema": _ema,
  "captions": _captions,
  "tipsito": _tipsito,
  "optimizer": _optimizer,
}


def get_config(arg=None):
  """The study `study=NAME`; see the module docstring for the args."""
  a = args_lib.parse_arg(
    arg,
    study="smoke",
    steps=0,
    batch=32,
    size=64,
    data="",
    data_dir="",
    train_images=10000,
    test_images=200,
    eval_examples=0,
    evals="+".join(EVAL_TYPES),
    log_every=20,
    ckpt_every=100,
    optim="adamw",
    pixels="clip",
    width=0,
    depth=0,
  )
  args_lib.check_choice("study", a.study, STUDIES)
  if a.study == "optimizer" and (a.optim, a.pixels) != ("adamw", "clip"):
    raise ValueError("config args optim / pixels: the optimizer study varies both itself; drop them")
  if not a.data:  # the runner's smoke study on procedural shapes; the paper studies on openclipart
    a.data = "shapes" if a.study == "smoke" else "openclipart"
  if not a.steps:
    a.steps = STUDY_STEPS[a.data]
  if a.ckpt_every % a.log_every:
    raise ValueError(
      f"config arg ckpt_every={a.ckpt_every} must be a multiple of log_every={a.log_every} "
      "(a run resumed from a checkpoint then logs the same per-step losses)"
    )
  s = STUDIES[a.study](a)
  c = mlc.ConfigDict()
  c.study = a.study
  c.claim = s["claim"]
  c.metrics = tuple(s["metrics"])
  c.bases = mlc.ConfigDict(s["bases"])
  c.arms = tuple(s["arms"])
  return c
