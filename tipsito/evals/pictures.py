"""Pictures of what an encoder sees: PCA maps of patch features and zero-shot segmentation overlays.

Why: numbers say how good dense features are; pictures say *why* (TIPSv2 Fig. 5 judges feature maps by
their first three PCA components as RGB, Fig. 6 shows zero-shot segmentation maps). Everything here
returns uint8 (H, W, 3) arrays, so one writer path serves TensorBoard (clu `write_images`) and PNG files.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

import numpy as np
from PIL import Image

from tipsito.data.builders import scenes_gen


def _robust_minmax(x: np.ndarray, lo_q: float = 1.0, hi_q: float = 99.0) -> np.ndarray:
  """Scales each last-axis channel to [0, 1] by its 1st/99th percentiles (outlier patches saturate)."""
  flat = x.reshape(-1, x.shape[-1])
  lo = np.percentile(flat, lo_q, axis=0)
  hi = np.percentile(flat, hi_q, axis=0)
  return np.clip((x - lo) / np.maximum(hi - lo, 1e-8), 0.0, 1.0)


def pca_components(features: np.ndarray, n_components: int = 3) -> np.ndarray:
  """Projects (N, D) features on their first n principal components -> (N, n), deterministic signs.

  SVD of the centred matrix; each component's sign is chosen so that its largest-magnitude loading is
  positive, so the same features always give the same colours. Missing components (D or N < n) are 0.
  """
  x = np.asarray(features, np.float64)
  x = x - x.mean(axis=0, keepdims=True)
  _, _, vt = np.linalg.svd(x, full_matrices=False)
  vt = vt[:n_components]
  signs = np.sign(vt[np.arange(vt.shape[0]), np.argmax(np.abs(vt), axis=1)])
  signs[signs == 0] = 1.0
  proj = x @ (vt * signs[:, None]).T
  if proj.shape[1] < n_components:
    proj = np.concatenate([proj, np.zeros((proj.shape[0], n_components - proj.shape[1]))], axis=1)
  return proj


def pca_rgb(patches: np.ndarray, *, joint: bool = False) -> np.ndarray:
  """First 3 PCA components of patch features as RGB: (B, h, w, D) -> uint8 (B, h, w, 3).

  joint=False fits one PCA per image (TIPSv2 Fig. 5); joint=True fits one PCA over all images so that
  colours are comparable across them.
  """
  p = np.asarray(patches, np.float32)
  if p.ndim == 3:
    p = p[None]
  b, h, w, d = p.shape
  if joint:
    comp = pca_components(p.reshape(-1, d)).reshape(b, h, w, 3)
    rgb = _robust_minmax(comp)
  else:
    rgb = np.stack([_robust_minmax(pca_components(p[i].reshape(-1, d)).reshape(h, w, 3)) for i in range(b)])
  return np.round(rgb * 255.0).astype(np.uint8)


def upsample_nearest(maps: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
  """Nearest-neighbour resize of uint8 (h, w[, C]) maps to (H, W) (patch grids keep hard edges)."""
  h, w = size_hw
  arr = np.asarray(maps)
  return np.asarray(Image.fromarray(arr).resize((w, h), resample=Image.NEAREST))


def pca_grid(images: np.ndarray, maps: np.ndarray) -> np.ndarray:
  """Rows of [image | PCA map] for k images: uint8 (k*H, 2*W, 3)."""
  rows = []
  for img, m in zip(np.asarray(images), np.asarray(maps)):
    img = _as_rgb_uint8(img)
    rows.append(np.concatenate([img, upsample_nearest(m, img.shape[:2])], axis=1))
  return np.concatenate(rows, axis=0)


# Sasha Trubetskoy's "20 simple, distinct colours" without grey, white and black, most distinct first:
# classes 1-19 of the small class lists of the built-in datasets stay easy to tell apart and to find in
# the legend.
DISTINCT = (
  (230, 25, 75),
  (60, 180, 75),
  (255, 225, 25),
  (0, 130, 200),
  (245, 130, 48),
  (145, 30, 180),
  (70, 240, 240),
  (240, 50, 230),
  (210, 245, 60),
  (250, 190, 212),
  (0, 128, 128),
  (220, 190, 255),
  (170, 110, 40),
  (255, 250, 200),
  (128, 0, 0),
  (170, 255, 195),
  (128, 128, 0),
  (255, 215, 180),
  (0, 0, 128),
)


def palette(num_classes: int, seed: int = 0) -> np.ndarray:
  """(256, 3) uint8 colour table: class 0 dark grey, 1-19 `DISTINCT` when there are at most 20 classes, else
  distinct hues; 255 (ignore) black."""
  rng = np.random.default_rng(seed)
  pal = np.zeros((256, 3), np.uint8)
  golden = 0.618033988749895
  for c in range(min(num_classes, 255)):
    hue = (c * golden) % 1.0
    sat = 0.65 + 0.35 * rng.random()
    val = 0.75 + 0.25 * rng.random()
    pal[c] = np.round(np.array(_hsv_to_rgb(hue, sat, val)) * 255).astype(np.uint8)
  if num_classes <= len(DISTINCT) + 1:
    pal[1:num_classes] = np.array(DISTINCT[: num_classes - 1], np.uint8).reshape(-1, 3)
  pal[0] = (64, 64, 64)
  pal[255] = (0, 0, 0)
  return pal


def _hsv_to_rgb(h: float, s: float, v: float) -> tuple[float, float, float]:
  """HSV in [0,1] -> RGB in [0,1] (colorsys-equivalent; kept local for a dependency-free palette)."""
  i = int(h * 6.0) % 6
  f = h * 6.0 - int(h * 6.0)
  p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
  return [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]


def colorize(labels: np.ndarray, num_classes: int) -> np.ndarray:
  """uint8 label map (H, W) -> RGB (H, W, 3) with `palette`."""
  return palette(num_classes)[np.asarray(labels).astype(np.uint8)]


# ------------------------------------------------------------------------------------------------------
# Classes drawn as what they are: the object's own colour with its pattern as hatching
# ------------------------------------------------------------------------------------------------------

BACKGROUND_LOOK = ((64, 64, 64), None)  # the background of a textured map: plain dark grey
HATCH_PERIOD = 12  # pattern period of a textured map, in panel pixels (the scenes' own is 4 px at 64 px)


def class_looks(class_names, background_index: int | None = None):
  """[(rgb, pattern or None) per class] when every non-background class is named '<colour> <pattern>'
  with a colour and pattern of the `scenes` testbed (tipsito/data/builders/scenes_gen.py: COLOURS,
  PATTERNS), else None (the maps then use `palette` and the figure says why).

  Why: a reader ties 'blue dots' on a map to the blue dotted object in the image without a legend, and
  sees at once which object a wrong answer was taken from."""

  looks = []
  for c, name in enumerate(class_names):
    if background_index is not None and c == int(background_index):
      looks.append(BACKGROUND_LOOK)
      continue
    parts = str(name).split(" ")
    if len(parts) != 2 or parts[0] not in scenes_gen.COLOURS or parts[1] not in scenes_gen.PATTERNS:
      return None
    looks.append((tuple(scenes_gen.COLOURS[parts[0]]), parts[1]))
  return looks


def hatch(pattern: str | None, hw: tuple[int, int], period: int = HATCH_PERIOD) -> np.ndarray:
  """bool (H, W): True where a `pattern` shows its light colour (the `scenes` patterns at `period`
  pixels: diagonal stripes, a checkerboard, light dots); all False for None."""
  yy, xx = np.mgrid[0 : hw[0], 0 : hw[1]]
  half = max(1, period // 2)
  if pattern is None:
    return np.zeros(hw, bool)
  if pattern == "stripes":
    return ((xx + yy) % period) >= half
  if pattern == "checks":
    return ((xx // half) + (yy // half)) % 2 == 1
  if pattern == "dots":
    return ((xx % period) < half) & ((yy % period) < half)
  raise ValueError(f"unknown pattern {pattern!r}")


def textured(labels: np.ndarray, looks, num_classes: int, period: int = HATCH_PERIOD) -> np.ndarray:
  """uint8 (H, W) labels -> RGB (H, W, 3): each class in its `class_looks` colour, hatched with its
  pattern in the scenes' light colour; ignored (255) black."""

  lab = np.asarray(labels)
  out = colorize(lab, num_classes).copy()
  for c, (rgb, pattern) in enumerate(looks):
    m = lab == c
    if not m.any():
      continue
    out[m] = rgb
    if pattern is not None:
      out[m & hatch(pattern, lab.shape, period)] = scenes_gen.PATTERN_LIGHT
  return out


