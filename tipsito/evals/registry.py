"""Evaluator base class, eval-data reading and the `make_evaluator` registry.

Why one module: every evaluator needs the same three things, and they must behave identically so that
numbers are comparable across evals and across training/standalone runs:
  1. records of an eval split (built-in tipsito datasets or any locally prepared TFDS dataset, with
     configurable field names), decoded and resized deterministically;
  2. fixed-size batches padded with a `_valid` mask, so the encoder's jitted functions compile once and
     every example counts exactly once;
  3. thin, shape-checked calls into the `Encoder` interface (`embed_images`, `embed_texts`).

Config (`config.evals.<name>`, a ConfigDict or dict), keys common to all evaluators:
  type: 'zeroshot' | 'retrieval' | 'segmentation' | 'knn'
  dataset: 'shapes' | 'tuxpaint' | 'fashion_mnist' | any TFDS name prepared under data_dir
  split ('test'), data_dir (None = TFDS default), every_steps (0 = only at the end of training),
  batch_size (32), image_size (224), cls_index (0: which CLS token feeds global evals),
  project (apply the export's image projection; default True for cross-modal evals, False for kNN),
  max_examples (None = all), image_key ('image'), label_key ('label'),
  resize ('center_crop' | 'resize'; segmentation defaults to 'resize'), num_pictures (0),
  class_names (None = from the dataset's ClassLabel feature or templates.CLASS_NAMES),
  templates (set name from templates.py or an explicit list; None = dataset default),
  text_batch_size (64), tokenizer (None = demo model; only used for encoders without a tokenizer),
  prepare (True: build a missing built-in dataset), enabled (True), num_workers (4 decode threads).
Evaluator-specific keys are documented in their modules.

Metrics returned by `Evaluator.run(encoder)` are `{'<name>/<metric>': float}` (percentages for
accuracies, recalls and IoUs), so several evaluators can write into one summary without collisions.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import inspect
import io
import math
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from PIL import Image

from tipsito.evals import metrics as metrics_lib
from tipsito.evals import templates as templates_lib

# Evaluator types -> "module:Class", resolved lazily (the evaluator modules import this one).
EVALUATOR_TYPES: dict[str, str] = {
    "zeroshot": "tipsito.evals.zeroshot:ZeroShotEvaluator",
    "retrieval": "tipsito.evals.retrieval:RetrievalEvaluator",
    "segmentation": "tipsito.evals.segmentation:SegmentationEvaluator",
    "knn": "tipsito.evals.knn:KnnEvaluator",
}

COMMON_DEFAULTS: dict[str, Any] = dict(
    type=None,
    dataset=None,
    split="test",
    data_dir=None,
    every_steps=0,
    batch_size=32,
    image_size=224,
    cls_index=0,
    project=True,
    max_examples=None,
    image_key="image",
    label_key="label",
    segmentation_key="segmentation",
    caption_keys=None,
    resize="center_crop",
    num_pictures=0,
    class_names=None,
    templates=None,
    text_batch_size=64,
    tokenizer=None,
    prepare=True,
    enabled=True,
    num_workers=4,
)

# Built-in datasets: registered TFDS builders of tipsito.data.builders.
BUILTIN_DATASETS = ("shapes", "tuxpaint", "fashion_mnist")

# A record source is a random-access sequence (or an iterable) of dict records, for one split.
SourceFn = Callable[[str], Any]


def _to_dict(cfg) -> dict:
  """ConfigDict / Mapping / None -> plain dict (evaluators keep an immutable snapshot)."""
  if cfg is None:
    return {}
  if hasattr(cfg, "to_dict"):
    return cfg.to_dict()
  return dict(cfg)


# ------------------------------------------------------------------------------------------------------
# Records: opening, field access, decoding
# ------------------------------------------------------------------------------------------------------


def get_field(record: Mapping, key: str):
  """Field lookup with '/'-separated paths for nested TFDS features (e.g. 'captions/text')."""
  cur = record
  for part in key.split("/"):
    if not isinstance(cur, Mapping) or part not in cur:
      return None
    cur = cur[part]
  return cur


def as_text(value) -> list[str]:
  """A text field (str, bytes, or a list/array of them) as a list of non-empty strings."""
  if value is None:
    return []
  if isinstance(value, (str, bytes, np.bytes_, np.str_)):
    value = [value]
  items = list(value) if isinstance(value, (list, tuple)) else np.asarray(value, dtype=object).reshape(-1).tolist()
  out = []
  for v in items:
    if isinstance(v, (bytes, np.bytes_)):
      v = bytes(v).decode("utf-8", errors="replace")
    v = str(v).strip()
    if v:
      out.append(v)
  return out


def decode_image(value, *, keep_alpha: bool = False) -> np.ndarray:
  """Encoded bytes or an array -> uint8 (H,W,C) array with C=3 (or 4 when keep_alpha and present).

  Why both: TFDS ArrayRecord sources return decoded arrays, raw readers return PNG/JPEG bytes. Grayscale
  becomes RGB; 16-bit becomes 8-bit; alpha is composited on white unless kept (tuxpaint masks).
  """
  if isinstance(value, (bytes, np.bytes_)):
    with Image.open(io.BytesIO(bytes(value))) as img:
      img.load()
      if img.mode in ("I;16", "I;16B", "I", "F"):
        arr = np.asarray(img, np.float32)
        arr = (arr / max(float(arr.max()), 1.0) * 255.0).round().astype(np.uint8)
        img = Image.fromarray(arr)
      has_alpha = "A" in img.getbands() or "transparency" in img.info
      img = img.convert("RGBA" if has_alpha else "RGB")
      arr = np.asarray(img)
  else:
    arr = np.asarray(value)
    if arr.dtype != np.uint8:
      if np.issubdtype(arr.dtype, np.floating) and arr.max() <= 1.0:
        arr = arr * 255.0
      arr = np.clip(np.round(arr), 0, 255).astype(np.uint8)
    if arr.ndim == 2:
      arr = arr[..., None]
    if arr.shape[-1] == 1:
      arr = np.repeat(arr, 3, axis=-1)
    elif arr.shape[-1] == 2:  # LA
      arr = np.concatenate([np.repeat(arr[..., :1], 3, -1), arr[..., 1:]], -1)
  if arr.shape[-1] == 4 and not keep_alpha:
    arr = composite_on_white(arr)
  return arr


def composite_on_white(rgba: np.ndarray) -> np.ndarray:
  """Alpha-composites an RGBA uint8 image on white (transparent stamps must not turn black)."""
  a = rgba[..., 3:4].astype(np.float32) / 255.0
  rgb = rgba[..., :3].astype(np.float32) * a + 255.0 * (1.0 - a)
  return np.round(rgb).astype(np.uint8)


def decode_mask(value) -> np.ndarray:
  """Encoded PNG bytes or an array -> uint8 (H,W) label map."""
  if isinstance(value, (bytes, np.bytes_)):
    with Image.open(io.BytesIO(bytes(value))) as img:
      arr = np.asarray(img)
  else:
    arr = np.asarray(value)
  if arr.ndim == 3:
    arr = arr[..., 0]
  return arr.astype(np.uint8)


def _resize_array(arr: np.ndarray, size_hw: tuple[int, int], nearest: bool) -> np.ndarray:
  """PIL resize of a uint8 (H,W) or (H,W,C) array to (h,w); bicubic (antialiased) or nearest."""
  h, w = size_hw
  if arr.shape[:2] == (h, w):
    return arr
  resample = Image.NEAREST if nearest else Image.BICUBIC
  if arr.ndim == 3 and arr.shape[-1] not in (3, 4):
    return np.stack([_resize_array(arr[..., c], size_hw, nearest) for c in range(arr.shape[-1])], -1)
  return np.asarray(Image.fromarray(arr).resize((w, h), resample=resample))


def resize_pair(image: np.ndarray, mask: np.ndarray | None, size: int | Sequence[int], mode: str):
  """Resizes an image (and its mask, with nearest) to a fixed (S,S) by `mode`.

  'resize': squash to SxS (keeps all content; the usual zero-shot segmentation pre-processing at a
  fixed size). 'center_crop': shorter side to S then centre crop (classification/retrieval standard).
  """
  if isinstance(size, (int, np.integer)):
    size = (int(size), int(size))
  th, tw = int(size[0]), int(size[1])
  if mode == "resize":
    out = _resize_array(image, (th, tw), nearest=False)
    m = None if mask is None else _resize_array(mask, (th, tw), nearest=True)
    return out, m
  if mode == "center_crop":
    h, w = image.shape[:2]
    scale = max(th / h, tw / w)
    nh, nw = max(th, int(round(h * scale))), max(tw, int(round(w * scale)))
    img = _resize_array(image, (nh, nw), nearest=False)
    m = None if mask is None else _resize_array(mask, (nh, nw), nearest=True)
    top, left = (nh - th) // 2, (nw - tw) // 2
    img = img[top:top + th, left:left + tw]
    m = None if m is None else m[top:top + th, left:left + tw]
    return img, m
  raise ValueError(f"unknown resize mode {mode!r} (use 'resize' or 'center_crop')")


def open_tfds(name: str, split: str, data_dir: str | None = None):
  """Opens a locally prepared TFDS dataset split: random access (ArrayRecord) or a re-iterable stream.

  Never downloads or builds: a missing dataset is an error saying where it was looked for.
  Returns (source, builder).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:  # tipsito's data code installs a small importlib_resources shim TFDS 4.9 needs on Python 3.11
    importlib.import_module("tipsito.data.builders._common")
  except ImportError:
    pass

  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except  # tfds' DatasetNotFoundError and friends
    if type(e).__name__ != "DatasetNotFoundError":
      raise
    raise FileNotFoundError(f"dataset {name!r} not found (data_dir={data_dir!r}): neither a tipsito "
                            "dataset nor a prepared TFDS dataset; evaluations never download") from None
  if not _is_prepared(builder):
    raise FileNotFoundError(
        f"TFDS dataset {name!r} is not prepared under {builder.data_dir!r}; build it first "
        "(evaluations never download)")
  try:
    return builder.as_data_source(split=split), builder
  except Exception:  # pylint: disable=broad-except  # not ArrayRecord (e.g. TFRecord): stream it
    ds = builder.as_dataset(split=split, shuffle_files=False)
    return _NumpyIterable(ds), builder


