"""Per-host grain input pipeline for training.

Why it is built this way:

  range(N) -> shuffle(shuffle_seed, reseeded per epoch) -> repeat -> tag (epoch, record)
    -> shard by JAX process (strided slice of the global stream: disjoint and covering)
    -> per-example transform, RNG = f(seed, epoch, record)  [decode, captions, views, mask, tokens]
    -> to_iter_dataset -> skip-and-count batcher (drops bad records, counts them per reason)
    -> grain multiprocessing workers (optional) -> thread prefetch -> skip accounting (parent)

* Augmentations and the CLS2 caption draw depend only on (seed, epoch, record index): the same
  example gets the same views whatever the worker or process count; a new epoch redraws them.
* Bad records never crash a worker. The transform returns a small skip marker instead of an
  example; the batcher, which runs inside each worker, drops markers and attaches per-reason counts
  to the batch it emits (so counting survives multiprocessing); the outermost iterator, in the
  training process, pops the counts into `iterator.stats`, keeps them in its checkpointable state,
  and raises `TooManySkippedError` naming the dataset when the skipped fraction passes
  `config.data.max_skip_fraction` after a minimum number of records.
* The returned object is a grain `DatasetIterator`: `get_state()` is JSON-serialisable, so the
  training checkpoint (grain's PyGrainCheckpointHandler or our own JSON) stores it; `set_state()`
  resumes exactly (same next batches), with or without workers (same worker count).
* Per-host batches are numpy dicts; the training step assembles them into global arrays.

Evaluation batches (deterministic, padded, masked) come from `tipsito.data.eval_input`, which
decodes and resizes with the same `transforms` functions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Mapping, Sequence

import grain.python as grain
from grain import experimental as grain_exp
import numpy as np

from tipsito import choices
from tipsito.data import batch as batch_lib
from tipsito.data import masking
from tipsito.data import sources
from tipsito.data import tokenizer as tok_lib
from tipsito.data import grain_ops
from tipsito.data import transforms as T

__all__ = [
  'TooManySkippedError',
  'ExampleSpec',
  'TrainExampleFn',
  'make_train_iterator',
  'open_source',
]

_REASON_INDEX = {r: i for i, r in enumerate(T.SKIP_REASONS)}
_SKIP = '_skip'  # key of the skip marker returned by the per-example function
_SKIPS = '_skips'  # per-batch per-reason skip counts (popped by the accounting iterator)
_SEEN = '_seen'  # per-batch number of records consumed (good + skipped)
DEFAULT_MIN_RECORDS_FOR_SKIP_CHECK = 256
# Crop area range of the second view ('image2') when `config.input.view2_crop_scale` is None: ITO's
# RandomResizedCrop scale (ITO "Method"), whatever the first view uses (declared in tipsito/choices.py).
ITO_VIEW2_SCALE = choices.VIEW2_CROP_SCALE

log = logging.getLogger(__name__)


class TooManySkippedError(RuntimeError):
  """The skipped fraction of a dataset passed `config.data.max_skip_fraction`."""


def _process_info(process_index, process_count):
  """Defaults to the JAX process; importing JAX only when the caller did not say."""
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index={process_index} not in [0, {process_count})')
  return int(process_index), int(process_count)


def open_source(data_config, split: str | None = None):
  """Opens config.data through the builders' `sources.open_source`.

  Returns (source, key overrides): that reader renames the configured fields to fixed keys
  ('image', 'alt_text', 'label', 'segmentation'; captions keep their names, and caption_keys=()
  there means every 'caption_*' field), so the spec must read those keys. `data.alt_text_key=None` stays
  None: 'text' is then drawn from the caption fields (which may name the raw alt-text field), as the
  spec's docstring says; renaming it to 'alt_text' would quietly train on the alt-text alone."""
  src, info = sources.open_source(data_config, split=split)
  keys = dict(
    image_key='image',
    alt_text_key='alt_text' if info.alt_text_key is not None else None,
    caption_keys=tuple(info.caption_keys),
    label_key='label' if info.label_key else None,
  )
  return src, keys


