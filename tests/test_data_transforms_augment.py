"""Augmentation/masking/caption samplers stay inside the papers' ranges and are exactly reproducible.

Why: these parameters are the paper's recipe; a silent drift (wrong scale range, non-log-uniform
ratio, inexact mask count, biased caption choice) would not crash anything but would change the
method. Samplers are pure functions, so we check their draws over many samples.
"""

import io
import math

import numpy as np
import pytest
from PIL import Image

from tipsito.data import masking
from tipsito.data import pipeline
from tipsito.data import grain_ops
from tipsito.data import transforms as T

SHAPES = [(400, 400), (300, 500), (500, 240), (64, 48)]


def _jpeg(h, w, seed=0):
  rng = np.random.default_rng(seed)
  arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, 'JPEG', quality=90)
  return buf.getvalue()


@pytest.mark.parametrize('scale', [(0.5, 1.0), (0.32, 1.0), (0.05, 0.32)])
def test_resized_crop_scale_and_ratio_in_spec(scale):
  ratio = (3 / 4, 4 / 3)
  rng = np.random.default_rng(0)
  draws, lrs = [], []
  for h, w in SHAPES:
    for _ in range(1500):
      p = T.sample_resized_crop(rng, h, w, scale, ratio)
      assert 0 <= p.top and p.top + p.height <= h and 0 <= p.left and p.left + p.width <= w
      if p.fallback:
        continue
      assert scale[0] <= p.scale <= scale[1]
      assert math.log(ratio[0]) <= p.log_ratio <= math.log(ratio[1])
      lrs.append(p.log_ratio)
      draws.append(p.scale)
      # realised box: area fraction and aspect within the spec up to integer rounding
      frac = p.height * p.width / (h * w)
      tol_a = (p.height + p.width + 1) / (h * w)
      assert scale[0] - tol_a <= frac <= scale[1] + tol_a
      asp = p.width / p.height
      assert ratio[0] * (1 - 1 / p.height) - 1 / p.height <= asp
      assert asp <= ratio[1] * (1 + 1 / p.height) + 1 / p.height
  draws, lrs = np.asarray(draws), np.asarray(lrs)
  # the draws cover the whole range (accepted draws are biased by torchvision's rejection of
  # boxes that do not fit, so only coverage, not the mean, is checked here)
  span = scale[1] - scale[0]
  assert draws.min() < scale[0] + 0.02 * span and draws.max() > scale[1] - 0.1 * span
  lo, hi = math.log(ratio[0]), math.log(ratio[1])
  assert lrs.min() < lo + 0.02 and lrs.max() > hi - 0.02


def test_resized_crop_fallback_is_centre_crop_with_clamped_ratio():
  rng = np.random.default_rng(1)
  # a 2:1 strip can never fit area 1.0 at ratio <= 4/3 -> fallback clamps ratio to 4/3
  p = T.sample_resized_crop(rng, 100, 200, (1.0, 1.0), (3 / 4, 4 / 3))
  assert p.fallback and p.height == 100 and p.width == round(100 * 4 / 3)
  assert p.left == (200 - p.width) // 2


def test_color_jitter_and_view_params_in_spec():
  rng = np.random.default_rng(0)
  n = 4000
  views = [T.sample_ito_view(rng, 400, 400) for _ in range(n)]
  jit = [v.jitter for v in views]
  for j in jit:
    assert 0.6 <= j.brightness <= 1.4 and 0.6 <= j.contrast <= 1.4 and 0.6 <= j.saturation <= 1.4
    assert -0.1 <= j.hue <= 0.1
    assert sorted(j.order) == [0, 1, 2, 3]
  for v in views:
    assert 0.1 <= v.sigma <= 2.0
    assert 0.5 <= v.crop.scale <= 1.0 or v.crop.fallback

  def close(frac, p):  # 5 sigma binomial band
    return abs(frac - p) < 5 * math.sqrt(p * (1 - p) / n)

  assert close(np.mean([j.applied for j in jit]), 0.8)
  assert close(np.mean([v.grayscale for v in views]), 0.2)
  assert close(np.mean([v.blur for v in views]), 0.5)
  assert close(np.mean([v.flip for v in views]), 0.5)
  # random order: every op appears first about 1/4 of the time
  firsts = np.bincount([j.order[0] for j in jit], minlength=4) / n
  assert all(close(f, 0.25) for f in firsts)
  b = np.array([j.brightness for j in jit])
  assert b.min() < 0.62 and b.max() > 1.38


def test_ito_two_views_trace_shapes_and_determinism():
  img = T.open_image(_jpeg(300, 420))
  tr = grain_ops.ITOTwoViews(size=224)
  trace = []
  out = tr.random_map({'image': img}, np.random.default_rng(5), trace=trace)
  assert out['image'].shape == (224, 224, 3) and out['image'].dtype == np.uint8
  assert out['image2'].shape == (224, 224, 3)
  assert len(trace) == 2 and all(t.jitter is not None for t in trace)
  out2 = tr.random_map({'image': T.open_image(_jpeg(300, 420))}, np.random.default_rng(5))
  np.testing.assert_array_equal(out['image'], out2['image'])
  np.testing.assert_array_equal(out['image2'], out2['image2'])