def _is_prepared(builder) -> bool:
  """Whether a TFDS builder's data exist (older builders lack is_prepared: look for dataset_info)."""
  try:
    return bool(builder.is_prepared())
  except Exception:  # pylint: disable=broad-except
    return os.path.exists(os.path.join(builder.data_dir, "dataset_info.json"))


class _NumpyIterable:
  """Re-iterable numpy view of a tf.data dataset (each iteration restarts from the first record)."""

  def __init__(self, ds):
    self._ds = ds

  def __iter__(self):
    """A fresh numpy iterator over the whole split."""
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    return iter(tfds.as_numpy(self._ds))


def _default_data_dir(data_dir: str | None) -> str:
  """The data_dir tipsito.data.sources uses when none is configured."""
  return data_dir or os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


def open_records(dataset: str, split: str, data_dir: str | None = None, prepare: bool = True, *,
                 image_key: str = "image", label_key: str | None = "label",
                 segmentation_key: str | None = "segmentation"):
  """Opens eval records of `dataset`/`split`; returns (source, class_names or None).

  Order: tipsito's own reader (`tipsito.data.sources.open_source`, tipsito record schema, encoded
  images; a missing built-in dataset is built first with `tipsito.data.convert` when `prepare`), then
  plain TFDS for any other locally prepared dataset (other field names, decoded images).
  """
  base = templates_lib.base_name(dataset)
  try:
    sources = importlib.import_module("tipsito.data.sources")
  except ImportError:
    sources = None
  if sources is not None:
    data_cfg = dict(name=dataset, split=split, data_dir=_default_data_dir(data_dir), image_key=image_key,
                    alt_text_key="alt_text", caption_keys=None, label_key=label_key,
                    segmentation_key=segmentation_key)
    for attempt in range(2):
      try:
        try:
          src, info = sources.open_source(data_cfg, split=split)
        except KeyError:
          if not data_cfg["label_key"]:
            raise
          data_cfg["label_key"] = None  # dataset without labels (retrieval-only data)
          src, info = sources.open_source(data_cfg, split=split)
        names = list(info.label_names) if getattr(info, "label_names", None) else None
        return src, names
      except FileNotFoundError:
        named_config = "/" in dataset.split(":")[0]  # e.g. 'shapes/tiny': built by the user, not here
        if attempt == 0 and prepare and base in BUILTIN_DATASETS and not named_config:
          _build_builtin(dataset, _default_data_dir(data_dir))
          continue
        if base in BUILTIN_DATASETS:
          raise
        break  # not a tipsito dataset directory: try TFDS' own catalogue below
      except (KeyError, ValueError):
        break  # different schema (e.g. no alt_text): read through TFDS with configured keys
  src, builder = open_tfds(dataset, split, data_dir)
  return src, _class_names_from(builder, label_key or "label")


