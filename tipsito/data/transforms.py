"""Per-example image/text transforms for tipsito (numpy + PIL only, no TF, no grain): the samplers and
view functions the grain operations of tipsito/data/grain_ops.py run, and the deterministic resize that
evaluation and inference use (so `tipsito.load` imports no data pipeline).

Why this shape:
* Every random decision is drawn from a numpy Generator handed in by the caller (grain's
  `random_map`, or the pipeline's per-(seed, epoch, record) generator), so an example's output
  depends only on (seed, epoch, record index) -- never on worker count or read order.
* Samplers (`sample_resized_crop`, `sample_color_jitter`, ...) are pure functions returning the
  drawn parameters so tests can check their ranges over many draws; the view transforms accept a
  `trace` list that receives the parameters actually used.
* Work stays in uint8 PIL images: crop-before-resize via `Image.resize(box=...)`, JPEG draft
  decoding when every crop allows a >=2x downscale, no float images on the host. Outputs are uint8.
* Bad input raises `SkipExample(reason)`; the pipeline turns it into a counted skip, never a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import time
from typing import Any, Sequence

import numpy as np
from PIL import Image

__all__ = [
  'SkipExample',
  'SKIP_REASONS',
  'ImageLimits',
  'open_image',
  'load_rgb',
  'decode_rgb',
  'CropParams',
  'JitterParams',
  'sample_resized_crop',
  'sample_color_jitter',
  'apply_color_jitter',
  'adjust_hue',
  'adjust_brightness',
  'adjust_contrast',
  'adjust_saturation',
  'image_mean_grey',
  'hue_shift_planes',
  'gaussian_kernel',
  'gaussian_blur',
  'gaussian_blur_array',
  'ITOViewParams',
  'sample_ito_view',
  'apply_view',
  'alpha_channel',
  'FIXED_RESIZE_MODES',
  'fixed_resize',
  'fixed_size_image',
  'decode_text',
  'choose_caption',
]

# PIL refuses images over ~179M pixels with DecompressionBombError (and warns above ~89M); we
# apply our own header-level limits (ImageLimits) instead, so its global guard is lifted here.
# Truncated files raise on load (PIL's default ImageFile.LOAD_TRUNCATED_IMAGES = False) and are
# skipped as 'corrupt_image'.
Image.MAX_IMAGE_PIXELS = None

BICUBIC = Image.Resampling.BICUBIC

#: Reasons a record can be skipped; the pipeline counts each separately.
SKIP_REASONS = (
  'read_error',  # the source raised while reading the record
  'missing_image',  # no image field / None
  'empty_image',  # zero-byte payload or zero-size array
  'corrupt_image',  # undecodable or truncated bytes, unsupported array
  'tiny_image',  # a side < ImageLimits.min_side
  'huge_image',  # more pixels than ImageLimits.hard_max_pixels
  'extreme_aspect',  # long/short side > ImageLimits.max_aspect
  'missing_text',  # alt-text field absent
  'bad_text',  # alt-text empty, or not valid UTF-8
  'missing_label',  # label configured but absent / not an int
  'other',  # any other exception inside a transform (bug guard)
)


class SkipExample(Exception):
  """Raised by a transform when a record must be skipped; `reason` is one of SKIP_REASONS."""

  def __init__(self, reason: str, detail: str = ''):
    super().__init__(reason, detail)
    self.reason = reason if reason in SKIP_REASONS else 'other'
    self.detail = detail

  def __str__(self):
    return f'{self.reason}: {self.detail}' if self.detail else self.reason


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageLimits:
  """What counts as a usable image.

  max_pixels: images above this are decoded downscaled (JPEG draft) or reduced after decoding,
  so one 100-megapixel web image cannot stall a worker; hard_max_pixels: above this the record is
  skipped outright (decompression-bomb guard); min_side: shorter side below this is skipped;
  max_aspect: long/short side ratio above this is skipped (banners, 1-px lines).
  """

  max_pixels: int = 4096 * 4096
  hard_max_pixels: int = 16384 * 16384
  min_side: int = 2
  max_aspect: float = 20.0
  background: tuple[int, int, int] = (255, 255, 255)


DEFAULT_LIMITS = ImageLimits()


def _check_size(width: int, height: int, limits: ImageLimits):
  """Header-level checks, before any pixel is decoded (cheap rejection of bad records)."""
  if width <= 0 or height <= 0:
    raise SkipExample('empty_image', f'{width}x{height}')
  if min(width, height) < limits.min_side:
    raise SkipExample('tiny_image', f'{width}x{height}')
  if max(width, height) / min(width, height) > limits.max_aspect:
    raise SkipExample('extreme_aspect', f'{width}x{height}')
  if width * height > limits.hard_max_pixels:
    raise SkipExample('huge_image', f'{width}x{height}')


def _array_to_pil(arr: np.ndarray) -> Image.Image:
  """Converts a decoded array (HW, HW1, HW3, HW4; uint8/uint16/float/bool) to an 8-bit PIL image."""
  if arr.ndim == 3 and arr.shape[-1] == 1:
    arr = arr[..., 0]
  if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (3, 4)):
    raise SkipExample('corrupt_image', f'unsupported array shape {arr.shape}')
  if arr.size == 0:
    raise SkipExample('empty_image', f'array shape {arr.shape}')
  if arr.dtype == np.uint8:
    pass
  elif arr.dtype == np.bool_:
    arr = arr.astype(np.uint8) * 255
  elif arr.dtype in (np.uint16, np.int32, np.uint32, np.int64):
    arr = (np.clip(arr, 0, 65535).astype(np.uint32) >> 8).astype(np.uint8)
  elif np.issubdtype(arr.dtype, np.floating):
    top = 1.0 if float(np.nanmax(arr)) <= 1.0 else 255.0
    arr = np.clip(np.nan_to_num(arr) * (255.0 / top), 0, 255).round().astype(np.uint8)
  else:
    raise SkipExample('corrupt_image', f'unsupported dtype {arr.dtype}')
  return Image.fromarray(np.ascontiguousarray(arr))  # mode inferred: L / RGB / RGBA


def open_image(value: Any, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
  """Opens an image lazily (header only for encoded bytes) and validates its size.

  Accepts encoded bytes (PNG/JPEG/... anything PIL reads), numpy arrays as tfds decodes them, or
  PIL images. Pixel data of encoded images is decoded later by `load_rgb`, which can then use
  JPEG draft mode sized to the crops actually needed.
  """
  if value is None:
    raise SkipExample('missing_image')
  if isinstance(value, Image.Image):
    img = value
  elif isinstance(value, np.ndarray) and value.dtype != object and value.dtype.kind not in 'SV':
    img = _array_to_pil(value)
  else:
    if isinstance(value, np.ndarray):  # object / bytes scalar array
      value = value.item() if value.size == 1 else b''
    if isinstance(value, memoryview):
      value = value.tobytes()
    if not isinstance(value, (bytes, bytearray)):
      raise SkipExample('corrupt_image', f'unsupported image value {type(value).__name__}')
    if len(value) == 0:
      raise SkipExample('empty_image', 'zero bytes')
    try:
      img = Image.open(io.BytesIO(value))
    except Exception as e:  # pylint: disable=broad-except
      raise SkipExample('corrupt_image', f'{type(e).__name__}: {e}') from None
  _check_size(*img.size, limits)
  return img


def _to_rgb(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
  """Any PIL mode -> 8-bit RGB; transparency composited on `background`, 16-bit scaled down."""
  mode = img.mode
  if mode == 'RGB':
    return img
  if mode in ('I;16', 'I;16B', 'I;16L', 'I;16N', 'I', 'F'):
    arr = np.asarray(img)
    if mode == 'F':
      arr = np.clip(np.nan_to_num(arr), 0, 255).astype(np.uint8)
    else:
      arr = (np.clip(arr, 0, 65535).astype(np.uint32) >> 8).astype(np.uint8)
    return Image.fromarray(arr, 'L').convert('RGB')
  if mode == 'P':
    img = img.convert('RGBA' if 'transparency' in img.info else 'RGB')
  elif mode in ('LA', 'La', 'PA', 'RGBa') or (mode == 'L' and 'transparency' in img.info):
    img = img.convert('RGBA')
  elif mode == '1':
    img = img.convert('L')
  if img.mode == 'RGBA':
    base = Image.new('RGB', img.size, background)
    base.paste(img, mask=img.getchannel('A'))
    return base
  return img.convert('RGB')  # L, CMYK (Adobe inversion handled by PIL), YCbCr, LAB, HSV, ...


def load_rgb(
  img: Image.Image, max_reduce: float = 1.0, limits: ImageLimits = DEFAULT_LIMITS
) -> tuple[Image.Image, float]:
  """Decodes `img` to RGB uint8, allowing a downscale by up to `max_reduce`.

  Returns (rgb, factor) where factor = original width / returned width (>= 1): callers scale their
  crop boxes by 1/factor. JPEGs use draft mode (DCT-domain 1/2, 1/4, 1/8 decoding) when the
  crops permit; any image above `limits.max_pixels` is reduced to fit regardless.
  """
  w0, h0 = img.size
  need = max(1.0, math.sqrt(w0 * h0 / limits.max_pixels))  # forced by the pixel cap
  allow = max(need, float(max_reduce))
  try:
    if getattr(img, 'format', None) == 'JPEG' and allow >= 2.0 and img.mode in ('RGB', 'L', 'CMYK'):
      img.draft(img.mode, (max(1, int(w0 / allow)), max(1, int(h0 / allow))))
    img.load()
    if img.width * img.height > limits.max_pixels:
      f = int(math.ceil(math.sqrt(img.width * img.height / limits.max_pixels)))
      img = img.reduce(f)
    rgb = _to_rgb(img, limits.background)
  except SkipExample:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise SkipExample('corrupt_image', f'{type(e).__name__}: {e}') from None
  return rgb, w0 / rgb.width


def decode_rgb(value: Any, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
  """Convenience: any supported image value -> (H, W, 3) uint8 at full resolution (up to caps)."""
  rgb, _ = load_rgb(open_image(value, limits), 1.0, limits)
  return np.asarray(rgb)


def alpha_channel(img: Image.Image) -> np.ndarray | None:
  """The (H, W) uint8 alpha of an opened image, or None when it has no transparency.

  Why separate from `load_rgb` (which composites transparency away): zero-shot segmentation reads
  foreground masks of cut-out images (tuxpaint stamps) from their alpha.
  """
  if 'A' not in img.getbands() and 'transparency' not in img.info:
    return None
  try:
    return np.asarray(img.convert('RGBA'))[..., 3]
  except Exception as e:  # pylint: disable=broad-except
    raise SkipExample('corrupt_image', f'{type(e).__name__}: {e}') from None


# --------------------------------------------------------------------------------------------
# Samplers (pure; instrumented by tests)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CropParams:
  """A crop box in source pixels (top, left, height, width) plus what was drawn to get it."""

  top: int
  left: int
  height: int
  width: int
  scale: float  # drawn target area fraction (NaN for the fallback)
  log_ratio: float  # drawn log aspect ratio (NaN for the fallback)
  fallback: bool


def sample_resized_crop(
  rng: np.random.Generator,
  height: int,
  width: int,
  scale: Sequence[float] = (0.08, 1.0),
  ratio: Sequence[float] = (3 / 4, 4 / 3),
) -> CropParams:
  """torchvision `RandomResizedCrop.get_params`: 10 tries of (area ~ U(scale), log-ratio ~ U),
  then a centre crop with the ratio clamped into range. Same rounding and integer ranges."""
  area = height * width
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  for _ in range(10):
    s = float(rng.uniform(scale[0], scale[1]))
    lr = float(rng.uniform(log_lo, log_hi))
    aspect = math.exp(lr)
    w = int(round(math.sqrt(area * s * aspect)))
    h = int(round(math.sqrt(area * s / aspect)))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return CropParams(top, left, h, w, s, lr, False)
  in_ratio = width / height
  if in_ratio < min(ratio):
    w = width
    h = int(round(w / min(ratio)))
  elif in_ratio > max(ratio):
    h = height
    w = int(round(h * max(ratio)))
  else:
    w, h = width, height
  return CropParams((height - h) // 2, (width - w) // 2, h, w, math.nan, math.nan, True)


@dataclasses.dataclass(frozen=True)
class JitterParams:
  """torchvision ColorJitter draw: application order (0=brightness,1=contrast,2=saturation,
  3=hue) and the factors; `applied` is the RandomApply(p) coin."""

  applied: bool
  order: tuple[int, ...]
  brightness: float
  contrast: float
  saturation: float
  hue: float


def sample_color_jitter(
  rng: np.random.Generator, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1, p: float = 0.8
) -> JitterParams:
  """Draws like `RandomApply([ColorJitter(b, c, s, h)], p)`: factors U(max(0,1-x), 1+x), hue
  U(-h, h), and a random permutation of the four ops. All values are drawn even when not
  applied, so RNG consumption (hence downstream draws) does not depend on the coin."""
  applied = bool(rng.random() < p)
  order = tuple(int(i) for i in rng.permutation(4))
  b = float(rng.uniform(max(0.0, 1 - brightness), 1 + brightness))
  c = float(rng.uniform(max(0.0, 1 - contrast), 1 + contrast))
  s = float(rng.uniform(max(0.0, 1 - saturation), 1 + saturation))
  h = float(rng.uniform(-hue, hue))
  return JitterParams(applied, order, b, c, s, h)


# Colour ops run on the (size x size) output crop only, never on the source. They keep torchvision's
# PIL semantics (what `ColorJitter` does on PIL images) but avoid its slow paths: PIL's per-pixel
# float RGB<->HSV round trip (~2 ms at 224 px) is replaced by integer numpy (one exact table for
# the 8-bit hue); the ImageEnhance blends build their constant image cheaply. Gaussian blur is a
# separable integer kernel in numpy instead of PIL's 3-pass box approximation.


@functools.lru_cache(maxsize=1)
def _hue_table() -> np.ndarray:
  """PIL's 8-bit H of `convert('HSV')` (Convert.c `rgb2hsv_row`), as table[branch, a, b].

  H depends only on which channel is the maximum (PIL tests r, then g, then b: branch 0, 1, 2)
  and the other two channels' distances to it (a, b; max - min = max(a, b)). Filled by running PIL
  on one representative pixel per entry, so it is exact, float rounding included. Built once per
  process (~0.05 s), 192 KiB."""
  i = np.arange(256)
  ia, ib = (x.ravel() for x in np.meshgrid(i, i, indexing='ij'))
  full = np.full_like(ia, 255)
  px = np.concatenate(
    [
      np.stack([full, 255 - ia, 255 - ib], 1),  # r is max: a=v-g, b=v-b
      np.stack([255 - ia, full, 255 - ib], 1),  # g is max: a=v-r, b=v-b
      np.stack([255 - ia, 255 - ib, full], 1),
    ]
  )  # b is max: a=v-r, b=v-g
  px = np.ascontiguousarray(px, np.uint8)
  im = Image.frombuffer('RGB', (px.shape[0], 1), px, 'raw', 'RGB', 0, 1)
  return np.asarray(im.convert('HSV'))[0, :, 0].copy()


def _sector_bits(table):
  return np.uint8(sum(1 << s for s, e in enumerate(table) if e))


# Output channel of each HSV sector (0..5, and 6 = h 255 which PIL maps to sector 0): 0 = v (max),
# 1 = the middle value, 2 = p (min). As bit masks over sectors: e > 0 and e > 1 per channel.
_SECTOR_E = ([0, 1, 2, 2, 1, 0, 0], [1, 0, 0, 1, 2, 2, 1], [2, 2, 1, 0, 0, 1, 2])
_SECTOR_GT0 = tuple(_sector_bits([e > 0 for e in t]) for t in _SECTOR_E)
_SECTOR_GT1 = tuple(_sector_bits([e > 1 for e in t]) for t in _SECTOR_E)


def hue_shift_planes(r: np.ndarray, g: np.ndarray, b: np.ndarray, shift: int):
  """torchvision's PIL hue rotation of flat uint8 planes: RGB -> 8-bit HSV, H += shift (mod 256,
  uint8 wrap-around), -> RGB. Returns three new flat uint8 planes.

  The 8-bit hue is PIL's exactly (`_hue_table`). The way back keeps the pixel's max and min and
  sets the middle channel to max - round((max - min) k), k = 6h/255 - floor(6h/255) or 1 - that
  by sector, in integers. PIL instead goes through an 8-bit saturation and float arithmetic, which
  moves the min (and so the middle channel) by up to one level: the result is within 1 level of
  PIL for every RGB colour and shift (checked over all 2**24 colours; ~38% of colours differ by
  one), and keeps the min and max exactly as the continuous HSV rotation does."""
  v = np.maximum(np.maximum(r, g), b)
  dr, dg, db = v - r, v - g, v - b
  nzr = dr != 0  # g or b is the max (PIL tests r first)
  isb = nzr & (dg != 0)  # b is the max
  key = (dr + dg * ~nzr).astype(np.intp)  # first distance
  key <<= 8
  key |= db + dg * isb  # second distance
  br = nzr.astype(np.intp)  # branch: 0 r max, 1 g max, 2 b max
  br += isb
  br <<= 16
  key |= br
  h = _hue_table().take(key)
  h += np.uint8(shift % 256)  # uint8 wrap-around, as torchvision
  c = np.maximum(np.maximum(dr, dg), db)  # max - min
  h6 = h.astype(np.uint16) * 6
  sector = (h6 + (h6 >> 8) + 1) >> 8  # floor(6 h / 255), 0..6 (6 = sector 0)
  j = h6 - sector * 255  # 255 * fractional part
  odd = sector & 1
  k = 255 - j  # even sectors: 1 - f; odd: f
  k += odd * (2 * j - 255)
  x = c * k  # uint16: <= 255 * 255
  x += 128
  dm = (((x >> 8) + x) >> 8).astype(np.uint8)  # round(c k / 255), PIL's MULDIV255
  dp = c - dm
  sector = sector.astype(np.uint8)
  out = []
  for ch in range(3):
    o = v - dm * ((_SECTOR_GT0[ch] >> sector) & 1)
    o -= dp * ((_SECTOR_GT1[ch] >> sector) & 1)
    out.append(o)
  return out


def adjust_hue(img: Image.Image, hue_factor: float) -> Image.Image:
  """torchvision's PIL `adjust_hue`: shift the 8-bit HSV hue channel with wrap-around.

  Same as `img.convert('HSV')`, H += np.uint8(hue_factor * 255), `.convert('RGB')` up to one
  grey level (`hue_shift_planes`), at ~1/3 of its CPU time."""
  if abs(hue_factor) < 1e-9:
    return img
  shift = int(np.int64(hue_factor * 255)) % 256  # np.uint8(hue_factor*255) in torchvision
  if img.mode != 'RGB':
    hsv = np.array(img.convert('HSV'))
    hsv[..., 0] += np.uint8(shift)
    return Image.fromarray(hsv, 'HSV').convert('RGB')
  planes = [np.asarray(c).reshape(-1) for c in img.split()]
  out = hue_shift_planes(*planes, shift)
  return Image.merge('RGB', [Image.frombuffer('L', img.size, o, 'raw', 'L', 0, 1) for o in out])


def adjust_brightness(img: Image.Image, factor: float) -> Image.Image:
  """`ImageEnhance.Brightness(img).enhance(factor)`: PIL blend with black, i.e. per value
  trunc(clip(float32 factor * x)) (a blend is cheaper than an RGB `point` table in PIL)."""
  return Image.blend(Image.new(img.mode, img.size, 0), img, factor)


def image_mean_grey(img: Image.Image) -> int:
  """`ImageEnhance.Contrast`'s degenerate level: int(mean of img.convert('L') + 0.5)."""
  hist = img.convert('L').histogram()
  return int(sum(i * n for i, n in enumerate(hist)) / max(1, sum(hist)) + 0.5)


