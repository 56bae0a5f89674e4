"""Prompt templates and class-name lists for the zero-shot evaluations.

Why a module of its own: the TIPS/CLIP protocols are defined as much by the prompts as by the model. Keeping
them in one place, addressable by a short name from the config (`templates='imagenet80'`), makes runs
reproducible and lets a config swap prompt sets without code changes.

Sets:
- `imagenet80`: CLIP's 80 ImageNet prompt-engineering templates (Radford et al. 2021), the standard for
  zero-shot classification.
- `tcl`: the 9 templates TCL (Cha et al. 2023) averages for zero-shot segmentation (its "custom" set: the
  7 CLIP "subset" templates plus two plural forms). TIPS/TIPSv2 report zero-shot segmentation with them.
- `simple`: one "a photo of a {}." prompt (quick checks, tiny models).
- small dataset-specific lists for the built-in demo datasets (`shapes`, `tuxpaint`, `fashion_mnist`,
  `openclipart`).
"""

from __future__ import annotations

from typing import Sequence

from tipsito.data import sources
from tipsito.data.builders import class_words

IMAGENET80 = (
  "a bad photo of a {}.",
  "a photo of many {}.",
  "a sculpture of a {}.",
  "a photo of the hard to see {}.",
  "a low resolution photo of the {}.",
  "a rendering of a {}.",
  "graffiti of a {}.",
  "a bad photo of the {}.",
  "a cropped photo of the {}.",
  "a tattoo of a {}.",
  "the embroidered {}.",
  "a photo of a hard to see {}.",
  "a bright photo of a {}.",
  "a photo of a clean {}.",
  "a photo of a dirty {}.",
  "a dark photo of the {}.",
  "a drawing of a {}.",
  "a photo of my {}.",
  "the plastic {}.",
  "a photo of the cool {}.",
  "a close-up photo of a {}.",
  "a black and white photo of the {}.",
  "a painting of the {}.",
  "a painting of a {}.",
  "a pixelated photo of the {}.",
  "a sculpture of the {}.",
  "a bright photo of the {}.",
  "a cropped photo of a {}.",
  "a plastic {}.",
  "a photo of the dirty {}.",
  "a jpeg corrupted photo of a {}.",
  "a blurry photo of the {}.",
  "a photo of the {}.",
  "a good photo of the {}.",
  "a rendering of the {}.",
  "a {} in a video game.",
  "a photo of one {}.",
  "a doodle of a {}.",
  "a close-up photo of the {}.",
  "a photo of a {}.",
  "the origami {}.",
  "the {} in a video game.",
  "a sketch of a {}.",
  "a doodle of the {}.",
  "a origami {}.",
  "a low resolution photo of a {}.",
  "the toy {}.",
  "a rendition of the {}.",
  "a photo of the clean {}.",
  "a photo of a large {}.",
  "a rendition of a {}.",
  "a photo of a nice {}.",
  "a photo of a weird {}.",
  "a blurry photo of a {}.",
  "a cartoon {}.",
  "art of a {}.",
  "a sketch of the {}.",
  "a embroidered {}.",
  "a pixelated photo of a {}.",
  "itap of the {}.",
  "a jpeg corrupted photo of the {}.",
  "a good photo of a {}.",
  "a plushie {}.",
  "a photo of the nice {}.",
  "a photo of the small {}.",
  "a photo of the weird {}.",
  "the cartoon {}.",
  "art of the {}.",
  "a drawing of the {}.",
  "a photo of the large {}.",
  "a black and white photo of a {}.",
  "the plushie {}.",
  "a dark photo of a {}.",
  "itap of a {}.",
  "graffiti of the {}.",
  "a toy {}.",
  "itap of my {}.",
  "a photo of a cool {}.",
  "a photo of a small {}.",
  "a tattoo of the {}.",
)

TCL9 = (
  "itap of a {}.",
  "a bad photo of a {}.",
  "a origami {}.",
  "a photo of the large {}.",
  "a {} in a video game.",
  "art of the {}.",
  "a photo of the small {}.",
  "a photo of many {}.",
  "a photo of {}s.",
)

SIMPLE = ("a photo of a {}.",)

