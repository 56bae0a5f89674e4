"""The dataset conversion library behind `python -m tipsito.data.convert` (tipsito/data/convert.py: the CLI).

Builds a tipsito dataset as sharded TFDS array_record (`convert`), with a skip report
(`conversion_report.json` next to the array_record files) for the inputs left out; library code
(tipsito/data/prepare.py, tipsito/data/eval_input.py) calls it here, not through the CLI module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Sequence

from tipsito import paths
from tipsito.data import builders
from tipsito.data.builders import _common
from tipsito.data.builders import scenes_gen
from tipsito.data.builders import shapes_gen

NAMES = tuple(builders.BUILDERS)
# Default records per array_record shard. TFDS sizes shards by bytes (64 MiB..1 GiB, and tfds 4.9.10
# ignores DownloadConfig's min/max_shard_size), which puts all of Fashion-MNIST's 60k small records
# in one shard; but an array_record random read costs time proportional to the records in its shard
# (measured: 25 us at 5k records, 560 us at 60k). So we pick num_shards from the split sizes.
EXAMPLES_PER_SHARD = 4096


class ConversionError(RuntimeError):
  """A conversion wrote nothing usable; the message carries the skip report and what to change."""


def _all_skipped_message(name: str, report: _common.SkipReport, builder, report_path: str | None) -> str:
  """Why every input was skipped (counts per reason, the first few items) and the flag that fixes it."""
  lines = [f"{name}: every input was skipped, nothing was written. {report.summary()}"]
  for s in report.skipped[:5]:
    lines.append(f"  skipped {s['item']}: {s['reason']}" + (f" ({s['detail']})" if s["detail"] else ""))
  if len(report.skipped) > 5:
    lines.append(f"  ... {len(report.skipped) - 5} more")
  if report_path:
    lines.append(f"  full report: {report_path}")
  reasons = report.by_reason
  if reasons.get(_common.SKIP_MISSING_IMAGE) and name == "table":
    root = getattr(builder, "_image_root", None)
    lines.append(
      f"Relative image paths are resolved against --image_root (now {root!r}, by default the "
      "table's folder): pass --image_root DIR with the folder the paths are relative to, or "
      "--image_column COL if the paths are in another column."
    )
  elif reasons.get(_common.SKIP_MISSING_CAPTION):
    lines.append("Pass --caption_columns with the columns (or json fields) that hold the captions.")
  return "\n".join(lines)


@dataclasses.dataclass
class ConvertResult:
  """What a conversion produced: the dataset directory (with version), split sizes and the report."""

  name: str
  dataset_dir: str
  split_sizes: dict
  report: _common.SkipReport | None
  report_path: str | None
  seconds: float


def parse_split_sizes(text: str | None) -> dict[str, int] | None:
  """'train=2000,test=200' (or '2000,200' = train,test) -> {'train': 2000, 'test': 200}."""
  if not text:
    return None
  out = {}
  for i, part in enumerate(p for p in text.split(",") if p.strip()):
    if "=" in part:
      k, v = part.split("=", 1)
    else:
      k, v = ("train", "test")[i], part
    out[k.strip()] = int(v)
  return out


def choose_num_shards(builder) -> int:
  """Shards per split (TFDS uses one count for all splits): ~EXAMPLES_PER_SHARD records in the
  largest split, never more shards than records in the smallest split."""
  sizes = [n for n in getattr(builder, "split_size_estimates", dict)().values() if n > 0]
  if not sizes:
    return 1
  return max(1, min(-(-max(sizes) // EXAMPLES_PER_SHARD), min(sizes)))


def convert(
  name: str,
  data_dir: str,
  *,
  input_path: str | None = None,
  split_sizes: dict | None = None,
  image_size: int | None = None,
  num_workers: int | None = None,
  num_shards: int | None = None,
  limit: int | None = None,
  config_name: str | None = None,
  overwrite: bool = False,
  verbose: bool = True,
  max_objects: int | None = None,
  object_sizes: Sequence[str] | None = None,
  colours: Sequence[str] | None = None,
  beam_runner: str | None = None,
  beam_options: str | None = None,
  rows_per_unit: int | None = None,
  **builder_kwargs,
) -> ConvertResult:
  """Builds dataset `name` into `data_dir`; returns a ConvertResult. See module docstring. `beam_runner`
  (table / webdataset): build on Apache Beam, the same dataset and report (tipsito/data/beam_convert.py)."""
  start = time.time()
  cls = builders.builder_class(name)
  kwargs = dict(builder_kwargs)
  kwargs["num_workers"] = _common.default_num_workers() if num_workers is None else num_workers
  config = _builder_options(
    name,
    cls,
    kwargs,
    input_path=input_path,
    split_sizes=split_sizes,
    image_size=image_size,
    limit=limit,
    config_name=config_name,
    max_objects=max_objects,
    object_sizes=object_sizes,
    colours=colours,
  )
  builder = cls(data_dir=data_dir, config=config, file_format="array_record", **kwargs)
  beam = None
  if beam_runner:  # tipsito/data/beam_convert.py: the same dataset and report, built on Beam
    beam = dict(
      runner=beam_runner, options=beam_options, num_workers=num_workers, rows_per_unit=rows_per_unit or 10000
    )
  report, report_path = _prepare(
    builder, name, data_dir, num_shards=num_shards, overwrite=overwrite, verbose=verbose, beam=beam
  )
  sizes = {k: v.num_examples for k, v in builder.info.splits.items()}
  result = ConvertResult(
    name=name,
    dataset_dir=os.fspath(builder.data_dir),
    split_sizes=sizes,
    report=report,
    report_path=report_path,
    seconds=time.time() - start,
  )
  if verbose:
    print(f"[{name}] {sizes} -> {result.dataset_dir} ({result.seconds:.1f}s)")
  return result


def _builder_options(
  name: str,
  cls,
  kwargs: dict,
  *,
  input_path,
  split_sizes,
  image_size,
  limit,
  config_name,
  max_objects,
  object_sizes,
  colours,
):
  """Checks the options that apply to builder `name`, adds them to `kwargs`; returns its BuilderConfig."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  config = None
  if name in ("shapes", "scenes", "tuxpaint", "fashion_mnist", "openclipart"):
    # Size knobs are builder overrides, not part of the config identity: the default config's
    # directory holds whatever sizes were asked for; --config_name keeps variants side by side.
    base = cls.BUILDER_CONFIGS[0]
    if config_name and config_name != base.name:
      config = dataclasses.replace(base, name=config_name, description=f"custom config {config_name}")
    else:
      config = base.name
  if name == "shapes":
    sizes = split_sizes or {}
    unknown = set(sizes) - {"train", "test"}
    if unknown:
      raise ValueError(f"shapes: unknown splits {sorted(unknown)} (train, test)")
    shapes_gen.check_options(max_objects=max_objects, sizes=object_sizes, colours=colours)
    object_sizes = tuple(object_sizes) if object_sizes is not None else None
    colours = tuple(colours) if colours is not None else None
    kwargs["overrides"] = {
      "image_size": image_size,
      "train_size": sizes.get("train"),
      "test_size": sizes.get("test"),
      "max_objects": max_objects,
      "object_sizes": object_sizes,
      "colours": colours,
    }
  elif name == "scenes":
    sizes = split_sizes or {}
    unknown = set(sizes) - {"train", "validation", "test"}
    if unknown:
      raise ValueError(f"scenes: unknown splits {sorted(unknown)} (train, validation, test)")
    if (object_sizes, colours) != (None, None):
      raise ValueError("scenes: object_sizes / colours only apply to shapes (scenes has one class set)")
    scenes_gen.check_options(max_objects=max_objects)
    kwargs["overrides"] = {
      "image_size": image_size,
      "train_size": sizes.get("train"),
      "validation_size": sizes.get("validation"),
      "test_size": sizes.get("test"),
      "max_objects": max_objects,
    }
  elif name == "tuxpaint":
    if input_path:
      kwargs["stamps_dir"] = input_path
    kwargs["limit"] = limit
    kwargs["overrides"] = {"max_size": image_size}
  elif name == "openclipart":
    if input_path:
      kwargs["input_dir"] = input_path
    kwargs["limit"] = limit
    kwargs["overrides"] = {"max_size": image_size}
  elif name == "fashion_mnist":
    if input_path:
      kwargs["input_dir"] = input_path
    kwargs["limit"] = limit
    kwargs["overrides"] = {"image_size": image_size}
  else:  # table / webdataset
    if not input_path:
      raise ValueError(f"{name}: --input is required")
    kwargs["input_path"] = input_path
    kwargs["limit"] = limit
    if config_name:
      config = tfds.core.BuilderConfig(name=config_name)
  if name not in ("shapes", "scenes") and (max_objects, object_sizes, colours) != (None, None, None):
    raise ValueError(
      f"{name}: max_objects / object_sizes / colours only apply to shapes (max_objects: scenes)"
    )
  if split_sizes and name not in ("shapes", "scenes"):
    raise ValueError(f"{name}: --split_sizes only applies to shapes and scenes (use --limit)")
  return config


