"""TFDS builder `table`: images + a CSV/TSV/JSONL caption table (or an image folder with .txt captions).

Why: the common shape of real image-text data (alt-text + synthetic captions such as PaliGemma or
Gemini captions in extra columns) - converted once into sharded array_record so training reads it
with random access, no TF, and no broken files.

Input (`input_path`):
  * a .csv / .tsv / .tab / .jsonl / .json (JSON lines) table: one column holds the image path
    (`image_column`, default: first of image, image_path, path, file, filename; relative paths are
    resolved against `image_root`, default the table's folder); caption columns (`caption_columns`,
    default: every other column except id/key and the label column) - the FIRST is the alt-text,
    the others become `caption_<column>`; an 'id' or 'key' column is used as the record id;
    `label_column` (optional) becomes a ClassLabel over its sorted distinct values.
  * a directory: every image (png/jpg/jpeg/webp/gif/bmp/tif) with a sidecar `NAME.txt` caption.
Bad inputs are skipped and reported (see `_common.SkipReport`): missing image, zero-byte, corrupt
(fully decoded at conversion), empty caption, non-UTF-8 caption.

Record schema: image (original JPEG/PNG bytes; other formats re-encoded as PNG), alt_text,
caption_<col>..., optional label, id. One split (`split`, default 'train').
"""

from __future__ import annotations

import csv
import io
import json
import os

import tensorflow_datasets as tfds

from tipsito import paths
from tipsito.data.builders import _common

IMAGE_COLUMNS = ("image", "image_path", "path", "file", "filename", "img")
ID_COLUMNS = ("id", "key")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")


def read_table(path: str) -> tuple[list[str], list[dict]]:
  """Reads a CSV/TSV/JSONL file into (columns, rows) without failing on bad bytes.

  Non-UTF-8 bytes are kept as surrogate escapes, so only the affected row is skipped later
  (`_common.text_field` detects them), not the whole table.
  """
  with paths.open_binary(path) as f:
    raw = f.read()
  text = raw.decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
  ext = os.path.splitext(path)[1].lower()
  if ext in (".jsonl", ".json", ".ndjson"):
    columns: list[str] = []
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
        if not isinstance(obj, dict):
          raise ValueError("not an object")
      except ValueError as e:
        rows.append({"__error__": (_common.SKIP_BAD_JSON, f"line {lineno}: {e}")})
        continue
      for k in obj:
        if k not in columns:
          columns.append(k)
      rows.append(obj)
    return columns, rows
  delimiter = "\t" if ext in (".tsv", ".tab") else ","
  reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
  rows = list(reader)
  return list(reader.fieldnames or []), rows