def adjust_contrast(img: Image.Image, factor: float) -> Image.Image:
  """`ImageEnhance.Contrast(img).enhance(factor)`: blend with the image's rounded mean grey
  level m, trunc(clip(m + factor (x - m))), with the constant image made directly."""
  m = image_mean_grey(img)
  return Image.blend(Image.new(img.mode, img.size, (m,) * len(img.getbands())), img, factor)


def adjust_saturation(img: Image.Image, factor: float) -> Image.Image:
  """`ImageEnhance.Color(img).enhance(factor)`: blend with the image's own grey version."""
  return Image.blend(img.convert('L').convert(img.mode), img, factor)


def gaussian_kernel(sigma: float, bits: int = 8) -> np.ndarray:
  """torchvision's sampled Gaussian exp(-x^2 / 2 sigma^2), normalised, truncated at ceil(3 sigma)
  (the tails beyond hold 0.3% of the mass), in fixed point: integer weights summing to 2**bits
  (the rounding residue goes to the centre tap)."""
  sigma = max(float(sigma), 1e-3)
  rad = max(1, int(math.ceil(3.0 * sigma)))
  x = np.arange(-rad, rad + 1, dtype=np.float64)
  g = np.exp(-0.5 * (x / sigma) ** 2)
  w = np.round(g / g.sum() * (1 << bits)).astype(np.int64)
  w[rad] += (1 << bits) - int(w.sum())
  return w


