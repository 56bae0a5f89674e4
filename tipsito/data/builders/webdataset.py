"""TFDS builder `webdataset`: webdataset tar shards (image + .txt/.json per key) -> array_record.

Why: most web-scale image-text corpora are distributed as webdataset tars; training wants random
access (exact resume, global shuffling), so they are converted once, validating every image.

Input (`input_path`): a .tar file, a directory of .tar files, or a glob; shards are read in sorted
order. Members are grouped webdataset-style: key = member path up to the first '.' of its basename,
consecutive members with the same key form one sample; extension = the rest (lower-cased).
  * image: first of jpg, jpeg, png, webp, gif, bmp, tif, tiff;
  * alt_text: the `.txt` member, else the json's first of caption / alt_text / text / txt;
  * json: every other string field `k` becomes `caption_<k>` (the set of fields is found by a first
    scan over the json members, or given with `caption_columns`); missing ones are stored as ''.
Bad samples are skipped and reported: no image, zero-byte or corrupt image, no/empty caption,
non-UTF-8 .txt, unparsable .json.

Record schema: image (original JPEG/PNG bytes, other formats re-encoded as PNG), alt_text,
caption_<field>..., id ('<shard name>/<key>'). One split (`split`, default 'train').
"""

from __future__ import annotations

import json
import os
import tarfile

import tensorflow_datasets as tfds

from tipsito import paths
from tipsito.data.builders import _common

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
ALT_TEXT_KEYS = ("caption", "alt_text", "text", "txt")
_NON_CAPTION_KEYS = {
  "key",
  "__key__",
  "url",
  "id",
  "width",
  "height",
  "original_width",
  "original_height",
  "sha256",
  "status",
  "error_message",
  "exif",
}


def list_shards(input_path: str) -> list[str]:
  """Sorted shard files of a tar path, a directory of tars, a glob, or a brace range
  ('shards/{00000..09999}.tar'); local or gs:// (tipsito/paths.py). The names of a brace range are
  taken as given, without a look-up each (10k look-ups on a bucket take minutes): a missing one is
  reported as an unreadable tar when it is read."""
  if "{" in input_path:
    shards = paths.expand_braces(input_path)
  elif any(ch in input_path for ch in "*?["):
    shards = paths.glob(input_path)
  elif paths.isdir(input_path):
    shards = [p for ext in ("*.tar", "*.tar.gz", "*.tgz") for p in paths.glob(os.path.join(input_path, ext))]
  else:
    shards = [input_path] if paths.isfile(input_path) else []
  if not shards:
    raise FileNotFoundError(f"webdataset: no .tar shards found at {input_path!r}")
  return sorted(shards)


def _split_name(member_name: str) -> tuple[str, str]:
  """webdataset convention: 'dir/000123.seg.png' -> ('dir/000123', 'seg.png')."""
  dirname, base = os.path.split(member_name)
  stem, _, ext = base.partition(".")
  return os.path.join(dirname, stem), ext.lower()


def _file_members(tar: tarfile.TarFile):
  """(member, key, ext) of every regular file of an open tar shard, in tar order."""
  for member in tar:
    if member.isfile():
      yield (member,) + _split_name(member.name)


def _open_tar(shard: str) -> tarfile.TarFile:
  """Opens a local or gs:// tar shard for reading (any compression)."""
  if paths.is_url(shard):
    return tarfile.open(fileobj=paths.open_binary(shard), mode="r:*")
  return tarfile.open(shard, "r:*")


def iter_samples(shard: str):
  """Yields (key, {ext: bytes}) for consecutive same-key member groups of one tar shard."""
  current, parts = None, {}
  with _open_tar(shard) as tar:
    for member, key, ext in _file_members(tar):
      if key != current:
        if current is not None:
          yield current, parts
        current, parts = key, {}
      f = tar.extractfile(member)
      parts[ext] = f.read() if f is not None else b""
  if current is not None:
    yield current, parts


def _caption_keys_of(obj: dict) -> list[str]:
  """String fields of a sample json that can be captions (urls, sizes, hashes are not)."""
  return [k for k, v in obj.items() if isinstance(v, str) and k not in _NON_CAPTION_KEYS]


