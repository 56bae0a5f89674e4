"""The enumerations a config's values are checked against: views, augmentations, mask shapes, loss-term
names and the batch fields each term needs, teacher methods, activations, remat policies, text flavours.

Why here and not next to the code that uses them: the schema (tipsito/config/schema.py) needs the names to
declare `choices=`, and a config must build and validate without importing JAX, Flax, grain or Orbax
(tests/test_light_imports.py). So the names live in this module, which imports nothing, and the modules
that act on them (tipsito/data/pipeline.py, tipsito/objective/terms.py, tipsito/models/layers.py, ...)
import them from here; where a module keeps a table keyed by these names (`TERMS`, `ACTIVATIONS`,
`REMAT_POLICIES`), tests/test_light_imports.py checks that its keys are these names, in this order.
"""

from __future__ import annotations

# `config.input.views`: what one example holds (tipsito/data/pipeline.py).
VIEWS = ("single", "two_views", "multicrop", "multicrop_two_views")
# `config.input.augment` / `augment_view2`: the augmentation family (tipsito/data/transforms.py).
AUGMENTS = ("ito", "tips", "none")
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
# term -> the batch fields it requires (`TERMS[term].fields`); validation uses it to ask for a second view.
TERM_FIELDS: dict[str, tuple[str, ...]] = {
  CLIP: ("image", "text"),
  SIGLIP: ("image", "text"),
  CLIP_VIEW2: ("image2", "text"),
  FUSION: ("image", "image2", "text"),
  KOLEO: ("image",),
  DINO: ("image",),
  IBOT: ("image",),
  FEATURE: ("image",),
}
TERM_NAMES = tuple(TERM_FIELDS)
# `config.loss_opts.view_weighting`: how the alt-text InfoNCE of ITO's two views combine
# (tipsito/objective/terms.py: `contrastive_pair_weights`).
VIEW_WEIGHTINGS = ("mean", "sum")
# `config.loss_opts.teacher_method`: how the teacher's outputs become targets (tipsito/losses/self_distill.py).
TEACHER_METHODS = ("centering", "sinkhorn")
# `config.loss_opts.dino_reduction`: how the DINO cross-entropies of the (student crop, teacher crop) pairs
# are combined (tipsito/losses/self_distill.py: `dino_loss_from_probs`).
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
