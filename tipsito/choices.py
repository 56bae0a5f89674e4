"""The enumerations a config's values are checked against: views, augmentations, mask shapes, loss-term
names and the terms that need a second view, teacher methods, activations, remat policies, text flavours.

Why here and not next to the code that uses them: the schema (tipsito/config/schema.py) needs the names to
declare `choices=`, and a config must build and validate without importing JAX, Flax, grain or Orbax
(tests/test_light_imports.py). So the names live in this module, which imports nothing, and the modules
that act on them (tipsito/data/pipeline.py, tipsito/objective/terms.py, tipsito/models/layers.py, ...)
import them from here; where a module keeps a table keyed by these names (`TERMS`, `ACTIVATIONS`,
`REMAT_POLICIES`), tests/test_light_imports.py checks that its keys are these names, in this order.
"""

from __future__ import annotations


from typing import NamedTuple


class ViewLayout(NamedTuple):
  """What a value of `config.input.views` means, decoded here once: every reader of the views (the pipeline,
  the declared batch tipsito/data/batch.py, validation, the schema's defaults, tipsito/planning/costs.py)
  asks this record instead of testing substrings of the name. A NamedTuple, not a dataclass, because this
  module imports nothing but `typing` (tests/test_import_structure.py: `LEAVES`)."""

  global_views: int  # 1: the global crop 'image'; 2: also ITO's second view 'image2' (same size)
  local_crops: bool  # multi-crop: also `config.input.num_local` local crops 'local_crops'

  @property
  def two_views(self) -> bool:
    """Whether the example holds ITO's second global view."""
    return self.global_views == 2


# `config.input.views`: what one example holds (tipsito/data/pipeline.py fills it, tipsito/data/batch.py
# declares the fields and shapes).
VIEW_LAYOUTS: dict[str, ViewLayout] = {
  "single": ViewLayout(global_views=1, local_crops=False),
  "two_views": ViewLayout(global_views=2, local_crops=False),
  "multicrop": ViewLayout(global_views=1, local_crops=True),
  "multicrop_two_views": ViewLayout(global_views=2, local_crops=True),
}
VIEWS = tuple(VIEW_LAYOUTS)
# The views with ITO's second view, for the messages that ask for one.
TWO_VIEWS = tuple(v for v, layout in VIEW_LAYOUTS.items() if layout.two_views)


def view_layout(views: str) -> ViewLayout:
  """The layout of a `config.input.views` value; a clear error for an unknown one."""
  try:
    return VIEW_LAYOUTS[views]
  except (KeyError, TypeError):
    raise ValueError(f"config.input.views={views!r}; valid values: {list(VIEWS)}") from None


