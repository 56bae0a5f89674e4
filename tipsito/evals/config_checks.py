"""The eval settings' checks that need more than the config: the segmentation benchmarks' class names,
and the checks that read the eval data on disk, run before training.

Why here and not in tipsito/config/validation.py: every eval key, its default and range are declared in
the config schema (tipsito/config/schema.py `EVAL_KEYS`) and checked, with the rules that relate them to
the model, by `validation.eval_settings` when a config validates (which opens no file and imports no
tipsito module outside the config layer but the leaves, tests/test_import_structure.py). What is left needs
the evaluators' tables or the data: a benchmark's class names (`resolve_segmentation_config`), a dense
benchmark's kind and splits, and a prepared dataset's own splits and fields (`check_evals_on_disk`, which
tipsito/train/loop.py runs before anything is written, so a bad split costs seconds, not a training run).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from tipsito import choices
from tipsito.config import validation
from tipsito.data import dense_benchmarks
from tipsito.data import sources
from tipsito.evals import class_names as class_names_lib


def as_dict(cfg) -> dict:
  """ConfigDict / Mapping / None -> plain dict (evaluators keep an immutable snapshot)."""
  if cfg is None:
    return {}
  if hasattr(cfg, "to_dict"):
    return cfg.to_dict()
  return dict(cfg)


# --- zero-shot segmentation (tipsito/evals/segmentation.py) ---


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One named zero-shot segmentation benchmark (see the module docstring)."""

  class_names: tuple[str, ...]
  background_index: int | None  # the scored 'background' class, or None (label 0 is ignored)
  reduce_zero_label: bool  # label 0 -> ignore, v -> v - 1
  source: str
  # the sizes (short side, 'slide' window and step: TIPS notebook; TCL steps 224) are choices.BENCHMARK_SIZES


BENCHMARKS: dict[str, Benchmark] = {
  "ade150": Benchmark(class_names_lib.ADE150, None, True, "TIPS zero-shot segmentation notebook"),
  "pc59": Benchmark(class_names_lib.PC59, None, True, "TCL 'context59' (mmseg PascalContextDataset59)"),
  "pc60": Benchmark(class_names_lib.PC60, 0, False, "TCL 'context' (mmseg PascalContextDataset)"),
  "voc21": Benchmark(class_names_lib.VOC21, 0, False, "TCL 'voc' (mmseg PascalVOCDataset)"),
}

# The benchmarks' names and whether each scores a background class are declared in tipsito/choices.py
# (validation reads them there); tests/test_eval_config_validation.py checks the two tables agree.
BENCHMARK_KEYS = choices.BENCHMARK_KEYS


def resolve_segmentation_config(cfg, *, name: str = "segmentation", need_dataset: bool = False) -> dict:
  """The full settings of a segmentation eval: `validation.eval_settings` (every key, checked, the
  benchmark's sizes), then the keys a `benchmark` sets itself (its class names and label conventions).
  Raises ConfigError (a ValueError) naming the key; used by the evaluator and `registry.resolved_config`.
  """
  given = {"type": "segmentation", **as_dict(cfg)}
  out = validation.eval_settings(name, given, need_dataset=need_dataset)
  if out["benchmark"] is not None:
    b = BENCHMARKS[out["benchmark"]]
    out.update(
      class_names=list(b.class_names),
      background_index=b.background_index,
      background_name=None,
      ignore_index=255,
      reduce_zero_label=b.reduce_zero_label,
      mask_source="segmentation",
      resize="short_side",
    )
  return out


# --- linear probes (tipsito/evals/probes.py) ---

# The dense-benchmark kind each probe reads (tipsito/data/dense_benchmarks.py; None: none).
PROBE_KINDS = {"linear_segmentation": "segmentation", "linear_depth": "depth", "linear_classification": None}

# The record fields each eval type reads besides the image (the label, the label map, the captions).
_LABEL_TYPES = ("zeroshot", "knn", "linear_classification")


def check_evals_on_disk(config) -> None:
  """Every enabled eval's settings against its data where that is on disk: a dense benchmark's kind and
  splits (probes), a prepared TFDS dataset's splits (dataset_info.json) and record fields (features.json:
  the image, the label, the label map, retrieval's caption fields). A dataset not prepared yet is skipped
  (a built-in one is built on first use). Raises ConfigError naming the key, before anything is written."""
  for name, ev in config.evals.items():
    if not validation.eval_enabled(ev):
      continue
    s = validation.eval_settings(name, ev)
    if s["type"] in PROBE_KINDS and _check_dense_benchmark(name, s):
      continue
    root = s["data_dir"] or sources.default_data_dir()
    try:
      folder = sources.resolve_dataset_dir(s["dataset"], root)
    except (FileNotFoundError, ValueError):
      continue
    splits, fields = _dataset_files(folder)
    where = f"dataset {s['dataset']!r} at {folder}"
    for key in ("split", "train_split"):
      if key in s and splits is not None and s[key] not in splits:
        raise validation.ConfigError(
          f"config.evals.{name}.{key}={s[key]!r} is not a split of {where}; valid values: {sorted(splits)}"
        )
    if fields is None:
      continue
    need = {"image_key": s["image_key"]}
    if s["type"] in _LABEL_TYPES:
      need["label_key"] = s["label_key"]
    if s["type"] == "segmentation" and s["mask_source"] == "segmentation":
      need["segmentation_key"] = s["segmentation_key"]
    for key, field in need.items():
      if field not in fields:
        raise validation.ConfigError(
          f"config.evals.{name}.{key}={field!r} is not a record field of {where}; valid values: "
          f"{sorted(fields)}"
        )
    if s["type"] == "retrieval" and s["caption_keys"]:
      missing = [k for k in s["caption_keys"] if k not in fields]
      if missing:
        raise validation.ConfigError(
          f"config.evals.{name}.caption_keys={tuple(s['caption_keys'])!r}: {missing} not record fields "
          f"of {where}; valid values: {sorted(f for f in fields if f.startswith('caption') or f == 'alt_text')}"
        )


def _check_dense_benchmark(name: str, s: dict) -> bool:
  """A probe on a dense benchmark (tipsito/data/dense_benchmarks.py): its kind and splits; False when the
  dataset is not one."""
  bench = dense_benchmarks.benchmark(s["dataset"])
  if bench is None:
    return False
  if PROBE_KINDS[s["type"]] != bench.kind:
    raise validation.ConfigError(
      f"config.evals.{name}.dataset={bench.name!r} is a {bench.kind} benchmark; type {s['type']!r} cannot "
      f"read it (valid types: {[t for t, k in PROBE_KINDS.items() if k == bench.kind]})"
    )
  for key in ("split", "train_split"):
    if s[key] not in bench.splits:
      raise validation.ConfigError(
        f"config.evals.{name}.{key}={s[key]!r} is not a split of {bench.name}; valid values: "
        f"{sorted(bench.splits)}"
      )
  return True


def _dataset_files(folder: str) -> tuple[Any, Any]:
  """(split names, record field names) of a prepared TFDS dataset folder; None for what it lacks."""
  splits = fields = None
  try:
    with open(os.path.join(folder, "dataset_info.json")) as f:
      splits = {sp["name"] for sp in json.load(f).get("splits", [])} or None
  except (OSError, ValueError, KeyError, TypeError):
    pass
  try:
    with open(os.path.join(folder, "features.json")) as f:
      fields = set(json.load(f)["featuresDict"]["features"])
  except (OSError, ValueError, KeyError, TypeError):
    pass
  return splits, fields