# The demo data are drawings of geometric shapes, clip-art/photo stamps and greyscale clothing photos;
# prompts that describe the medium help tiny models and are what a user would write.
SHAPES = (
  "a {}.",
  "a picture of a {}.",
  "a drawing of a {}.",
  "a {} shape.",
  "an image with a {}.",
)

TUXPAINT = (
  "a picture of {}.",
  "a drawing of {}.",
  "a photo of {}.",
  "clip art of {}.",
  "a stamp of {}.",
)

OPENCLIPART = (
  "a drawing of a {}.",
  "clip art of a {}.",
  "a vector drawing of a {}.",
  "an icon of a {}.",
  "a simple illustration of a {}.",
)

FASHION_MNIST = (
  "a photo of a {}.",
  "a black and white photo of a {}.",
  "a low resolution photo of a {}.",
  "a photo of the {}, a type of clothing.",
  "a greyscale picture of a {}.",
)

TEMPLATE_SETS: dict[str, tuple[str, ...]] = {
  "imagenet80": IMAGENET80,
  "clip": IMAGENET80,
  "tcl": TCL9,
  "simple": SIMPLE,
  "shapes": SHAPES,
  "tuxpaint": TUXPAINT,
  "fashion_mnist": FASHION_MNIST,
  "openclipart": OPENCLIPART,
  "identity": ("{}",),
}


def class_names_for(dataset: str | None) -> tuple[str, ...] | None:
  """Curated class names of a built-in dataset (better prompts than raw folder names), or None.

  tuxpaint's and openclipart's ClassLabel names are folder names ('naturalforces', 'signs_and_symbols');
  their builders also define the words their captions use ('force of nature', 'sign or symbol'), which
  are what a prompt should say. Fashion-MNIST's are its builder's `CLASS_NAMES` (the one list of its
  labels), which also hold for a copy built elsewhere that stores integer labels only. All three tables
  live in tipsito/data/builders/class_words.py, which imports nothing (the builders import TFDS).
  """
  return CURATED_CLASS_NAMES.get(sources.base_name(dataset))


# Built-in datasets whose prompts name their classes by these words (in label order).
CURATED_CLASS_NAMES: dict[str, tuple[str, ...]] = {
  "tuxpaint": tuple(class_words.TUXPAINT_CATEGORY_WORDS[c] for c in class_words.TUXPAINT_CATEGORIES),
  "openclipart": tuple(class_words.OPENCLIPART_CATEGORY_WORDS[c] for c in class_words.OPENCLIPART_CATEGORIES),
  "fashion_mnist": tuple(class_words.FASHION_MNIST_CLASS_NAMES),
}


# Which template set each dataset uses when the config says `templates=None`.
DEFAULT_TEMPLATES: dict[str, str] = {
  "shapes": "shapes",
  "tuxpaint": "tuxpaint",
  "fashion_mnist": "fashion_mnist",
  "openclipart": "openclipart",
}


def get_templates(spec: str | Sequence[str] | None, dataset: str | None = None) -> tuple[str, ...]:
  """Resolves a template spec (set name, explicit list, or None = dataset default) to format strings.

  Accepting both names and lists keeps configs short for the standard sets while allowing a custom list;
  each template must contain exactly one `{}` so that a class name can be substituted.
  """
  if spec is None:
    spec = DEFAULT_TEMPLATES.get(sources.base_name(dataset), "imagenet80")
  if isinstance(spec, str):
    if spec in TEMPLATE_SETS:
      templates = TEMPLATE_SETS[spec]
    elif "{}" in spec:
      templates = (spec,)
    else:
      raise KeyError(f"unknown template set {spec!r}; known: {sorted(TEMPLATE_SETS)}")
  else:
    templates = tuple(str(t) for t in spec)
  for t in templates:
    if t.count("{}") != 1:
      raise ValueError(f"template {t!r} must contain exactly one '{{}}'")
  if not templates:
    raise ValueError("empty template list")
  return templates


def fill(templates: Sequence[str], class_names: Sequence[str]) -> list[str]:
  """Class-major list of prompts: [c0 t0, c0 t1, ..., c1 t0, ...] (reshape to (C, T) after embedding)."""
  return [t.format(name) for name in class_names for t in templates]
