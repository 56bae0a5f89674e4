"""TFDS builder `tuxpaint`: the 785 captioned PNG stamps of Debian's `tuxpaint-stamps-default`.

Why: real photos/drawings with human-written English captions and exact foreground masks, installed
by a package (no download at run time) - a small real image-text set for demos, zero-shot
classification (16 categories) and zero-shot segmentation.

Inputs: `/usr/share/tuxpaint/stamps/<category>/.../NAME.png` with `NAME.txt` whose first line is the
English caption (later lines are `<locale>.utf8=...` translations, ignored). PNGs without a caption
file (`*_mirror.png` variants, the `cartoon` folder) are not part of the dataset. The stamp (RGBA,
LA, P or RGB) is resized to fit `max_size` and composited, centred with a margin, onto a
deterministic background (plain or gradient colour chosen from a hash of its path).

Record schema (array_record), one split 'train' with all 785 examples:
  image: PNG RGB; alt_text: cleaned caption (quotes/dashes normalised, whitespace collapsed);
  caption_category: "a picture of <article> <category word>" (e.g. "a picture of an animal");
  caption_detailed: caption + category + background description;
  label: ClassLabel of the top folder (16 categories); segmentation: PNG uint8 (H,W,1),
  value = label + 1 where the stamp's alpha >= 128, 0 = background;
  id: 'tuxpaint/<path relative to the stamps dir, without .png>'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from tipsito.data.builders import _common
from tipsito.data.builders import class_words

DEFAULT_STAMPS_DIR = "/usr/share/tuxpaint/stamps"

CATEGORIES = class_words.TUXPAINT_CATEGORIES
CATEGORY_WORDS = class_words.TUXPAINT_CATEGORY_WORDS
_BACKGROUNDS = {
  "white": (250, 250, 250),
  "light gray": (200, 200, 200),
  "cream": (245, 235, 205),
  "sky blue": (170, 205, 235),
  "pale green": (200, 230, 195),
  "pale pink": (245, 210, 220),
  "dark blue": (30, 40, 90),
}


@dataclasses.dataclass(eq=False)
class TuxpaintConfig(tfds.core.BuilderConfig):
  """max_size: longest side of the stamp after resizing (smaller stamps are not upscaled)."""

  max_size: int = 384
  margin: float = 0.1


def find_stamps(stamps_dir: str = DEFAULT_STAMPS_DIR) -> list[tuple[str, str]]:
  """Sorted (png_path, category) of every stamp PNG that has a matching caption .txt."""
  out = []
  for root, _, files in os.walk(stamps_dir):
    for f in files:
      if not f.endswith(".png"):
        continue
      png = os.path.join(root, f)
      if not os.path.exists(png[:-4] + ".txt"):
        continue
      category = os.path.relpath(png, stamps_dir).split(os.sep)[0]
      if category in CATEGORIES:
        out.append((png, category))
  return sorted(out)


def read_caption(txt_path: str) -> str:
  """First line of a stamp's .txt, cleaned; '' when missing/empty."""
  with open(txt_path, "rb") as f:
    raw = f.read()
  text = _common.decode_utf8(raw, txt_path)
  for line in text.splitlines():
    line = line.strip()
    if line and ".utf8=" not in line.split(" ")[0]:
      return _common.clean_caption(line)
    if line:
      break
  return ""


def _article(word: str) -> str:
  """'a' or 'an' for the next word, so captions read naturally."""
  return "an" if word[0] in "aeiou" else "a"