def _pad_reflect(a: np.ndarray, k: int, dtype) -> np.ndarray:
  """(H, W, C) -> (H + 2k, W + 2k, C) of `dtype`, reflect padding (edge pixel not repeated, as
  torch's 'reflect'); edge padding where a side is too short to reflect."""
  h, w, _ = a.shape
  if k >= h or k >= w:
    return np.pad(a, ((k, k), (k, k), (0, 0)), mode='edge').astype(dtype)
  p = np.empty((h + 2 * k, w + 2 * k, a.shape[2]), dtype)
  p[k : k + h, k : k + w] = a
  p[k : k + h, :k] = a[:, k:0:-1]
  p[k : k + h, k + w :] = a[:, w - 2 : w - k - 2 : -1] if w - k - 2 >= 0 else a[:, w - 2 :: -1]
  p[:k] = p[2 * k : k : -1]
  p[k + h :] = p[k + h - 2 : h - 2 : -1]
  return p


def _blur_pass(flat: np.ndarray, w: np.ndarray, step: int, n: int) -> np.ndarray:
  """One 1-D pass over a flat uint16 array: out[i] = round(sum_j w_j flat[i + k*step + j*step]
  / 256) for i < n (k = len(w) // 2). Symmetric pairs are added first; all sums fit in uint16
  (255 * 256 total, pairs <= 510 * 128)."""
  k = len(w) // 2
  acc = flat[k * step : k * step + n] * np.uint16(w[k])
  tmp = np.empty_like(acc)
  for j in range(1, k + 1):
    if w[k + j]:
      np.add(flat[(k - j) * step : (k - j) * step + n], flat[(k + j) * step : (k + j) * step + n], out=tmp)
      tmp *= np.uint16(w[k + j])
      acc += tmp
  acc += np.uint16(128)
  acc >>= 8
  return acc