class Table(_common.SingleInputSplit, tfds.core.GeneratorBasedBuilder):
  """Caption-table / image-folder converter (see module docstring)."""

  VERSION = tfds.core.Version("1.0.0")

  def __init__(
    self,
    *,
    input_path: str | None = None,
    image_root: str | None = None,
    image_column: str | None = None,
    caption_columns: list[str] | None = None,
    label_column: str | None = None,
    split: str = "train",
    num_workers: int = 1,
    limit: int | None = None,
    **kwargs,
  ):
    """input_path None = reading an existing dataset; else reads the table now (its columns set the features)."""
    self._input_path = input_path
    self._split = split
    self._num_workers = num_workers
    self._limit = limit
    self._label_column = label_column
    self._label_names = None
    self._caption_columns: list[str] = []
    self._rows: list[dict] = []
    self._image_column = image_column
    self._image_root = image_root
    self.report = _common.SkipReport(self.name)
    if input_path is not None:
      self._scan(input_path, caption_columns)
    super().__init__(**kwargs)

  def _scan(self, input_path: str, caption_columns):
    """Reads the table (or lists the folder) up front: the feature set depends on its columns."""
    if paths.isdir(input_path):
      self._caption_columns = ["alt_text"]
      self._image_root = self._image_root or input_path
      return
    if not paths.isfile(input_path):
      raise FileNotFoundError(f"{self.name}: input {input_path!r} not found")
    columns, self._rows = read_table(input_path)
    self._image_root = self._image_root or os.path.dirname(paths.resolve(input_path))
    if self._image_column is None:
      found = [c for c in IMAGE_COLUMNS if c in columns]
      if not found:
        raise ValueError(
          f"{self.name}: no image column in {input_path!r} (columns {columns}); "
          f"expected one of {IMAGE_COLUMNS} or pass --image_column"
        )
      self._image_column = found[0]
    if caption_columns:
      missing = [c for c in caption_columns if c not in columns]
      if missing:
        raise ValueError(f"{self.name}: caption columns {missing} not in {input_path!r} (columns {columns})")
      self._caption_columns = list(caption_columns)
    else:
      skip = {self._image_column, self._label_column, *ID_COLUMNS}
      self._caption_columns = [c for c in columns if c not in skip]
    if not self._caption_columns:
      raise ValueError(f"{self.name}: no caption column in {input_path!r} (columns {columns})")
    if self._label_column:
      if self._label_column not in columns:
        raise ValueError(f"{self.name}: label column {self._label_column!r} not in {columns}")
      values = {str(r.get(self._label_column, "")).strip() for r in self._rows if "__error__" not in r}
      self._label_names = sorted(v for v in values if v)

  def _info(self) -> tfds.core.DatasetInfo:
    """Features from the table columns; None when reading (restored from features.json)."""
    features = None  # reading an existing dataset: features are restored from its features.json
    if self._input_path is not None:
      features = _common.make_features(
        [_common.caption_field(c) for c in self._caption_columns[1:]],
        label_names=self._label_names,
        image_format=None,
      )
    return self.dataset_info_from_configs(description=__doc__, features=features)

  def split_size_estimates(self) -> dict[str, int]:
    """Upper bound of examples per split (inputs before skipping), to choose the number of shards."""
    if self._input_path is None:
      return {}
    n = len(self._folder_files()) if paths.isdir(self._input_path) else len(self._rows)
    return {self._split: min(n, self._limit) if self._limit else n}

  def _folder_files(self) -> list[str]:
    """Image-folder mode: every image under the folder (local or gs://), sorted."""
    if paths.is_url(self._input_path):  # epath refuses recursive globs on GCS; walk lists each folder once
      base = paths.resolve(self._input_path)
      bare = base.split("://", 1)[1]  # walk's folders come back without the scheme
      files = []
      for root, _, names in paths.as_path(base).walk():
        sub = os.fspath(root).split("://", 1)[-1][len(bare) :].strip("/")
        files += [
          "/".join(x for x in (base, sub, n) if x) for n in names if n.lower().endswith(IMAGE_EXTENSIONS)
        ]
    else:
      files = [
        os.path.join(root, n)
        for root, _, names in os.walk(self._input_path)
        for n in names
        if n.lower().endswith(IMAGE_EXTENSIONS)
      ]
    files.sort()
    return files[: self._limit] if self._limit else files

  def unit_reader(self) -> "RowReader":
    """The picklable reader of a unit of work (tipsito/data/beam_convert.py)."""
    return RowReader(
      input_dir=self._input_path if paths.isdir(self._input_path) else None,
      image_column=self._image_column,
      image_root=self._image_root,
      caption_columns=self._caption_columns,
      label_column=self._label_column,
      label_names=self._label_names,
    )

  def units(self, rows_per_unit: int = 10000) -> list[tuple[int, list]]:
    """The units of work in input order: (index of the first row / file, its rows / file paths)."""
    inputs = (
      self._folder_files()
      if paths.isdir(self._input_path)
      else (self._rows[: self._limit] if self._limit else self._rows)
    )
    return [(i, inputs[i : i + rows_per_unit]) for i in range(0, len(inputs), rows_per_unit)]

  def _items(self):
    """(key, image path, fields) per input, or ('__skip__', name, reason, detail)."""
    reader = self.unit_reader()
    for unit in self.units():
      yield from reader.unit_items(unit)

  def _generate_examples(self):
    """Rows through the validating worker pool; skips go to the report."""
    yield from _common.run_conversion(self, self._items(), self.report, self._num_workers)


