"""Conversion on Apache Beam: `python -m tipsito.data.convert webdataset|table ... --beam_runner R`.

Why: a billion image-text pairs do not convert on one machine. This module runs the same builders
(tipsito/data/builders/table.py, webdataset.py) as a Beam pipeline that TFDS's `download_and_prepare`
drives, and gives the same result as the single-machine path:

* the same records under the same keys, and the same array_record shards, byte for byte: TFDS's own
  BeamWriter cuts shards at hash-space boundaries (uneven, empty ones dropped), while the
  single-machine writer sorts every record by its hashed key and cuts the sorted list into
  `num_shards` equal slices; `ExactShardBeamWriter` below computes those same slices on Beam
  (`_plan`, `_split_keys`), so a dataset converted either way reads back identically, in the same
  order, and a training run over it is the same run;
* the same `conversion_report.json`: every unit of work writes its own skip report, and the driver
  merges them in input order (counts summed, each skipped input named once).

Units of work: one tar shard (webdataset), a range of `rows_per_unit` table rows, or that many
files of an image folder. A unit is converted by one worker and committed to the unit cache
(`<data_dir>/_units/<name>/<config>/<version>/<split>-<fingerprint>/`): its records
(`unit-NNNNNN.records`, a pickle stream) and then its report (`unit-NNNNNN.json`, the commit mark),
each written to a temporary name and renamed. So:

* a worker that fails mid-unit leaves no commit mark; the runner's retry (Dataflow retries a failed
  work item up to 4 times in batch; Beam's local FnApiRunner, which `DirectRunner` means here, does
  not retry and fails the job) redoes that one unit from its input;
* a job that is killed or fails leaves the committed units behind: rerunning the same command
  (same inputs and options = same fingerprint) reads those units back instead of converting them
  again, so a finished shard is neither redone nor written twice (keys are unique; TFDS refuses
  duplicates). The cache is deleted when the conversion succeeds.

Large unit inputs (table rows, file lists over 64 KiB pickled) are written to the cache as
`unit-NNNNNN.input` by the driver, so the pipeline graph holds only small elements.

`DirectRunner` is mapped to Beam's FnApiRunner, which is what Beam's DirectRunner runs batch
pipelines on after it has tried to download the Prism runner binary (a network fetch this module
avoids); `--num_workers N` becomes `--direct_num_workers=N --direct_running_mode=multi_processing`
unless `--beam_options` says otherwise. Tests: tests/test_data_beam_convert.py.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import inspect
import json
import os
import pickle
import shlex
import uuid
from typing import Sequence
from unittest import mock

from etils import epath
from tensorflow_datasets.core import shuffle, utils, writer as writer_lib
from tensorflow_datasets.core.utils import shard_utils
from tensorflow_datasets.core.utils.lazy_imports_utils import apache_beam as beam

from tipsito import paths
from tipsito.data.builders import _common

ROWS_PER_UNIT = 10000  # table rows / folder files per unit of work
SPILL_BYTES = 64 * 1024  # unit inputs above this size go to the unit cache, not into the pipeline graph
FINE_BUCKETS_PER_SHARD = 64  # hash-space buckets per output shard, to find the exact shard boundaries
UNITS_DIRNAME = "_units"


def runner_and_options(runner: str, options: str | Sequence[str] | None, num_workers: int | None):
  """(runner for beam.Pipeline, PipelineOptions) from the CLI flags (see module docstring)."""
  from apache_beam.options import pipeline_options  # pylint: disable=g-import-not-at-top

  args = shlex.split(options) if isinstance(options, str) else list(options or [])
  given = {a.split("=", 1)[0].lstrip("-") for a in args}
  if runner in ("DirectRunner", "FnApiRunner"):
    from apache_beam.runners.portability.fn_api_runner import fn_runner  # pylint: disable=g-import-not-at-top

    if "default_sdk_harness_log_level" not in given:  # the workers' INFO lines would drown the report
      args.append("--default_sdk_harness_log_level=WARNING")
    if num_workers and num_workers > 1 and "direct_num_workers" not in given:
      args.append(f"--direct_num_workers={num_workers}")
      if "direct_running_mode" not in given:
        args.append("--direct_running_mode=multi_processing")
    return fn_runner.FnApiRunner(), pipeline_options.PipelineOptions(args)
  return runner, pipeline_options.PipelineOptions(args)


def unit_cache_dir(builder, reader, units: list) -> str:
  """The cache folder of this conversion: data_dir/_units/name/config/version/split-fingerprint.

  The fingerprint covers everything that decides a unit's records: the reader's settings (fields,
  image root, labels), every unit's input (shard path and sample cap, or rows) and the version.
  """
  h = hashlib.sha256()
  h.update(
    json.dumps(
      [type(reader).__name__, vars(reader), builder.name, str(builder.version)], sort_keys=True, default=str
    ).encode()
  )
  for unit in units:
    h.update(json.dumps(unit, sort_keys=True, default=str).encode())
  config = builder.builder_config.name if builder.builder_config else "default"
  return paths.join(
    builder.data_dir_root,
    UNITS_DIRNAME,
    builder.name,
    config,
    str(builder.version),
    f"{builder._split}-{h.hexdigest()[:16]}",
  )  # pylint: disable=protected-access


def _unit_path(cache_dir: str, index: int, suffix: str) -> str:
  """cache_dir/unit-NNNNNN.suffix."""
  return paths.join(cache_dir, f"unit-{index:06d}.{suffix}")


def _commit(path: str, data: bytes) -> None:
  """Writes `data` to `path` atomically (temporary name, then rename)."""
  tmp = f"{path}.tmp-{uuid.uuid4().hex}"
  paths.as_path(tmp).write_bytes(data)
  _rename(tmp, path)


def _rename(src: str, dst: str) -> None:
  """Renames (replaces) src to dst, local or remote."""
  if paths.is_url(src):
    paths.as_path(src).rename(dst)
  else:
    os.replace(src, dst)


def unit_elements(units: list, cache_dir: str) -> list[tuple[int, bytes]]:
  """(index, pickled unit) per unit; a unit whose pickle is over SPILL_BYTES is written to the cache
  and replaced by the pickle of ('@file', path). Pickled, because Beam's inferred coders cannot
  encode every input (a non-UTF-8 table row is a str with surrogate escapes)."""
  out = []
  for i, unit in enumerate(units):
    blob = pickle.dumps(unit, protocol=pickle.HIGHEST_PROTOCOL)
    if len(blob) > SPILL_BYTES:
      path = _unit_path(cache_dir, i, "input")
      if not paths.isfile(path):
        paths.as_path(cache_dir).mkdir(parents=True, exist_ok=True)
        _commit(path, blob)
      blob = pickle.dumps(("@file", path), protocol=pickle.HIGHEST_PROTOCOL)
    out.append((i, blob))
  return out


def convert_unit(reader, cache_dir: str, index: int, unit_blob: bytes):
  """Converts one unit (or reads it back from the cache if it was committed); yields (key, record).

  Runs on a Beam worker. The records stream to a temporary file while they are yielded; the unit is
  committed (records renamed, then its report written) only after the last one.
  """
  done = _unit_path(cache_dir, index, "json")
  records_path = _unit_path(cache_dir, index, "records")
  if paths.isfile(done):
    _counter("units_reused").inc()
    with paths.open_binary(records_path) as f:
      while True:
        try:
          yield pickle.load(f)
        except EOFError:
          return
  unit = pickle.loads(unit_blob)
  if isinstance(unit, tuple) and len(unit) == 2 and unit[0] == "@file":
    with paths.open_binary(unit[1]) as f:
      unit = pickle.load(f)
  report = _common.SkipReport(dataset="unit")
  paths.as_path(cache_dir).mkdir(parents=True, exist_ok=True)
  tmp = f"{records_path}.tmp-{uuid.uuid4().hex}"
  with paths.as_path(tmp).open("wb") as f:
    for key, record in _common.run_conversion(None, reader.unit_items(unit), report, num_workers=1):
      pickle.dump((key, record), f, protocol=pickle.HIGHEST_PROTOCOL)
      yield key, record
  _rename(tmp, records_path)
  _commit(done, json.dumps({"index": index, **report.to_dict()}, ensure_ascii=False).encode("utf-8"))
  _counter("units_converted").inc()


def _counter(name: str):
  """A Beam metrics counter of this module."""
  return beam.metrics.Metrics.counter("tipsito_convert", name)


def merge_reports(cache_dir: str, num_units: int, dataset: str) -> tuple[_common.SkipReport, list[int]]:
  """The merged SkipReport of the committed units, in unit order; and the indices of missing units."""
  report = _common.SkipReport(dataset)
  missing = []
  for i in range(num_units):
    path = _unit_path(cache_dir, i, "json")
    if not paths.isfile(path):
      missing.append(i)
      continue
    part = json.loads(paths.as_path(path).read_text(encoding="utf-8"))
    report.total += part["total"]
    report.written += part["written"]
    report.skipped += part["skipped"]
  return report, missing


def _units_transform(elements, reader, cache_dir: str):
  """PTransform: unit elements -> (key, record), each unit on one worker (a Reshuffle spreads them)."""

  @beam.ptransform_fn
  def _convert_units(pbegin):
    """Create -> Reshuffle -> convert (or read back) each unit."""
    return (
      pbegin
      | "Units" >> beam.Create(elements, reshuffle=False)
      | "Spread" >> beam.Reshuffle()
      | "Convert" >> beam.FlatMap(lambda e: convert_unit(reader, cache_dir, *e))
    )

  return _convert_units()  # pylint: disable=no-value-for-parameter


class ExactShardBeamWriter(writer_lib.BeamWriter):
  """TFDS BeamWriter whose shards are those of TFDS's single-machine Writer (module docstring).

  The records sorted by hashed key are cut at ranks round(N * i / num_shards). The rank of a key is
  found without sorting all records in one place: the hash space is cut into FINE_BUCKETS_PER_SHARD
  buckets per shard, the records per bucket are counted, and only the few buckets that hold a
  boundary rank have their keys (not records) gathered and sorted to name the boundary key.
  """

  def _plan(self, num_examples: int, total_size: int) -> dict:
    """num_shards (as the single-machine Writer picks it), the boundary ranks, the fine buckets."""
    num_shards = self._shard_config.get_number_shards(total_size, num_examples)
    boundaries = list(shard_utils.get_shard_boundaries(num_examples, num_shards))
    return {
      "num_shards": num_shards,
      "boundaries": boundaries,
      "buckets": FINE_BUCKETS_PER_SHARD * num_shards,
    }

  @staticmethod
  def _bucket(hkey: int, plan: dict) -> int:
    """The fine bucket of a hashed key (buckets are in key order)."""
    return (hkey * plan["buckets"]) >> shuffle.HKEY_SIZE

  @staticmethod
  def _needed(plan: dict, counts: dict) -> dict:
    """bucket -> [(rank inside the bucket, boundary number)] for every rank where a shard starts."""
    starts = plan["boundaries"][:-1]
    needed: dict = {}
    offset, j = 0, 0
    for b in sorted(counts):
      while j < len(starts) and starts[j] < offset + counts[b]:
        needed.setdefault(b, []).append((starts[j] - offset, j))
        j += 1
      offset += counts[b]
    return needed

  @staticmethod
  def _pick(bucket_keys, needed: dict):
    """The boundary keys that lie in one bucket: (boundary number, key)."""
    bucket, keys = bucket_keys
    keys = sorted(keys)
    for rank, j in needed[bucket]:
      yield j, keys[rank]

  def _write_shard(self, shard_examples, plan: dict):
    """Writes one shard (records sorted by hashed key) to its final name; returns its _ShardInfo."""
    shard_id, examples = shard_examples
    examples = sorted(examples, key=lambda kv: kv[0])
    for (k1, e1), (k2, e2) in zip(examples, examples[1:]):
      if k1 == k2 and not self._ignore_duplicates:
        writer_lib._raise_error_for_duplicated_keys(e1, e2, self._serializer.example_specs)  # pylint: disable=protected-access
    if self._ignore_duplicates:
      examples = [kv for i, kv in enumerate(examples) if i == 0 or kv[0] != examples[i - 1][0]]
    shard_path = self._filename_template.sharded_filepath(shard_index=shard_id, num_shards=plan["num_shards"])
    with utils.incomplete_files(epath.Path(shard_path)) as tmp_path:
      record_keys = self._example_writer.write(tmp_path, examples)
    if record_keys:
      writer_lib._write_index_file(writer_lib._get_index_path(os.fspath(shard_path)), list(record_keys))  # pylint: disable=protected-access
    self.inc_counter(name="written_shards")
    return writer_lib._ShardInfo(
      id=shard_id,
      num_examples=len(examples),  # pylint: disable=protected-access
      size=sum(len(e) for _, e in examples),
    )

  def write_from_pcollection(self, examples_pcollection):
    """(key, example) -> exact shards + split info (see class docstring)."""
    side = beam.pvalue.AsSingleton
    serialized = examples_pcollection | "Serialize" >> beam.Map(self._serialize_example)
    keys = serialized | "Keys" >> beam.Keys()
    total_size = side(serialized | beam.Values() | beam.Map(len) | "TotalSize" >> beam.CombineGlobally(sum))
    plan_pc = (
      keys
      | "CountExamples" >> beam.combiners.Count.Globally()
      | "CheckValidNumExamples" >> beam.Map(self._check_num_examples)
      | "Plan" >> beam.Map(self._plan, total_size=total_size)
    )
    plan = side(plan_pc)
    counts = side(
      keys
      | "FineBucket" >> beam.Map(lambda h, p: (self._bucket(h, p), 1), p=plan)
      | "CountPerBucket" >> beam.CombinePerKey(sum)
      | "CountsToDict" >> beam.combiners.ToDict()
    )
    needed = side(plan_pc | "Needed" >> beam.Map(lambda p, c: self._needed(p, c), c=counts))
    split_keys = side(
      keys
      | "KeyToBucket" >> beam.Map(lambda h, p: (self._bucket(h, p), h), p=plan)
      | "BoundaryBuckets" >> beam.Filter(lambda bh, n: bh[0] in n, n=needed)
      | "GroupBoundaryBuckets" >> beam.GroupByKey()
      | "PickBoundaryKeys" >> beam.FlatMap(self._pick, needed=needed)
      | "BoundaryKeys" >> beam.combiners.ToList()
      | "SortBoundaryKeys" >> beam.Map(lambda jk: [k for _, k in sorted(jk)])
    )
    return (
      serialized
      | "AssignShard" >> beam.Map(lambda kv, s: (bisect.bisect_right(s, kv[0]), kv), s=split_keys)
      | "GroupShards" >> beam.GroupByKey()
      | "WriteFinalShards" >> beam.Map(self._write_shard, plan=plan)
      | "CollectShardInfo" >> beam.combiners.ToList()
      | "CalculateSplitInfo" >> beam.ParDo(self._store_split_info)
    )


def _remove_cache(cache_dir: str, units_root: str) -> None:
  """Deletes a unit cache and the folders above it up to `units_root` that it leaves empty."""
  path = paths.as_path(cache_dir)
  path.rmtree(missing_ok=True)
  root = paths.as_path(units_root)
  while path != root and root in path.parents:
    path = path.parent
    try:
      if any(path.iterdir()):
        break
      path.rmdir()
    except OSError:
      break


@dataclasses.dataclass
class BeamRun:
  """What a Beam conversion did: units in all, units already committed before it ran, the cache."""

  num_units: int
  reused_units: int
  cache_dir: str


def download_and_prepare(
  builder,
  download_config,
  *,
  runner: str,
  options=None,
  num_workers: int | None = None,
  rows_per_unit: int = ROWS_PER_UNIT,
) -> BeamRun:
  """Builds `builder` (table / webdataset) on Beam; sets `builder.report` to the merged skip report.

  The report is merged even when the pipeline fails (the units that did commit), so that an
  all-skipped conversion is reported as on the single-machine path (tipsito/data/convert.py).
  """
  if not hasattr(builder, "unit_reader"):
    raise ValueError(f"{builder.name}: --beam_runner is supported for the table and webdataset builders")
  takes_rows = "rows_per_unit" in inspect.signature(builder.units).parameters
  units = builder.units(rows_per_unit=rows_per_unit) if takes_rows else builder.units()
  reader = builder.unit_reader()
  cache_dir = unit_cache_dir(builder, reader, units)
  reused = (
    sum(paths.isfile(_unit_path(cache_dir, i, "json")) for i in range(len(units)))
    if paths.isdir(cache_dir)
    else 0
  )
  if reused:
    print(f"[{builder.name}] {reused} of {len(units)} units already converted in {cache_dir}: read back")
  elements = unit_elements(units, cache_dir)
  beam_runner, beam_options = runner_and_options(runner, options, num_workers)
  config = dataclasses.replace(download_config, beam_runner=beam_runner, beam_options=beam_options)
  builder.beam_transform = _units_transform(elements, reader, cache_dir)
  ok = False
  try:
    with mock.patch.object(writer_lib, "BeamWriter", ExactShardBeamWriter):
      builder.download_and_prepare(download_config=config)
    ok = True
  finally:
    builder.beam_transform = None
    report, missing = merge_reports(cache_dir, len(units), builder.name)
    builder.report = report
    if ok and missing:
      raise RuntimeError(f"{builder.name}: units {missing[:10]} wrote no report in {cache_dir}")
    if ok or (not missing and report.written == 0):  # done, or nothing worth resuming
      _remove_cache(cache_dir, paths.join(builder.data_dir_root, UNITS_DIRNAME))
  return BeamRun(num_units=len(units), reused_units=reused, cache_dir=cache_dir)