def _build_builtin(dataset: str, data_dir: str) -> None:
  """Builds a missing built-in dataset (default config) locally: no downloads; shapes is procedural,
  tuxpaint / fashion_mnist read Debian packages."""
  from tipsito.data import convert  # pylint: disable=g-import-not-at-top
  convert.convert(templates_lib.base_name(dataset), data_dir, verbose=True)


def _class_names_from(obj, label_key: str = "label") -> list[str] | None:
  """ClassLabel names from a TFDS builder / source (if it exposes dataset info)."""
  info = getattr(obj, "info", None) or getattr(obj, "dataset_info", None)
  try:
    feat = info.features[label_key]
    names = list(feat.names)
    return names or None
  except Exception:  # pylint: disable=broad-except
    return None


def subset_indices(n: int, max_examples: int | None) -> np.ndarray:
  """Indices of a deterministic, evenly spread subset of size min(n, max_examples).

  Why spread and not the first k: datasets stored in class order (tuxpaint folders) would otherwise give
  a one-class "subset"; a fixed stride keeps every run on the same examples.
  """
  if max_examples is None or int(max_examples) >= n:
    return np.arange(n)
  k = max(0, int(max_examples))
  return np.floor(np.arange(k) * (n / k)).astype(np.int64) if k else np.zeros((0,), np.int64)