# --------------------------------------------------------------------------------------------
# Example specification and per-example functions
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
  """Everything the per-example function needs, resolved once from the config (picklable).

  Why `batch`: what a batch holds (its views, crop sides, local-crop count and mask grid) is decoded from
  `config.input` in one place, `BatchLayout` (tipsito/data/batch.py), which the step's shapes are built
  from too; this spec adds only how examples are cut and read (augmentation, crop ranges, masking, keys).
  No defaults: the schema (tipsito/config/schema.py) declares them and has checked every choice."""

  batch: batch_lib.BatchLayout
  augment: str
  augment_view2: str | None  # multicrop_two_views: the second global view's augmentation
  global_scale: tuple[float, float]
  local_scale: tuple[float, float]
  view2_scale: tuple[float, float]  # the second view ('image2') of two-view modes
  ratio: tuple[float, float]
  mask_ratio: float
  mask_type: str
  mask_prob: float
  patch_size: int
  image_key: str
  alt_text_key: str | None
  caption_keys: tuple[str, ...]
  label_key: str | None
  limits: T.ImageLimits

  @classmethod
  def from_config(cls, config) -> 'ExampleSpec':
    """Reads a validated config (or a saved config.json, upgraded to the schema when read:
    tipsito/config/run_file.py): config.input, config.data, config.model.image.patch_size. The None of an
    optional crop range means the default range written here."""
    inp, data = config.input, config.data
    return cls(
      batch=batch_lib.BatchLayout.from_config(config),
      augment=inp.augment,
      augment_view2=inp.augment_view2,
      global_scale=tuple(inp.global_crop_scale or choices.GLOBAL_CROP_SCALE_BY_AUGMENT[inp.augment]),
      local_scale=tuple(inp.local_crop_scale or choices.LOCAL_CROP_SCALE),
      view2_scale=tuple(inp.view2_crop_scale or ITO_VIEW2_SCALE),
      ratio=tuple(inp.crop_ratio or choices.CROP_RATIO),
      mask_ratio=float(inp.mask_ratio),
      mask_type=inp.mask_type,
      mask_prob=float(inp.mask_prob),
      patch_size=int(config.model.image.patch_size),
      image_key=data.image_key,
      alt_text_key=data.alt_text_key,
      caption_keys=tuple(data.caption_keys),
      label_key=data.label_key,
      limits=T.ImageLimits(
        max_pixels=int(data.max_pixels),
        hard_max_pixels=int(data.hard_max_pixels),
        min_side=int(data.min_side),
        max_aspect=float(data.max_aspect),
        background=tuple(data.background),
      ),
    )

  @property
  def layout(self) -> choices.ViewLayout:
    """The views of an example (tipsito/choices.py: `view_layout`), as the batch holds them."""
    return self.batch.views

  @property
  def global_size(self) -> int:
    return self.batch.global_size

  @property
  def local_size(self) -> int:
    return self.batch.local_size

  @property
  def num_local(self) -> int:
    return self.batch.num_local

  def view_transform(self):
    """The grain RandomMapTransform producing the image fields for these views/augment."""
    layout = self.layout
    if layout.local_crops:
      return grain_ops.MultiCrop(
        self.global_size,
        self.local_size,
        self.num_local,
        self.global_scale,
        self.local_scale,
        self.ratio,
        num_global=layout.global_views,
        photometric=self.augment == 'ito',
        limits=self.limits,
        view2_photometric=(self.augment_view2 or self.augment) == 'ito',
        view2_scale=self.view2_scale,
      )
    if self.augment == 'none':
      return None  # the deterministic resize evaluations use (see TrainExampleFn)
    return grain_ops.ITOTwoViews(
      self.global_size,
      self.global_scale,
      self.ratio,
      self.limits,
      photometric=self.augment == 'ito',
      num_views=layout.global_views,
      view2_scale=self.view2_scale,
    )

  @property
  def mask_grid(self) -> int:
    """Side of MASK's patch grid (the batch's; 0 without a mask)."""
    return self.batch.mask_grid


class _Tokenizer:
  """Picklable lazy handle: an injected tokenizer object, or (path, max_len, flavour) built on first use
  in whichever process needs it (sentencepiece processors are not reliably picklable). `flavour` is the
  text tower's ('clip' adds SOT/EOT, tipsito/data/tokenizer.py)."""

  def __init__(self, tokenizer=None, path=None, max_len=64, flavour='tips'):
    self._tok, self.path, self.max_len = tokenizer, path, int(max_len)
    self.flavour = flavour or 'tips'
    self._injected = tokenizer is not None

  def __getstate__(self):
    state = dict(self.__dict__)
    if not self._injected:
      state['_tok'] = None
    return state

  def get(self):
    """The tokenizer, constructed on first use in this process."""
    if self._tok is None:
      self._tok = tok_lib.Tokenizer(self.path, max_len=self.max_len, flavour=self.flavour)
    return self._tok

  def __call__(self, texts: Sequence[str]) -> np.ndarray:
    return np.asarray(self.get().tokenize(list(texts)), dtype=np.int32)