def _as_rgb_uint8(img: np.ndarray) -> np.ndarray:
  """Any image array (uint8 or float [0,1]/[0,255], gray or RGB(A)) -> uint8 RGB, for writers."""
  img = np.asarray(img)
  if img.dtype != np.uint8:
    img = np.clip(np.round(img * (255.0 if img.max() <= 1.0 else 1.0)), 0, 255).astype(np.uint8)
  if img.ndim == 2:
    img = np.repeat(img[..., None], 3, -1)
  return img[..., :3]


def segmentation_overlay(
  image: np.ndarray, pred: np.ndarray, gt: np.ndarray | None, num_classes: int, alpha: float = 0.6
) -> np.ndarray:
  """[image | prediction over image | ground truth over image] as uint8 (H, 2W or 3W, 3)."""
  img = _as_rgb_uint8(image)
  panels = [img]
  for lab in (pred, gt):
    if lab is None:
      continue
    col = colorize(lab, num_classes).astype(np.float32)
    blend = alpha * col + (1 - alpha) * img.astype(np.float32)
    panels.append(np.round(blend).astype(np.uint8))
  return np.concatenate(panels, axis=1)


# ------------------------------------------------------------------------------------------------------
# The segmentation figure a person reads: titled panels side by side, large enough, with a colour legend
# ------------------------------------------------------------------------------------------------------