def iterate_source(source, max_examples: int | None = None) -> Iterator[Mapping]:
  """Yields records of a random-access source (an evenly spread subset when max_examples < len), or
  the first max_examples records of a stream."""
  if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
    for i in subset_indices(len(source), max_examples):
      yield source[int(i)]
  else:
    for i, rec in enumerate(source):
      if max_examples is not None and i >= int(max_examples):
        return
      yield rec


def pad_batch(examples: list[dict], batch_size: int) -> dict:
  """Stacks per-example numpy fields into a batch of exactly batch_size with a `_valid` mask.

  Padding repeats zeros of the same shape/dtype (non-array fields such as caption lists pad with []),
  so every batch has identical shapes and padded rows are marked invalid.
  """
  n = len(examples)
  if n == 0 or n > batch_size:
    raise ValueError(f"cannot pad {n} examples to batch size {batch_size}")
  out: dict[str, Any] = {}
  for key in examples[0]:
    vals = [ex[key] for ex in examples]
    if isinstance(vals[0], np.ndarray) or np.isscalar(vals[0]):
      arr = np.stack([np.asarray(v) for v in vals])
      if n < batch_size:
        arr = np.concatenate([arr, np.zeros((batch_size - n,) + arr.shape[1:], arr.dtype)], axis=0)
      out[key] = arr
    else:
      out[key] = list(vals) + [type(vals[0])() for _ in range(batch_size - n)]
  out["_valid"] = np.arange(batch_size) < n
  return out


# ------------------------------------------------------------------------------------------------------
# Evaluator base
# ------------------------------------------------------------------------------------------------------


