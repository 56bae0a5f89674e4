"""Evaluation input: the records of an eval split as fixed-size, padded, masked batches.

Why one module, in `tipsito/data`: every evaluator (and training's periodic evals and the standalone
`tipsito.evaluate`) must see the same pixels, so that a number means the same thing everywhere. Images are
opened and decoded by the training decoder (`transforms.open_image` / `load_rgb`, full resolution, no JPEG
draft) and resized by the one deterministic resize (`transforms.fixed_resize`, also used by training with
`input.augment='none'`). Batches have a fixed size, so the encoder's jitted functions compile once, and a
`_valid` mask, so every example counts exactly once. The zero-shot segmentation benchmarks instead resize
the short side keeping the aspect ratio and score at the label map's own size (`resize='short_side'`);
those examples are read one by one (`eval_examples`).

Why not the grain training pipeline: an eval split may be any prepared TFDS dataset, including TFRecord
streams without random access; an evaluation is one ordered pass with no RNG, no shuffling and no resume
state; and on several hosts every process reads the same batches (each host encodes a slice of every
batch, `tipsito.evals.evaluator.over_processes`), so there is nothing to shard. A small thread pool
decodes in order (PIL releases the GIL).

Records: built-in tipsito datasets are read with `tipsito.data.sources.open_source` (encoded images;
a missing built-in dataset is built first), any other locally prepared TFDS dataset through TFDS with
configurable field names ('/'-separated for nested features, e.g. 'captions/text'). Nothing is downloaded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import os
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
from PIL import Image

from tipsito import choices
from tipsito.data import batch as batch_lib
from tipsito.data import conversion
from tipsito.data import sources
from tipsito.data import transforms as T

# Eval images are whatever the dataset holds: keep the pixel caps (decompression-bomb guard) but accept
# thin or tiny images that training would skip, since an evaluation must count every example.
EVAL_LIMITS = T.ImageLimits(min_side=1, max_aspect=float('inf'))

# `MaskSpec.source` and `EvalFields.resize` modes, declared in the leaf tipsito/choices.py (the config
# schema checks them without importing this module): resize is one of the two fixed-size modes of
# `transforms.fixed_resize` (image and label map resized together to (S, S)), or 'short_side' (zero-shot
# segmentation benchmarks: the image's short side to S keeping the aspect ratio, the label map left at
# its original size; see `short_side_size`). tests/test_eval_config_validation.py checks they agree.
MASK_SOURCES = choices.MASK_SOURCES
RESIZE_MODES = choices.RESIZE_MODES


# --------------------------------------------------------------------------------------------
# Opening an eval split
# --------------------------------------------------------------------------------------------


def open_records(
  dataset: str,
  split: str,
  data_dir: str | None = None,
  prepare: bool = True,
  *,
  image_key: str = 'image',
  label_key: str | None = 'label',
  segmentation_key: str | None = 'segmentation',
):
  """Opens eval records of `dataset`/`split`; returns (source, class_names or None).

  Order: tipsito's own reader (tipsito record schema, encoded images; a missing built-in dataset is built
  first with `tipsito.data.convert` when `prepare`), then plain TFDS for any other locally prepared
  dataset (other field names, decoded images).
  """
  data_dir = data_dir or sources.default_data_dir()
  data_cfg = dict(
    name=dataset,
    split=split,
    data_dir=data_dir,
    image_key=image_key,
    alt_text_key='alt_text',
    caption_keys=None,
    label_key=label_key,
    segmentation_key=segmentation_key,
  )
  builtin = sources.base_name(dataset) in sources.BUILT_IN_CONVERTERS
  for attempt in range(2):
    try:
      src, info = _open_tipsito_source(data_cfg, split)
      return src, (list(info.label_names) if info.label_names else None)
    except FileNotFoundError:
      named_config = '/' in dataset.split(':')[0]  # e.g. 'shapes/tiny': built by the user, not here
      if attempt == 0 and prepare and builtin and not named_config:
        conversion.convert(sources.base_name(dataset), data_dir, verbose=True)  # no downloads (see convert)
        continue
      if builtin:
        raise
      break  # not a tipsito dataset directory: try TFDS' own catalogue below
    except (KeyError, ValueError):
      break  # different schema (e.g. no alt_text): read through TFDS with the configured keys
  src, builder = open_tfds(dataset, split, data_dir)
  return src, class_names_of(builder, label_key or 'label')


def _open_tipsito_source(data_cfg: dict, split: str):
  """`sources.open_source`, retried without a label for label-less (retrieval-only) datasets."""
  try:
    return sources.open_source(data_cfg, split=split)
  except KeyError:
    if not data_cfg['label_key']:
      raise
    data_cfg['label_key'] = None
    return sources.open_source(data_cfg, split=split)


def open_tfds(name: str, split: str, data_dir: str | None = None):
  """Opens a locally prepared TFDS dataset split: random access (ArrayRecord) or a re-iterable stream.

  Never downloads or builds: a missing dataset is an error saying where it was looked for.
  Returns (source, builder).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except  # tfds' DatasetNotFoundError and friends
    if type(e).__name__ != 'DatasetNotFoundError':
      raise
    raise FileNotFoundError(
      f'dataset {name!r} not found (data_dir={data_dir!r}): neither a tipsito '
      'dataset nor a prepared TFDS dataset; evaluations never download'
    ) from None
  if not _is_prepared(builder):
    raise FileNotFoundError(
      f'TFDS dataset {name!r} is not prepared under {builder.data_dir!r}; build it first '
      '(evaluations never download)'
    )
  try:
    return builder.as_data_source(split=split), builder
  except Exception:  # pylint: disable=broad-except  # not ArrayRecord (e.g. TFRecord): stream it
    return _NumpyIterable(builder.as_dataset(split=split, shuffle_files=False)), builder


