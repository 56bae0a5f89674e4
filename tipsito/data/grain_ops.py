"""The training views as grain operations: ITO's two views, TIPS / DINOv2 multi-crop, and the caption
choice, each a `grain.RandomMapTransform` over the pure functions of tipsito/data/transforms.py.

Why apart from transforms.py: these are the only code of the per-example transforms that needs grain,
and evaluation and inference (`tipsito.load`) use transforms.py without a data pipeline
(tests/test_light_imports.py runs them with grain unimportable).
"""

from __future__ import annotations

import time
from typing import Sequence

import grain.python as grain
import numpy as np
from PIL import Image

from tipsito.data.batch import GLOBAL_VIEWS, IMAGE, LOCAL_CROPS, TEXT, TEXT2
from tipsito.data.transforms import (
  DEFAULT_LIMITS,
  ImageLimits,
  ITOViewParams,
  SkipExample,
  apply_view,
  choose_caption,
  decode_text,
  load_rgb,
  sample_ito_view,
)
from tipsito.data.transforms import _tick  # noqa: F401 (the per-op CPU timer apply_view uses too)


def _max_reduce(views: Sequence[tuple[ITOViewParams, int]]) -> float:
  """Largest source downscale every crop tolerates (crop side / output side), for JPEG draft."""
  return min(min(v.crop.width, v.crop.height) / size for v, size in views)


def _decode_for(
  img: Image.Image, plan: Sequence[tuple[ITOViewParams, int]], limits: ImageLimits, timings: dict | None
) -> tuple[Image.Image, tuple[float, float]]:
  """Decodes `img` once, as small as every planned (view, output size) allows; returns the RGB image
  and the (x, y) factor from source to decoded pixels."""
  w, h = img.size  # before decoding: JPEG draft mode changes img.size
  t0 = time.process_time() if timings is not None else 0.0
  rgb, _ = load_rgb(img, _max_reduce(plan), limits)
  _tick(timings, 'decode', t0)
  return rgb, (w / rgb.width, h / rgb.height)


def _put_global_views(
  out: dict, rgb: Image.Image, views: Sequence[ITOViewParams], factor, size: int, timings: dict | None
) -> None:
  """Renders the global views into out[IMAGE], out[IMAGE2] (tipsito/data/batch.py: `GLOBAL_VIEWS`)."""
  for i, v in enumerate(views):
    out[GLOBAL_VIEWS[i]] = apply_view(rgb, v, factor, size, timings)


class ITOTwoViews(grain.RandomMapTransform):
  """ITO two views: element['image'] (PIL) -> 'image', 'image2' (S, S, 3) uint8. The first view's crop
  area is drawn from `scale`, the second's from `view2_scale` (None = `scale`)."""

  def __init__(
    self,
    size: int = 224,
    scale=(0.5, 1.0),
    ratio=(3 / 4, 4 / 3),
    limits: ImageLimits = DEFAULT_LIMITS,
    photometric: bool = True,
    num_views: int = 2,
    view2_scale=None,
  ):
    self.size, self.scale, self.ratio = size, tuple(scale), tuple(ratio)
    self.limits, self.photometric, self.num_views = limits, photometric, num_views
    self.view2_scale = self.scale if view2_scale is None else tuple(view2_scale)

  def random_map(self, element, rng, trace: list | None = None, timings: dict | None = None):
    """grain RandomMapTransform entry point; `trace` (tests) receives the drawn params,
    `timings` (bench) CPU seconds per op ('decode' + the `apply_view` keys)."""
    img = element[IMAGE]
    w, h = img.size
    views = [
      sample_ito_view(
        rng,
        h,
        w,
        scale=self.scale if i == 0 else self.view2_scale,
        ratio=self.ratio,
        photometric=self.photometric,
      )
      for i in range(self.num_views)
    ]
    rgb, factor = _decode_for(img, [(v, self.size) for v in views], self.limits, timings)
    out = dict(element)
    _put_global_views(out, rgb, views, factor, self.size, timings)
    if trace is not None:
      trace.extend(views)
    return out