def gaussian_blur_array(arr: np.ndarray, sigma: float) -> np.ndarray:
  """Separable Gaussian blur (std `sigma` pixels, torchvision's sampled kernel and reflect
  padding) of an (H, W) or (H, W, C) uint8 array.

  uint16 fixed point, every pass a few contiguous 1-D numpy ops: 8-bit weights, a rounding after
  each pass. Within ~1 grey level of the exact float convolution on photos and 2-2.5 on white
  noise or steep synthetic gradients, mean error < 0.5 (the 3-pass box approximation of PIL's
  GaussianBlur that this replaces is off by up to ~4 levels on photos and ~30 on noise at small
  sigma); uint32 with 12-bit weights would halve the error at twice the CPU time. The horizontal
  pass runs over the flat padded rows (shifts by whole pixels never reach into the next row for
  the columns kept)."""
  w = gaussian_kernel(sigma)
  k = len(w) // 2
  squeeze = arr.ndim == 2
  a = arr[..., None] if squeeze else arr
  h, wd, c = a.shape
  flat = _pad_reflect(a, k, np.uint16).reshape(-1)
  row = (wd + 2 * k) * c
  n = h * row
  acc = _blur_pass(flat, w, row, n)  # vertical: rows k..k+h of the padded image
  m = n - 2 * k * c
  out = _blur_pass(acc, w, c, m)  # horizontal, over the flat rows
  res = np.empty(n, np.uint8)
  res[k * c : k * c + m] = out
  res = res.reshape(h, wd + 2 * k, c)[:, k : k + wd]
  return np.ascontiguousarray(res[..., 0] if squeeze else res)