def _is_prepared(builder) -> bool:
  """Whether a TFDS builder's data exist (older builders lack is_prepared: look for dataset_info)."""
  try:
    return bool(builder.is_prepared())
  except Exception:  # pylint: disable=broad-except
    return os.path.exists(os.path.join(builder.data_dir, 'dataset_info.json'))


class _NumpyIterable:
  """Re-iterable numpy view of a tf.data dataset (each iteration restarts from the first record)."""

  def __init__(self, ds):
    self._ds = ds

  def __iter__(self):
    """A fresh numpy iterator over the whole split."""
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    return iter(tfds.as_numpy(self._ds))


def class_names_of(obj, label_key: str = 'label') -> list[str] | None:
  """ClassLabel names from a TFDS builder / source that exposes dataset info, else None."""
  info = getattr(obj, 'info', None) or getattr(obj, 'dataset_info', None)
  try:
    return list(info.features[label_key].names) or None
  except Exception:  # pylint: disable=broad-except
    return None


# --------------------------------------------------------------------------------------------
# One record -> one eval example
# --------------------------------------------------------------------------------------------


def get_field(record: Mapping, key: str):
  """Field lookup with '/'-separated paths for nested TFDS features (e.g. 'captions/text')."""
  cur = record
  for part in key.split('/'):
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
  items = (
    list(value) if isinstance(value, (list, tuple)) else np.asarray(value, dtype=object).reshape(-1).tolist()
  )
  out = []
  for v in items:
    if isinstance(v, (bytes, np.bytes_)):
      v = bytes(v).decode('utf-8', errors='replace')
    v = str(v).strip()
    if v:
      out.append(v)
  return out


def captions_of(record: Mapping, caption_keys: Sequence[str] | None = None) -> list[str]:
  """All distinct captions of a record: the given keys, or 'alt_text' plus every 'caption_*' field."""
  keys = (
    list(caption_keys)
    if caption_keys
    else (['alt_text'] + sorted(k for k in record if str(k).startswith('caption_')))
  )
  caps: list[str] = []
  for k in keys:
    for c in as_text(get_field(record, k)):
      if c not in caps:
        caps.append(c)
  return caps


