"""Procedural 'shapes' images and captions (pure numpy/PIL, no TFDS).

Why separate from the builder: the tokenizer trainer and tests need the captions without TFDS, and
conversion workers need a light module. Every example is a pure function of (seed, split, index),
so two builds are byte-identical and any index can be regenerated on its own.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

SHAPE_CLASSES = ("circle", "square", "triangle", "star", "hexagon", "diamond", "cross", "pentagon")

COLOURS = {
  "red": (220, 30, 40),
  "green": (40, 170, 60),
  "blue": (35, 70, 215),
  "yellow": (245, 215, 30),
  "orange": (245, 135, 20),
  "purple": (140, 50, 180),
  "pink": (245, 120, 190),
  "brown": (130, 80, 35),
  "cyan": (30, 200, 220),
  "black": (20, 20, 20),
}
BACKGROUNDS = {
  "white": (245, 245, 245),
  "gray": (150, 150, 150),
  "beige": (235, 220, 190),
  "light blue": (190, 215, 240),
  "dark gray": (60, 60, 65),
  "light green": (200, 235, 200),
}
# Paraphrase vocabulary for the second synthetic caption ('gemini' style).
_SIZE_WORDS = {
  "small": ("small", "tiny", "little"),
  "medium": ("medium-sized", "mid-sized", "modest"),
  "large": ("large", "big", "huge"),
}
_POS_WORDS = {
  "top left": "in the upper left corner",
  "top": "near the top edge",
  "top right": "in the upper right corner",
  "left": "on the left side",
  "center": "in the middle",
  "right": "on the right side",
  "bottom left": "in the lower left corner",
  "bottom": "near the bottom edge",
  "bottom right": "in the lower right corner",
}
_SPLIT_IDS = {"train": 0, "test": 1, "validation": 2}


def _polygon(cx, cy, r, n, rot=0.0, inner=None):
  """Vertices of a regular polygon (or a star when `inner` is the inner radius ratio)."""
  pts = []
  steps = n * 2 if inner else n
  for k in range(steps):
    rr = r * (inner if inner and k % 2 else 1.0)
    a = rot + 2 * math.pi * k / steps - math.pi / 2
    pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
  return pts


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, rot: float, fill):
  """Draws one shape of radius ~r centred at (cx, cy) with `fill` (colour or mask value)."""
  if kind == "circle":
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
  elif kind == "square":
    draw.polygon(_polygon(cx, cy, r * 1.2, 4, rot + math.pi / 4), fill=fill)
  elif kind == "triangle":
    draw.polygon(_polygon(cx, cy, r * 1.15, 3, rot), fill=fill)
  elif kind == "star":
    draw.polygon(_polygon(cx, cy, r * 1.15, 5, rot, inner=0.45), fill=fill)
  elif kind == "hexagon":
    draw.polygon(_polygon(cx, cy, r, 6, rot), fill=fill)
  elif kind == "pentagon":
    draw.polygon(_polygon(cx, cy, r, 5, rot), fill=fill)
  elif kind == "diamond":
    draw.polygon(
      [(cx, cy - r * 1.2), (cx + r * 0.75, cy), (cx, cy + r * 1.2), (cx - r * 0.75, cy)], fill=fill
    )
  elif kind == "cross":
    t = r * 0.35
    draw.polygon(
      [
        (cx - t, cy - r),
        (cx + t, cy - r),
        (cx + t, cy - t),
        (cx + r, cy - t),
        (cx + r, cy + t),
        (cx + t, cy + t),
        (cx + t, cy + r),
        (cx - t, cy + r),
        (cx - t, cy + t),
        (cx - r, cy + t),
        (cx - r, cy - t),
        (cx - t, cy - t),
      ],
      fill=fill,
    )
  else:
    raise ValueError(f"unknown shape {kind!r}")


def _position_name(cx: float, cy: float, size: int) -> str:
  """3x3 grid cell name of a point ('top left', 'center', ...)."""
  col = min(2, int(3 * cx / size))
  row = min(2, int(3 * cy / size))
  v = ("top", "", "bottom")[row]
  h = ("left", "", "right")[col]
  return (f"{v} {h}".strip()) or "center"


def _pos_phrase(position: str) -> str:
  """'center' -> 'in the center', 'left' -> 'on the left', 'top left' -> 'at the top left'."""
  if position == "center":
    return "in the center"
  if position in ("left", "right"):
    return f"on the {position}"
  return f"at the {position}"


def _article(word: str) -> str:
  """'a' or 'an' for the next word, so captions read naturally."""
  return "an" if word[0] in "aeiou" else "a"


def _join(items: list[str]) -> str:
  """'x', 'x and y', 'x, y and z': natural-language list of object phrases."""
  if len(items) == 1:
    return items[0]
  return ", ".join(items[:-1]) + " and " + items[-1]


SIZE_NAMES = ("small", "medium", "large")
_SIZE_FRACTIONS = {"small": (0.07, 0.11), "medium": (0.12, 0.17), "large": (0.18, 0.26)}


def check_options(*, max_objects: int | None = None, sizes=None, colours=None) -> None:
  """Fails naming the option and its valid values (build options come from configs and the CLI)."""
  if max_objects is not None and max_objects < 1:
    raise ValueError(f"shapes max_objects={max_objects}: must be >= 1")
  for key, value, valid in (("object_sizes", sizes, SIZE_NAMES), ("colours", colours, tuple(COLOURS))):
    if value is not None and (not value or isinstance(value, str) or any(v not in valid for v in value)):
      raise ValueError(f"shapes {key}={value!r}: valid values are non-empty subsets of {valid}")


# Longer than ~60 lines on purpose: one example is drawn from one seeded RNG in a fixed order of draws;
# splitting the draws over helpers would make that order (and so every image) easy to change by accident.
def generate(
  index: int,
  *,
  split: str = "train",
  image_size: int = 224,
  seed: int = 0,
  max_objects: int = 4,
  sizes: tuple[str, ...] = SIZE_NAMES,
  colours: tuple[str, ...] | None = None,
) -> dict:
  """Returns one example: uint8 image (S,S,3), mask (S,S) (class+1, 0 = background), captions, label.

  The main object (label and short caption) is the largest one; it is drawn first, smaller ones may
  overlap it. The segmentation mask holds the class of the top-most object at each pixel.
  `sizes` restricts object sizes (radius as a fraction of the image: small 7-11%, medium 12-17%,
  large 18-26%): at 64 px a small star or hexagon is a few pixels wide, so the 64 px CPU demo uses
  ('large',). `colours` restricts the fill colours (names of
  COLOURS; None = all ten): with ten colours, colour alone tells most captions in a batch apart, so a
  small contrastive model can match captions without ever learning shape.
  """
  check_options(max_objects=max_objects, sizes=sizes, colours=colours)
  colours = tuple(COLOURS) if colours is None else tuple(colours)
  rng = np.random.default_rng([seed, _SPLIT_IDS.get(split, 3), index])
  s = image_size
  n = int(rng.integers(1, max_objects + 1))
  bg_name = list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
  gradient = bool(rng.random() < 0.5)
  bg = np.array(BACKGROUNDS[bg_name], np.float32)
  if gradient:
    bg2 = bg * 0.6 + 0.4 * np.array((255, 255, 255) if bg.mean() < 128 else (90, 90, 90), np.float32)
    t = np.linspace(0.0, 1.0, s, dtype=np.float32)
    ramp = t[:, None] if rng.random() < 0.5 else t[None, :]
    canvas = bg[None, None] * (1 - ramp[..., None]) + bg2[None, None] * ramp[..., None]
    canvas = np.broadcast_to(canvas, (s, s, 3))
  else:
    canvas = np.broadcast_to(bg, (s, s, 3))
  img = Image.fromarray(np.ascontiguousarray(canvas).round().astype(np.uint8), "RGB")
  mask = Image.new("L", (s, s), 0)
  draw_img, draw_mask = ImageDraw.Draw(img), ImageDraw.Draw(mask)

  objects = []
  for _ in range(n):
    size_name = tuple(sizes)[rng.integers(len(sizes))]
    frac = _SIZE_FRACTIONS[size_name]
    r = float(rng.uniform(*frac)) * s
    cx = float(rng.uniform(r, s - r))
    cy = float(rng.uniform(r, s - r))
    kind_idx = int(rng.integers(len(SHAPE_CLASSES)))
    colour = colours[rng.integers(len(colours))]
    rot = float(rng.uniform(0, 2 * math.pi)) if rng.random() < 0.3 else 0.0
    objects.append(
      dict(
        kind=SHAPE_CLASSES[kind_idx],
        label=kind_idx,
        colour=colour,
        size=size_name,
        r=r,
        cx=cx,
        cy=cy,
        rot=rot,
        position=_position_name(cx, cy, s),
      )
    )
  objects.sort(key=lambda o: -o["r"])  # largest first: it is the main object and stays mostly visible
  for o in objects:
    _draw_shape(draw_img, o["kind"], o["cx"], o["cy"], o["r"], o["rot"], COLOURS[o["colour"]])
    _draw_shape(draw_mask, o["kind"], o["cx"], o["cy"], o["r"], o["rot"], o["label"] + 1)

  main = objects[0]
  short = f"{_article(main['colour'])} {main['colour']} {main['kind']}"
  bg_desc = f"{'gradient' if gradient else 'plain'} {bg_name} background"
  parts = [
    f"{_article(o['size'])} {o['size']} {o['colour']} {o['kind']} {_pos_phrase(o['position'])}"
    for o in objects
  ]
  detailed = f"{_join(parts)}, on a {bg_desc}."
  detailed = detailed[0].upper() + detailed[1:]
  words = []
  for o in objects:
    sw = _SIZE_WORDS[o["size"]][rng.integers(3)]
    words.append(f"{_article(sw)} {sw} {o['colour']} {o['kind']} {_POS_WORDS[o['position']]}")
  count = "one shape" if n == 1 else f"{n} shapes"
  gemini = (
    f"This image shows {count} on a {'smoothly shaded' if gradient else 'flat'} {bg_name} "
    f"background: {_join(words)}."
  )
  return {
    "image": np.asarray(img),
    "segmentation": np.asarray(mask),
    "alt_text": short,
    "caption_detailed": detailed,
    "caption_gemini": gemini,
    "label": main["label"],
    "id": f"shapes-{split}-{index:07d}",
  }