# `config.input.augment` / `augment_view2`: the augmentation family (tipsito/data/transforms.py).
AUGMENTS = ("ito", "tips", "none")
# The crop ranges that `None` in `config.input.global_crop_scale` / `local_crop_scale` / `view2_crop_scale` /
# `crop_ratio` stands for, declared once here for the schema (tipsito/config/schema.py describes them) and
# the pipeline (tipsito/data/pipeline.py applies them): ITO's random resized crop (area 0.5-1, ITO "Method")
# for the `ito` augmentation, DINOv2's global crop (0.32-1) otherwise; DINO's local crops; ITO's second view.
GLOBAL_CROP_SCALE_BY_AUGMENT = {"ito": (0.5, 1.0), "tips": (0.32, 1.0), "none": (0.32, 1.0)}
LOCAL_CROP_SCALE = (0.05, 0.32)
VIEW2_CROP_SCALE = (0.5, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
# `config.input.mask_type`: the iBOT mask shape (tipsito/data/masking.py).
MASK_TYPES = ("random", "block")

# The loss terms (tipsito/objective/terms.py: `TERMS`), in the order they are summed into `loss/total`.
CLIP = "clip"
SIGLIP = "siglip"
CLIP_VIEW2 = "clip_view2"
FUSION = "fusion"
KOLEO = "koleo"
DINO = "dino"
IBOT = "ibot"
FEATURE = "feature"
TERM_NAMES = (CLIP, SIGLIP, CLIP_VIEW2, FUSION, KOLEO, DINO, IBOT, FEATURE)
# The terms that compare ITO's second view (`IMAGE2` of tipsito/data/batch.py among `TERMS[term].fields`;
# tests/test_light_imports.py checks the two agree): validation asks for a two-view `config.input.views`
# when one of them is weighted.
SECOND_VIEW_TERMS = (CLIP_VIEW2, FUSION)
# `config.loss_opts.view_weighting`: how the alt-text InfoNCE of ITO's two views combine
# (tipsito/objective/terms.py: `contrastive_pair_weights`).
VIEW_WEIGHTINGS = ("mean", "sum")
# `config.loss_opts.teacher_method`: how the teacher's outputs become targets (tipsito/losses/teacher_targets.py).
TEACHER_METHODS = ("centering", "sinkhorn")
# `config.loss_opts.dino_reduction`: how the DINO cross-entropies of the (student crop, teacher crop) pairs
# are combined (tipsito/losses/dino.py: `dino_loss_from_probs`).
DINO_REDUCTIONS = ("mean", "sum")

# `config.model.*.activation`: the keys of `ACTIVATIONS` in tipsito/models/layers.py.
ACTIVATIONS = ("gelu", "gelu_exact", "quick_gelu", "relu")
# `config.model.{image,text,fusion}.attention`: the attention cores of tipsito/models/layers.py
# (`attention_core`): plain XLA, cuDNN flash attention (GPU), the Pallas TPU splash kernel.
ATTENTIONS = ("xla", "cudnn", "splash")
# `config.model.*.remat_policy`: the keys of `REMAT_POLICIES` in tipsito/models/layers.py.
REMAT_POLICIES = (
  "none",
  "nothing_saveable",
  "dots_saveable",
  "dots_with_no_batch_dims_saveable",
  "everything_saveable",
)
# `config.model.text.flavour`: TIPS' masked mean pooling or CLIP's last token (tipsito/models/text.py).
FLAVOURS = ("tips", "clip")


def dataset_base_name(name: str | None) -> str:
  """'shapes/tiny:1.0.0' -> 'shapes': the builder name of a TFDS dataset name (config and version dropped),
  which converters, dataset defaults and the eval suites use (tipsito/data/sources.py `base_name`)."""
  return str(name or "").split(":")[0].split("/")[0]


# --- evaluation settings (`config.evals.<name>.*`, declared in tipsito/config/schema.py `EVAL_KEYS`) ---
# `type`: the evaluator types (the keys of `EVALUATOR_TYPES` in tipsito/evals/registry.py, in this order).
EVAL_TYPES = (
  "zeroshot",
  "retrieval",
  "segmentation",
  "knn",
  "linear_segmentation",
  "linear_depth",
  "linear_classification",
)
# The linear probes (tipsito/evals/probes.py): they train a layer, so the suites add them on request only.
PROBE_TYPES = ("linear_segmentation", "linear_depth", "linear_classification")
# `resize`: how an eval image reaches `image_size` (tipsito/data/eval_input.py; the first two are the fixed
# resizes of tipsito/data/transforms.py `FIXED_RESIZE_MODES`, 'short_side' keeps the aspect ratio).
RESIZE_MODES = ("center_crop", "resize", "short_side")
# `mask_source` of a segmentation eval: where the label map comes from (tipsito/data/eval_input.py).
MASK_SOURCES = ("auto", "segmentation", "alpha")
# `protocol` of a segmentation eval: the whole image at once or sliding windows (tipsito/evals/segmentation.py).
PROTOCOLS = ("whole", "slide")
# `benchmark` of a segmentation eval: name -> whether it scores a 'background' class (the class names and
# label conventions: `BENCHMARKS` in tipsito/evals/config_checks.py, whose keys are these, in this order).
SEGMENTATION_BENCHMARKS = {"ade150": False, "pc59": False, "pc60": True, "voc21": True}
# The keys a benchmark sets itself (giving one beside `benchmark` is refused), and the sizes it uses when the
# eval leaves them unset (short side, 'slide' window and step: the TIPS notebook's).
BENCHMARK_KEYS = (
  "class_names",
  "background_index",
  "background_name",
  "ignore_index",
  "reduce_zero_label",
  "mask_source",
  "resize",
)
BENCHMARK_SIZES = {"image_size": 448, "crop_size": 448, "stride": 336}
# `templates` given as a name: the sets of tipsito/evals/templates.py `TEMPLATE_SETS` (its keys, in this order).
TEMPLATE_SET_NAMES = (
  "imagenet80",
  "clip",
  "tcl",
  "simple",
  "shapes",
  "tuxpaint",
  "fashion_mnist",
  "openclipart",
  "identity",
)
# The prompt templates of the `scenes` testbed, whose words its tokenizer knows (tipsito/evals/suites.py,
# tipsito/data/builders/scenes_gen.py and tipsito/data/train_tokenizer.py read them here).
SCENES_PROMPTS = ("{}.", "a picture of {}.", "photo of {}.", "{} on the ground.")