MIN_PANEL = 256  # the shorter side of every panel of `segmentation_row`, in pixels
GAP = 4  # white pixels between panels
TITLE_ROWS = 18  # height of the title strip above a row's panels
INK = (0, 0, 0)
PAPER = (255, 255, 255)


def _font(size: int = 13):
  """Pillow's bundled font (no file or network access); the small bitmap font on builds without FreeType."""
  from PIL import ImageFont  # pylint: disable=g-import-not-at-top

  try:
    return ImageFont.load_default(size=size)
  except (TypeError, OSError, ImportError):
    return ImageFont.load_default()


def upscale_factor(hw: tuple[int, int], min_side: int = MIN_PANEL) -> int:
  """The smallest integer factor that brings the shorter side of an (h, w) map to >= min_side."""
  return max(1, -(-int(min_side) // max(1, int(min(hw)))))


def _scaled(arr: np.ndarray, factor: int, smooth: bool) -> np.ndarray:
  """uint8 (h, w[, 3]) scaled by an integer factor: bilinear for photos, nearest for maps (hard edges)."""
  if factor == 1:
    return arr
  h, w = arr.shape[:2]
  resample = Image.Resampling.BILINEAR if smooth else Image.Resampling.NEAREST
  return np.asarray(Image.fromarray(arr).resize((w * factor, h * factor), resample))


def _titled(panels: list[np.ndarray], titles: list[str]) -> np.ndarray:
  """Equal-height panels side by side with GAP white columns between, each titled in a strip above."""
  from PIL import ImageDraw  # pylint: disable=g-import-not-at-top

  h = panels[0].shape[0]
  width = sum(p.shape[1] for p in panels) + GAP * (len(panels) - 1)
  canvas = Image.new("RGB", (width, h + TITLE_ROWS), PAPER)
  draw = ImageDraw.Draw(canvas)
  font = _font()
  x = 0
  for panel, title in zip(panels, titles):
    canvas.paste(Image.fromarray(panel), (x, TITLE_ROWS))
    draw.text((x + 2, 2), title, fill=INK, font=font)
    x += panel.shape[1] + GAP
  return np.asarray(canvas)


def segmentation_row(
  image: np.ndarray,
  gt: np.ndarray,
  predictions: Mapping[str, np.ndarray],
  num_classes: int,
  pca: np.ndarray | None = None,
  alpha: float = 0.7,
  min_side: int = MIN_PANEL,
  looks=None,
) -> np.ndarray:
  """One example as titled panels: image | ground truth | each prediction (title -> (H, W) labels) | PCA.

  Label maps are blended (`alpha`) over the image's grey levels (so a class keeps its legend colour
  whatever the object's own colour), drawn with `looks` (`class_looks`: the object's colour hatched with
  its pattern) when given, else in `palette` colours; every panel is scaled by one
  integer factor so that its shorter side is >= `min_side` (labels and the PCA grid nearest-neighbour,
  so patch edges stay visible; the photo bilinear). `image` must already be at the label map's size;
  `pca` is the uint8 (h, w, 3) patch grid of `pca_rgb`, upsampled to the panel size.
  """
  img = _as_rgb_uint8(image)
  hw = np.asarray(gt).shape[:2]
  if img.shape[:2] != hw:
    raise ValueError(f"image {img.shape[:2]} and label map {hw} differ; resize the image first")
  f = upscale_factor(hw, min_side)
  big = _scaled(img, f, smooth=True)
  grey = big.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)  # keeps the legend's hues

  def over(labels):
    if looks is not None:  # hatched at the panel's scale, so the pattern stays readable
      col = textured(_scaled(np.asarray(labels, np.uint8), f, smooth=False), looks, num_classes)
      col = col.astype(np.float32)
    else:
      col = _scaled(colorize(labels, num_classes), f, smooth=False).astype(np.float32)
    return np.round(alpha * col + (1 - alpha) * grey[..., None]).astype(np.uint8)

  panels, titles = [big, over(gt)], ["image", "ground truth"]
  for title, pred in predictions.items():
    panels.append(over(pred))
    titles.append(str(title))
  if pca is not None:
    panels.append(upsample_nearest(np.asarray(pca, np.uint8), (hw[0] * f, hw[1] * f)))
    titles.append("PCA of patch tokens")
  return _titled(panels, titles)


def legend(
  class_names: list[str], classes, num_classes: int, width: int, swatch: int = 14, looks=None
) -> np.ndarray:
  """uint8 (H, width, 3) strip: a swatch (`palette` colour, or the `looks` colour and hatching) and the
  name of each class in `classes`, wrapped in lines of `width` pixels (255 is written 'ignored')."""
  from PIL import ImageDraw  # pylint: disable=g-import-not-at-top

  font = _font()
  pal = palette(num_classes)
  entries = [(int(c), "ignored" if int(c) == 255 else str(class_names[int(c)])) for c in classes]
  draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
  place, x, y, line = [], 4, 4, swatch + 6
  for c, name in entries:
    w = swatch + 4 + int(np.ceil(draw.textlength(name, font=font))) + 12
    if x > 4 and x + w > width:
      x, y = 4, y + line
    place.append((c, name, x, y))
    x += w
  canvas = Image.new("RGB", (max(1, width), y + line + 2), PAPER)
  draw = ImageDraw.Draw(canvas)
  for c, name, x, y in place:
    draw.rectangle((x, y, x + swatch - 1, y + swatch - 1), fill=tuple(int(v) for v in pal[c]), outline=INK)
    if looks is not None and c < len(looks):
      tile = textured(np.full((swatch - 2, swatch - 2), c, np.uint8), looks, num_classes, period=6)
      canvas.paste(Image.fromarray(tile), (x + 1, y + 1))
    draw.text((x + swatch + 4, y), name, fill=INK, font=font)
  return np.asarray(canvas)


def caption_strip(lines: list[str], width: int, note: str | None = None) -> np.ndarray:
  """uint8 (H, width, 3) strip of text lines (the figure's caption row), `note` last."""
  from PIL import ImageDraw  # pylint: disable=g-import-not-at-top

  lines = list(lines) + ([note] if note else [])
  line = TITLE_ROWS
  canvas = Image.new("RGB", (max(1, width), line * len(lines) + 4), PAPER)
  draw = ImageDraw.Draw(canvas)
  font = _font()
  for i, text in enumerate(lines):
    draw.text((4, 2 + i * line), text, fill=INK, font=font)
  return np.asarray(canvas)


NO_LOOKS_NOTE = (
  "colours: legend only (class names are not '<colour> <pattern>' of the scenes testbed, so a class "
  "cannot be drawn as its object looks)"
)


def segmentation_figure(
  rows: list[np.ndarray],
  class_names: list[str],
  classes,
  num_classes: int,
  caption: list[str] | None = None,
  looks=None,
) -> np.ndarray:
  """`segmentation_row`s stacked (padded on the right to the widest) over a `legend` of `classes` and,
  when `caption` is given, a caption row of its lines (the eval's numbers and references; a note says
  so when the maps cannot use `looks`)."""
  width = max([r.shape[1] for r in rows] + [_text_width(caption or [])])
  padded = [np.pad(r, ((0, GAP), (0, width - r.shape[1]), (0, 0)), constant_values=255) for r in rows]
  parts = padded + [legend(class_names, classes, num_classes, width, looks=looks)]
  if caption is not None:
    parts.append(caption_strip(caption, width, None if looks is not None else NO_LOOKS_NOTE))
  return np.concatenate(parts, axis=0)


def _text_width(lines: list[str]) -> int:
  """Pixels the longest of `lines` needs in `_font`, plus margins."""
  from PIL import ImageDraw  # pylint: disable=g-import-not-at-top

  if not lines:
    return 0
  draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
  font = _font()
  return 8 + max(int(np.ceil(draw.textlength(t, font=font))) for t in list(lines) + [NO_LOOKS_NOTE])


def stack_rows(rows: list[np.ndarray]) -> np.ndarray:
  """Vertically stacks equally wide uint8 pictures."""
  return np.concatenate(rows, axis=0)


def write_png(path: str | os.PathLike, array: np.ndarray) -> str:
  """Writes a uint8 (H, W, 3) array as PNG (parent folders created); returns the path."""
  path = os.fspath(path)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  Image.fromarray(_as_rgb_uint8(array)).save(path, format="PNG")
  return path


def _safe_name(name: str) -> str:
  """Picture name -> file-name-safe stem ('eval/pca' -> 'eval_pca')."""
  return re.sub(r"[^0-9A-Za-z_.-]+", "_", name).strip("_") or "picture"


def write_pictures(
  pictures: Mapping[str, np.ndarray],
  *,
  step: int = 0,
  writer=None,
  directory: str | os.PathLike | None = None,
) -> list[str]:
  """Writes pictures as TensorBoard images (clu `writer.write_images`) and/or PNG files.

  PNG names are '<name with / -> _>_<step>.png' under `directory`. Returns the PNG paths written.
  """
  paths = []
  if writer is not None and pictures:
    writer.write_images(step, {k: _as_rgb_uint8(v)[None] for k, v in pictures.items()})
  if directory is not None:
    for name, arr in pictures.items():
      paths.append(
        write_png(os.path.join(os.fspath(directory), f"{_safe_name(name)}_{int(step):08d}.png"), arr)
      )
  return paths