def test_multicrop_trace_scales_and_shapes():
  mc = grain_ops.MultiCrop(global_size=64, local_size=28, num_local=6)
  rng = np.random.default_rng(0)
  for i in range(40):
    trace = []
    out = mc.random_map({'image': T.open_image(_jpeg(120, 160, i))}, rng, trace=trace)
    assert out['image'].shape == (64, 64, 3) and out['local_crops'].shape == (6, 28, 28, 3)
    assert out['local_crops'].dtype == np.uint8 and 'image2' not in out
    g, locs = trace[0], trace[1:]
    assert g.jitter is None and not g.grayscale and not g.blur  # crop + flip only
    assert g.crop.fallback or 0.32 <= g.crop.scale <= 1.0
    assert len(locs) == 6 and all(l.crop.fallback or 0.05 <= l.crop.scale <= 0.32 for l in locs)


def test_jpeg_draft_used_only_when_crops_allow():
  big = _jpeg(1600, 1600)
  rgb, f = T.load_rgb(T.open_image(big), max_reduce=4.0)
  assert f >= 2.0 and rgb.width <= 800
  rgb, f = T.load_rgb(T.open_image(big), max_reduce=1.0)
  assert f == 1.0 and rgb.size == (1600, 1600)
  # the view result stays valid when drafting (crop boxes rescaled)
  out = grain_ops.MultiCrop(global_size=98, local_size=32, num_local=2).random_map(
    {'image': T.open_image(big)}, np.random.default_rng(0)
  )
  assert out['image'].shape == (98, 98, 3) and out['image'].std() > 0


def test_hue_matches_torchvision_pil_semantics():
  """torchvision's PIL hue: 8-bit HSV, H += np.uint8(hf * 255). The fast path keeps PIL's 8-bit
  hue exactly and is within one grey level of PIL's float way back (tests/test_data_transforms_
  colour.py checks it further)."""
  rng = np.random.default_rng(0)
  img = Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
  for hf in (-0.1, -0.03, 0.05, 0.1):
    h, s, v = [np.asarray(c) for c in img.convert('HSV').split()]
    h = (h.astype(np.int64) + int(np.int64(hf * 255))) % 256  # np.uint8(hf*255) wrap
    ref = Image.merge('HSV', [Image.fromarray(x.astype(np.uint8), 'L') for x in (h, s, v)])
    got = np.asarray(T.adjust_hue(img, hf)).astype(int)
    assert np.abs(got - np.asarray(ref.convert('RGB'))).max() <= 1
    np.testing.assert_array_equal(
      np.asarray(Image.fromarray(got.astype(np.uint8)).convert('HSV'))[..., 2], v
    )  # value (max channel) unchanged


@pytest.mark.parametrize('kind', ['random', 'block'])
@pytest.mark.parametrize('grid', [(14, 14), (16, 16), (7, 7), (16, 12)])
def test_mask_count_is_exact(kind, grid):
  gh, gw = grid
  for ratio in (0.1, 0.3, 0.5, 0.75, 0.9):
    k = round(ratio * gh * gw)
    for seed in range(25):
      m = masking.make_mask(np.random.default_rng(seed), gh, gw, ratio, kind)
      assert m.shape == grid and m.dtype == bool
      assert int(m.sum()) == k, (kind, grid, ratio, seed)
  m1 = masking.make_mask(np.random.default_rng(3), gh, gw, 0.5, kind)
  m2 = masking.make_mask(np.random.default_rng(3), gh, gw, 0.5, kind)
  np.testing.assert_array_equal(m1, m2)


def test_block_masks_are_blocky():
  def boundary(m):
    return int((m[1:] != m[:-1]).sum() + (m[:, 1:] != m[:, :-1]).sum())

  rb = [boundary(masking.block_mask(np.random.default_rng(s), 14, 14, 0.4)) for s in range(30)]
  rr = [boundary(masking.random_mask(np.random.default_rng(s), 14, 14, 0.4)) for s in range(30)]
  assert np.mean(rb) < 0.6 * np.mean(rr)