class Evaluator:
  """Base class: configuration, eval data and encoder calls shared by all evaluators.

  Subclasses set `TYPE`, `DEFAULTS` (their specific keys) and implement `run(encoder)`. `pictures` is a
  dict name -> uint8 (H,W,3) array filled by the last `run` when `num_pictures > 0`.
  """

  TYPE = ""
  DEFAULTS: dict[str, Any] = {}
  NEEDS_MASKS = False  # segmentation masks are only read (and decoded) by evaluators that use them

  def __init__(self, name: str, cfg=None, *, source_fn: SourceFn | None = None,
               class_names: Sequence[str] | None = None):
    self.name = str(name)
    merged = dict(COMMON_DEFAULTS)
    merged.update(self.DEFAULTS)
    given = _to_dict(cfg)
    unknown = set(given) - set(merged)
    if unknown:
      raise KeyError(f"eval {self.name!r}: unknown config keys {sorted(unknown)}")
    merged.update({k: v for k, v in given.items()})
    self.cfg = merged
    if not merged.get("dataset") and source_fn is None:
      raise ValueError(f"eval {self.name!r}: config needs a 'dataset'")
    self._source_fn = source_fn
    self._class_names_override = list(class_names) if class_names is not None else None
    self._sources: dict[str, tuple[Any, list[str] | None]] = {}
    self.pictures: dict[str, np.ndarray] = {}
    self._tokenizer = None

  # -------------------------------------------------------------------- scheduling / config helpers
  def should_run(self, step: int, *, is_last: bool = False) -> bool:
    """True at multiples of every_steps (>0) and always at the last step (final report)."""
    every = int(self.cfg.get("every_steps") or 0)
    return bool(is_last or (every > 0 and step > 0 and step % every == 0))

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.name!r}, dataset={self.cfg.get('dataset')!r})"

  def key(self, metric: str) -> str:
    """Namespaced metric key '<eval name>/<metric>'."""
    return f"{self.name}/{metric}"

  # -------------------------------------------------------------------- data
  def source(self, split: str | None = None):
    """The record source of a split (cached per evaluator; TFDS opening is not free)."""
    split = split or self.cfg["split"]
    if split not in self._sources:
      if self._source_fn is not None:
        src = self._source_fn(split)
        self._sources[split] = (src, _class_names_from(src, self.cfg["label_key"]))
      else:
        self._sources[split] = open_records(
            self.cfg["dataset"], split, self.cfg["data_dir"], self.cfg["prepare"],
            image_key=self.cfg["image_key"], label_key=self.cfg["label_key"],
            segmentation_key=self.cfg["segmentation_key"] if self.NEEDS_MASKS else None)
    return self._sources[split][0]

  def class_names(self) -> list[str]:
    """Class names: config > constructor override > curated names of a built-in dataset
    (templates.class_names_for) > the dataset's ClassLabel names ('_' -> ' ')."""
    if self.cfg.get("class_names"):
      return [str(c) for c in self.cfg["class_names"]]
    if self._class_names_override:
      return self._class_names_override
    curated = templates_lib.class_names_for(self.cfg.get("dataset"))
    if curated:
      return list(curated)
    self.source()
    names = self._sources[self.cfg["split"]][1]
    if names:
      return [n.replace("_", " ") for n in names]
    raise ValueError(f"eval {self.name!r}: no class names (set config.evals.{self.name}.class_names)")

  def templates(self, default: str | None = None) -> tuple[str, ...]:
    """Prompt templates from the config (or the dataset / evaluator default)."""
    spec = self.cfg.get("templates")
    if (spec is None and default is not None
        and templates_lib.base_name(self.cfg.get("dataset")) not in templates_lib.DEFAULT_TEMPLATES):
      spec = default
    return templates_lib.get_templates(spec, self.cfg.get("dataset"))

  def preprocess(self, record: Mapping, *, need_label=False, need_mask=False, need_captions=False,
                 resize: str | None = None, image_size=None) -> dict:
    """Decodes and resizes one record into the fields an evaluator asked for.

    Subclasses override `extra_fields` to add derived fields (e.g. masks from alpha).
    """
    cfg = self.cfg
    ex: dict[str, Any] = {}
    raw_img = get_field(record, cfg["image_key"])
    if raw_img is None:
      raise KeyError(f"record has no image field {cfg['image_key']!r} (keys: {sorted(record)})")
    img = decode_image(raw_img, keep_alpha=need_mask)
    mask = None
    if need_mask:
      mask = self.make_mask(record, img)
      if img.shape[-1] == 4:
        img = composite_on_white(img)
    img, mask = resize_pair(img, mask, image_size or cfg["image_size"], resize or cfg["resize"])
    ex["image"] = np.ascontiguousarray(img)
    if need_mask:
      ex["segmentation"] = np.ascontiguousarray(mask)
    if need_label:
      lab = get_field(record, cfg["label_key"])
      if lab is None:
        raise KeyError(f"record has no label field {cfg['label_key']!r}")
      ex["label"] = np.int32(int(np.asarray(lab).reshape(-1)[0]))
    if need_captions:
      ex["captions"] = self.captions_of(record)
    return ex

  def make_mask(self, record: Mapping, image: np.ndarray) -> np.ndarray:
    """The GT label map of a record (segmentation evaluator overrides it for alpha masks)."""
    raw = get_field(record, self.cfg["segmentation_key"])
    if raw is None:
      raise KeyError(f"record has no segmentation field {self.cfg['segmentation_key']!r}")
    return decode_mask(raw)

  def captions_of(self, record: Mapping) -> list[str]:
    """All captions of a record: configured keys, or 'alt_text' plus every 'caption_*' field."""
    keys = self.cfg.get("caption_keys")
    if not keys:
      keys = ["alt_text"] + sorted(k for k in record if str(k).startswith("caption_"))
    caps: list[str] = []
    for k in keys:
      for c in as_text(get_field(record, k)):
        if c not in caps:
          caps.append(c)
    return caps

  def batches(self, split: str | None = None, *, max_examples: int | None = None, **pre_kw
              ) -> Iterator[dict]:
    """Padded fixed-size batches of preprocessed examples (with `_valid`), in dataset order.

    Decoding runs in a small thread pool (PIL releases the GIL), preserving order.
    """
    bs = int(self.cfg["batch_size"])
    if max_examples is None:
      max_examples = self.cfg.get("max_examples")
    records = iterate_source(self.source(split), max_examples)
    workers = max(1, int(self.cfg.get("num_workers") or 1))

    def chunks(it: Iterable, n: int):
      """Groups records into lists of n (the last one shorter)."""
      buf = []
      for r in it:
        buf.append(r)
        if len(buf) == n:
          yield buf
          buf = []
      if buf:
        yield buf

    fn = lambda r: self.preprocess(r, **pre_kw)
    if workers == 1:
      for recs in chunks(records, bs):
        yield pad_batch([fn(r) for r in recs], bs)
      return
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      for recs in chunks(records, bs):
        yield pad_batch(list(pool.map(fn, recs)), bs)

  # -------------------------------------------------------------------- encoder calls
  def embed_images(self, encoder, images: np.ndarray, *, project: bool | None = None,
                   need_values: bool = False) -> dict[str, np.ndarray]:
    """Runs the image tower on one fixed-size batch; returns numpy cls (B,n_cls,D), patches, values."""
    if project is None:
      project = bool(self.cfg["project"])

    def embed(rows):
      if _accepts_kwarg(encoder.embed_images, "values"):  # skip the value pass when it is not needed
        out = encoder.embed_images(rows, project=project, values=need_values)
      else:
        out = encoder.embed_images(rows, project=project)
      return {k: np.asarray(v, np.float32) for k, v in out.items() if v is not None}

    res = over_processes(embed, images)
    if res["cls"].ndim == 2:
      res["cls"] = res["cls"][:, None]
    if need_values and "values" not in res:
      raise KeyError("encoder.embed_images returned no 'values' (needed by zero-shot segmentation)")
    return res

  def cls_features(self, out: Mapping[str, np.ndarray]) -> np.ndarray:
    """The configured CLS token (cls_index), L2-normalised, (B, D)."""
    cls = out["cls"]
    idx = int(self.cfg["cls_index"])
    if idx >= cls.shape[1]:
      raise ValueError(f"eval {self.name!r}: cls_index {idx} but the encoder has {cls.shape[1]} CLS tokens")
    return metrics_lib.l2_normalize(cls[:, idx].astype(np.float32))

  def embed_texts(self, encoder, texts: Sequence[str]) -> np.ndarray:
    """L2-normalised text embeddings (N, D), computed in fixed-size chunks (one compile)."""
    texts = list(texts)
    bs = int(self.cfg["text_batch_size"])
    out = []
    for start in range(0, len(texts), bs):
      chunk = texts[start:start + bs]
      n = len(chunk)
      chunk = chunk + [chunk[-1]] * (bs - n)  # repeat (not ''): padding never produces NaNs
      emb = over_processes(
          lambda rows: np.asarray(encoder.embed_texts(self._text_input(encoder, rows)), np.float32),
          chunk)[:n]
      out.append(emb)
    emb = np.concatenate(out, 0) if out else np.zeros((0, 0), np.float32)
    return metrics_lib.l2_normalize(emb)

  def _text_input(self, encoder, texts: list[str]):
    """Strings for encoders with a tokenizer; else token ids from the configured tokenizer.

    Why: an export made without --tokenizer (e.g. imported TIPS weights) embeds ids only; evals then
    tokenize with `tokenizer` (None = the shipped demo model) and check the ids fit the text vocab.
    """
    if getattr(encoder, "tokenizer", "n/a") is not None:
      return texts
    if self._tokenizer is None:
      from tipsito.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
      text_cfg = getattr(encoder, "text_config", None) or {}
      self._tokenizer = Tokenizer(self.cfg.get("tokenizer"), max_len=int(text_cfg.get("max_len", 64)))
      vocab = text_cfg.get("vocab_size")
      if vocab is not None and self._tokenizer.vocab_size > int(vocab):
        raise ValueError(f"eval {self.name!r}: tokenizer vocab {self._tokenizer.vocab_size} exceeds the "
                         f"text encoder's {vocab}; set the eval's 'tokenizer'")
    return self._tokenizer.tokenize(texts)

  def class_text_embeddings(self, encoder, class_names: Sequence[str], templates: Sequence[str]
                            ) -> np.ndarray:
    """Per-class text embedding: prompts embedded, normalised, averaged over templates, renormalised."""
    prompts = templates_lib.fill(templates, class_names)
    emb = self.embed_texts(encoder, prompts).reshape(len(class_names), len(templates), -1)
    return metrics_lib.l2_normalize(emb.mean(axis=1))

  def run(self, encoder) -> dict[str, float]:  # pragma: no cover - abstract
    """Evaluates `encoder`; returns {'<name>/<metric>': value}."""
    raise NotImplementedError

  # -------------------------------------------------------------------- pictures
  def _collect_pca(self, out: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]) -> None:
    """Stores PCA maps of the first `num_pictures` valid images of a batch (TIPSv2 Fig. 5 style)."""
    n = int(self.cfg.get("num_pictures") or 0)
    if n <= 0 or f"{self.name}/pca" in self.pictures:
      return
    from tipsito.evals import pictures as pictures_lib  # pylint: disable=g-import-not-at-top
    k = int(min(n, int(np.sum(batch["_valid"]))))
    if k == 0 or "patches" not in out:
      return
    maps = pictures_lib.pca_rgb(out["patches"][:k], joint=False)
    images = batch["image"][:k]
    self.pictures[f"{self.name}/pca"] = pictures_lib.pca_grid(images, maps)


