"""Conversion throughput: `python -m tipsito.data.convert_bench` (also `pipeline_bench --convert`).

Why: converting a billion image-text pairs is CPU-bound (every image is fully decoded once to catch
truncated files, tipsito/data/builders/_common.py), so its cost is inputs per CPU-second per worker
times workers. This writes webdataset tars of synthetic photo-like JPEG and PNG images of realistic
sizes (the ~`size` px images of tipsito/data/synthetic.py, default 512 and 1024 px sides, 3
captions each) and measures, for each format and size:

* `validate_*_per_cpu_s`: the image check alone (PIL full decode), inputs per CPU-second;
* `single_*_per_cpu_s` / `single_*_per_s`: the whole single-machine conversion with one process
  (tar read, check, TFDS encode, shuffle, array_record write), per CPU-second and per wall second;
* with Apache Beam installed (the [beam] extra) and `--beam_workers 1,2`: `beam_w{W}_*_per_s`, the
  same conversion on Beam's DirectRunner with W worker processes (wall clock), and
  `beam_w{W}_*_per_cpu_s` (CPU of this process and its reaped worker processes).

Conversion rates are marginal: `num_inputs` and 3 x `num_inputs` inputs are converted and the extra
inputs are divided by the extra time, so start-up (TFDS, Beam's workers importing TensorFlow) cancels;
it is reported as `*_fixed_s`.

CPU-second figures are per core even on a shared, busy machine, where wall-clock figures also count
other people's work (the load average is printed). Prints a table and one JSON line;
`run_convert_bench()` returns the numbers.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import sys
import tarfile
import tempfile
import time
from typing import Sequence

from tipsito.data import conversion
from tipsito.data.builders import _common
from tipsito.data.synthetic import synthetic_source


def _cpu_seconds() -> float:
  """CPU seconds of this process and of its finished (reaped) child processes."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  kids = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def write_tars(
  directory: str, fmt: str, size: int, num_inputs: int, per_tar: int, distinct: int = 16
) -> list[str]:
  """webdataset tars of `num_inputs` samples (`distinct` different images, cycled), `per_tar` a tar."""
  src = synthetic_source(distinct, fmt, size)
  ext = "jpg" if fmt == "JPEG" else "png"
  os.makedirs(directory, exist_ok=True)
  paths = []
  for t in range(-(-num_inputs // per_tar)):
    path = os.path.join(directory, f"{t:05d}.tar")
    with tarfile.open(path, "w") as tar:
      for j in range(t * per_tar, min(num_inputs, (t + 1) * per_tar)):
        r = src[j % distinct]
        meta = json.dumps(
          {"caption": r["alt_text"], "paligemma": r["caption_paligemma"], "gemini": r["caption_gemini"]}
        ).encode()
        for name, data in ((f"{j:08d}.{ext}", r["image"]), (f"{j:08d}.json", meta)):
          info = tarfile.TarInfo(name)
          info.size = len(data)
          tar.addfile(info, io.BytesIO(data))
    paths.append(path)
  return paths


def _validate_rate(fmt: str, size: int, seconds: float) -> tuple[float, float]:
  """(inputs per CPU-second, mean encoded KiB) of `_common.check_image_bytes` alone."""
  images = [r["image"] for r in synthetic_source(8, fmt, size)]
  n, c0 = 0, time.thread_time()
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    for data in images:
      _common.check_image_bytes(data)
      n += 1
  return n / max(time.thread_time() - c0, 1e-9), sum(map(len, images)) / len(images) / 1024


def _convert_once(tars_dir: str, data_dir: str, n: int, **kwargs) -> tuple[float, float]:
  """(wall seconds, CPU seconds) of one conversion of the tars in `tars_dir` (n samples)."""
  shutil.rmtree(data_dir, ignore_errors=True)
  c0, t0 = _cpu_seconds(), time.perf_counter()
  result = conversion.convert(
    "webdataset",
    data_dir,
    input_path=tars_dir,
    caption_columns=["paligemma", "gemini"],
    verbose=False,
    **kwargs,
  )
  wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
  assert result.split_sizes["train"] == n and result.report.written == n, (result.split_sizes, n)
  shutil.rmtree(data_dir, ignore_errors=True)
  return wall, cpu


def _convert_rate(small: str, big: str, n: int, data_dir: str, **kwargs) -> tuple[float, float, float]:
  """Marginal (inputs per wall second, inputs per CPU-second, fixed wall seconds): after a warm-up,
  conversions of n and 3n inputs; the extra 2n inputs over the extra time, so start-up costs (TFDS, Beam's worker
  processes importing TensorFlow) cancel and are reported apart."""
  _convert_once(small, data_dir, n, **kwargs)  # warm-up: first imports, Beam's first pipeline
  w1, c1 = _convert_once(small, data_dir, n, **kwargs)
  w3, c3 = _convert_once(big, data_dir, 3 * n, **kwargs)
  rate = 2 * n / max(w3 - w1, 1e-9)
  return rate, 2 * n / max(c3 - c1, 1e-9), max(0.0, w1 - n / rate)


def run_convert_bench(
  sizes: Sequence[int] = (512, 1024),
  formats: Sequence[str] = ("JPEG", "PNG"),
  num_inputs: int = 128,
  per_tar: int = 32,
  beam_workers: Sequence[int] = (1, 2),
  seconds: float = 2.0,
  work_dir: str | None = None,
) -> dict:
  """Measures validate / single-machine / Beam conversion rates; returns a flat result dict."""
  res = {
    "cpu_count": os.cpu_count(),
    "load_avg_1m": round(os.getloadavg()[0], 2),
    "num_inputs": num_inputs,
    "inputs_per_tar": per_tar,
  }
  try:
    import apache_beam  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import

    have_beam = True
  except ImportError:
    have_beam = False
    res["beam"] = "not installed (pip install -e '.[beam]')"
  tmp = work_dir or tempfile.mkdtemp(prefix="convert_bench_")
  try:
    for fmt in formats:
      for size in sizes:
        tag = f"{fmt.lower()}{size}"
        res[f"validate_{tag}_per_cpu_s"], res[f"{tag}_kib"] = _validate_rate(fmt, size, seconds)
        big, small = os.path.join(tmp, tag, "big"), os.path.join(tmp, tag, "small")
        tars = write_tars(big, fmt, size, 3 * num_inputs, per_tar)
        os.makedirs(small)
        for path in tars[: -(-num_inputs // per_tar)]:
          os.symlink(path, os.path.join(small, os.path.basename(path)))
        shards = max(1, num_inputs // 64)
        out = os.path.join(tmp, "out")
        runs = [("single", dict(num_workers=1))]
        if have_beam:
          runs += [(f"beam_w{w}", dict(num_workers=w, beam_runner="DirectRunner")) for w in beam_workers]
        for name, kwargs in runs:
          (res[f"{name}_{tag}_per_s"], res[f"{name}_{tag}_per_cpu_s"], res[f"{name}_{tag}_fixed_s"]) = (
            _convert_rate(small, big, num_inputs, out, num_shards=shards, **kwargs)
          )
        shutil.rmtree(os.path.join(tmp, tag), ignore_errors=True)
  finally:
    if work_dir is None:
      shutil.rmtree(tmp, ignore_errors=True)
  res["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
  return res


def main(argv: Sequence[str] | None = None) -> dict:
  """CLI entry point; also callable as `main([...])`."""
  ap = argparse.ArgumentParser(
    prog="python -m tipsito.data.convert_bench", description=__doc__.split("\n")[0]
  )
  ap.add_argument("--sizes", default="512,1024", help="comma list of image sides in pixels")
  ap.add_argument("--formats", default="JPEG,PNG", help="comma list of JPEG, PNG")
  ap.add_argument(
    "--num_inputs", type=int, default=128, help="samples of the smaller conversion (the larger: 3x)"
  )
  ap.add_argument("--per_tar", type=int, default=32, help="samples per tar (a Beam unit of work)")
  ap.add_argument(
    "--beam_workers", default="1,2", help="comma list of Beam DirectRunner worker counts; '' = none"
  )
  ap.add_argument("--seconds", type=float, default=2.0, help="timing window of the validate-only rate")
  args = ap.parse_args(argv)
  res = run_convert_bench(
    sizes=[int(s) for s in args.sizes.split(",") if s.strip()],
    formats=[f.strip().upper() for f in args.formats.split(",") if f.strip()],
    num_inputs=args.num_inputs,
    per_tar=args.per_tar,
    seconds=args.seconds,
    beam_workers=[int(w) for w in args.beam_workers.split(",") if w.strip()],
  )
  print(
    "Conversion throughput (inputs = image + captions). *_per_cpu_s: per CPU-second (= per worker "
    "core); *_per_s: wall clock on this machine (shared: see load_avg_1m)."
  )
  width = max(len(k) for k in res)
  for k, v in res.items():
    print(f"{k:<{width}}  {v:>10.1f}" if isinstance(v, float) else f"{k:<{width}}  {v!s:>10}")
  print(json.dumps({"convert_bench": res}, sort_keys=True))
  sys.stdout.flush()
  return res


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()
