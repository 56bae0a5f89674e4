"""tipsito's second view gets ITO's augmentation (colour jitter, grayscale, blur) while view 1 keeps TIPS'
crop + flip; other recipes are unchanged.

Why: ITO credits its gain to the photometric augmentation of the second view; the tipsito recipe must not
silently drop it by inheriting the TIPS view's augmentation.
"""

import io

import numpy as np
from PIL import Image

from tipsito.config import defaults
from tipsito.data import pipeline
from tipsito.data import grain_ops
from tipsito.data import transforms as T


def _jpeg(seed=0):
  rs = np.random.RandomState(seed)
  buf = io.BytesIO()
  Image.fromarray(rs.randint(0, 255, (96, 128, 3), np.uint8)).save(buf, format="JPEG")
  return buf.getvalue()


def test_tipsito_view2_is_ito_augmented_view1_is_not():
  c = defaults.tiny_config("tipsito")
  assert c.input.augment == "tips" and c.input.augment_view2 == "ito"
  tr = pipeline.ExampleSpec.from_config(c).view_transform()
  assert isinstance(tr, grain_ops.MultiCrop) and tr.num_global == 2
  rng = np.random.default_rng(0)
  jittered = gray_or_blur = 0
  for i in range(40):
    trace = []
    out = tr.random_map({"image": T.open_image(_jpeg(i))}, rng, trace=trace)
    v1, v2 = trace[0], trace[1]
    assert v1.jitter is None and not v1.grayscale and not v1.blur  # TIPS view as it was
    assert all(t.jitter is None for t in trace[2:])  # local crops as they were
    jittered += v2.jitter is not None and v2.jitter.applied
    gray_or_blur += v2.grayscale or v2.blur
    assert out["image2"].shape == out["image"].shape
  assert jittered > 20 and gray_or_blur > 10  # p = 0.8 jitter, 0.2 grayscale, 0.5 blur over 40 draws


def test_other_recipes_keep_their_augmentation():
  for recipe, photometric in (("tipsv2", False), ("ito", True)):
    c = defaults.tiny_config(recipe)
    assert c.input.augment_view2 is None
    tr = pipeline.ExampleSpec.from_config(c).view_transform()
    if isinstance(tr, grain_ops.MultiCrop):
      assert tr.photometric == tr.view2_photometric == photometric
  c = defaults.tiny_config("tipsito")
  c.input.augment_view2 = None  # same as view 1
  tr = pipeline.ExampleSpec.from_config(c).view_transform()
  assert not tr.photometric and not tr.view2_photometric