def _skip_marker(reason: str) -> dict:
  """The tiny dict that travels in place of a bad example (reason index only)."""
  return {_SKIP: np.int32(_REASON_INDEX.get(reason, _REASON_INDEX['other']))}


def _example_rngs(seed: int, epoch: int, record: int, n: int):
  """Independent per-example generators keyed only by (seed, epoch, record)."""
  ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(epoch), int(record)])
  return [np.random.Generator(np.random.Philox(s)) for s in ss.spawn(n)]


class TrainExampleFn:
  """(epoch, record index) -> training example dict, or a skip marker for bad records.

  Output fields (per example, tipsito/data/batch.py): IMAGE (S,S,3) uint8, IMAGE2 (two-view modes),
  LOCAL_CROPS (M,s,s,3) uint8 (multicrop, M>0), MASK (gh,gw) bool (mask_ratio>0), TEXT / TEXT2 (L,)
  int32, LABEL () int32 (label_key set)."""

  _warned = 0

  def __init__(self, source, spec: ExampleSpec, tokenizer: _Tokenizer | None, seed: int):
    self.source, self.spec, self.tokenizer = source, spec, tokenizer
    self.seed = int(seed)
    self.views = spec.view_transform()
    self.captions = grain_ops.ChooseCaptions(spec.alt_text_key, spec.caption_keys)

  def __call__(self, item) -> dict:
    return self._guard(self._process, int(item[0]), int(item[1]))

  def _read(self, index: int) -> Mapping:
    """source[index] with read failures turned into a counted skip."""
    try:
      record = self.source[index]
    except Exception as e:  # pylint: disable=broad-except
      raise T.SkipExample('read_error', f'{type(e).__name__}: {e}') from None
    if not isinstance(record, Mapping):
      raise T.SkipExample('read_error', f'record is {type(record).__name__}, not a mapping')
    return record

  def _label(self, record) -> np.int32:
    """The configured label as int32; a missing/non-int label is a counted skip."""
    v = record.get(self.spec.label_key)
    try:
      return np.int32(int(np.asarray(v).item()))
    except Exception:  # pylint: disable=broad-except
      raise T.SkipExample('missing_label', repr(v)[:50]) from None

  def _guard(self, fn, *args):
    """Runs fn; a SkipExample or any other error becomes a skip marker (never a crash)."""
    try:
      return fn(*args)
    except T.SkipExample as e:
      return _skip_marker(e.reason)
    except Exception as e:  # pylint: disable=broad-except
      if TrainExampleFn._warned < 5:  # a bug guard: count it, say it loudly a few times
        TrainExampleFn._warned += 1
        log.warning(
          'tipsito.data: unexpected error in example transform (counted as skip \'other\'): %s: %s',
          type(e).__name__,
          e,
          exc_info=True,
        )
      return _skip_marker('other')

  def _process(self, epoch: int, index: int) -> dict:
    """The actual per-example work; raises SkipExample for bad records."""
    spec = self.spec
    rng_img, rng_cap, rng_mask = _example_rngs(self.seed, epoch, index, 3)
    record = self._read(index)
    out = {}
    if spec.label_key:
      out[batch_lib.LABEL] = self._label(record)
    if self.tokenizer is not None and (spec.alt_text_key or spec.caption_keys):
      if spec.alt_text_key:
        txt = self.captions.random_map(record, rng_cap)
        pair = [txt[batch_lib.TEXT], txt[batch_lib.TEXT2]]
      else:
        _, cap = T.choose_caption(rng_cap, record, spec.caption_keys)
        if cap is None:
          raise T.SkipExample('missing_text', 'no usable caption field')
        pair = [cap, cap]
      ids = self.tokenizer(pair)
      out[batch_lib.TEXT], out[batch_lib.TEXT2] = ids[0], ids[1]
    img = T.open_image(record.get(spec.image_key), spec.limits)
    if self.views is None:
      image = T.fixed_size_image(img, spec.global_size, 'center_crop', spec.limits)
      out.update((name, image) for name in batch_lib.GLOBAL_VIEWS[: spec.layout.global_views])
    else:
      out.update((k, v) for k, v in self.views.random_map({batch_lib.IMAGE: img}, rng_img).items())
    if spec.mask_ratio > 0:
      g = spec.mask_grid
      if spec.mask_prob >= 1.0 or rng_mask.random() < spec.mask_prob:
        out[batch_lib.MASK] = masking.make_mask(rng_mask, g, g, spec.mask_ratio, spec.mask_type)
      else:
        out[batch_lib.MASK] = np.zeros((g, g), bool)
    return out


