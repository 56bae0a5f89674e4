"""Procedural multi-object 'scenes' with per-pixel class and depth truth (pure numpy/PIL, no TFDS).

Why: a testbed where dense patch-text alignment has a right answer (issue 31). Every image holds 2-4
objects of *different* classes at random positions, sizes and depths on a textured ground plane; nearer
objects occlude farther ones. A class is a colour x pattern (e.g. 'red stripes'), a local appearance that
one or two 8-px patches show, so a patch can be labelled without seeing the whole object, while a model
that copies one global answer to every patch gets the other objects wrong. Shape is not part of a class
(every object is an ellipse or a rectangle at random): the pilot in the project notes found shape
unlearnable at demo scale and colour alone nearly solved, so classes combine colour with a pattern.

Every example is a pure function of (seed, split, index) (one seeded RNG, a fixed order of draws), so
two builds are byte-identical and any example can be regenerated on its own. All classes and generator
parameters live in this module's constants (COLOURS, PATTERNS, CLASSES, SIZE_RANGE, ...).

Geometry: a camera looks at a ground plane whose inverse depth is linear in the image row, from
FAR_DEPTH_M at the top row to NEAR_DEPTH_M at the bottom row. An object stands upright on the ground
at its bottom edge and takes the ground's depth there (a flat billboard: one depth per object), so lower
objects are nearer and are painted over higher ones. Depth maps are in millimetres (uint16, the NYUv2
`sync_depth` scale), never 0.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from tipsito.choices import SCENES_PROMPTS

# The class set: every colour x pattern. Class c is CLASSES[c]; segmentation value c + 1.
COLOURS = {
  "red": (215, 35, 40),
  "green": (35, 165, 60),
  "blue": (40, 75, 220),
  "yellow": (240, 205, 25),
}
PATTERNS = ("stripes", "dots", "checks")
CLASSES = tuple(f"{c} {p}" for c in COLOURS for p in PATTERNS)
# The light colour a pattern alternates with (the object's colour is the other one).
PATTERN_LIGHT = (250, 250, 250)
# Background ground textures: muted colours, none close to a class colour, with pixel noise.
GROUNDS = {
  "gray": (128, 128, 128),
  "sand": (170, 155, 125),
  "slate": (95, 105, 115),
  "clay": (140, 110, 95),
}
GROUND_NOISE = 18.0  # std of the ground's per-pixel grey noise (0-255 scale)
NEAR_DEPTH_M = 2.0  # ground depth at the bottom row
FAR_DEPTH_M = 10.0  # ground depth at the top row
MIN_OBJECTS, MAX_OBJECTS = 2, 4
SIZE_RANGE = (0.14, 0.30)  # object half-extent as a fraction of the image side
SIZE_WORDS = ((0.19, "small"), (0.25, "medium"), (1.0, "large"))  # half-extent fraction upper bounds
MIN_VISIBLE = 0.4  # every object keeps at least this fraction of its own area visible
PATTERN_PERIOD = 1 / 16  # pattern period as a fraction of the side (4 px at 64 px; at least 4 px)
_LAYOUT_TRIES = 60
_SPLIT_IDS = {"train": 0, "test": 1, "validation": 2}
# Zero-shot prompts of the scenes eval suite (tipsito/evals/suites.py), phrased like the alt-texts so that
# the scenes tokenizer (tipsito/data/assets/scenes_sp.model) knows every word; declared in the leaf
# tipsito/choices.py so that a config names them without importing this generator (and PIL).
PROMPTS = SCENES_PROMPTS
_ALT_TEMPLATES = ("{}", "{} in a picture", "photo of {}", "{} on the ground", "some {}")


def pattern_period(image_size: int) -> int:
  """Pattern period in pixels: two periods per 8-px patch at 64 px, scaled with the image side."""
  return max(4, int(round(image_size * PATTERN_PERIOD)))


def ground_depth_m(image_size: int) -> np.ndarray:
  """Depth (metres) of the ground plane at each row: inverse depth linear from far (top) to near (bottom)."""
  t = np.arange(image_size, dtype=np.float64) / max(1, image_size - 1)
  inv = 1.0 / FAR_DEPTH_M + t * (1.0 / NEAR_DEPTH_M - 1.0 / FAR_DEPTH_M)
  return 1.0 / inv


def object_mask(obj: dict, image_size: int) -> np.ndarray:
  """Boolean (S,S) mask of an object's full extent (ignoring occlusion); `obj` as in `generate`'s list."""
  mask = Image.new("L", (image_size, image_size), 0)
  draw = ImageDraw.Draw(mask)
  x0, y0, x1, y1 = obj["box"]
  if obj["shape"] == "ellipse":
    draw.ellipse([x0, y0, x1, y1], fill=1)
  else:
    draw.rectangle([x0, y0, x1, y1], fill=1)
  return np.asarray(mask, dtype=bool)


def _pattern(name: str, image_size: int, phase: tuple[int, int]) -> np.ndarray:
  """Boolean (S,S): True where the pattern shows the object's colour, False where it shows the light one."""
  p = pattern_period(image_size)
  yy, xx = np.mgrid[0:image_size, 0:image_size]
  yy, xx = yy + phase[0], xx + phase[1]
  if name == "stripes":  # diagonal stripes, half a period wide
    return ((xx + yy) % p) < p // 2
  if name == "checks":  # a checkerboard of half-period cells
    return ((xx // (p // 2)) + (yy // (p // 2))) % 2 == 0
  if name == "dots":  # light dots (a quarter of each cell) on the colour
    return ~(((xx % p) < p // 2) & ((yy % p) < p // 2))
  raise ValueError(f"unknown pattern {name!r}; known: {PATTERNS}")


def _ground(rng: np.random.Generator, image_size: int) -> tuple[str, np.ndarray]:
  """A textured ground: a base colour, lighter towards the horizon, with grey pixel noise."""
  name = list(GROUNDS)[rng.integers(len(GROUNDS))]
  base = np.array(GROUNDS[name], np.float64)
  t = np.linspace(1.15, 0.85, image_size)[:, None, None]
  noise = rng.normal(0.0, GROUND_NOISE, (image_size, image_size, 1))
  return name, np.clip(base[None, None] * t + noise, 0, 255)


def _size_word(frac: float) -> str:
  """'small' / 'medium' / 'large' of a half-extent fraction (SIZE_WORDS)."""
  return next(word for bound, word in SIZE_WORDS if frac <= bound)


def _position_name(cx: float, cy: float, size: int) -> str:
  """3x3 grid cell name of a point ('top left', 'center', ...)."""
  col, row = min(2, int(3 * cx / size)), min(2, int(3 * cy / size))
  return f"{('top', '', 'bottom')[row]} {('left', '', 'right')[col]}".strip() or "center"


def _join(items: list[str]) -> str:
  """'x', 'x and y', 'x, y and z'."""
  return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _layout(rng: np.random.Generator, s: int, n: int) -> list[dict]:
  """Draws n objects of distinct classes (class, shape, box, depth), unrendered."""
  classes = rng.choice(len(CLASSES), size=n, replace=False)
  ground = ground_depth_m(s)
  objects = []
  for c in classes:
    frac = float(rng.uniform(*SIZE_RANGE))
    aspect = float(rng.uniform(0.7, 1.4))
    hx, hy = frac * s * aspect**0.5, frac * s / aspect**0.5
    cx, cy = float(rng.uniform(hx * 0.5, s - hx * 0.5)), float(rng.uniform(hy * 0.5, s - hy * 0.5))
    box = (round(cx - hx), round(cy - hy), round(cx + hx), round(cy + hy))
    bottom = min(s - 1, max(0, box[3]))
    objects.append(
      dict(
        label=int(c),
        name=CLASSES[int(c)],
        shape=("ellipse", "rectangle")[rng.integers(2)],
        box=box,
        depth_mm=int(round(ground[bottom] * 1000)),
        size=_size_word(frac),
        position=_position_name(cx, cy, s),
        phase=(int(rng.integers(8)), int(rng.integers(8))),
      )
    )
  return objects


def _render(objects: list[dict], s: int) -> tuple[np.ndarray, list[np.ndarray]]:
  """Paints far to near: returns the class map (S,S) uint8 and each object's full mask."""
  seg = np.zeros((s, s), np.uint8)
  masks = [object_mask(o, s) for o in objects]
  for i in sorted(range(len(objects)), key=lambda k: -objects[k]["depth_mm"]):
    seg[masks[i]] = objects[i]["label"] + 1
  return seg, masks


def check_options(*, max_objects: int | None = None) -> None:
  """Fails naming the option and its valid range (build options come from configs and the CLI)."""
  if max_objects is not None and not MIN_OBJECTS <= max_objects <= len(CLASSES):
    raise ValueError(f"scenes max_objects={max_objects}: must be in [{MIN_OBJECTS}, {len(CLASSES)}]")


# Longer than ~60 lines on purpose: one example is drawn from one seeded RNG in a fixed order of draws;
# splitting the draws further would make that order (and so every image) easy to change by accident.
def generate(
  index: int, *, split: str = "train", image_size: int = 64, seed: int = 0, max_objects: int = 4
) -> dict:
  """Returns one example: image (S,S,3) uint8, segmentation (S,S) uint8, depth (S,S) uint16 (mm), the
  object list, label (largest visible object), labels (all classes present, sorted), captions, id.

  Layouts are redrawn (same RNG, so still deterministic) until every object keeps MIN_VISIBLE of its area
  and all object depths differ; after half the tries the object count falls to MIN_OBJECTS.
  """
  check_options(max_objects=max_objects)
  rng = np.random.default_rng([seed, _SPLIT_IDS.get(split, 3), index])
  s = image_size
  n = int(rng.integers(MIN_OBJECTS, max_objects + 1))
  ground_name, canvas = _ground(rng, s)
  for attempt in range(_LAYOUT_TRIES):
    if attempt == _LAYOUT_TRIES // 2:
      n = MIN_OBJECTS
    objects = _layout(rng, s, n)
    seg, masks = _render(objects, s)
    for o, m in zip(objects, masks):
      o["area"] = int(m.sum())
      o["visible"] = int((seg == o["label"] + 1).sum())
    depths_distinct = len({o["depth_mm"] for o in objects}) == n
    if depths_distinct and all(o["visible"] >= MIN_VISIBLE * o["area"] > 0 for o in objects):
      break
  else:
    raise RuntimeError(f"scenes: no valid layout for example {index} of {split!r} (seed {seed})")

  image = canvas.copy()
  depth = np.repeat(np.round(ground_depth_m(s) * 1000)[:, None], s, axis=1)
  for o in objects:
    vis = seg == o["label"] + 1
    colour_name, pattern_name = o["name"].split(" ")
    on = _pattern(pattern_name, s, o["phase"])
    paint = np.where(on[..., None], np.array(COLOURS[colour_name]), np.array(PATTERN_LIGHT))
    image[vis] = paint[vis]
    depth[vis] = o["depth_mm"]

  # Largest object: most visible pixels, ties to the lower class index (the record contract).
  by_size = sorted(objects, key=lambda o: (-o["visible"], o["label"]))
  main = by_size[0]
  alt_n = 1 if len(objects) == 1 or rng.random() < 0.6 else 2
  alt_objs = [objects[k] for k in sorted(rng.choice(len(objects), size=alt_n, replace=False))]
  alt_text = _ALT_TEMPLATES[rng.integers(len(_ALT_TEMPLATES))].format(_join([o["name"] for o in alt_objs]))
  caption = _join([o["name"] for o in by_size]) + "."
  detailed = (
    ", ".join(f"{o['size']} {o['name']} {o['position']}" for o in by_size) + f", {ground_name} ground."
  )
  return {
    "image": image.round().astype(np.uint8),
    "segmentation": seg,
    "depth": depth.astype(np.uint16),
    "objects": [
      dict(
        label=o["label"],
        box=o["box"],
        shape=o["shape"],
        depth_m=o["depth_mm"] / 1000.0,
        visible_pixels=o["visible"],
      )
      for o in by_size
    ],
    "label": main["label"],
    "labels": sorted(o["label"] for o in objects),
    "alt_text": alt_text,
    "caption": caption,
    "caption_detailed": detailed,
    "id": f"scenes-{split}-{index:07d}",
  }
