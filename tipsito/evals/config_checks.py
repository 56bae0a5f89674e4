"""The eval configs' defaults and checks that run when a config is validated: light (no JAX).

Why its own module: tipsito/config/validation.py checks every enabled segmentation and probe eval of a
config before anything compiles (unknown keys, a benchmark's fixed keys, splits and kinds), and a config
validates in a process without JAX, Flax, grain, Orbax or TensorFlow (tests/test_light_imports.py). The
evaluators that run these configs (tipsito/evals/evaluator.py, segmentation.py, probes.py) import JAX,
so the keys they share (`COMMON_DEFAULTS`), the segmentation benchmarks and defaults and the probes'
defaults live here, with the checks, and the evaluators take them from here. What each key means is
documented in the evaluator modules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tipsito.data import dense_benchmarks
from tipsito.data import eval_input
from tipsito.evals import class_names as class_names_lib

# Keys every evaluator takes (tipsito/evals/evaluator.py documents them).
COMMON_DEFAULTS: dict[str, Any] = dict(
  type=None,
  dataset=None,
  split="test",
  data_dir=None,
  every_steps=0,
  batch_size=32,
  image_size=224,
  cls_index=0,
  project=None,
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
  bootstrap=1000,
)


def as_dict(cfg) -> dict:
  """ConfigDict / Mapping / None -> plain dict (evaluators keep an immutable snapshot)."""
  if cfg is None:
    return {}
  if hasattr(cfg, "to_dict"):
    return cfg.to_dict()
  return dict(cfg)


# --- zero-shot segmentation (tipsito/evals/segmentation.py) ---

PROTOCOLS = ("whole", "slide")


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One named zero-shot segmentation benchmark (see the module docstring)."""

  class_names: tuple[str, ...]
  background_index: int | None  # the scored 'background' class, or None (label 0 is ignored)
  reduce_zero_label: bool  # label 0 -> ignore, v -> v - 1
  source: str
  image_size: int = 448  # short side
  crop_size: int = 448  # 'slide' window
  stride: int = 336  # 'slide' step (TIPS notebook; TCL uses 224)


BENCHMARKS: dict[str, Benchmark] = {
  "ade150": Benchmark(class_names_lib.ADE150, None, True, "TIPS zero-shot segmentation notebook"),
  "pc59": Benchmark(class_names_lib.PC59, None, True, "TCL 'context59' (mmseg PascalContextDataset59)"),
  "pc60": Benchmark(class_names_lib.PC60, 0, False, "TCL 'context' (mmseg PascalContextDataset)"),
  "voc21": Benchmark(class_names_lib.VOC21, 0, False, "TCL 'voc' (mmseg PascalVOCDataset)"),
}

# Keys a benchmark sets itself; giving one next to `benchmark` is an error (it would change the benchmark).
BENCHMARK_KEYS = (
  "class_names",
  "background_index",
  "background_name",
  "ignore_index",
  "reduce_zero_label",
  "mask_source",
  "resize",
)

SEGMENTATION_DEFAULTS = dict(
  benchmark=None,
  protocol="whole",
  crop_size=None,
  stride=None,
  background_index=0,
  background_name="background",
  bg_threshold=None,
  ignore_index=255,
  reduce_zero_label=False,
  mask_source="auto",
  alpha_label="label",
  resize="resize",
  patch_tokens=True,
  global_copy=True,
)