class MultiCrop(grain.RandomMapTransform):
  """TIPSv2 / DINOv2 multi-crop: `num_global` global crops at `global_size` (scale
  `global_scale`) -> 'image' (and 'image2'), plus `num_local` local crops at `local_size`
  (scale `local_scale`) -> 'local_crops' (M, s, s, 3). Crop + flip only unless `photometric`
  (then every crop gets the ITO photometric ops). The global crop is the teacher's unmasked view.
  `view2_photometric` gives the second global crop ('image2', tipsito's ITO view) the ITO photometric
  ops (colour jitter, grayscale, blur) while the first keeps the TIPS crop + flip; its crop area is
  drawn from `view2_scale` (None = `global_scale`).
  """

  def __init__(
    self,
    global_size: int = 224,
    local_size: int = 98,
    num_local: int = 6,
    global_scale=(0.32, 1.0),
    local_scale=(0.05, 0.32),
    ratio=(3 / 4, 4 / 3),
    num_global: int = 1,
    photometric: bool = False,
    limits: ImageLimits = DEFAULT_LIMITS,
    view2_photometric: bool | None = None,
    view2_scale=None,
  ):
    self.global_size, self.local_size, self.num_local = global_size, local_size, num_local
    self.global_scale, self.local_scale = tuple(global_scale), tuple(local_scale)
    self.ratio, self.num_global = tuple(ratio), num_global
    self.photometric, self.limits = photometric, limits
    self.view2_photometric = photometric if view2_photometric is None else view2_photometric
    self.view2_scale = self.global_scale if view2_scale is None else tuple(view2_scale)

  def random_map(self, element, rng, trace: list | None = None, timings: dict | None = None):
    """grain RandomMapTransform entry point; `trace` (tests) receives the drawn params,
    `timings` (bench) CPU seconds per op ('decode' + the `apply_view` keys)."""
    img = element[IMAGE]
    w, h = img.size
    glob = [
      sample_ito_view(
        rng,
        h,
        w,
        scale=self.global_scale if i == 0 else self.view2_scale,
        ratio=self.ratio,
        photometric=self.photometric if i == 0 else self.view2_photometric,
      )
      for i in range(self.num_global)
    ]
    loc = [
      sample_ito_view(rng, h, w, scale=self.local_scale, ratio=self.ratio, photometric=self.photometric)
      for _ in range(self.num_local)
    ]
    plan = [(v, self.global_size) for v in glob] + [(v, self.local_size) for v in loc]
    rgb, factor = _decode_for(img, plan, self.limits, timings)
    out = dict(element)
    _put_global_views(out, rgb, glob, factor, self.global_size, timings)
    if self.num_local:
      crops = np.empty((self.num_local, self.local_size, self.local_size, 3), np.uint8)
      for i, v in enumerate(loc):
        crops[i] = apply_view(rgb, v, factor, self.local_size, timings)
      out[LOCAL_CROPS] = crops
    if trace is not None:
      trace.extend(glob + loc)
    return out


class ChooseCaptions(grain.RandomMapTransform):
  """grain op: 'text' <- alt-text (required), 'text2' <- a synthetic caption drawn uniformly per
  example (per epoch, via the per-epoch RNG), falling back to the alt-text. Strings only; the
  pipeline tokenises them in one call per example."""

  def __init__(self, alt_text_key: str | None = 'alt_text', caption_keys: Sequence[str] = ()):
    self.alt_text_key = alt_text_key
    self.caption_keys = tuple(caption_keys or ())

  def random_map(self, element, rng):
    """grain RandomMapTransform entry point; `trace` (tests) receives the drawn params."""
    out = dict(element)
    alt = None
    if self.alt_text_key:
      if self.alt_text_key not in element or element[self.alt_text_key] is None:
        raise SkipExample('missing_text', self.alt_text_key)
      alt = decode_text(element[self.alt_text_key])
      if alt is None:
        raise SkipExample('bad_text', f'{self.alt_text_key} empty or not UTF-8')
      out[TEXT] = alt
    key, cap = choose_caption(rng, element, self.caption_keys)
    out[TEXT2] = cap if cap is not None else alt
    out['text2_key'] = key
    return out