def gaussian_blur(img: Image.Image, sigma: float) -> Image.Image:
  """Gaussian blur with standard deviation `sigma` output pixels (torchvision GaussianBlur's
  sigma): `gaussian_blur_array` on the image's pixels (~3x cheaper in CPU time than PIL's 3-pass
  box approximation at 224 px, and a true sampled Gaussian)."""
  return Image.fromarray(gaussian_blur_array(np.asarray(img), sigma))


def apply_color_jitter(img: Image.Image, jp: JitterParams) -> Image.Image:
  """Applies a JitterParams draw with torchvision's PIL functional semantics, in the drawn
  order (each op sees the previous one's clipped uint8 result, as in torchvision)."""
  if not jp.applied:
    return img
  for op in jp.order:
    img = _jitter_op(img, op, jp)
  return img


def _jitter_op(img: Image.Image, op: int, jp: JitterParams) -> Image.Image:
  """One ColorJitter op: 0 brightness, 1 contrast, 2 saturation, 3 hue."""
  if op == 0:
    return adjust_brightness(img, jp.brightness)
  if op == 1:
    return adjust_contrast(img, jp.contrast)
  if op == 2:
    return adjust_saturation(img, jp.saturation)
  return adjust_hue(img, jp.hue)


@dataclasses.dataclass(frozen=True)
class ITOViewParams:
  """Everything drawn for one augmented view (ITO or crop-only)."""

  crop: CropParams
  flip: bool
  jitter: JitterParams | None
  grayscale: bool
  blur: bool
  sigma: float


