"""What a training run is doing: step time, images/s, data wait, FLOP utilisation, memory, profiler
traces, and a console that shows them instead of library noise.

Why a module of its own: the train loop (`tipsito/train/loop.py`) only calls a few hooks
(`quiet_library_logs`, `create_writer`, `log_parameter_summary`, `StepMonitor`), so timing and logging
rules live in one place that `tipsito/bench/step_bench.py` shares (FLOP count, peak table), and the figures of a run
and of the benchmark are computed the same way.

Timing rules, and why:
  * JAX dispatches steps asynchronously, so a clock read after `train_step(...)` returns measures the
    dispatch, not the device (clu's ReportProgress showed 38 steps/s after a resume when the device did 3).
    The loop already blocks on the metrics of a log interval when it fetches them; `StepMonitor.write`
    reads the clock right after that, so interval time / steps is the real step time, and no extra
    synchronisation is added to the steps in between.
  * An interval's clock starts when the loop asks for the interval's first batch, so time spent after
    the previous log step (evaluations, checkpoint saves, TensorBoard writes at that step) is not charged
    to training; work at steps that are not log steps is.
  * Data wait is the time the loop spends in `next(data_iter)` plus the host-to-device copy. While it
    waits, the device may still be busy with earlier steps, so the fraction is an upper bound of the
    device's idle share; with a prefetching pipeline that keeps up it is close to 0.
  * FLOPs per step come from XLA's cost analysis of the lowered (not yet partitioned) step, i.e. the
    FLOPs of the whole global batch. XLA counts the body of a loop once, whatever its trip count, so a
    model whose layers run under `lax.scan` would look several times cheaper than it is; `step_flops`
    adds the missing iterations of every matmul / convolution inside scans, counted from the step's
    jaxpr (exact for those ops; element-wise work in scan bodies stays counted once). Recomputation
    under `remat` is included, so with remat on the utilisation is hardware FLOPs rather than model FLOPs.
"""

from __future__ import annotations

import contextlib
import logging as py_logging
import os
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import jax
import numpy as np
from absl import logging
from jax._src.interpreters import partial_eval  # dce_jaxpr: no public name in JAX 0.10.2 (setup.py pins it)

# Libraries whose INFO lines (about 60 per Orbax checkpoint) bury the training metrics. Their WARNING and
# ERROR lines always show; `--verbosity=1` (absl's flag) shows everything again.
QUIET_LIBRARIES = ("orbax", "tensorflow_datasets")

# Dense bf16 peak TFLOP/s of one JAX device, by `jax.Device.device_kind` (substring, first match wins;
# vendor data sheets). TPU v2/v3 expose each TensorCore as a device, later TPUs one device per chip.
PEAK_TFLOPS_BF16 = (
  ("TPU v2", 22.5),
  ("TPU v3", 61.5),
  ("TPU v4", 275.0),
  ("TPU v5 lite", 197.0),  # v5e
  ("TPU v5e", 197.0),
  ("TPU v5p", 459.0),
  ("TPU v5", 459.0),  # v5p reports "TPU v5"
  ("TPU v6 lite", 918.0),  # v6e (Trillium)
  ("TPU v6e", 918.0),
  ("H100 PCIe", 756.0),
  ("H100", 989.0),
  ("H200", 989.0),
  ("A100", 312.0),
  ("L4", 121.0),
)

GIB = 2.0**30


# --------------------------------------------------------------------------------------------------
# Console and logging.


class _LibraryInfoFilter(py_logging.Filter):
  """Drops records below WARNING that were logged from a file inside one of `QUIET_LIBRARIES`.

  absl routes every library that uses `from absl import logging` through the one "absl" logger, so a
  per-library level is impossible there; the record's source path tells the libraries apart.
  """

  def __init__(self, libraries: Sequence[str]):
    super().__init__()
    self._parts = tuple(f"{os.sep}{lib}{os.sep}" for lib in libraries)

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING:
      return True
    path = record.pathname or ""
    return not any(p in path for p in self._parts)