class RowReader:
  """Turns table rows (or folder images) into converter items; picklable, so that a Beam worker
  converts one unit (a range of rows) on its own (tipsito/data/beam_convert.py)."""

  def __init__(self, *, input_dir, image_column, image_root, caption_columns, label_column, label_names):
    """input_dir: the image folder (folder mode) or None (table mode); the rest as `Table` found them."""
    self.input_dir = input_dir
    self.image_column = image_column
    self.image_root = image_root
    self.caption_columns = list(caption_columns)
    self.label_column = label_column
    self.label_names = label_names

  def unit_items(self, unit: tuple[int, list]):
    """Items of one unit (first index, rows or files), in order."""
    start, inputs = unit
    if self.input_dir is not None:
      for path in inputs:
        yield self.file_item(path)
    else:
      for i, row in enumerate(inputs, start):
        yield self.row_item(i, row)

  def row_item(self, i: int, row: dict):
    """(key, image path, fields) of table row `i`, or ('__skip__', name, reason, detail)."""
    alt_col, extra = self.caption_columns[0], self.caption_columns[1:]
    if "__error__" in row:
      return ("__skip__", f"row {i}", *row["__error__"])
    image = str(row.get(self.image_column) or "").strip()
    name = image or f"row {i}"
    rid = str(next((row[c] for c in ID_COLUMNS if row.get(c) not in (None, "")), "") or "")
    if not image:
      return ("__skip__", name, _common.SKIP_MISSING_IMAGE, f"row {i}: empty {self.image_column!r}")
    try:
      fields = {"alt_text": _common.text_field(row.get(alt_col), f"row {i} column {alt_col!r}")}
      for c in extra:
        fields[_common.caption_field(c)] = _common.text_field(row.get(c), f"row {i} column {c!r}")
      if not fields["alt_text"]:
        raise _common.SkipInput(_common.SKIP_MISSING_CAPTION, f"row {i}: empty {alt_col!r}")
      rid = _common.text_field(rid, f"row {i} id") or f"{i:08d}-{os.path.basename(image)}"
      fields["id"] = rid
      if self.label_names is not None:
        value = str(row.get(self.label_column) or "").strip()
        if not value:
          raise _common.SkipInput("missing label", f"row {i}")
        fields["label"] = self.label_names.index(value)
    except _common.SkipInput as e:
      return ("__skip__", name, e.reason, e.detail)
    absolute = os.path.isabs(image) or paths.is_url(image)
    path = image if absolute else os.path.join(self.image_root, image)
    return (f"{i:08d}", path, fields)

  def file_item(self, path: str):
    """Image-folder mode: (relative path, path, fields) for an image with a non-empty sidecar .txt."""
    rel = (
      os.path.relpath(path, self.input_dir)
      if not paths.is_url(path)
      else path[len(self.input_dir) :].lstrip("/")
    )
    txt = os.path.splitext(path)[0] + ".txt"
    try:
      if not paths.isfile(txt):
        raise _common.SkipInput(_common.SKIP_MISSING_CAPTION, f"no {os.path.basename(txt)}")
      with paths.open_binary(txt) as f:
        raw = f.read()
      lines = _common.decode_utf8(raw, txt).strip().splitlines()
      caption = _common.clean_caption(lines[0]) if lines else ""
      if not caption:
        raise _common.SkipInput(_common.SKIP_MISSING_CAPTION, f"empty {os.path.basename(txt)}")
    except _common.SkipInput as e:
      return ("__skip__", rel, e.reason, e.detail)
    return (rel, path, {"alt_text": caption, "id": os.path.splitext(rel)[0]})
