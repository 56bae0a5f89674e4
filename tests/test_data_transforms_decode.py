"""Robust decoding: every odd-but-valid image becomes RGB uint8; every broken one a typed skip.

Why: web-scale data holds palettes, alpha, CMYK, 16-bit PNGs, truncated files and banners. The
pipeline must turn each into either a correct RGB image or a counted skip, never a crash.
"""

import io

import numpy as np
import pytest
from PIL import Image

from tipsito.data import transforms as T


def _enc(img, fmt='PNG', **kw):
  buf = io.BytesIO()
  img.save(buf, fmt, **kw)
  return buf.getvalue()


def test_rgba_composited_on_background():
  arr = np.zeros((8, 8, 4), np.uint8)
  arr[..., 0] = 200
  arr[:4, :, 3] = 255  # top half opaque red, bottom transparent
  out = T.decode_rgb(_enc(Image.fromarray(arr, 'RGBA')))
  assert out.shape == (8, 8, 3) and out.dtype == np.uint8
  assert (out[:4] == [200, 0, 0]).all() and (out[4:] == 255).all()
  lim = T.ImageLimits(background=(0, 0, 0))
  assert (T.decode_rgb(_enc(Image.fromarray(arr, 'RGBA')), lim)[4:] == 0).all()


@pytest.mark.parametrize('mode', ['L', 'LA', 'P', 'PA', '1', 'CMYK', 'I;16', 'RGB'])
def test_modes_convert_to_rgb(mode):
  rng = np.random.default_rng(0)
  base = Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8))
  if mode == 'I;16':
    img = Image.fromarray((np.arange(120, dtype=np.uint16).reshape(10, 12) * 500))
    data = _enc(img, 'PNG')
  elif mode == 'CMYK':
    data = _enc(base.convert('CMYK'), 'JPEG')
  elif mode == 'P':
    p = base.convert('P')
    p.info['transparency'] = 0
    data = _enc(p, 'PNG')
  else:
    data = base.convert(mode) if mode == 'PA' else _enc(base.convert(mode), 'PNG')  # PIL input
  out = T.decode_rgb(data)
  assert out.shape == (10, 12, 3) and out.dtype == np.uint8
  if mode == 'I;16':
    assert out.max() > 200  # scaled from 16 bit, not clipped to 255 garbage


def test_arrays_of_many_dtypes():
  g = np.linspace(0, 1, 48, dtype=np.float32).reshape(6, 8)
  for arr in (
    g,
    (g * 255).astype(np.uint8),
    (g * 65535).astype(np.uint16),
    np.stack([g] * 3, -1),
    (g[..., None] * 255).astype(np.uint8),
    g > 0.5,
    np.concatenate([np.stack([g] * 3, -1), np.ones((6, 8, 1), np.float32)], -1),
  ):
    out = T.decode_rgb(arr)
    assert out.shape == (6, 8, 3) and out.dtype == np.uint8
    assert out.max() >= 250


def test_bad_images_raise_typed_skips():
  good = _enc(Image.new('RGB', (64, 48), (1, 2, 3)), 'JPEG')
  cases = {
    'empty_image': b'',
    'corrupt_image': b'not an image at all',
    'tiny_image': _enc(Image.new('RGB', (1, 40))),
    'extreme_aspect': _enc(Image.new('RGB', (3, 70))),
    'missing_image': None,
  }
  for reason, value in cases.items():
    with pytest.raises(T.SkipExample) as e:
      T.decode_rgb(value)
    assert e.value.reason == reason, (reason, e.value)
  with pytest.raises(T.SkipExample) as e:  # truncated JPEG: header fine, data cut
    T.decode_rgb(good[: len(good) // 2])
  assert e.value.reason == 'corrupt_image'
  with pytest.raises(T.SkipExample) as e:
    T.decode_rgb(np.zeros((4, 4, 2), np.uint8))
  assert e.value.reason == 'corrupt_image'
  with pytest.raises(T.SkipExample) as e:
    T.decode_rgb(good, T.ImageLimits(hard_max_pixels=1000))
  assert e.value.reason == 'huge_image'


def test_huge_images_are_downscaled_to_the_pixel_cap():
  big_png = _enc(Image.new('RGB', (600, 400), (9, 9, 9)), 'PNG')
  lim = T.ImageLimits(max_pixels=60_000)
  rgb, f = T.load_rgb(T.open_image(big_png, lim), 1.0, lim)
  assert rgb.width * rgb.height <= 60_000 and f > 1
  big_jpg = _enc(Image.new('RGB', (800, 800), (9, 9, 9)), 'JPEG')
  rgb, f = T.load_rgb(T.open_image(big_jpg, lim), 1.0, lim)
  assert rgb.width * rgb.height <= 60_000
  assert (np.asarray(rgb) == 9).all() or np.abs(np.asarray(rgb).astype(int) - 9).max() <= 2