def sample_ito_view(
  rng: np.random.Generator,
  height: int,
  width: int,
  *,
  scale=(0.5, 1.0),
  ratio=(3 / 4, 4 / 3),
  photometric: bool = True,
  jitter=(0.4, 0.4, 0.4, 0.1),
  jitter_p=0.8,
  gray_p=0.2,
  blur_p=0.5,
  sigma=(0.1, 2.0),
  flip_p=0.5,
) -> ITOViewParams:
  """Draws one ITO view: RandomResizedCrop, then (ITO only) ColorJitter p=0.8,
  grayscale p=0.2, Gaussian blur sigma~U(0.1,2) p=0.5, and horizontal flip p=0.5."""
  crop = sample_resized_crop(rng, height, width, scale, ratio)
  if photometric:
    jp = sample_color_jitter(rng, *jitter, p=jitter_p)
    gray = bool(rng.random() < gray_p)
    blur = bool(rng.random() < blur_p)
    sig = float(rng.uniform(*sigma))
  else:
    jp, gray, blur, sig = None, False, False, 0.0
  flip = bool(rng.random() < flip_p)
  return ITOViewParams(crop, flip, jp, gray, blur, sig)


def _resize_box(img: Image.Image, crop: CropParams, factor, size: int) -> Image.Image:
  """Crop-before-resize in one PIL call. `factor` (scalar or (fx, fy)) maps source coordinates to
  the decoded image (> 1 after JPEG draft / pixel-cap reduction); the box is clamped to it."""
  fx, fy = (factor, factor) if np.isscalar(factor) else factor
  box = (
    max(0.0, crop.left / fx),
    max(0.0, crop.top / fy),
    min(float(img.width), (crop.left + crop.width) / fx),
    min(float(img.height), (crop.top + crop.height) / fy),
  )
  down = min(box[2] - box[0], box[3] - box[1]) / size
  return img.resize((size, size), BICUBIC, box=box, reducing_gap=3.0 if down > 3.0 else None)


