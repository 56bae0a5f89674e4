"""Shared pieces of the tipsito TFDS builders.

Why this module exists: every builder writes the same record schema (contract, "tipsito/data"), checks
input files the same way and reports skipped inputs the same way, so those rules live in one place.
It imports only numpy/PIL at module level (TFDS is imported lazily inside functions) so that
multiprocessing workers that unpickle the worker functions below start fast and never touch TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import multiprocessing
import os
import re
import unicodedata
from typing import Any, Callable, Iterable, Iterator, Sequence

import sys

import numpy as np
from PIL import Image

from tipsito import paths


def _install_importlib_resources_shim() -> None:
  """Private shim: tfds 4.9.10 touches `importlib_resources.abc` whenever it builds a dataset from
  code (DatasetBuilder.code_path) but only requires that backport on Python < 3.9. On 3.11 the
  standard library module has the same API, so we alias it when the backport is not installed.
  """
  try:
    import importlib_resources  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    import importlib.resources  # pylint: disable=g-import-not-at-top
    import importlib.resources.abc  # noqa: F401  pylint: disable=g-import-not-at-top

    sys.modules.setdefault("importlib_resources", importlib.resources)


_install_importlib_resources_shim()

# Reasons a converter may skip an input; stable strings so tests and dashboards can count them.
SKIP_ZERO_BYTE = "zero-byte"
SKIP_CORRUPT = "corrupt image"
SKIP_MISSING_IMAGE = "missing image"
SKIP_MISSING_CAPTION = "missing caption"
SKIP_NON_UTF8 = "non-UTF-8 caption"
SKIP_BAD_JSON = "bad json"

REPORT_FILENAME = "conversion_report.json"

# Images larger than this (pixels) are refused: a decompression bomb would stall a whole host later.
MAX_PIXELS = 16384 * 16384
Image.MAX_IMAGE_PIXELS = MAX_PIXELS


class SkipInput(Exception):
  """Raised by a worker for an input that must be skipped; `reason` is one of the SKIP_* strings."""

  def __init__(self, reason: str, detail: str = ""):
    """reason: one of the SKIP_* strings; detail: free text for the report."""
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = reason
    self.detail = detail


def make_features(
  caption_names: Sequence[str],
  *,
  label_names: Sequence[str] | None = None,
  segmentation: bool = False,
  image_format: str | None = "png",
):
  """Returns the tfds FeaturesDict of the shared record schema.

  Why one function: the pipeline and evals rely on identical field names/types in every dataset.
  `caption_names` are the suffixes of the extra caption fields ('detailed' -> 'caption_detailed').
  The image is stored encoded (PNG for generated data; the original JPEG/PNG bytes for converted
  data, `image_format=None`), so readers can skip TFDS decoding and decode with PIL themselves.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  feats: dict[str, Any] = {
    "image": tfds.features.Image(shape=(None, None, 3), encoding_format=image_format),
    "alt_text": tfds.features.Text(),
    "id": tfds.features.Text(),
  }
  for name in caption_names:
    feats[caption_field(name)] = tfds.features.Text()
  if label_names is not None:
    feats["label"] = tfds.features.ClassLabel(names=list(label_names))
  if segmentation:
    feats["segmentation"] = tfds.features.Image(shape=(None, None, 1), encoding_format="png")
  return tfds.features.FeaturesDict(feats)


def caption_field(name: str) -> str:
  """Maps a caption column/key name to its record field name ('gemini' -> 'caption_gemini')."""
  name = re.sub(r"[^0-9a-zA-Z_]+", "_", name.strip()).strip("_").lower() or "text"
  return name if name.startswith("caption_") else f"caption_{name}"


def png_bytes(array_or_image, compress_level: int = 3) -> bytes:
  """Encodes a uint8 array (H,W), (H,W,1), (H,W,3) or a PIL image as PNG bytes.

  compress_level 3 (not PIL's default 6): conversion speed matters more than a few % of disk.
  """
  if isinstance(array_or_image, np.ndarray):
    arr = array_or_image
    if arr.ndim == 3 and arr.shape[-1] == 1:
      arr = arr[..., 0]
    img = Image.fromarray(np.ascontiguousarray(arr.astype(np.uint8)))
  else:
    img = array_or_image
  buf = io.BytesIO()
  img.save(buf, format="PNG", compress_level=compress_level)
  return buf.getvalue()


_QUOTES = str.maketrans(
  {
    "\u201c": '"',
    "\u201d": '"',
    "\u201e": '"',
    "\u2018": "'",
    "\u2019": "'",
    "\u2013": "-",
    "\u2014": "-",
    "\u2026": "...",
    "\u00a0": " ",
  }
)