def _make_example(args):
  """Worker: (png_path, category, stamps_dir, max_size, margin) -> (key, example)."""
  png, category, stamps_dir, max_size, margin = args
  caption = read_caption(png[:-4] + ".txt")
  if not caption:
    raise _common.SkipInput(_common.SKIP_MISSING_CAPTION, png)
  rel = os.path.relpath(png, stamps_dir)[:-4]
  digest = hashlib.sha256(rel.encode()).digest()
  try:
    with Image.open(png) as im:
      im.load()
      stamp = im.convert("RGBA")
  except Exception as e:  # pylint: disable=broad-except
    raise _common.SkipInput(_common.SKIP_CORRUPT, f"{png}: {e}") from None
  w, h = stamp.size
  scale = min(1.0, max_size / max(w, h))
  if scale < 1.0:
    stamp = stamp.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.LANCZOS)
    w, h = stamp.size
  pad = max(2, int(round(margin * max(w, h))))
  cw, ch = w + 2 * pad, h + 2 * pad
  bg_name = list(_BACKGROUNDS)[digest[0] % len(_BACKGROUNDS)]
  c1 = np.array(_BACKGROUNDS[bg_name], np.float32)
  if digest[1] % 2:  # gradient towards a darker/lighter tone
    c2 = c1 * 0.7 + 0.3 * (255.0 if c1.mean() < 128 else 60.0)
    t = np.linspace(0, 1, ch, dtype=np.float32)[:, None, None]
    canvas = c1 * (1 - t) + c2 * t
    canvas = np.broadcast_to(canvas, (ch, cw, 3))
    bg_desc = f"gradient {bg_name}"
  else:
    canvas = np.broadcast_to(c1, (ch, cw, 3))
    bg_desc = f"plain {bg_name}"
  base = Image.fromarray(np.ascontiguousarray(canvas).round().astype(np.uint8), "RGB")
  base.paste(stamp, (pad, pad), stamp)
  alpha = np.asarray(stamp.getchannel("A"))
  label = CATEGORIES.index(category)
  seg = np.zeros((ch, cw), np.uint8)
  seg[pad : pad + h, pad : pad + w][alpha >= 128] = label + 1
  word = CATEGORY_WORDS[category]
  ex = {
    "image": _common.png_bytes(base),
    "segmentation": _common.png_bytes(seg),
    "alt_text": caption,
    "caption_category": f"a picture of {_article(word)} {word}",
    "caption_detailed": (
      f"{caption.rstrip('.!?')}. A picture of {_article(word)} {word} on a {bg_desc} background."
    ),
    "label": label,
    "id": f"tuxpaint/{rel}",
  }
  return ex["id"], ex


class Tuxpaint(tfds.core.GeneratorBasedBuilder):
  """Tux Paint stamps with captions, categories and alpha masks (see module docstring)."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [TuxpaintConfig(name="default", description="stamps resized to <= 384 px")]
  DEFAULT_CONFIG_NAME = "default"

  def __init__(
    self,
    *,
    stamps_dir: str = DEFAULT_STAMPS_DIR,
    num_workers: int = 1,
    limit: int | None = None,
    overrides: dict | None = None,
    **kwargs,
  ):
    """overrides: TuxpaintConfig fields (max_size, margin) replacing the config's values."""
    self._overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    self._stamps_dir = stamps_dir
    self._num_workers = num_workers
    self._limit = limit
    self.report = _common.SkipReport("tuxpaint")
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    """Schema: image, alt_text, caption_category, caption_detailed, label (16), segmentation, id."""
    return self.dataset_info_from_configs(
      description=__doc__,
      features=_common.make_features(("category", "detailed"), label_names=CATEGORIES, segmentation=True),
      supervised_keys=("image", "label"),
      homepage="https://tuxpaint.org/",
    )

  def split_size_estimates(self) -> dict[str, int]:
    """Examples per split (used to choose the number of shards before generating)."""
    n = len(find_stamps(self._stamps_dir)) if os.path.isdir(self._stamps_dir) else 0
    return {"train": min(n, self._limit) if self._limit else n}

  def _split_generators(self, dl_manager):
    """One 'train' split with every captioned stamp; fails clearly when the package is missing."""
    del dl_manager
    if not os.path.isdir(self._stamps_dir):
      raise FileNotFoundError(
        f"tuxpaint: stamps directory {self._stamps_dir!r} not found; install the Debian package "
        "'tuxpaint-stamps-default' or pass --input DIR"
      )
    stamps = find_stamps(self._stamps_dir)
    if self._limit:
      stamps = stamps[: self._limit]
    return {"train": self._generate_examples(stamps)}

  def _generate_examples(self, stamps):
    """Composites stamps in the worker pool (ordered) and records skipped ones in the report."""
    cfg = dataclasses.replace(self.builder_config, **self._overrides)
    items = [(png, cat, self._stamps_dir, cfg.max_size, cfg.margin) for png, cat in stamps]
    self.report.total += len(items)
    for (png, _, *_), (status, value) in zip(
      items, _common.parallel_map(_make_example, items, self._num_workers, chunksize=4)
    ):
      if status == "ok":
        self.report.written += 1
        yield value
      else:
        self.report.skip(png, *value)
