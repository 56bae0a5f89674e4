"""TFDS builder `openclipart`: the 8,121 drawings of Debian's `openclipart-png` + `openclipart-svg`.

Why: a real image-text set of a size between Tux Paint (785) and web data, installed by two packages
(no download at run time), with noisy web-style alt-texts (the authors' titles), keywords, sometimes a
description, 22 categories and exact object masks (the PNGs' alpha), and a fixed train/test split, so
CPU studies can train on it and evaluate zero-shot, kNN, retrieval and segmentation on drawings they
never trained on.

Inputs: `<input>/png/<category>/.../NAME.png` and `<input>/svg/<category>/.../NAME.svg` (default input
`/usr/share/openclipart`), matched by relative path without the extension. From the SVG's RDF metadata
(the first `cc:Work`) come `dc:title`, `dc:description` and the `rdf:li` keywords of `dc:subject`; the
SVG drawing itself is not rendered. `<category>` is the top folder (`CATEGORIES`).

Record schema (array_record), splits 'train' and 'test':
  image: PNG RGB, the drawing composited on white (as the training pipeline composites RGBA on its
    default `config.data.background`), downscaled (Lanczos, never upscaled) to fit `max_size`
    (`--image_size`, default 256; the studies crop 64-112 px);
  alt_text: the cleaned `dc:title` (`_common.clean_caption`: quotes/dashes normalised, whitespace
    collapsed; otherwise as the author wrote it, e.g. 'pink_cake', 'gramastar'). An SVG without a title
    (no metadata, an empty `dc:title`) gets the file stem with `_ - .` replaced by spaces
    ('lime_slice_ganson' -> 'lime slice ganson'), counted as 'title from file name';
  caption_short (coarse): 'a drawing of <article> <category word>: <k1>, <k2>, <k3>' with the first
    three keywords, or 'a drawing of <article> <category word>' when there are none;
  caption_detailed (fine): '<description>. A clip art drawing of <article> <category word>, tagged
    <k1>, ..., <k10>.' with up to ten keywords; '<title>' replaces a missing description and the
    ', tagged ...' clause is left out without keywords (keywords: cleaned, lower-cased, '_' -> ' ',
    duplicates dropped, in the SVG's order). Artifacts of the package's metadata export are dropped:
    the description 'HASH(0x858b108)' (29 drawings) and the keywords 'hash' (1,924) and '0x...';
  label: ClassLabel of the top folder (22 names, `CATEGORIES`; the words are `CATEGORY_WORDS`);
  segmentation: PNG uint8 (H,W,1) at the image's size, value = label + 1 where the (downscaled) alpha
    >= 128, 0 = background (the tuxpaint convention); a drawing with no pixel below 128 (a PNG without
    transparency: mostly flags and patterns, which fill their canvas) is label + 1 everywhere, counted
    as 'opaque'; a faint drawing with no pixel >= 128 (the thin-line 'gramastar' stars of shapes/stars)
    is 0 everywhere, counted as 'no object pixel';
  id: 'openclipart/<path relative to png/, without .png>'.

Split (fixed, depends only on the file names and PNG bytes converted): the package holds the same
drawing several times (2,126 PNGs are byte-identical copies, 481 of the 905 groups across categories,
e.g. geography/ and signs_and_symbols/map_symbols/), so drawings are grouped first: two PNGs are in one
group when their file names (without folders) are equal or their bytes are identical, transitively.
A group is 'test' when int(sha256('openclipart/' + KEY).hexdigest(), 16) % 100 < `test_percent`
(default 10), KEY being the group's smallest file name (e.g. 'fries_ganson.png'), else 'train'; every
copy of a drawing is thus in the same split. `split_of(file_name)` is the rule for a file without copies.
`--limit N` keeps the first N inputs by relative path. Records are in TFDS's order (by a hash of the id).

Skipped and reported (`conversion_report.json`): a PNG without its SVG ('missing caption': no title,
description or keywords), an SVG without its PNG ('missing image'), a zero-byte PNG ('zero-byte'), a PNG
PIL cannot decode ('corrupt image'), a PNG above `_common.MAX_PIXELS` ('huge image', two in the package,
20990 x 29700), a PNG with every pixel fully transparent ('blank image': 118 of special/gradients, whose
gradients the package's renderer left out, and 6 more), an SVG that is not well-formed XML ('bad svg'),
a file outside the 22 category folders ('unknown category'). An SVG that parses but has no metadata is
kept (title from the file name). The report also holds the counts per split and category and of the
fallbacks ('stats').
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import os
import re
import warnings
import xml.etree.ElementTree as ET

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from tipsito.data.builders import _common
from tipsito.data.builders import class_words

DEFAULT_DIR = "/usr/share/openclipart"

CATEGORIES = class_words.OPENCLIPART_CATEGORIES
CATEGORY_WORDS = class_words.OPENCLIPART_CATEGORY_WORDS

ALPHA_THRESHOLD = 128  # alpha >= this is object (as tuxpaint and the segmentation eval's alpha source)
KEYWORDS_SHORT = 3
KEYWORDS_DETAILED = 10
SPLIT_SALT = "openclipart/"

# Skip reasons of this converter besides the shared _common.SKIP_* ones.
SKIP_HUGE_IMAGE = "huge image"
SKIP_BAD_SVG = "bad svg"
SKIP_UNKNOWN_CATEGORY = "unknown category"
SKIP_BLANK = "blank image"

# Fallbacks counted in the report's stats (not skips).
NOTE_TITLE_FROM_NAME = "title from file name"
NOTE_NO_DESCRIPTION = "no description"
NOTE_NO_KEYWORDS = "no keywords"
NOTE_OPAQUE = "opaque"
NOTE_NO_OBJECT = "no object pixel"
NOTE_DOWNSCALED = "downscaled"

_DC = "{http://purl.org/dc/elements/1.1/}"
# Artifacts of the metadata export (a Perl hash reference printed as text): descriptions
# 'HASH(0x858b108)', and keywords 'hash' (1,924 drawings) and '0x8863bcc'. They are dropped.
_HASH_ARTIFACT = re.compile(r"HASH\(0x[0-9a-fA-F]+\)")
_KEYWORD_ARTIFACT = re.compile(r"hash|0x[0-9a-f]+|hash\(0x[0-9a-f]+\)")


@dataclasses.dataclass(eq=False)
class OpenclipartConfig(tfds.core.BuilderConfig):
  """max_size: longest side of the stored image (smaller drawings are not upscaled);
  test_percent: share of drawing groups in 'test' (see the split rule in the module docstring)."""

  max_size: int = 256
  test_percent: int = 10


def _local(tag: str) -> str:
  """'{namespace}name' -> 'name'."""
  return tag.rsplit("}", 1)[-1]


def find_inputs(root: str = DEFAULT_DIR) -> list[tuple[str, str | None, str | None]]:
  """Sorted (relative path without extension, png path or None, svg path or None) of every drawing."""
  found: dict[str, list] = collections.defaultdict(lambda: [None, None])
  for i, (sub, ext) in enumerate((("png", ".png"), ("svg", ".svg"))):
    base = os.path.join(root, sub)
    for d, _, files in os.walk(base):
      for f in files:
        if f.lower().endswith(ext):
          path = os.path.join(d, f)
          found[os.path.relpath(path, base)[: -len(ext)]][i] = path
  return sorted((rel, png, svg) for rel, (png, svg) in found.items())


def read_metadata(svg_path: str) -> dict:
  """{'title', 'description', 'keywords'} from the SVG's first cc:Work ('' / () when absent).

  Parses only up to the end of that element. Raises SkipInput('bad svg') for malformed XML.
  """
  out = {"title": "", "description": "", "keywords": ()}
  try:
    with open(svg_path, "rb") as f:
      for _, el in ET.iterparse(f, events=("end",)):
        if _local(el.tag) != "Work":
          continue
        for child in el:
          if child.tag == _DC + "title":
            out["title"] = _common.clean_caption(" ".join(child.itertext()))
          elif child.tag == _DC + "description":
            desc = _common.clean_caption(" ".join(child.itertext()))
            out["description"] = "" if _HASH_ARTIFACT.fullmatch(desc) else desc
          elif child.tag == _DC + "subject":
            items = [" ".join(li.itertext()) for li in child.iter() if _local(li.tag) == "li"]
            if not items:  # a plain 'a, b, c' subject
              items = re.split(r"[,;]", " ".join(child.itertext()))
            out["keywords"] = clean_keywords(items)
        break
  except ET.ParseError as e:
    raise _common.SkipInput(SKIP_BAD_SVG, f"{svg_path}: {e}") from None
  return out


def clean_keywords(items) -> tuple[str, ...]:
  """Cleaned, lower-cased keywords ('_' -> ' ') without empty ones, export artifacts and duplicates, in
  their order."""
  out, seen = [], set()
  for k in items:
    k = _common.clean_caption(k.replace("_", " ")).lower()
    if k and k not in seen and not _KEYWORD_ARTIFACT.fullmatch(k):
      seen.add(k)
      out.append(k)
  return tuple(out)


def title_from_stem(stem: str) -> str:
  """The alt-text of a drawing without a title: 'lime_slice_ganson' -> 'lime slice ganson'."""
  return re.sub(r"[\s_.\-]+", " ", stem).strip() or stem


def _article(word: str) -> str:
  """'a' or 'an' for the next word, so captions read naturally."""
  return "an" if word[0] in "aeiou" else "a"


def make_captions(title: str, description: str, keywords, category: str) -> dict:
  """caption_short and caption_detailed of one drawing (formats in the module docstring)."""
  word = CATEGORY_WORDS[category]
  what = f"{_article(word)} {word}"
  short = f"a drawing of {what}"
  if keywords:
    short += ": " + ", ".join(keywords[:KEYWORDS_SHORT])
  head = (description or title).rstrip(".!?")
  detailed = f"{head}. A clip art drawing of {what}"
  if keywords:
    detailed += ", tagged " + ", ".join(keywords[:KEYWORDS_DETAILED])
  return {"caption_short": short, "caption_detailed": detailed + "."}


def split_of(key: str, test_percent: int = 10) -> str:
  """'test' or 'train' for a group key (the group's smallest file name, e.g. 'fries_ganson.png')."""
  h = int(hashlib.sha256((SPLIT_SALT + key).encode("utf-8")).hexdigest(), 16)
  return "test" if h % 100 < test_percent else "train"


def group_keys(pngs: dict[str, str]) -> dict[str, str]:
  """{rel: group key} for {rel: png path}: groups joined by equal file names or identical PNG bytes."""
  parent = {rel: rel for rel in pngs}

  def find(x):
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x

  first: dict = {}
  for rel in sorted(pngs):
    with open(pngs[rel], "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()
    for k in (("name", os.path.basename(pngs[rel])), ("bytes", digest)):
      if k in first:
        a, b = find(first[k]), find(rel)
        if a != b:
          parent[max(a, b)] = min(a, b)
      else:
        first[k] = rel
  smallest: dict[str, str] = {}
  for rel in pngs:
    r = find(rel)
    name = os.path.basename(pngs[rel])
    smallest[r] = min(smallest.get(r, name), name)
  return {rel: smallest[find(rel)] for rel in pngs}


def _load_png(path: str) -> tuple[Image.Image, Image.Image]:
  """(RGB composited on white, alpha 'L') of a PNG (alpha 255 without transparency); SkipInput for bad
  files."""
  with open(path, "rb") as f:
    data = f.read()
  if not data:
    raise _common.SkipInput(_common.SKIP_ZERO_BYTE, path)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size is checked below
      im = Image.open(io.BytesIO(data))
    with im:
      w, h = im.size
      if w * h > _common.MAX_PIXELS:
        raise _common.SkipInput(SKIP_HUGE_IMAGE, f"{path}: {w}x{h}")
      im.load()
      rgba = im.convert("RGBA")
  except _common.SkipInput:
    raise
  except Image.DecompressionBombError as e:  # PIL refuses to open above 2 x MAX_PIXELS
    raise _common.SkipInput(SKIP_HUGE_IMAGE, f"{path}: {e}") from None
  except Exception as e:  # pylint: disable=broad-except  # PIL raises many types
    raise _common.SkipInput(_common.SKIP_CORRUPT, f"{path}: {type(e).__name__}: {e}") from None
  alpha = rgba.getchannel("A")
  rgb = Image.new("RGB", rgba.size, (255, 255, 255))
  rgb.paste(rgba, mask=alpha)
  return rgb, alpha


def _make_example(args):
  """Worker: (rel, png, svg, category, max_size) -> (key, example, notes)."""
  rel, png, svg, category, max_size = args
  meta = read_metadata(svg)
  rgb, alpha = _load_png(png)
  if alpha.getextrema()[1] == 0:
    raise _common.SkipInput(SKIP_BLANK, f"{png}: every pixel is fully transparent")
  notes = []
  title = meta["title"]
  if not title:
    title = title_from_stem(os.path.basename(rel))
    notes.append(NOTE_TITLE_FROM_NAME)
  if not meta["description"]:
    notes.append(NOTE_NO_DESCRIPTION)
  if not meta["keywords"]:
    notes.append(NOTE_NO_KEYWORDS)
  w, h = rgb.size
  scale = min(1.0, max_size / max(w, h))
  if scale < 1.0:
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    rgb = rgb.resize(size, Image.LANCZOS, reducing_gap=3.0)
    alpha = alpha.resize(size, Image.LANCZOS, reducing_gap=3.0)
    notes.append(NOTE_DOWNSCALED)
  label = CATEGORIES.index(category)
  obj = np.asarray(alpha) >= ALPHA_THRESHOLD
  if obj.all():
    notes.append(NOTE_OPAQUE)
  elif not obj.any():
    notes.append(NOTE_NO_OBJECT)
  ex = {
    "image": _common.png_bytes(rgb),
    "segmentation": _common.png_bytes(obj.astype(np.uint8) * (label + 1)),
    "alt_text": title,
    **make_captions(title, meta["description"], meta["keywords"], category),
    "label": label,
    "id": f"openclipart/{rel}",
  }
  return ex["id"], ex, tuple(notes)


@dataclasses.dataclass
class OpenclipartReport(_common.SkipReport):
  """The shared skip report plus counts per split and category and of the fallbacks (`stats`)."""

  per_split: dict = dataclasses.field(default_factory=dict)
  notes: dict = dataclasses.field(default_factory=dict)

  def count(self, split: str, category: str, notes) -> None:
    """Records one written example of `split` / `category` with its fallback notes."""
    cats = self.per_split.setdefault(split, {})
    cats[category] = cats.get(category, 0) + 1
    for n in notes:
      self.notes[n] = self.notes.get(n, 0) + 1

  def to_dict(self) -> dict:
    """The shared report with 'stats': {'per_split': {split: {category: n}}, 'notes': {note: n}}."""
    d = super().to_dict()
    d["stats"] = {
      "per_split": {s: dict(sorted(c.items())) for s, c in self.per_split.items()},
      "notes": dict(sorted(self.notes.items())),
    }
    return d

  def summary(self) -> str:
    """The shared line, then one line per split (total and per category) and one of the fallbacks."""
    lines = [super().summary()]
    for split, cats in self.per_split.items():
      per = ", ".join(f"{c} {n}" for c, n in sorted(cats.items()))
      lines.append(f"  {split}: {sum(cats.values())} ({per})")
    if self.notes:
      lines.append("  fallbacks: " + ", ".join(f"{k} {v}" for k, v in sorted(self.notes.items())))
    return "\n".join(lines)


class Openclipart(tfds.core.GeneratorBasedBuilder):
  """Openclipart drawings with titles, keyword captions, categories and alpha masks (module docstring)."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [OpenclipartConfig(name="default", description="drawings resized to <= 256 px")]
  DEFAULT_CONFIG_NAME = "default"

  def __init__(
    self,
    *,
    input_dir: str = DEFAULT_DIR,
    num_workers: int = 1,
    limit: int | None = None,
    overrides: dict | None = None,
    **kwargs,
  ):
    """overrides: OpenclipartConfig fields (max_size, test_percent) replacing the config's values."""
    self._overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    self._input_dir = input_dir
    self._num_workers = num_workers
    self._limit = limit
    self._plan_cache = None
    self.report = OpenclipartReport("openclipart")
    super().__init__(**kwargs)

  @property
  def options(self) -> OpenclipartConfig:
    """The config with `overrides` applied (what is actually converted)."""
    return dataclasses.replace(self.builder_config, **self._overrides)

  def _info(self) -> tfds.core.DatasetInfo:
    """Schema: image, alt_text, caption_short, caption_detailed, label (22), segmentation, id."""
    return self.dataset_info_from_configs(
      description=__doc__,
      features=_common.make_features(("short", "detailed"), label_names=CATEGORIES, segmentation=True),
      supervised_keys=("image", "label"),
      homepage="https://openclipart.org/",
    )

  def _plan(self):
    """(items per split, unmatched/unknown inputs as (path, reason, detail)); computed once."""
    if self._plan_cache is not None:
      return self._plan_cache
    if not os.path.isdir(os.path.join(self._input_dir, "png")):
      raise FileNotFoundError(
        f"openclipart: directory {os.path.join(self._input_dir, 'png')!r} not found; install the Debian "
        "packages 'openclipart-png' and 'openclipart-svg' or pass --input DIR (holding png/ and svg/)"
      )
    inputs = find_inputs(self._input_dir)
    if self._limit:
      inputs = inputs[: self._limit]
    bad, pairs = [], []
    for rel, png, svg in inputs:
      category = rel.split(os.sep)[0] if os.sep in rel else ""
      if png is None:
        bad.append((svg, _common.SKIP_MISSING_IMAGE, "no PNG for this SVG"))
      elif svg is None:
        bad.append((png, _common.SKIP_MISSING_CAPTION, "no SVG (title, description, keywords) for this PNG"))
      elif category not in CATEGORIES:
        bad.append((png, SKIP_UNKNOWN_CATEGORY, f"top folder {category!r} is not one of {len(CATEGORIES)}"))
      else:
        pairs.append((rel, png, svg, category))
    keys = group_keys({rel: png for rel, png, _, _ in pairs})
    cfg = self.options
    splits: dict[str, list] = {"train": [], "test": []}
    for rel, png, svg, category in pairs:
      splits[split_of(keys[rel], cfg.test_percent)].append((rel, png, svg, category, cfg.max_size))
    self._plan_cache = (splits, bad)
    return self._plan_cache

  def split_size_estimates(self) -> dict[str, int]:
    """Examples per split before skips (used to choose the number of shards before generating)."""
    if not os.path.isdir(os.path.join(self._input_dir, "png")):
      return {"train": 0}
    return {k: len(v) for k, v in self._plan()[0].items()}

  def _split_generators(self, dl_manager):
    """'train' and 'test' by the split rule (an empty one is left out); unmatched inputs are reported."""
    del dl_manager
    splits, bad = self._plan()
    self.report.total += len(bad)
    for item in bad:
      self.report.skip(*item)
    return {split: self._generate_examples(split, items) for split, items in splits.items() if items}

  def _generate_examples(self, split: str, items):
    """Converts drawings in the worker pool (ordered) and records skipped ones in the report."""
    self.report.total += len(items)
    for (_, png, svg, category, _), (status, value) in zip(
      items, _common.parallel_map(_make_example, items, self._num_workers, chunksize=4)
    ):
      if status == "ok":
        key, ex, notes = value
        self.report.written += 1
        self.report.count(split, category, notes)
        yield key, ex
      else:
        reason, detail = value
        self.report.skip(svg if reason == SKIP_BAD_SVG else png, reason, detail)