def _accepts_kwarg(fn, name: str) -> bool:
  """Whether a callable takes keyword `name` (the Encoder's optional `values=` switch)."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def make_evaluator(name: str, cfg, **kwargs) -> Evaluator:
  """Builds the evaluator of `cfg.type` ('zeroshot'|'retrieval'|'segmentation'|'knn')."""
  typ = _to_dict(cfg).get("type")
  if typ not in EVALUATOR_TYPES:
    raise KeyError(f"eval {name!r}: unknown type {typ!r}; known: {sorted(EVALUATOR_TYPES)}")
  module_name, cls_name = EVALUATOR_TYPES[typ].split(":")
  cls = getattr(importlib.import_module(module_name), cls_name)
  return cls(name, cfg, **kwargs)


# Which evals each built-in dataset supports, and the split each reads (tuxpaint has only 'train').
BUILTIN_SUITES: dict[str, dict[str, dict[str, Any]]] = {
    "shapes": {
        "zeroshot": dict(split="test"),
        "retrieval": dict(split="test"),
        "segmentation": dict(split="test"),
        "knn": dict(split="test", train_split="train"),
    },
    "tuxpaint": {
        "zeroshot": dict(split="train"),
        "retrieval": dict(split="train"),
        "segmentation": dict(split="train"),
    },
    "fashion_mnist": {
        "zeroshot": dict(split="test"),
        "knn": dict(split="test", train_split="train", max_train_examples=10000),
    },
}


def builtin_evals(dataset: str = "shapes", *, types: Sequence[str] | None = None, data_dir: str | None = None,
                  image_size: int = 224, batch_size: int = 32, every_steps: int = 0,
                  max_examples: int | None = None, num_pictures: int = 4, cls_index: int = 0,
                  **overrides) -> dict[str, dict]:
  """The standard eval suite of a built-in dataset as `config.evals` entries named '<dataset>_<type>'.

  Why here: training configs (periodic evals) and eval configs (standalone) share one definition, so
  the same name means the same protocol everywhere. `dataset` may name a config ('shapes/tiny');
  `overrides` apply to every entry (e.g. tokenizer=...).
  """
  base = templates_lib.base_name(dataset)
  if base not in BUILTIN_SUITES:
    raise KeyError(f"no built-in eval suite for {dataset!r}; known: {sorted(BUILTIN_SUITES)}")
  suite = BUILTIN_SUITES[base]
  out = {}
  for typ, spec in suite.items():
    if types is not None and typ not in types:
      continue
    cfg = dict(type=typ, dataset=dataset, data_dir=data_dir, image_size=image_size,
               batch_size=batch_size, every_steps=every_steps, max_examples=max_examples,
               num_pictures=num_pictures if typ == "segmentation" else 0, cls_index=cls_index)
    cfg.update(spec)
    if typ == "knn" and max_examples is not None:
      cfg["max_train_examples"] = min(int(spec.get("max_train_examples", 10 ** 9)), 4 * int(max_examples))
    cfg.update(overrides)
    out[f"{base}_{typ}"] = cfg
  return out


def make_evaluators(config) -> dict[str, Evaluator]:
  """All enabled evaluators of `config.evals` (a top-level config or the evals dict itself)."""
  evals = getattr(config, "evals", None) if not isinstance(config, Mapping) else config.get("evals", None)
  if evals is None:
    evals = config
  evals = _to_dict(evals)
  out = {}
  for name in sorted(evals):
    cfg = _to_dict(evals[name])
    if cfg.get("enabled", True) is False:
      continue
    out[name] = make_evaluator(name, cfg)
  return out


def over_processes(fn: Callable[[Any], Any], rows):
  """`fn(rows)` computed with the rows split over all JAX processes; every process gets the whole result.

  Why: on a pod every host runs the same evaluator on the same batches; each encodes only its own
  contiguous slice (padded by repeating the last row) and `multihost_utils.process_allgather` puts the
  rows back in order, so the numbers equal a one-process run while each host does 1/N of the work.
  `fn` maps a list/array of B rows to an array or a dict of arrays with leading dim B. Every process must
  call this the same number of times (it is a collective); one process just calls `fn`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  count = jax.process_count()
  if count == 1:
    return fn(rows)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  n = len(rows)
  per = -(-n // count)
  lo = jax.process_index() * per
  mine = [rows[min(i, n - 1)] for i in range(lo, lo + per)]
  if isinstance(rows, np.ndarray):
    mine = np.stack(mine)
  out = multihost_utils.process_allgather(fn(mine), tiled=True)
  return jax.tree.map(lambda a: np.asarray(a)[:n], out)


def run_evaluators(evaluators: Mapping[str, Evaluator] | Sequence[Evaluator], encoder, *, step: int = 0,
                   writer=None, picture_dir: str | None = None, only_due: bool = False,
                   is_last: bool = False, log: Callable[[str], None] | None = None) -> dict[str, float]:
  """Runs evaluators, merges their metrics, and writes scalars/pictures (the training-loop hook).

  writer: a clu metric writer (write_scalars / write_images), optional.
  picture_dir: PNG output folder for pictures, optional.
  only_due: run only evaluators whose `should_run(step, is_last=is_last)` is True.
  """
  evs = list(evaluators.values()) if isinstance(evaluators, Mapping) else list(evaluators)
  results: dict[str, float] = {}
  pics: dict[str, np.ndarray] = {}
  for ev in evs:
    if only_due and not ev.should_run(step, is_last=is_last):
      continue
    res = ev.run(encoder)
    results.update(res)
    pics.update(ev.pictures)
    if log is not None:
      log(f"eval {ev.name} @ step {step}: " + ", ".join(f"{k.split('/', 1)[-1]}={v:.2f}"
                                                       for k, v in res.items()))
  if writer is not None and results:
    writer.write_scalars(step, {k: v for k, v in results.items() if np.isfinite(v)})
  if pics:
    from tipsito.evals import pictures as pictures_lib  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    # Every process computes the same pictures; only process 0 writes PNGs (shared file systems).
    pictures_lib.write_pictures(pics, step=step, writer=writer,
                                directory=picture_dir if jax.process_index() == 0 else None)
  if writer is not None:
    try:
      writer.flush()
    except Exception:  # pylint: disable=broad-except
      pass
  return results


def pct(x: float) -> float:
  """Fraction -> percentage, keeping NaN (no examples) visible."""
  return float(x) * 100.0 if x == x else float("nan")


def finite_or_nan(x) -> float:
  """float(x), mapping inf to NaN (JSON-safe summaries)."""
  x = float(x)
  return x if math.isfinite(x) else float("nan")