_FILTER: Optional[_LibraryInfoFilter] = None


def quiet_library_logs(verbosity: Optional[int] = None) -> bool:
  """Orbax and TFDS log at WARNING unless absl's `--verbosity` is >= 1; returns True when quieted.

  Args:
    verbosity: absl verbosity (0 = INFO, 1 = DEBUG); default: the value of the `--verbosity` flag.
  """
  global _FILTER
  if verbosity is None:
    verbosity = logging.get_verbosity()
  absl_logger = py_logging.getLogger("absl")
  if _FILTER is not None:  # idempotent, and switchable back (tests, notebooks)
    absl_logger.removeFilter(_FILTER)
  quiet = verbosity < 1
  for lib in QUIET_LIBRARIES:  # libraries that use Python's logging module directly
    py_logging.getLogger(lib).setLevel(py_logging.WARNING if quiet else py_logging.NOTSET)
  if quiet:
    _FILTER = _LibraryInfoFilter(QUIET_LIBRARIES)
    absl_logger.addFilter(_FILTER)
  return quiet


def create_writer(workdir: str, process_index: Optional[int] = None):
  """TensorBoard writer for `workdir` on process 0, a writer that drops everything elsewhere.

  Why not clu's `create_default_writer`: it also logs every scalar as one long console line; the
  console gets `StepMonitor`'s compact line instead.
  """
  from clu import metric_writers  # pylint: disable=import-outside-toplevel

  if process_index is None:
    process_index = jax.process_index()
  if process_index > 0:
    return metric_writers.MultiWriter([])
  return metric_writers.AsyncMultiWriter([metric_writers.SummaryWriter(workdir)])


def _count(tree) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def _bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def parameter_summary(params: Mapping[str, Any]) -> str:
  """One row per top-level part (towers, heads, fusion, scalars) instead of one per leaf."""
  rows = [(k, _count(v), _bytes(v)) for k, v in sorted(params.items())]
  rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows)))
  w = max(len(r[0]) for r in rows)
  lines = [f"{'part':<{w}} | {'parameters':>12} | {'MiB':>9}"]
  lines += [f"{name:<{w}} | {n:>12,} | {b / 2**20:>9.2f}" for name, n, b in rows]
  return "\n".join(lines)


def log_parameter_summary(params: Mapping[str, Any]) -> None:
  """Logs `parameter_summary` on process 0 (`python -m tipsito.info --sharding` lists every leaf)."""
  if jax.process_index() == 0:
    logging.info("Parameters per part:\n%s", parameter_summary(params))


def format_duration(seconds: float) -> str:
  """`2m10s`, `1h05m`, `45s`."""
  s = int(round(max(0.0, seconds)))
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _rate(x: float) -> str:
  return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def console_line(step: int, total: int, scalars: Mapping[str, float]) -> str:
  """The one line per log step: progress, speed, ETA, losses, then what the run has of data wait, LR,
  utilisation and memory. `scalars` are the values written to TensorBoard at `step`.

  >>> console_line(400, 800, {"perf/steps_per_sec": 3.1, "perf/images_per_sec": 99.2,
  ...   "perf/eta_s": 130, "loss/total": 4.123, "loss/clip": 1.3})
  'step 400/800 | 3.1 it/s | 99 img/s | ETA 2m10s | loss 4.12 (clip 1.3)'
  """
  parts = [f"step {step}/{total}"]
  if "perf/steps_per_sec" in scalars:
    parts.append(f"{_rate(scalars['perf/steps_per_sec'])} it/s")
    parts.append(f"{scalars['perf/images_per_sec']:.0f} img/s")
    parts.append(f"ETA {format_duration(scalars['perf/eta_s'])}")
  terms = {k[len("loss/") :]: v for k, v in scalars.items() if k.startswith("loss/") and k != "loss/total"}
  if "loss/total" in scalars:
    detail = ", ".join(f"{k} {v:.3g}" for k, v in sorted(terms.items()))
    parts.append(f"loss {scalars['loss/total']:.3g}" + (f" ({detail})" if detail else ""))
  if "perf/data_wait_fraction" in scalars:
    parts.append(f"data wait {100 * scalars['perf/data_wait_fraction']:.0f}%")
  if "lr" in scalars:
    parts.append(f"lr {scalars['lr']:.2e}")
  if "perf/flop_utilisation" in scalars:
    parts.append(f"MFU {100 * scalars['perf/flop_utilisation']:.1f}%")
  elif "perf/tflops_per_sec" in scalars:
    parts.append(f"{scalars['perf/tflops_per_sec']:.3g} TFLOP/s")
  if "perf/mem_in_use_GiB" in scalars:
    mem = f"mem {scalars['perf/mem_in_use_GiB']:.2f}"
    if "perf/mem_peak_GiB" in scalars:
      mem += f" (peak {scalars['perf/mem_peak_GiB']:.2f})"
    parts.append(mem + " GiB")
  if scalars.get("data/skipped"):
    parts.append(f"skipped {int(scalars['data/skipped'])}")
  if scalars.get(
    "train/nonfinite_steps"
  ):  # steps skipped by the non-finite guard (tipsito/train/nonfinite.py)
    parts.append(f"non-finite steps {int(scalars['train/nonfinite_steps'])}")
  return " | ".join(parts)