class Webdataset(_common.SingleInputSplit, tfds.core.GeneratorBasedBuilder):
  """webdataset tar converter (see module docstring)."""

  VERSION = tfds.core.Version("1.0.0")

  def __init__(
    self,
    *,
    input_path: str | None = None,
    caption_columns: list[str] | None = None,
    split: str = "train",
    num_workers: int = 1,
    limit: int | None = None,
    **kwargs,
  ):
    """input_path None = reading an existing dataset; else scans the shards (fields, sample count)."""
    self._input_path = input_path
    self._split = split
    self._num_workers = num_workers
    self._limit = limit
    self._json_fields: list[str] = []
    self._shard_samples: dict[str, int] | None = None  # samples per shard, from _scan
    self.report = _common.SkipReport(self.name)
    if input_path is not None:
      self._shards = list_shards(input_path)
      # Given caption_columns, the scan is only needed to count samples (lazily, for the shard count):
      # with --caption_columns and --num_shards a conversion reads every tar once.
      self._json_fields = list(caption_columns) if caption_columns else self._scan()
    super().__init__(**kwargs)

  def _scan(self) -> list[str]:
    """First pass reading member headers and json members only: which string fields exist
    (features are static) and how many samples there are (to choose the shard count)."""
    fields: list[str] = []
    self._shard_samples = {}
    for shard in self._shards:
      last_key = None
      self._shard_samples[shard] = 0
      try:
        with _open_tar(shard) as tar:
          for member, key, ext in _file_members(tar):
            if key != last_key:
              self._shard_samples[shard] += 1
              last_key = key
            if ext != "json":
              continue
            try:
              obj = json.loads(tar.extractfile(member).read().decode("utf-8"))
            except (ValueError, UnicodeDecodeError, AttributeError):
              continue
            if isinstance(obj, dict):
              fields += [k for k in _caption_keys_of(obj) if k not in fields]
      except (tarfile.TarError, OSError, EOFError):
        continue  # an unreadable shard is reported when it is read for real
    return fields

  def _extra_fields(self) -> list[str]:
    """json fields that become caption_<k> (caption/alt_text/text/txt are alt-text sources)."""
    return [k for k in self._json_fields if k not in ALT_TEXT_KEYS]

  def _info(self) -> tfds.core.DatasetInfo:
    """Features from the scanned json fields; None when reading (restored from features.json)."""
    features = None  # reading an existing dataset: features are restored from its features.json
    if self._input_path is not None:
      features = _common.make_features(
        [_common.caption_field(k) for k in self._extra_fields()], image_format=None
      )
    return self.dataset_info_from_configs(description=__doc__, features=features)

  def split_size_estimates(self) -> dict[str, int]:
    """Upper bound of examples per split (samples before skipping), to choose the number of shards."""
    n = sum(self.shard_samples().values())
    return {self._split: min(n, self._limit) if self._limit else n}

  def shard_samples(self) -> dict[str, int]:
    """Samples per shard (scanning the shards on first use)."""
    if self._shard_samples is None:
      self._scan()
    return self._shard_samples

  def unit_reader(self) -> "ShardReader":
    """The picklable reader of one input shard (a unit of work of tipsito/data/beam_convert.py)."""
    return ShardReader(self._extra_fields())

  def units(self) -> list[tuple[str, int | None]]:
    """The units of work, in input order: (tar shard, at most this many samples or None); --limit
    caps them from the sample counts, as the single-machine path stops after `limit` samples."""
    if not self._limit:
      return [(shard, None) for shard in self._shards]
    out, left = [], self._limit
    for shard in self._shards:
      if left <= 0:
        break
      out.append((shard, left))
      left -= self.shard_samples()[shard]
    return out

  def _items(self):
    """(key, image bytes, fields) per sample, or ('__skip__', name, reason, detail)."""
    reader = self.unit_reader()
    count = [0]
    for shard in self._shards:
      if self._limit and count[0] >= self._limit:
        return
      yield from reader.items(shard, self._limit - count[0] if self._limit else None, count)

  def _generate_examples(self):
    """Streams the shards through the validating worker pool; skips go to the report."""
    yield from _common.run_conversion(self, self._items(), self.report, self._num_workers)


class ShardReader:
  """Reads one tar shard into converter items (picklable: Beam workers run it, tipsito/data/beam_convert.py)."""

  def __init__(self, extra_fields: list[str]):
    """extra_fields: the json fields stored as caption_<field>."""
    self.extra_fields = list(extra_fields)

  def items(self, shard: str, max_samples: int | None = None, counter: list | None = None):
    """(key, image bytes, fields) or ('__skip__', name, reason, detail) per sample of `shard`, at most
    `max_samples` samples; an unreadable tar is one skip naming the shard. counter[0] counts samples."""
    shard_name = os.path.splitext(os.path.basename(shard))[0]
    count = 0
    try:
      for key, parts in iter_samples(shard):  # streamed: a shard is never held in memory
        if max_samples is not None and count >= max_samples:
          return
        count += 1
        if counter is not None:
          counter[0] += 1
        name = f"{shard_name}/{key}"
        try:
          yield (name, *sample_record(name, parts, self.extra_fields))
        except _common.SkipInput as e:
          yield ("__skip__", name, e.reason, e.detail)
    except (tarfile.TarError, OSError, EOFError) as e:
      yield ("__skip__", shard, _common.SKIP_CORRUPT, f"unreadable tar: {e}")

  def unit_items(self, unit: tuple[str, int | None]):
    """The items of one unit of `Webdataset.units()`: (shard, sample cap)."""
    return self.items(*unit)


def sample_record(name: str, parts: dict, extra: list[str]):
  """Validates one sample's members -> (image bytes, fields) or raises SkipInput with the reason."""
  ext = next((e for e in IMAGE_EXTS if e in parts), None)
  if ext is None:  # multi-part extensions such as 'seg.png' / 'webp.png'
    ext = next((e for e in parts if e.rsplit(".", 1)[-1] in IMAGE_EXTS), None)
  image = parts[ext] if ext is not None else None
  if image is None:
    raise _common.SkipInput(_common.SKIP_MISSING_IMAGE, f"members: {sorted(parts)}")
  obj = {}
  if "json" in parts:
    try:
      obj = json.loads(_common.decode_utf8(parts["json"], f"{name}.json"))
    except ValueError as e:
      raise _common.SkipInput(_common.SKIP_BAD_JSON, f"{name}.json: {e}") from None
    if not isinstance(obj, dict):
      raise _common.SkipInput(_common.SKIP_BAD_JSON, f"{name}.json: not an object")
  alt = ""
  if "txt" in parts:
    alt = _common.text_field(parts["txt"], f"{name}.txt")
  if not alt:
    alt = next(
      (
        _common.text_field(obj[k], f"{name}.json[{k}]")
        for k in ALT_TEXT_KEYS
        if isinstance(obj.get(k), str) and obj[k].strip()
      ),
      "",
    )
  if not alt:
    raise _common.SkipInput(_common.SKIP_MISSING_CAPTION, name)
  fields = {"alt_text": alt, "id": name}
  for k in extra:
    v = obj.get(k)
    fields[_common.caption_field(k)] = (
      _common.text_field(v, f"{name}.json[{k}]") if isinstance(v, str) else ""
    )
  return image, fields