def resolve_segmentation_config(cfg) -> dict:
  """The full config of a segmentation eval (common defaults, these defaults, the benchmark, `cfg`).

  Raises KeyError for unknown keys and ValueError for a wrong value or a key that contradicts the
  benchmark; used by the evaluator and by `tipsito.config.validation` (before anything compiles).
  """
  given = as_dict(cfg)
  merged = dict(COMMON_DEFAULTS)
  merged.update(SEGMENTATION_DEFAULTS)
  unknown = set(given) - set(merged)
  if unknown:
    raise KeyError(f"unknown config keys {sorted(unknown)}")
  merged.update(given)
  if merged["protocol"] not in PROTOCOLS:
    raise ValueError(
      f"protocol={merged['protocol']!r} is not allowed; valid values: {list(PROTOCOLS)} "
      f"(the benchmark is `benchmark`: {sorted(BENCHMARKS)})"
    )
  name = merged["benchmark"]
  if name is not None:
    if name not in BENCHMARKS:
      raise ValueError(f"benchmark={name!r} is not allowed; valid values: None or {sorted(BENCHMARKS)}")
    clash = sorted(k for k in BENCHMARK_KEYS if k in given)
    if clash:
      raise ValueError(
        f"benchmark={name!r} defines {clash}; remove them, or drop `benchmark` and set every key yourself"
      )
    b = BENCHMARKS[name]
    merged.update(
      class_names=list(b.class_names),
      background_index=b.background_index,
      background_name=None,
      ignore_index=255,
      reduce_zero_label=b.reduce_zero_label,
      mask_source="segmentation",
      resize="short_side",
    )
    for key in ("image_size", "crop_size", "stride"):
      if given.get(key) is None:
        merged[key] = getattr(b, key)
    if b.background_index is None and merged["bg_threshold"] is not None:
      raise ValueError(f"bg_threshold is set but benchmark={name!r} has no background class")
  if merged["resize"] not in eval_input.RESIZE_MODES:
    raise ValueError(
      f"resize={merged['resize']!r} is not allowed; valid values: {list(eval_input.RESIZE_MODES)}"
    )
  b = merged["bootstrap"]
  if isinstance(b, bool) or not isinstance(b, int) or b < 0:
    raise ValueError(f"bootstrap={b!r} is not allowed; valid values: 0 (no intervals) or a resample count")
  for key in ("patch_tokens", "global_copy"):
    if not isinstance(merged[key], bool):
      raise ValueError(f"{key}={merged[key]!r} is not allowed; valid values: True or False")
  for key in ("crop_size", "stride"):
    v = merged[key]
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(f"{key}={v!r} is not allowed; valid values: None or an integer >= 1")
  if merged["resize"] == "short_side" and (
    isinstance(merged["image_size"], bool) or not isinstance(merged["image_size"], int)
  ):
    raise ValueError(
      f"resize='short_side' needs an integer image_size (the short side), got {merged['image_size']!r}"
    )
  return merged


# --- linear probes (tipsito/evals/probes.py) ---

# The dense-benchmark kind each probe reads (tipsito/data/dense_benchmarks.py; None: none).
PROBE_KINDS = {"linear_segmentation": "segmentation", "linear_depth": "depth", "linear_classification": None}

PROBE_DEFAULTS: dict[str, Any] = dict(
  train_split="train",
  max_train_examples=None,
  steps=1000,
  lr=1e-3,
  weight_decay=1e-4,
  probe_batch_size=16,
  seed=0,
  resize="resize",
  project=False,
)


# Each probe's own keys and defaults (tipsito/evals/probes.py: the evaluator of each type).
PROBE_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
  "linear_segmentation": dict(
    PROBE_DEFAULTS, num_classes=None, ignore_index=255, reduce_zero_label=False, raw_pixel_probe=True
  ),
  "linear_depth": dict(PROBE_DEFAULTS, depth_key="depth", depth_scale=1000.0, min_depth=1e-3, max_depth=10.0),
  "linear_classification": dict(PROBE_DEFAULTS, num_classes=None, resize="center_crop"),
}


def check_probe_config(cfg) -> None:
  """Raises KeyError / ValueError for a probe eval config that cannot run (tipsito/config/validation.py
  calls this at config time, before training starts): unknown keys, a schedule that trains nothing, a
  dense benchmark of the other kind or an unknown split of it."""
  cfg = as_dict(cfg)
  typ = cfg.get("type")
  defaults = PROBE_TYPE_DEFAULTS[typ]
  known = set(COMMON_DEFAULTS) | set(defaults)
  unknown = sorted(set(cfg) - known)
  if unknown:
    raise KeyError(f"unknown keys {unknown} for type {typ!r}; known: {sorted(known)}")
  merged = {**COMMON_DEFAULTS, **defaults, **cfg}
  for key in ("steps", "probe_batch_size"):
    if int(merged[key]) < 1:
      raise ValueError(f"{key} must be >= 1, got {merged[key]!r}")
  if not float(merged["lr"]) > 0:
    raise ValueError(f"lr must be > 0, got {merged['lr']!r}")
  bench = dense_benchmarks.benchmark(merged.get("dataset"))
  if bench is not None:
    if PROBE_KINDS[typ] != bench.kind:
      raise ValueError(f"dataset {bench.name!r} is a {bench.kind} benchmark; type {typ!r} cannot read it")
    for key in ("split", "train_split"):
      if merged[key] not in bench.splits:
        raise ValueError(
          f"{key} {merged[key]!r} is not a split of {bench.name}; known: {sorted(bench.splits)}"
        )