def _tick(timings: dict | None, key: str, t0: float) -> float:
  """Adds the CPU time since t0 to timings[key] (when collecting); returns the new t0."""
  if timings is None:
    return t0
  t1 = time.process_time()
  timings[key] = timings.get(key, 0.0) + (t1 - t0)
  timings[key + '#n'] = timings.get(key + '#n', 0) + 1
  return t1


_JITTER_NAMES = ('jitter_brightness', 'jitter_contrast', 'jitter_saturation', 'jitter_hue')


def apply_view(
  img: Image.Image, vp: ITOViewParams, factor, size: int, timings: dict | None = None
) -> np.ndarray:
  """Renders a sampled view to a (size, size, 3) uint8 array.

  Order: crop+resize, flip, colour jitter, grayscale, blur. (torchvision flips last; flipping
  commutes with every op here -- per-pixel ops, the image mean, and a symmetric blur with
  symmetric padding -- and is cheapest on the small uint8 image.) `timings` (bench) accumulates
  CPU seconds per op under keys 'crop_resize', 'flip', 'jitter_*', 'grayscale', 'blur',
  'to_array' (and 'KEY#n' counts)."""
  t0 = time.process_time() if timings is not None else 0.0
  out = _resize_box(img, vp.crop, factor, size)
  t0 = _tick(timings, 'crop_resize', t0)
  if vp.flip:
    out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    t0 = _tick(timings, 'flip', t0)
  jp = vp.jitter
  if jp is not None and jp.applied:
    for op in jp.order:
      out = _jitter_op(out, op, jp)
      t0 = _tick(timings, _JITTER_NAMES[op], t0)
  if vp.grayscale:
    out = out.convert('L')
  arr = np.asarray(out)
  if vp.grayscale:
    t0 = _tick(timings, 'grayscale', t0)
  if vp.blur:  # on the single grey plane when grayscale (3x less work, same result)
    arr = gaussian_blur_array(arr, vp.sigma)
    t0 = _tick(timings, 'blur', t0)
  if arr.ndim == 2:
    arr = np.repeat(arr[..., None], 3, axis=2)
  _tick(timings, 'to_array', t0)
  return arr