def clean_caption(text: str) -> str:
  """Normalises a caption: NFC, ASCII quotes/dashes, collapsed whitespace, no wrapping quotes/dashes.

  Why: tokenizers see fewer rare pieces, and captions like '“Hospital”.' become 'Hospital.'.
  """
  text = unicodedata.normalize("NFC", text).lstrip("\ufeff").translate(_QUOTES)
  text = re.sub(r"\s+", " ", text).strip()
  text = re.sub(r'^[-\s]+', "", text)  # leading dash ("- Because a brain ...")
  # Strip a pair of quotes wrapping the whole caption, keeping trailing punctuation.
  m = re.fullmatch(r'"([^"]+)"([.!?]*)', text)
  if m:
    text = m.group(1).rstrip(".") + (m.group(2) or "")
  return text.strip()


def decode_utf8(raw: bytes, what: str = "caption") -> str:
  """Decodes caption bytes strictly; non-UTF-8 input is skipped rather than silently mangled."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise SkipInput(SKIP_NON_UTF8, f"{what}: {e}") from None


def check_image_bytes(data: bytes, *, keep_formats=("PNG", "JPEG")) -> bytes:
  """Validates encoded image bytes; returns bytes to store (re-encoded PNG if not JPEG/PNG).

  Fully decodes the image (not just the header) so truncated files are caught at conversion
  time and not in the training loop. JPEG/PNG bytes are kept as they are (no quality loss, the
  pipeline handles alpha/grayscale/16-bit); other formats (GIF, WEBP, BMP, TIFF) become RGB(A) PNG.
  """
  if not data:
    raise SkipInput(SKIP_ZERO_BYTE)
  try:
    with Image.open(io.BytesIO(data)) as img:
      fmt = img.format
      img.load()
      if fmt in keep_formats:
        return data
      if img.mode not in ("RGB", "RGBA", "L", "LA"):
        img = img.convert("RGBA" if "A" in img.getbands() or "transparency" in img.info else "RGB")
      return png_bytes(img)
  except SkipInput:
    raise
  except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError, DecompressionBomb)
    raise SkipInput(SKIP_CORRUPT, f"{type(e).__name__}: {e}") from None


@dataclasses.dataclass
class SkipReport:
  """Counts and lists inputs a converter skipped, with the reason; written as JSON next to the data.

  Why: silent data loss is the worst failure of a converter; the report makes it visible and
  testable (counts per reason).
  """

  dataset: str
  total: int = 0
  written: int = 0
  skipped: list = dataclasses.field(default_factory=list)

  def skip(self, item: str, reason: str, detail: str = "") -> None:
    """Records one skipped input."""
    self.skipped.append({"item": str(item), "reason": reason, "detail": detail})

  @property
  def by_reason(self) -> dict[str, int]:
    """Number of skipped inputs per reason."""
    return dict(collections.Counter(s["reason"] for s in self.skipped))

  def to_dict(self) -> dict:
    """JSON-able summary (also what is written to disk)."""
    return {
      "dataset": self.dataset,
      "total": self.total,
      "written": self.written,
      "num_skipped": len(self.skipped),
      "by_reason": self.by_reason,
      "skipped": self.skipped,
    }

  def write(self, directory: str | os.PathLike) -> str:
    """Writes `conversion_report.json` in `directory`; returns its path."""
    path = (
      paths.join(directory, REPORT_FILENAME)
      if paths.is_url(directory)
      else os.path.join(os.fspath(directory), REPORT_FILENAME)
    )
    paths.as_path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False), encoding="utf-8")
    return path

  def summary(self) -> str:
    """One human line, printed by the converter."""
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_reason.items())) or "none"
    return (
      f"[{self.dataset}] inputs: {self.total}, written: {self.written}, "
      f"skipped: {len(self.skipped)} ({reasons})"
    )


def _call_safely(fn_and_item):
  """Pool helper: runs fn(item) and turns SkipInput into a value (exceptions don't cross nicely)."""
  fn, item = fn_and_item
  try:
    return ("ok", fn(item))
  except SkipInput as e:
    return ("skip", (e.reason, e.detail))


def parallel_map(
  fn: Callable[[Any], Any], items: Iterable[Any], num_workers: int, chunksize: int = 8
) -> Iterator[tuple[str, Any]]:
  """Ordered map of `fn` over `items` in a process pool; yields ('ok', result) or ('skip', (reason, detail)).

  Why ordered: TFDS keys and the skip report must not depend on worker timing. `fn` must be a
  module-level function (picklable). Workers are forked: they only run PIL/numpy code.
  num_workers <= 1 runs inline (tests, debugging).
  """
  if num_workers <= 1:
    for item in items:
      yield _call_safely((fn, item))
    return
  ctx = multiprocessing.get_context("fork")
  with ctx.Pool(num_workers) as pool:
    yield from pool.imap(_call_safely, ((fn, it) for it in items), chunksize=chunksize)


def default_num_workers() -> int:
  """Workers used when not given: all cores but one (at least 1), capped at 16."""
  return max(1, min(16, (os.cpu_count() or 2) - 1))


def image_record_worker(item):
  """Worker for converted (table / folder / webdataset) inputs: validates the image, builds the record.

  item = (key, image, fields) where image is a file path (str) or encoded bytes, and fields holds
  'alt_text', 'caption_*', optional 'label', 'id'. Returns (key, record) or raises SkipInput.
  """
  key, image, fields = item
  if isinstance(image, str):
    image = _read_image_file(image)
  record = dict(fields)
  record["image"] = check_image_bytes(image)
  return key, record


def _read_image_file(path: str) -> bytes:
  """The bytes of a local or remote (gs://, through tipsito/paths.py) image; missing -> SkipInput."""
  if "://" not in path:
    if not os.path.isfile(path):
      raise SkipInput(SKIP_MISSING_IMAGE, path)
    with open(path, "rb") as f:
      return f.read()
  try:
    with paths.open_binary(path) as f:
      return f.read()
  except FileNotFoundError:
    raise SkipInput(SKIP_MISSING_IMAGE, path) from None


def text_field(value: Any, what: str) -> str:
  """Turns a caption value (str / bytes / number / None) into a clean str; non-UTF-8 -> SkipInput."""
  if value is None:
    return ""
  if isinstance(value, bytes):
    value = decode_utf8(value, what)
  elif isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError:  # surrogateescape'd bytes from a non-UTF-8 table row
      raise SkipInput(SKIP_NON_UTF8, what) from None
  else:
    value = str(value)
  return clean_caption(value)


def run_conversion(
  builder, items: Iterable[Any], report: "SkipReport", num_workers: int, chunksize: int = 8
) -> Iterator[tuple[str, dict]]:
  """Feeds `items` ((key, image, fields) or SkipInput placeholders) through the worker pool.

  Items that are already known to be bad are passed as ('__skip__', item_name, reason, detail)
  tuples so the report keeps input order. Yields (key, record) for the TFDS writer.
  """
  del builder
  # Input order of the report: each item is queued as it is read (the pool's feeder thread reads
  # ahead of the results), and a result (returned in input order) first flushes the known-bad
  # items queued before its own entry.
  order: collections.deque = collections.deque()

  def _good_items():
    """Counts every input, queues each one, diverts the already-known bad ones to the queue only."""
    for it in items:
      report.total += 1
      if it[0] == "__skip__":
        order.append(("skip", it[1:]))
        continue
      order.append(("pool", it[1] if isinstance(it[1], str) else it[0]))  # the file path when there is one
      yield it

  for status, value in parallel_map(image_record_worker, _good_items(), num_workers, chunksize):
    while order[0][0] == "skip":
      report.skip(*order.popleft()[1])
    name = order.popleft()[1]
    if status == "ok":
      report.written += 1
      yield value
    else:
      report.skip(name, *value)
  while order:
    report.skip(*order.popleft()[1])


class SingleInputSplit:
  """Mixin for builders converting user files (table, webdataset): one split named `self._split`, built
  from `self._input_path` by `self._generate_examples()`. Shared so both fail the same clear way when no
  input is given."""

  def _split_generators(self, dl_manager):
    """A single split named `split`; building needs input_path. With a Beam transform set by
    tipsito/data/beam_convert.py, the split is that transform (TFDS then builds it on Beam)."""
    del dl_manager
    if self._input_path is None:
      raise ValueError(f"{self.name}: input_path is required to build the dataset")
    beam_transform = getattr(self, "beam_transform", None)
    return {self._split: beam_transform if beam_transform is not None else self._generate_examples()}

  def _example_writer(self):
    """TFDS's record writer, also for a gs:// data_dir (tipsito/data/builders/_storage.py)."""
    # _storage imports TFDS; conversion workers and the sources import this module without it.
    from tipsito.data.builders import _storage  # lazy: TFDS (see above)

    return _storage.ExampleWriter(file_format=self.info.file_format)
