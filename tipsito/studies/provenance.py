"""Where and on what a study run ran: the commit, the machine and the accelerator, for its result.json.

Why: a study's number is only comparable with another if both ran the same code on a known machine; wall
times in particular mean nothing without the cores they had. Every finished run records this next to its
metrics (tipsito/studies/jobs.py), and results.json lists the commits and machines of all its runs
(tipsito/studies/results.py), so a table mixing two commits or two machine kinds says so.

`environment` adds, once per sweep, what else decides a number: the versions of the packages that compute
it (jax, jaxlib, flax, optax, numpy, tensorflow-datasets), the XLA flags of the process (`XLA_FLAGS`,
inherited by the sweep's subprocess jobs) and a fingerprint of every dataset the runs read: the sha256
of each built split's examples (`dataset_fingerprint`), so that two results.json files that read different
builds of `scenes` (another size, another builder version) say so, and two builds of the same examples
do not differ.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
from typing import Any, Iterable

import jax


def commit() -> dict[str, Any]:
  """The git commit of the tipsito source that runs, and whether its work tree had uncommitted changes
  (None where the package is not in a git checkout, e.g. an installed wheel)."""
  here = os.path.dirname(os.path.abspath(__file__))

  def git(*args):
    out = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=30, check=False)
    return out.stdout.strip() if out.returncode == 0 else None

  try:
    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    head = dirty = None
  return {"commit": head, "dirty": None if head is None or dirty is None else bool(dirty)}


def memory_gib() -> float | None:
  """Physical memory of this machine in GiB (POSIX sysconf; None where it is not available)."""
  try:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
  except (ValueError, OSError, AttributeError):
    return None


def processor() -> dict[str, str | None]:
  """The CPU's model name and a digest of its instruction-set flags (Linux /proc/cpuinfo; else
  `platform.processor()` and None). Why: XLA:CPU compiles for the processor it runs on, so the same code,
  config and data round differently on two processors, and a run's numbers are reproducible to the last
  digit only on the same kind (docs/studies.md); two machines with the same cores and memory may differ
  here."""
  model, flags = None, None
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
          model = value.strip()
        elif key.strip() == "flags" and flags is None:
          flags = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:12]
  except OSError:
    pass
  return {"model": model or platform.processor() or None, "flags_sha256": flags}


# Shared-library names of the allocators a process can be run under (LD_PRELOAD) instead of the C library's.
_ALLOCATORS = {"libjemalloc": "jemalloc", "libtcmalloc": "tcmalloc", "libmimalloc": "mimalloc"}


def allocator() -> dict[str, str | None]:
  """Which `malloc` this process runs: a preloaded allocator found among its mapped libraries
  (/proc/self/maps), else the C library's ('libc'); None off Linux. `conf` is jemalloc's MALLOC_CONF.

  Why: XLA:CPU allocates a step's temporaries at every call; glibc maps allocations that large afresh and
  faults them in each time, an allocator that keeps freed memory mapped does not, and the same step is
  20-25 % faster under the second (docs/performance.md). A step time means little without it."""
  try:
    with open("/proc/self/maps", encoding="utf-8") as f:
      maps = f.read()
  except OSError:
    return {"name": None, "conf": None}
  for prefix, name in _ALLOCATORS.items():
    if f"/{prefix}" in maps:  # a mapped file's path: .../libjemalloc.so.2
      return {"name": name, "conf": os.environ.get("MALLOC_CONF") if name == "jemalloc" else None}
  return {"name": "libc", "conf": None}


def machine() -> dict[str, Any]:
  """Cores, memory, processor and accelerator of this process's machine (the accelerator as JAX sees it),
  and the allocator it runs under."""
  devices = jax.local_devices()
  return {
    "host": platform.node(),
    "processor": processor(),
    "cores": os.cpu_count(),
    "memory_gib": memory_gib(),
    "allocator": allocator(),
    "platform": devices[0].platform if devices else None,
    "accelerator": sorted({d.device_kind for d in devices}) if devices else [],
    "local_devices": len(devices),
    "jax": jax.__version__,
    "python": platform.python_version(),
  }


# The commit of the code this process runs: taken when the module is first imported (the sweep and each
# job import it before training), since a checkout that moves on while a long sweep runs does not change
# the code already loaded.
_LOADED = commit()


def describe() -> dict[str, Any]:
  """The provenance of a run of this process: the commit its code was loaded from, and the machine."""
  return {**_LOADED, "machine": machine()}


# The packages whose versions results.json records (distribution names).
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "tensorflow-datasets")
# `<name>-<split>.<format>-00000-of-00001`: a TFDS split file (tipsito/data/conversion.py writes them).
_SPLIT_FILE = re.compile(r"^[^-]+-(?P<split>[A-Za-z0-9_]+)\.(array_record|tfrecord|riegeli)\b")


def packages(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
  """{distribution: installed version} (None when not installed)."""
  out = {}
  for n in names:
    try:
      out[n] = importlib.metadata.version(n)
    except importlib.metadata.PackageNotFoundError:
      out[n] = None
  return out


def dataset_fingerprint(dataset_dir: str) -> dict[str, str]:
  """{split: sha256} over the built split files of a TFDS dataset folder (`<data_dir>/<name>/<version>`):
  per split, the file names and the examples in name and record order. Files of no split
  (dataset_info.json, ...) are left out: they hold metadata that a rebuild may reorder without changing an
  example.

  Why the examples and not the files' bytes: a serialised tf.train.Example writes its feature map in no
  fixed order, so two builds of the same examples in the same order differ byte for byte (docs/data.md);
  each array_record example is hashed in deterministic serialisation. Other formats are hashed as bytes."""
  groups: dict[str, list[str]] = {}
  for f in sorted(os.listdir(dataset_dir)):
    m = _SPLIT_FILE.match(f)
    if m and os.path.isfile(os.path.join(dataset_dir, f)):
      groups.setdefault(m.group("split"), []).append(f)
  out = {}
  for split, files in sorted(groups.items()):
    h = hashlib.sha256()
    for f in files:
      h.update(f.encode() + b"\0")
      path = os.path.join(dataset_dir, f)
      if ".array_record" in f:
        for record in _canonical_examples(path):
          h.update(len(record).to_bytes(8, "little") + record)
        continue
      with open(path, "rb") as fh:
        for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
          h.update(chunk)
    out[split] = h.hexdigest()
  return out


def _canonical_examples(path: str) -> Iterable[bytes]:
  """The records of an array_record file, each a tf.train.Example re-serialised deterministically (a record
  that is no Example is taken as it is)."""
  from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=import-outside-toplevel
  from tensorflow.core.example import example_pb2  # pylint: disable=import-outside-toplevel
  from google.protobuf.message import DecodeError  # pylint: disable=import-outside-toplevel

  reader = ArrayRecordReader(path)
  try:
    n = reader.num_records()
    for start in range(0, n, 1024):
      for raw in reader.read(start, min(start + 1024, n)):
        try:
          yield example_pb2.Example.FromString(raw).SerializeToString(deterministic=True)
        except DecodeError:
          yield raw
  finally:
    reader.close()


def _datasets(configs) -> list[tuple[str, str]]:
  """(name, data_dir) of the training data and of every eval of `configs`, in order, once each."""
  seen: list[tuple[str, str]] = []
  for c in configs:
    pairs = [(c.data.name, c.data.data_dir)]
    for ev in c.evals.values():
      if hasattr(ev, "get") and ev.get("dataset"):
        pairs.append((ev.dataset, ev.get("data_dir") or c.data.data_dir))
    for p in pairs:
      if p[1] and p not in seen:
        seen.append(p)
  return seen


def environment(configs) -> dict[str, Any]:
  """The packages, XLA flags and dataset fingerprints of a sweep whose runs have `configs` (call once the
  data is built; a dataset that is not there is recorded with `splits: None` and why)."""
  from tipsito.data import sources  # pylint: disable=import-outside-toplevel  # array_record only once data is built

  datasets = []
  for name, data_dir in _datasets(configs):
    entry: dict[str, Any] = {"name": name, "data_dir": str(data_dir)}
    try:
      d = os.fspath(sources.resolve_dataset_dir(name, data_dir))
      entry.update(dataset_dir=d, splits=dataset_fingerprint(d))
    except (FileNotFoundError, ValueError, OSError) as e:
      entry.update(splits=None, error=f"{type(e).__name__}: {e}"[:300])
    datasets.append(entry)
  return {"packages": packages(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "datasets": datasets}