def decode_mask(value) -> np.ndarray:
  """Encoded PNG bytes or an array -> uint8 (H, W) label map."""
  if isinstance(value, (bytes, np.bytes_)):
    with Image.open(io.BytesIO(bytes(value))) as img:
      arr = np.asarray(img)
  else:
    arr = np.asarray(value)
  if arr.ndim == 3:
    arr = arr[..., 0]
  return arr.astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Where a zero-shot segmentation ground truth comes from.

  source: 'segmentation' (the record's label map at `key`), 'alpha' (foreground = alpha >= 128, labelled
  label + 1 from `alpha_label_key`, or 1 when None; an image without alpha is all `ignore_index`), or
  'auto' (the label map when the record has one, else alpha). `reduce_zero_label` maps 0 -> ignore and
  v -> v - 1 (the ADE20K convention).
  """

  source: str = 'segmentation'
  key: str = 'segmentation'
  alpha_label_key: str | None = 'label'
  reduce_zero_label: bool = False
  ignore_index: int = 255


@dataclasses.dataclass(frozen=True)
class DepthSpec:
  """Where a ground-truth depth map comes from: the record's field `key`, an integer PNG (or array)
  whose value / `scale` is the depth in metres; 0 marks a pixel without depth.

  Why a scale and not a fixed unit: NYUv2's common on-disk layout (`sync_depth_*.png`) and the `scenes`
  testbed store uint16 millimetres (scale 1000); other datasets store other units.
  """

  key: str = 'depth'
  scale: float = 1000.0


def decode_depth(value, scale: float = 1000.0) -> np.ndarray:
  """Encoded PNG bytes (16-bit or 8-bit, one channel) or an array -> float32 (H, W) depth in metres."""
  if isinstance(value, (bytes, np.bytes_)):
    with Image.open(io.BytesIO(bytes(value))) as img:
      arr = np.asarray(img)
  else:
    arr = np.asarray(value)
  if arr.ndim == 3:
    arr = arr[..., 0]
  return (arr.astype(np.float64) / float(scale)).astype(np.float32)


def ground_truth_depth(record: Mapping, spec: DepthSpec) -> np.ndarray:
  """The (H, W) float32 depth map of a record in metres (see `DepthSpec`)."""
  raw = get_field(record, spec.key)
  if raw is None:
    raise KeyError(f'record has no depth field {spec.key!r} (keys: {sorted(record)})')
  return decode_depth(raw, spec.scale)


def ground_truth_mask(
  record: Mapping, alpha: np.ndarray | None, image_hw: tuple[int, int], spec: MaskSpec
) -> np.ndarray:
  """The (H, W) uint8 GT label map of a record (see `MaskSpec`)."""
  raw = get_field(record, spec.key)
  if spec.source not in MASK_SOURCES:
    raise ValueError(f'unknown mask_source {spec.source!r}; valid: {list(MASK_SOURCES)}')
  if spec.source == 'segmentation' or (spec.source == 'auto' and raw is not None):
    if raw is None:
      raise KeyError(f'record has no segmentation field {spec.key!r}')
    mask = decode_mask(raw)
  elif alpha is None:
    mask = np.full(image_hw, spec.ignore_index, np.uint8)  # no alpha: nothing to score
  else:
    value = 1
    if spec.alpha_label_key:
      value = int(np.asarray(get_field(record, spec.alpha_label_key)).reshape(-1)[0]) + 1
    mask = ((alpha >= 128) * value).astype(np.uint8)
  if spec.reduce_zero_label:
    ign = int(spec.ignore_index)
    m = mask.astype(np.int32)
    mask = np.where(m == 0, ign, np.where(m == ign, ign, m - 1)).astype(np.uint8)
  return mask


def short_side_size(h: int, w: int, size: int) -> tuple[int, int]:
  """(h', w') with the short side = `size` and the aspect ratio kept, the long side truncated.

  The rule of the official TIPS zero-shot segmentation notebook ("TIPS_zeroshot_segmentation.ipynb",
  its `ShortSideResize`): a square image becomes (size, size); an image whose short side already is
  `size` is left alone.
  """
  h, w, size = int(h), int(w), int(size)
  if min(h, w) == size:
    return h, w
  if w < h:
    return int(size * h / w), size
  return size, int(size * w / h)


def resize_short_side(image: np.ndarray, size: int) -> np.ndarray:
  """A uint8 (H, W, 3) image resized (PIL bicubic, antialiased) to `short_side_size`."""
  nh, nw = short_side_size(image.shape[0], image.shape[1], size)
  if (nh, nw) == image.shape[:2]:
    return image
  return np.asarray(Image.fromarray(image).resize((nw, nh), resample=T.BICUBIC))


@dataclasses.dataclass(frozen=True)
class EvalFields:
  """What one eval example holds: 'image' (S, S, 3) uint8 always; 'label' () int32 when `label_key`;
  'segmentation' (S, S) uint8 when `mask`; 'depth' (S, S) float32 metres when `depth` (nearest
  neighbour, like the label map); 'captions' (list of str) when `captions`.

  With `resize='short_side'` the image is (H', W', 3) with min(H', W') = S (`short_side_size`) and the
  label map keeps the record's own (H, W): such examples differ in shape, so they are read one by one
  (`eval_examples`), never stacked into batches."""

  image_size: int | tuple[int, int] = 224
  resize: str = 'center_crop'
  image_key: str = 'image'
  label_key: str | None = None
  mask: MaskSpec | None = None
  depth: DepthSpec | None = None
  captions: bool = False
  caption_keys: tuple[str, ...] | None = None


def read_example(record: Mapping, fields: EvalFields) -> dict:
  """Decodes and resizes one record into the fields asked for (deterministic)."""
  raw = get_field(record, fields.image_key)
  if raw is None:
    raise KeyError(f'record has no image field {fields.image_key!r} (keys: {sorted(record)})')
  img = T.open_image(raw, EVAL_LIMITS)
  mask = None
  if fields.mask is not None:
    mask = ground_truth_mask(record, T.alpha_channel(img), (img.height, img.width), fields.mask)
  rgb, _ = T.load_rgb(img, 1.0, EVAL_LIMITS)
  if fields.resize == 'short_side':
    if not isinstance(fields.image_size, (int, np.integer)):
      raise ValueError(f"resize='short_side' needs an int image_size, got {fields.image_size!r}")
    image = resize_short_side(np.asarray(rgb), int(fields.image_size))  # the label map stays as it is
  else:
    image, mask = T.fixed_resize(np.asarray(rgb), mask, fields.image_size, fields.resize)
  ex: dict[str, Any] = {batch_lib.IMAGE: np.ascontiguousarray(image)}
  if mask is not None:
    ex[batch_lib.SEGMENTATION] = np.ascontiguousarray(mask)
  if fields.depth is not None:
    if fields.resize == 'short_side':
      raise ValueError("depth maps are read with the fixed-size resize modes ('resize', 'center_crop')")
    depth = ground_truth_depth(record, fields.depth)
    if depth.shape != (img.height, img.width):
      raise ValueError(f'depth map {depth.shape} does not match its image {(img.height, img.width)}')
    _, depth = T.fixed_resize(np.asarray(rgb), depth, fields.image_size, fields.resize)
    ex[batch_lib.DEPTH] = np.ascontiguousarray(depth, np.float32)
  if fields.label_key:
    label = get_field(record, fields.label_key)
    if label is None:
      raise KeyError(f'record has no label field {fields.label_key!r}')
    ex[batch_lib.LABEL] = np.int32(int(np.asarray(label).reshape(-1)[0]))
  if fields.captions:
    ex[batch_lib.CAPTIONS] = captions_of(record, fields.caption_keys)
  return ex


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


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
  if hasattr(source, '__len__') and hasattr(source, '__getitem__'):
    for i in subset_indices(len(source), max_examples):
      yield source[int(i)]
  else:
    for i, rec in enumerate(source):
      if max_examples is not None and i >= int(max_examples):
        return
      yield rec


def pad_batch(examples: list[dict], batch_size: int) -> dict:
  """Stacks per-example fields into a batch of exactly batch_size with a `_valid` mask.

  Padding repeats zeros of the same shape/dtype (non-array fields such as caption lists pad with []),
  so every batch has identical shapes and padded rows are marked invalid.
  """
  n = len(examples)
  if n == 0 or n > batch_size:
    raise ValueError(f'cannot pad {n} examples to batch size {batch_size}')
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
  out[batch_lib.VALID] = np.arange(batch_size) < n
  return out


def chunks(items: Iterable, n: int) -> Iterator[list]:
  """Groups items into lists of n (the last one shorter)."""
  buf = []
  for item in items:
    buf.append(item)
    if len(buf) == n:
      yield buf
      buf = []
  if buf:
    yield buf


def eval_examples(
  source, fields: EvalFields, *, max_examples: int | None = None, num_workers: int = 1, chunk_size: int = 32
) -> Iterator[dict]:
  """`read_example` outputs one by one, in dataset order (for examples of different shapes).

  Records are decoded `chunk_size` at a time by `num_workers` threads, so memory stays bounded; the
  order never depends on either. Every process of a multi-host run gets the same examples.
  """
  read = functools.partial(read_example, fields=fields)
  records = iterate_source(source, max_examples)
  workers = max(1, int(num_workers or 1))
  if workers == 1:
    for rec in records:
      yield read(rec)
    return
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for recs in chunks(records, max(1, int(chunk_size))):
      yield from pool.map(read, recs)


def eval_batches(
  source, fields: EvalFields, batch_size: int, *, max_examples: int | None = None, num_workers: int = 1
) -> Iterator[dict]:
  """Padded fixed-size batches of `read_example` outputs (with `_valid`), in dataset order.

  `num_workers` decoding threads; the order never depends on it. Every process of a multi-host run
  gets the same batches. Fixed-size resize modes only ('short_side' examples differ in shape: use
  `eval_examples`).
  """
  if fields.resize == 'short_side':
    raise ValueError(
      "resize='short_side' examples differ in shape and cannot be batched; read them with eval_examples"
    )
  records = iterate_source(source, max_examples)
  read = functools.partial(read_example, fields=fields)
  workers = max(1, int(num_workers or 1))
  if workers == 1:
    for recs in chunks(records, batch_size):
      yield pad_batch([read(r) for r in recs], batch_size)
    return
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for recs in chunks(records, batch_size):
      yield pad_batch(list(pool.map(read, recs)), batch_size)