def _prepare(builder, name: str, data_dir: str, *, num_shards, overwrite: bool, verbose: bool, beam=None):
  """Runs TFDS' download_and_prepare unless already built; returns (ConversionReport, its path) or Nones."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  dl_config = tfds.download.DownloadConfig(
    num_shards=num_shards or choose_num_shards(builder),
    download_mode=(
      tfds.download.GenerateMode.FORCE_REDOWNLOAD
      if overwrite
      else tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS
    ),
  )
  already = builder.is_prepared() if hasattr(builder, "is_prepared") else False
  if already and not overwrite:
    if verbose:
      print(f"[{name}] already prepared at {builder.data_dir} (use --overwrite to rebuild)")
    return None, None
  try:
    if beam:
      from tipsito.data import beam_convert  # optional dependency: Apache Beam (--beam_runner only)

      beam_convert.download_and_prepare(builder, dl_config, **beam)
    else:
      builder.download_and_prepare(download_config=dl_config)
  except Exception as e:  # TFDS ends an all-skipped split with "No examples were yielded"
    report = getattr(builder, "report", None)
    if report is None or report.written or not report.skipped:
      raise
    paths.as_path(data_dir).mkdir(parents=True, exist_ok=True)
    report_path = paths.join(data_dir, f"{name}_{_common.REPORT_FILENAME}")
    paths.as_path(report_path).write_text(
      json.dumps(report.to_dict(), indent=2, ensure_ascii=False), encoding="utf-8"
    )
    raise ConversionError(_all_skipped_message(name, report, builder, report_path)) from e
  report = getattr(builder, "report", None)
  report_path = report.write(builder.data_dir) if report is not None else None
  if verbose and report is not None:
    print(report.summary())
    for s in report.skipped[:50]:
      print(f"  skipped {s['item']}: {s['reason']}" + (f" ({s['detail']})" if s["detail"] else ""))
    if len(report.skipped) > 50:
      print(f"  ... {len(report.skipped) - 50} more in {report_path}")
  return report, report_path