# --------------------------------------------------------------------------------------------
# grain plumbing: epoch tagging, skip-and-count batching, accounting
# --------------------------------------------------------------------------------------------


class _EpochTag:
  """map_with_index over the repeated global stream: (position, record) -> [epoch, record]."""

  def __init__(self, num_records: int):
    self.n = int(num_records)

  def __call__(self, position, record):
    return np.array([int(position) // self.n, int(record)], np.int64)


def _stack(examples: Sequence[dict]) -> dict:
  """Stacks example dicts field-wise (all examples share the same fields and shapes)."""
  return {k: np.stack([np.asarray(e[k]) for e in examples]) for k in examples[0]}


def _skip_error(name, skipped, seen, limit, counts) -> TooManySkippedError:
  """The error raised when too many records are skipped; names the dataset."""
  reasons = {r: int(c) for r, c in zip(T.SKIP_REASONS, counts) if c}
  return TooManySkippedError(
    f'dataset {name!r}: skipped {int(skipped)} of {int(seen)} records '
    f'({skipped / max(seen, 1):.1%}) > config.data.max_skip_fraction={limit}; '
    f'by reason: {reasons}. Check the data (or raise the limit).'
  )


class _SkipBatchIterDataset(grain.IterDataset):
  """Batches good examples, dropping skip markers and counting them per reason.

  Runs inside each grain worker (before mp_prefetch), so both the batching and the counting
  happen where the data is. Each batch carries `_skips` (len(SKIP_REASONS),) int64 and `_seen`
  (records consumed for it). State is the parent's state at a batch boundary, so resuming is exact.
  A whole batch's worth of consecutive failures beyond the limit raises here (all-bad datasets
  would otherwise spin forever)."""

  def __init__(self, parent, batch_size: int, name: str, max_skip_fraction: float, min_records: int):
    super().__init__(parent)
    self.batch_size, self.name = int(batch_size), name
    self.max_skip_fraction, self.min_records = float(max_skip_fraction), int(min_records)

  def __iter__(self):
    return _SkipBatchIterator(self._parent.__iter__(), self)

  def __str__(self):
    return f'SkipBatchIterDataset(batch_size={self.batch_size})'


class _SkipBatchIterator(grain.DatasetIterator):
  """Iterator of `_SkipBatchIterDataset`."""

  def __init__(self, parent, cfg: _SkipBatchIterDataset):
    super().__init__(parent)
    self._cfg = cfg

  def __next__(self):
    cfg = self._cfg
    good, counts, seen = [], np.zeros(len(T.SKIP_REASONS), np.int64), 0
    guard = max(cfg.min_records, 4 * cfg.batch_size)
    while len(good) < cfg.batch_size:
      ex = next(self._parent)  # StopIteration ends the epoch-limited stream (no partial batch)
      seen += 1
      if _SKIP in ex:
        counts[int(ex[_SKIP])] += 1
        skipped = int(counts.sum())
        if skipped >= guard and skipped / seen > cfg.max_skip_fraction:
          raise _skip_error(cfg.name, skipped, seen, cfg.max_skip_fraction, counts)
        continue
      good.append(ex)
    batch = _stack(good)
    batch[_SKIPS] = counts
    batch[_SEEN] = np.int64(seen)
    return batch

  def get_state(self):
    """JSON-serialisable state at a batch boundary."""
    return self._parent.get_state()

  def set_state(self, state):
    """Restores a state from get_state (exact resume)."""
    self._parent.set_state(state)


class _AccountingIterDataset(grain.IterDataset):
  """Outermost stage (training process): pops per-batch skip counts into running totals that are
  part of the checkpointed state, exposes them as `iterator.stats`, enforces max_skip_fraction."""

  def __init__(self, parent, name: str, max_skip_fraction: float, min_records: int):
    super().__init__(parent)
    self.name, self.max_skip_fraction, self.min_records = name, max_skip_fraction, min_records

  def __iter__(self):
    return PipelineIterator(self._parent.__iter__(), self)

  def __str__(self):
    return f'SkipAccountingIterDataset(name={self.name!r})'


class PipelineIterator(grain.DatasetIterator):
  """The iterator returned by make_train_iterator.

  `stats` -> {'seen', 'skipped', 'skip_fraction', 'skipped_by_reason'} (cumulative over the run,
  restored with the state); `get_state()` / `set_state()` for exact resume (JSON-serialisable);
  `close()` stops worker processes."""

  def __init__(self, parent, cfg: _AccountingIterDataset):
    super().__init__(parent)
    self._cfg = cfg
    self._counts = np.zeros(len(T.SKIP_REASONS), np.int64)
    self._seen = 0

  def __next__(self):
    batch = next(self._parent)
    counts = batch.pop(_SKIPS, None)
    seen = batch.pop(_SEEN, None)
    if counts is not None:
      self._counts += np.asarray(counts, np.int64).reshape(-1, len(T.SKIP_REASONS)).sum(0)
      self._seen += int(np.sum(seen))
      skipped = int(self._counts.sum())
      if self._seen >= self._cfg.min_records and skipped > self._cfg.max_skip_fraction * self._seen:
        raise _skip_error(self._cfg.name, skipped, self._seen, self._cfg.max_skip_fraction, self._counts)
    return batch

  @property
  def stats(self) -> dict:
    """Cumulative skip accounting (restored with the state)."""
    skipped = int(self._counts.sum())
    return {
      'seen': int(self._seen),
      'skipped': skipped,
      'skip_fraction': skipped / max(self._seen, 1),
      'skipped_by_reason': {r: int(c) for r, c in zip(T.SKIP_REASONS, self._counts) if c},
    }

  def get_state(self):
    """JSON-serialisable state at a batch boundary."""
    return {
      'pipeline': self._parent.get_state(),
      'seen': int(self._seen),
      'skipped': [int(c) for c in self._counts],
    }

  def set_state(self, state):
    """Restores a state from get_state (exact resume)."""
    self._parent.set_state(state['pipeline'])
    self._seen = int(state.get('seen', 0))
    counts = state.get('skipped', [0] * len(T.SKIP_REASONS))
    self._counts = np.asarray(list(counts) + [0] * (len(T.SKIP_REASONS) - len(counts)), np.int64)

  def close(self):
    """Stops prefetch threads / worker processes held by the parents."""
    stack = [self]
    while stack:
      it = stack.pop()
      if it is not self and hasattr(it, 'close'):
        try:
          it.close()
        except Exception:  # pylint: disable=broad-except
          pass
      stack.extend(getattr(it, '_parents', ()))

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


# --------------------------------------------------------------------------------------------
# Public constructors
# --------------------------------------------------------------------------------------------


def _read_options(num_workers: int, config_input, per_host_batch: int) -> grain.ReadOptions:
  """Threads per process for reading+transforming: PIL releases the GIL in decode and resize, so
  a few threads help in-process; inside worker processes one thread avoids oversubscription."""
  default = 1 if num_workers > 0 else min(4, os.cpu_count() or 1)
  threads = int(config_input.read_threads or default)  # None: the default above
  return grain.ReadOptions(
    num_threads=threads, prefetch_buffer_size=max(2 * threads, min(per_host_batch, 256))
  )


def _ensure_absl_flags_parsed():
  """grain's multiprocessing reads absl flags; outside an absl app (tests, notebooks) they are
  unparsed and reading them raises, so use their defaults."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


# How often a grain worker checks that the training process that started it is still its parent.
_PARENT_POLL_S = 0.5


def _end_with_parent(parent_pid: int, worker_index: int, worker_count: int) -> None:
  """Runs first in each grain worker process (mp_prefetch's `worker_init_fn`): a daemon thread that ends
  the worker as soon as the training process that started it is no longer its parent, however that
  process died (SIGKILL and the OOM killer included: nothing runs in a process killed that way, so the
  worker has to notice). Without it, workers of a hard-killed run slept on with parent 1, holding their
  memory until the machine rebooted.

  Why a watch on the parent pid and not the kernel's parent-death signal (prctl PR_SET_PDEATHSIG): that
  signal fires when the *thread* that started the child ends, and grain starts its workers from the
  reader threads of a thread pool (InterleaveIterDataset's make-iterator threads), so it would kill
  healthy workers when such a thread ends. A reparented worker sees a new parent pid (1 or a
  subreaper), never the old one again."""
  del worker_index, worker_count

  def watch():
    while os.getppid() == parent_pid:
      time.sleep(_PARENT_POLL_S)
    os._exit(0)  # pylint: disable=protected-access  # no atexit work: the consumer of our output is gone

  threading.Thread(target=watch, name='tipsito-parent-watch', daemon=True).start()


def _finish(
  ds: grain.MapDataset,
  *,
  per_host: int,
  name: str,
  num_workers: int,
  prefetch: int,
  max_skip: float,
  min_records: int,
  read_options,
) -> PipelineIterator:
  """The tail: to_iter_dataset -> skip-and-count batcher -> workers -> thread prefetch -> accounting."""
  it = _SkipBatchIterDataset(ds.to_iter_dataset(read_options), per_host, name, max_skip, min_records)
  if num_workers > 0:
    _ensure_absl_flags_parsed()
    it = it.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=num_workers, per_worker_buffer_size=max(1, prefetch)),
      worker_init_fn=functools.partial(_end_with_parent, os.getpid()),
    )
  if prefetch > 0:
    it = grain_exp.ThreadPrefetchIterDataset(it, prefetch_buffer_size=prefetch)
  return iter(_AccountingIterDataset(it, name, max_skip, min_records))


def _tokenizer_for(config, tokenizer) -> _Tokenizer:
  """Wraps an injected tokenizer, or config.tokenizer/max_len/model.text.flavour, in a picklable handle."""
  if isinstance(tokenizer, _Tokenizer):
    return tokenizer
  return _Tokenizer(tokenizer, config.tokenizer, config.max_len, config.model.text.flavour)


def _skip_settings(data):
  """(max_skip_fraction, min records before the fraction is checked) from config.data."""
  return (
    float(data.max_skip_fraction),
    int(data.min_records_for_skip_check or DEFAULT_MIN_RECORDS_FOR_SKIP_CHECK),  # None: the default
  )


def make_train_iterator(
  config, *, source=None, process_index: int | None = None, process_count: int | None = None, tokenizer=None
) -> PipelineIterator:
  """The per-host training iterator (contract batch format), a grain DatasetIterator.

  Args:
    config: the experiment ConfigDict (reads config.seed, .tokenizer, .max_len, .data.*, .input.*,
      .model.image.patch_size; see `ExampleSpec.from_config` and the module docstring).
    source: random-access source (len + getitem -> record dict); default opens config.data via
      `tipsito.data.sources.open_source`.
    process_index, process_count: JAX process layout (default: from jax).
    tokenizer: object with `.tokenize(list[str]) -> (n, L) int32`; default
      `tipsito.data.tokenizer.Tokenizer(config.tokenizer, max_len=config.max_len)`.

  Yields dicts of per-host numpy arrays with leading dim config.input.batch_size // process_count.
  """
  pi, pc = _process_info(process_index, process_count)
  inp, data = config.input, config.data
  global_bs = int(inp.batch_size)
  if global_bs % pc:
    raise ValueError(f'config.input.batch_size={global_bs} is not divisible by the process count {pc}')
  per_host = global_bs // pc
  name = str(data.name)
  spec = ExampleSpec.from_config(config)
  if source is None:
    source, keys = open_source(data)
    spec = dataclasses.replace(spec, **keys)
  n = len(source)
  if n == 0:
    raise ValueError(f'dataset {name!r} (split {data.split!r}) is empty')
  seed = int(config.seed)
  shuffle_seed = int(inp.shuffle_seed)
  num_workers = int(inp.num_workers)
  prefetch = int(inp.prefetch)
  max_skip, min_records = _skip_settings(data)

  ds = grain.MapDataset.range(n)
  if inp.shuffle:
    ds = ds.shuffle(seed=shuffle_seed)
  ds = ds.repeat(inp.num_epochs)  # reshuffled every epoch
  ds = ds.map_with_index(_EpochTag(n))  # epoch feeds augmentation + caption RNG
  ds = ds.slice(slice(pi, None, pc))  # disjoint, covering per-process shards
  ds = ds.map(TrainExampleFn(source, spec, _tokenizer_for(config, tokenizer), seed))
  return _finish(
    ds,
    per_host=per_host,
    name=name,
    num_workers=num_workers,
    prefetch=prefetch,
    max_skip=max_skip,
    min_records=min_records,
    read_options=_read_options(num_workers, inp, per_host),
  )