def test_caption_choice_uniform_chi_square():
  """CLS2 caption drawn uniformly from the synthetic fields (per example, per epoch)."""
  keys = ('caption_a', 'caption_b', 'caption_c', 'caption_d')
  rec = {k: f'text {k}' for k in keys}
  counts = np.zeros(len(keys))
  n = 4000
  per_example = []
  for i in range(n // 2):
    picks = []
    for epoch in (0, 1):
      _, rng, _ = pipeline._example_rngs(123, epoch, i, 3)  # the pipeline's caption stream
      key, text = T.choose_caption(rng, rec, keys)
      assert text == rec[key]
      counts[keys.index(key)] += 1
      picks.append(key)
    per_example.append(picks[0] == picks[1])
  expected = n / len(keys)
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  assert chi2 < 16.27, (chi2, counts)  # chi-square 0.999 quantile, 3 dof
  # per-epoch redraw: the two epochs agree about 1/4 of the time, not always
  agree = np.mean(per_example)
  assert abs(agree - 0.25) < 5 * math.sqrt(0.25 * 0.75 / len(per_example))


def test_caption_fallbacks_and_bad_text():
  rng = np.random.default_rng(0)
  cc = grain_ops.ChooseCaptions('alt_text', ('caption_a', 'caption_b'))
  out = cc.random_map({'alt_text': b'alt', 'caption_a': b'', 'caption_b': b'\xff\xfe'}, rng)
  assert out['text'] == 'alt' and out['text2'] == 'alt'  # no usable synthetic -> alt-text
  out = cc.random_map({'alt_text': 'alt', 'caption_a': '  ', 'caption_b': 'syn'}, rng)
  assert out['text2'] == 'syn'
  with pytest.raises(T.SkipExample) as e:
    cc.random_map({'alt_text': b'\xc3\x28'}, rng)
  assert e.value.reason == 'bad_text'
  with pytest.raises(T.SkipExample) as e:
    cc.random_map({'caption_a': 'x'}, rng)
  assert e.value.reason == 'missing_text'


def test_fixed_resize_deterministic():
  img = _jpeg(120, 200)
  a = T.fixed_size_image(T.open_image(img), 64, 'center_crop')
  b = T.fixed_size_image(T.open_image(img), 64, 'center_crop')
  np.testing.assert_array_equal(a, b)
  assert a.shape == (64, 64, 3)
  seg = np.zeros((120, 200), np.uint8)
  seg[:, 100:] = 3
  _, s = T.fixed_resize(T.decode_rgb(img), seg, 64, 'center_crop')
  assert s.shape == (64, 64) and set(np.unique(s)) == {0, 3}
  assert (s[:, :30] == 0).all() and (s[:, 34:] == 3).all()
  r, s = T.fixed_resize(T.decode_rgb(img), seg, 64, 'resize')  # squashed: all content kept
  assert r.shape == (64, 64, 3) and (s[:, :31] == 0).all() and (s[:, 33:] == 3).all()


def test_gaussian_blur_is_a_normalised_gaussian():
  """torchvision's sampled Gaussian kernel (std sigma px), mass-preserving, reflect padding."""
  flat = Image.fromarray(np.full((20, 24, 3), 77, np.uint8))
  assert (np.asarray(T.gaussian_blur(flat, 1.7)) == 77).all()  # mass preserved
  x = np.arange(-15, 16)
  for sigma in (0.1, 0.5, 1.0, 1.37, 2.0):
    g = np.exp(-0.5 * (x / sigma) ** 2)
    g /= g.sum()
    w = T.gaussian_kernel(sigma)  # the fixed-point kernel: normalised, variance sigma^2
    k = np.arange(len(w)) - len(w) // 2
    assert w.sum() == 256 and (w == w[::-1]).all()
    np.testing.assert_allclose(w / 256, g[15 - len(w) // 2 : 16 + len(w) // 2], atol=len(w) / 512)
    assert abs((w * k**2).sum() / 256 - (g * x**2).sum()) < 0.02 + 0.02 * sigma**2
    # a point (the worst case for 8-bit weights): the 2-D Gaussian within two grey levels
    a = np.zeros((31, 31, 3), np.uint8)
    a[15, 15] = 255
    out = np.asarray(T.gaussian_blur(Image.fromarray(a), sigma)).astype(float)
    for c in range(3):
      np.testing.assert_allclose(out[..., c], 255 * np.outer(g, g), atol=2.0)
    # a line: 1-D profile keeps its tails in uint8, so its variance is sigma^2 (sampled kernel)
    line = np.zeros((31, 31), np.uint8)
    line[:, 15] = 255
    prof = T.gaussian_blur_array(line, sigma)[15].astype(float)
    np.testing.assert_allclose(prof, 255 * g, atol=1.5)
    var = (prof * x**2).sum() / prof.sum()
    assert abs(var - (g * x**2).sum()) < 0.02 + 0.03 * sigma**2, (sigma, var)
    assert abs(var - sigma**2) < 0.1 * sigma**2 + 0.05, (sigma, var)
  # reflect padding: a ramp's border pixel mirrors around itself (torchvision's padding mode)
  ramp = np.tile(np.arange(0, 200, 10, dtype=np.uint8), (8, 1))
  out = T.gaussian_blur_array(ramp, 1.0).astype(int)
  xs = np.arange(-4, 5)
  wr = np.exp(-0.5 * xs**2)
  wr /= wr.sum()
  assert abs(out[4, 0] - (wr * np.abs(xs) * 10).sum()) <= 1
  np.testing.assert_allclose(out[:, 5:15], ramp[:, 5:15], atol=1)  # linear interior kept