# --------------------------------------------------------------------------------------------
# Deterministic resize (evaluation, and training with input.augment='none')
# --------------------------------------------------------------------------------------------

#: 'center_crop': shorter side to S, then the centre S x S (classification / retrieval standard);
#: 'resize': squash to S x S, keeping all content (zero-shot segmentation at a fixed size).
FIXED_RESIZE_MODES = ('center_crop', 'resize')


def _resize_array(arr: np.ndarray, size_hw: tuple[int, int], nearest: bool) -> np.ndarray:
  """PIL resize of a uint8 (H,W) or (H,W,C) array to (h,w); bicubic (antialiased) or nearest."""
  h, w = size_hw
  if arr.shape[:2] == (h, w):
    return arr
  resample = Image.Resampling.NEAREST if nearest else BICUBIC
  if arr.ndim == 3 and arr.shape[-1] not in (3, 4):
    return np.stack([_resize_array(arr[..., c], size_hw, nearest) for c in range(arr.shape[-1])], -1)
  return np.asarray(Image.fromarray(arr).resize((w, h), resample=resample))


def fixed_resize(
  image: np.ndarray, mask: np.ndarray | None, size: int | Sequence[int], mode: str = 'center_crop'
) -> tuple[np.ndarray, np.ndarray | None]:
  """Resizes a decoded uint8 image (and its label map, nearest neighbour) to a fixed (S, S).

  The geometry comes from the image, so a label map stays aligned with it. The whole image is
  resized before the centre crop (not crop-before-resize): evaluation numbers are defined by exactly
  this resampling, so it must not change with speed tricks.
  """
  if isinstance(size, (int, np.integer)):
    size = (int(size), int(size))
  th, tw = int(size[0]), int(size[1])
  if mode == 'resize':
    out = _resize_array(image, (th, tw), nearest=False)
    return out, None if mask is None else _resize_array(mask, (th, tw), nearest=True)
  if mode != 'center_crop':
    raise ValueError(f'unknown resize mode {mode!r}; valid: {list(FIXED_RESIZE_MODES)}')
  h, w = image.shape[:2]
  scale = max(th / h, tw / w)
  nh, nw = max(th, int(round(h * scale))), max(tw, int(round(w * scale)))
  top, left = (nh - th) // 2, (nw - tw) // 2
  img = _resize_array(image, (nh, nw), nearest=False)[top : top + th, left : left + tw]
  if mask is not None:
    mask = _resize_array(mask, (nh, nw), nearest=True)[top : top + th, left : left + tw]
  return img, mask


def fixed_size_image(
  img: Image.Image, size: int, mode: str = 'center_crop', limits: ImageLimits = DEFAULT_LIMITS
) -> np.ndarray:
  """A lazily opened image decoded at full resolution (no JPEG draft) and `fixed_resize`d."""
  rgb, _ = load_rgb(img, 1.0, limits)
  return np.ascontiguousarray(fixed_resize(np.asarray(rgb), None, size, mode)[0])


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def decode_text(value: Any) -> str | None:
  """A caption field -> stripped str, or None when missing / empty / not valid UTF-8."""
  if value is None:
    return None
  if isinstance(value, np.ndarray):
    if value.size != 1:
      return None
    value = value.item()
  if isinstance(value, (bytes, bytearray, np.bytes_)):
    try:
      value = bytes(value).decode('utf-8')
    except UnicodeDecodeError:
      return None
  if not isinstance(value, str):
    return None
  value = value.strip()
  return value or None


def choose_caption(
  rng: np.random.Generator, record: dict, caption_keys: Sequence[str]
) -> tuple[str | None, str | None]:
  """CLS2 caption: uniform over the configured synthetic fields that hold usable text.

  Returns (key, text); (None, None) when no field is usable (caller falls back to alt-text).
  One uniform draw is always consumed so later draws do not depend on data content."""
  u = rng.random()
  usable = []
  for k in caption_keys:
    t = decode_text(record.get(k))
    if t is not None:
      usable.append((k, t))
  if not usable:
    return None, None
  return usable[min(int(u * len(usable)), len(usable) - 1)]