# --------------------------------------------------------------------------------------------------
# FLOPs, peak, memory.


def _sub_jaxprs(eqn) -> Iterable[Any]:
  """Jaxprs nested in an equation's params (pjit, remat, scan, cond branches, custom_vjp, ...)."""
  for v in eqn.params.values():
    for x in v if isinstance(v, (list, tuple)) else (v,):
      j = getattr(x, "jaxpr", x)  # ClosedJaxpr -> Jaxpr
      if hasattr(j, "eqns"):
        yield j


def _eqn_flops(eqn) -> float:
  """FLOPs of one dot_general / conv_general_dilated (2 per multiply-add), 0 for other primitives."""
  name = eqn.primitive.name
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    k = float(np.prod([lhs[d] for d in lhs_contract])) if lhs_contract else 1.0
    return 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * k
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    per_output = float(np.prod(rhs)) / rhs[out_feature_dim]
    return 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * per_output
  return 0.0


def matmul_flops(jaxpr, *, scan_trip_counts: bool = True) -> tuple[float, bool]:
  """(matmul + convolution FLOPs of `jaxpr`, whether it has a `while` loop of unknown trip count).

  With `scan_trip_counts=False` every scan body counts once, as XLA's cost analysis counts it.
  Conditionals count their most expensive branch.
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total, has_while = 0.0, False
  for eqn in jaxpr.eqns:
    total += _eqn_flops(eqn)
    name = eqn.primitive.name
    has_while |= name == "while"
    subs = [matmul_flops(j, scan_trip_counts=scan_trip_counts) for j in _sub_jaxprs(eqn)]
    if not subs:
      continue
    has_while |= any(w for _, w in subs)
    if name == "cond":
      sub = max(f for f, _ in subs)
    else:
      sub = sum(f for f, _ in subs)
    if name == "scan" and scan_trip_counts:
      sub *= int(eqn.params["length"])
    total += sub
  return total, has_while


def live_jaxpr(closed_jaxpr):
  """The jaxpr of a traced step with dead code eliminated: the equations whose values reach an output.

  Why: JAX drops values a jitted function computes and never uses before XLA sees them, so XLA's cost
  analysis never counts them; a count of the traced jaxpr itself would (a `scan` whose result is unused
  would add its trip count's matmuls to the scan correction of `step_flops`)."""
  jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
  live, _ = partial_eval.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
  return live


def step_flops(jitted: Callable, args: Sequence[Any]) -> dict[str, Any]:
  """FLOPs of one call of `jitted(*args)` for the whole global batch (all devices together).

  Returns {'flops': float or None, 'xla_flops': XLA's count, 'scan_correction': FLOPs added for scan
  iterations XLA counts once (of the scans whose values are used: `live_jaxpr`), 'while_loops': True when
  a while loop's trip count is unknown (its body is counted once: the total is a lower bound)}. Lowering
  only: nothing is compiled or run.
  """
  traced = jitted.trace(*args)
  out: dict[str, Any] = {"flops": None, "xla_flops": None, "scan_correction": 0.0, "while_loops": False}
  try:
    ca = traced.lower().cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    xla = float((ca or {}).get("flops", 0.0)) or None
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("XLA cost analysis unavailable (%s): no FLOP utilisation", e)
    xla = None
  live = live_jaxpr(traced.jaxpr)  # what XLA's count covers (`live_jaxpr`)
  full, has_while = matmul_flops(live, scan_trip_counts=True)
  once, _ = matmul_flops(live, scan_trip_counts=False)
  out.update(xla_flops=xla, scan_correction=full - once, while_loops=has_while)
  if xla is not None:
    out["flops"] = xla + full - once
  return out


def peak_tflops_per_device(
  config_value: float = 0.0, device_kind: Optional[str] = None
) -> tuple[Optional[float], str]:
  """(peak TFLOP/s of one device, where it came from): `config.peak_tflops` when > 0, else the
  `PEAK_TFLOPS_BF16` entry of the device kind, else (None, reason)."""
  if config_value and float(config_value) > 0:
    return float(config_value), "config.peak_tflops"
  if device_kind is None:
    device_kind = jax.devices()[0].device_kind
  for key, value in PEAK_TFLOPS_BF16:
    if key.lower() in device_kind.lower():
      return value, f"bf16 peak of {device_kind!r}"
  return None, f"no peak known for device kind {device_kind!r}: set config.peak_tflops"


def device_memory(devices: Optional[Sequence[Any]] = None) -> dict[str, float]:
  """Largest in-use / peak / limit bytes (GiB) over this process's devices, where the platform reports
  them (TPU and GPU do; the CPU backend reports nothing, and then this is empty)."""
  out: dict[str, float] = {}
  for d in devices if devices is not None else jax.local_devices():
    try:
      stats = d.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except
      stats = {}
    for key, tag in (
      ("bytes_in_use", "perf/mem_in_use_GiB"),
      ("peak_bytes_in_use", "perf/mem_peak_GiB"),
      ("bytes_limit", "perf/mem_limit_GiB"),
    ):
      if key in stats:
        out[tag] = max(out.get(tag, 0.0), float(stats[key]) / GIB)
  return out


# --------------------------------------------------------------------------------------------------
# The loop's monitor.


class StepMonitor:
  """Per log interval: step time, throughput, data wait, FLOP utilisation, memory; console line; profiler.

  Loop protocol (see `tipsito/train/loop.py`):
    with monitor.data_wait(): batch = ...          # every step
    state, metrics = train_step(...)
    monitor.first_step(train_step, (state, batch, frozen), step)  # once, after the blocked-on first step
    monitor.after_step(step, metrics)              # every step (profiler)
    monitor.write(step, scalars)                   # at log steps, after the metrics were fetched
    monitor.close()                                # after the loop
  """

  def __init__(
    self,
    config,
    *,
    writer,
    workdir: str,
    start_step: int,
    log: Callable[[str], None] = logging.info,
    clock: Callable[[], float] = time.perf_counter,
  ):
    self.writer = writer
    self.clock = clock
    self.workdir = workdir
    self.total = int(config.total_steps)
    self.batch_size = int(config.input.batch_size)
    self.log = log
    self.num_devices = jax.device_count()
    self.peak, self.peak_source = peak_tflops_per_device(float(config.peak_tflops))
    self.flops: Optional[float] = None
    self._t0: Optional[float] = None
    self._t0_step = start_step
    self._wait = 0.0
    n = int(config.profile_steps)
    # Trace the n steps after the compiling first step of this run: steps start+2 .. start+1+n.
    self._profile = (start_step + 2, start_step + 1 + n) if n > 0 else None
    self._profiling = False
    self._last_step = start_step

  @contextlib.contextmanager
  def data_wait(self):
    """Times fetching one batch; the first fetch after a reset starts the interval clock."""
    t = self.clock()
    if self._t0 is None:
      self._t0 = t
    try:
      yield
    finally:
      self._wait += self.clock() - t

  def _reset(self, step: int) -> None:
    self._t0, self._t0_step, self._wait = None, step, 0.0

  def first_step(self, jitted: Callable, args: Sequence[Any], step: int) -> None:
    """After the first (compiling, blocked-on) step: FLOPs per step, once, and a clean interval start."""
    try:
      info = step_flops(jitted, args)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Could not count the step's FLOPs (%s): no FLOP utilisation", e)
      info = {"flops": None}
    self.flops = info["flops"]
    if self.flops:
      notes = ["XLA cost analysis"]
      if info.get("scan_correction"):
        notes.append(f"+{info['scan_correction'] / 1e12:.3g} TFLOP for scan iterations")
      if info.get("while_loops"):
        notes.append("while loops of unknown trip count counted once: a lower bound")
      msg = f"Step cost {self.flops / 1e12:.4g} TFLOP for the global batch ({'; '.join(notes)}); "
      if self.peak:
        msg += (
          f"utilisation against {self.peak:g} TFLOP/s per device x {self.num_devices} devices "
          f"({self.peak_source})"
        )
      else:
        msg += f"no FLOP utilisation ({self.peak_source})"
      self.log(msg)
    self._reset(step)

  def after_step(self, step: int, metrics: Any) -> None:
    """Starts / stops the profiler trace around the configured steps."""
    self._last_step = step
    if self._profile is None:
      return
    first, last = self._profile
    if step == first - 1 and not self._profiling and step < self.total:
      jax.profiler.start_trace(self.workdir)
      self._profiling = True
    elif step >= last and self._profiling:
      self._stop_profile(step, metrics)

  def _stop_profile(self, step: int, metrics: Any = None) -> None:
    if metrics is not None:
      jax.block_until_ready(metrics)  # the trace must contain the device work of the last step
    jax.profiler.stop_trace()
    self._profiling = False
    self.log(
      f"Profiler trace of steps {self._profile[0]}-{step} written to "
      f"{os.path.join(self.workdir, 'plugins', 'profile')} (TensorBoard: Profile tab, needs "
      f"the [profile] extra)"
    )

  def interval_scalars(self, step: int) -> dict[str, float]:
    """perf/* scalars of the interval ending at `step` (empty when it has no timed step)."""
    now = self.clock()
    n = step - self._t0_step
    if self._t0 is None or n <= 0:
      return {}
    wall = max(now - self._t0, 1e-9)
    step_s = wall / n
    out = {
      "perf/step_time_s": step_s,
      "perf/steps_per_sec": 1.0 / step_s,
      "perf/images_per_sec": self.batch_size / step_s,
      "perf/data_wait_fraction": min(1.0, self._wait / wall),
      "perf/eta_s": max(0, self.total - step) * step_s,
    }
    if self.flops:
      out["perf/tflops_per_sec"] = self.flops / step_s / 1e12
      if self.peak:
        out["perf/flop_utilisation"] = out["perf/tflops_per_sec"] / (self.peak * self.num_devices)
    return out

  def write(self, step: int, scalars: dict) -> dict:
    """At a log step, after the interval's metrics were fetched from the device (that fetch is the
    synchronisation): adds perf/* and memory scalars to `scalars` (in place), writes them to
    TensorBoard, logs the console line, starts the next interval. Returns `scalars`."""
    scalars.update(self.interval_scalars(step))
    scalars.update(device_memory())
    self.writer.write_scalars(step, scalars)
    self.log(console_line(step, self.total, scalars))
    self._reset(step)
    return scalars

  def close(self) -> None:
    """Stops a trace still running (a run that stopped early)."""
    if self._profiling:
      self._stop_profile(self._last_step)
