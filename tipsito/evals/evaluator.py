"""The `Evaluator` base class: configuration, eval batches and encoder calls shared by all evaluators.

Why one base: every evaluator needs the same three things, and they must behave identically so that
numbers are comparable across evals and across training/standalone runs:
  1. the eval split's batches, from `tipsito.data.eval_input` (decoded and resized deterministically,
     fixed size, padded, with a `_valid` mask);
  2. thin, shape-checked calls into the `Encoder` interface (`embed_images`, `embed_texts`), split over
     the JAX processes of a multi-host run (`over_processes`);
  3. class names and prompt templates resolved the same way.
Subclasses (zeroshot.py, retrieval.py, segmentation.py, knn.py) hold only their metric logic.

Config (`config.evals.<name>`, a ConfigDict or dict): every key, its default and range is declared in
tipsito/config/schema.py (`EVAL_KEYS`, listed by `python -m tipsito.info --schema`), and `self.cfg` holds
the completed, checked settings (tipsito/config/validation.py `eval_settings`). Keys common to all
evaluators:
  type: 'zeroshot' | 'retrieval' | 'segmentation' | 'knn' | 'linear_segmentation' | 'linear_depth' |
    'linear_classification' (probes.py)
  dataset: 'shapes' | 'tuxpaint' | 'fashion_mnist' | any TFDS name prepared under data_dir
  split ('test'), data_dir (None = TFDS default), every_steps (0 = only at the end of training),
  batch_size (32), image_size (224), cls_index (0: which CLS token feeds global evals),
  project (apply the export's image projection; None = what the model was trained with, the encoder's
  `default_project`: projected for CLIP/ITO, raw for TIPS, as `tipsito.load` does; kNN: False),
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

import inspect
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from tipsito.data import batch as batch_lib
from tipsito.data import eval_input
from tipsito.data import sources
from tipsito.data.tokenizer import Tokenizer
from tipsito.evals import metrics as metrics_lib
from tipsito.config import validation as config_validation
from tipsito.evals.config_checks import as_dict  # noqa: F401  (registry.py, the evaluators)
from tipsito.evals import pictures as pictures_lib
from tipsito.evals import templates as templates_lib

# A record source is a random-access sequence (or an iterable) of dict records, for one split.
SourceFn = Callable[[str], Any]


def pct(x: float) -> float:
  """Fraction -> percentage, keeping NaN (no examples) visible."""
  return float(x) * 100.0 if x == x else float("nan")


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


def _accepts_kwarg(fn, name: str) -> bool:
  """Whether a callable takes keyword `name` (the Encoder's optional `values=` switch)."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


class Evaluator:
  """Base class: configuration, eval data and encoder calls shared by all evaluators.

  Subclasses set `TYPE` (their keys are the schema's for that type) and implement `run(encoder)`.
  `pictures` is a dict name -> uint8 (H,W,3) array filled by the last `run` when `num_pictures > 0`.
  """

  TYPE = ""
  NEEDS_MASKS = False  # segmentation masks are only read (and decoded) by evaluators that use them

  def __init__(
    self, name: str, cfg=None, *, source_fn: SourceFn | None = None, class_names: Sequence[str] | None = None
  ):
    self.name = str(name)
    self.cfg = self.settings(cfg, need_dataset=source_fn is None)
    self._source_fn = source_fn
    self._class_names_override = list(class_names) if class_names is not None else None
    self._sources: dict[str, tuple[Any, list[str] | None]] = {}
    self.pictures: dict[str, np.ndarray] = {}
    self._tokenizer = None

  def settings(self, cfg, *, need_dataset: bool) -> dict[str, Any]:
    """The completed settings of this eval (`type` = `TYPE` when the config leaves it out)."""
    return config_validation.eval_settings(
      self.name, {"type": self.TYPE, **as_dict(cfg)}, need_dataset=need_dataset
    )

  # -------------------------------------------------------------------- scheduling / config helpers
  def should_run(self, step: int, *, is_last: bool = False) -> bool:
    """True at multiples of every_steps (>0) and always at the last step (final report)."""
    every = int(self.cfg["every_steps"])
    return bool(is_last or (every > 0 and step > 0 and step % every == 0))

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.name!r}, dataset={self.cfg['dataset']!r})"

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
        self._sources[split] = (src, eval_input.class_names_of(src, self.cfg["label_key"]))
      else:
        self._sources[split] = eval_input.open_records(
          self.cfg["dataset"],
          split,
          self.cfg["data_dir"],
          self.cfg["prepare"],
          image_key=self.cfg["image_key"],
          label_key=self.cfg["label_key"],
          segmentation_key=self.cfg["segmentation_key"] if self.NEEDS_MASKS else None,
        )
    return self._sources[split][0]

  def class_names(self) -> list[str]:
    """Class names: config > constructor override > curated names of a built-in dataset
    (templates.class_names_for) > the dataset's ClassLabel names ('_' -> ' ')."""
    if self.cfg["class_names"]:
      return [str(c) for c in self.cfg["class_names"]]
    if self._class_names_override:
      return self._class_names_override
    curated = templates_lib.class_names_for(self.cfg["dataset"])
    if curated:
      return list(curated)
    self.source()
    names = self._sources[self.cfg["split"]][1]
    if names:
      return [n.replace("_", " ") for n in names]
    raise ValueError(f"eval {self.name!r}: no class names (set config.evals.{self.name}.class_names)")

  def templates(self, default: str | None = None) -> tuple[str, ...]:
    """Prompt templates from the config (or the dataset / evaluator default)."""
    spec = self.cfg["templates"]
    if (
      spec is None
      and default is not None
      and sources.base_name(self.cfg["dataset"]) not in templates_lib.DEFAULT_TEMPLATES
    ):
      spec = default
    return templates_lib.get_templates(spec, self.cfg["dataset"])

  def mask_spec(self) -> eval_input.MaskSpec:
    """Where the GT label map comes from (the segmentation evaluator adds alpha masks)."""
    return eval_input.MaskSpec(source="segmentation", key=self.cfg["segmentation_key"])

  def input_fields(self, *, need_label=False, need_mask=False, need_captions=False) -> eval_input.EvalFields:
    """The per-example fields an evaluator asks for, with this config's keys and geometry."""
    cfg = self.cfg
    caption_keys = cfg["caption_keys"]
    return eval_input.EvalFields(
      image_size=cfg["image_size"],
      resize=cfg["resize"],
      image_key=cfg["image_key"],
      label_key=cfg["label_key"] if need_label else None,
      mask=self.mask_spec() if need_mask else None,
      captions=need_captions,
      caption_keys=tuple(caption_keys) if caption_keys else None,
    )

  def batches(self, split: str | None = None, *, max_examples: int | None = None, **need) -> Iterator[dict]:
    """Padded fixed-size batches (with `_valid`) of a split in dataset order; `need`: the keywords of
    `input_fields` (need_label, need_mask, need_captions)."""
    if max_examples is None:
      max_examples = self.cfg["max_examples"]
    return eval_input.eval_batches(
      self.source(split),
      self.input_fields(**need),
      int(self.cfg["batch_size"]),
      max_examples=max_examples,
      num_workers=max(1, int(self.cfg["num_workers"])),
    )

  # -------------------------------------------------------------------- encoder calls
  def embed_images(
    self, encoder, images: np.ndarray, *, project: bool | None = None, need_values: bool = False
  ) -> dict[str, np.ndarray]:
    """Runs the image tower on one fixed-size batch; returns numpy cls (B,n_cls,D), patches, values."""
    if project is None:
      project = self.cfg["project"]
    if project is None:  # the model's own default (tipsito.inference.Encoder.default_project)
      project = bool(getattr(encoder, "default_project", True))

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
      chunk = texts[start : start + bs]
      n = len(chunk)
      chunk = chunk + [chunk[-1]] * (bs - n)  # repeat (not ''): padding never produces NaNs
      emb = over_processes(
        lambda rows: np.asarray(encoder.embed_texts(self._text_input(encoder, rows)), np.float32), chunk
      )[:n]
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
      text_cfg = encoder.text_config  # every key stated (tipsito/inference.py: Encoder)
      self._tokenizer = Tokenizer(
        self.cfg["tokenizer"],
        max_len=int(text_cfg["max_len"]),
        flavour=text_cfg["flavour"],
      )
      vocab = text_cfg["vocab_size"]
      if vocab is not None and self._tokenizer.vocab_size > int(vocab):
        raise ValueError(
          f"eval {self.name!r}: tokenizer vocab {self._tokenizer.vocab_size} exceeds the "
          f"text encoder's {vocab}; set the eval's 'tokenizer'"
        )
    return self._tokenizer.tokenize(texts)

  def class_text_embeddings(
    self, encoder, class_names: Sequence[str], templates: Sequence[str]
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
    n = int(self.cfg["num_pictures"])
    if n <= 0 or f"{self.name}/pca" in self.pictures:
      return
    k = int(min(n, int(np.sum(batch[batch_lib.VALID]))))
    if k == 0 or "patches" not in out:
      return
    maps = pictures_lib.pca_rgb(out["patches"][:k], joint=False)
    images = batch[batch_lib.IMAGE][:k]
    self.pictures[f"{self.name}/pca"] = pictures_lib.pca_grid(images, maps)
