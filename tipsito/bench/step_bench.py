"""Train-step benchmark: `python -m tipsito.bench.step_bench --config F[:args] [--recipes a,b] [--steps N]
[--batch B] [--microbatches 1,4]` (console script `tipsito-bench`); the input pipeline has its own, tipsito/data/pipeline_bench.py.

Why: the cost of a recipe (e.g. tipsito's extra view + fusion over TIPSv2, or head-only vs full EMA) is
measured, not guessed: the same config is built per recipe in one process, on synthetic batches (no data
needed), and step time, throughput, FLOPs (XLA cost analysis), FLOP utilisation against an optional
`--peak_tflops`, and peak device memory (where the platform reports it) are printed as a table plus one
JSON line. Ratios between recipes come from the same run, so machine load affects them alike.
`--attention xla,cudnn --remat false,true` multiply the rows (`cudnn_mask`: cudnn with the padding as a mask,
not as sequence lengths); `--batch_candidates 256,128,64` runs each row
at the largest batch whose compiled memory fits the device; `--jsonl F` appends the rows to F and
`--markdown F` prints them as a table with each recipe's time and FLOPs per image against CLIP's
(launch/gpu_bench.sh drives all of this on one GPU).
The batch is `tipsito.data.synthetic.synthetic_batch` (the tests use it too), whose fields and shapes are the
declared ones of tipsito/data/batch.py (the planner, tipsito/planning/pod.py, compiles against the same `shape_spec`).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np
from absl import app
from absl import flags

from tipsito import command
from tipsito import distributed
from tipsito.config import defaults
from tipsito.config import validation as config_validation
from tipsito.data.synthetic import synthetic_batch
from tipsito.models import layers
from tipsito.studies import provenance
from tipsito.train import assembly
from tipsito.train import observability
from tipsito.train import sharding
from tipsito.train import step as step_lib

FLAGS = flags.FLAGS
_BOOLS = {"true": True, "false": False, "1": True, "0": False}
# `--attention cudnn_mask`: the cudnn core with an explicit boolean padding mask (see _bench_row).
CUDNN_MASK = "cudnn_mask"


def _define_flags() -> None:
  if "recipes" in FLAGS:
    return
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py[:args]).")
  flags.DEFINE_list("recipes", [], "Recipes to compare (default: the config's own).")
  flags.DEFINE_list("ema", [], "EMA modes to compare for self-distillation recipes (head,full).")
  flags.DEFINE_integer("steps", 5, "Timed steps per entry (after one compile+warmup step).")
  flags.DEFINE_integer("batch", 0, "Global batch override (0 = config).")
  flags.DEFINE_list(
    "microbatches",
    [],
    "Micro-batch counts to compare (input.microbatches, exact "
    "gradient accumulation), e.g. 1,2,4 (default: the config's).",
  )
  flags.DEFINE_float(
    "peak_tflops",
    0.0,
    "Peak TFLOP/s of all devices (for utilisation); 0 = "
    "config.peak_tflops or the platform table (tipsito/train/observability.py).",
  )
  flags.DEFINE_list(
    "attention",
    [],
    "Attention cores to compare (model.{image,text,fusion}.attention: xla, cudnn, splash; cudnn_mask: "
    "cudnn given the padding as a boolean mask instead of sequence lengths); default: the config's.",
  )
  flags.DEFINE_list(
    "remat", [], "Remat settings to compare for both towers (false,true); default: the config's."
  )
  flags.DEFINE_list(
    "batch_candidates",
    [],
    "Global batches to try, largest first (e.g. 256,128,64): each entry uses the largest whose compiled "
    "memory fits the device (overrides --batch).",
  )
  flags.DEFINE_string("jsonl", None, "Also append every row as one JSON line to this file.")
  flags.DEFINE_string(
    "markdown",
    None,
    "Print the markdown table of the rows in this JSON-lines file (written by --jsonl) and exit.",
  )
  distributed.define_flags()  # --distributed: one process per host, the step runs on the global mesh


def bench_one(
  config, *, steps: int = 5, peak_tflops: float = 0.0, max_bytes: Optional[int] = None
) -> dict[str, Any]:
  """Builds `config`, compiles its step, times `steps` steps on a synthetic batch.

  With `max_bytes`, a step whose compiled memory (arguments + temporaries + outputs) exceeds it is not run:
  the row says `fits: False` (how `run_bench` finds the largest batch that fits without an OOM).
  """
  config_validation.validate(config, num_devices=jax.device_count())  # synthetic ids
  setup = assembly.build(config)
  state = setup.init_state()
  vocab = setup.model.text_cfg["vocab_size"] if setup.model.text_cfg else 100  # no text tower: any ids
  host = synthetic_batch(  # this process's slice of the global batch
    config, batch_size=int(config.input.batch_size) // jax.process_count(), vocab_size=int(vocab)
  )
  batch = sharding.global_batch(host, setup.mesh)
  frozen = setup.frozen()
  fn = step_lib.jit_train_step(setup)
  t0 = time.perf_counter()
  compiled = fn.lower(state, batch, frozen).compile()
  compile_s = time.perf_counter() - t0
  # Global-batch FLOPs with scan iterations counted, as the train loop logs them (observability.py).
  flops = observability.step_flops(fn, (state, batch, frozen))["flops"]
  if not peak_tflops:  # config.peak_tflops or the per-platform table, times the devices
    peak, _ = observability.peak_tflops_per_device(float(config.peak_tflops))
    peak_tflops = peak * jax.device_count() if peak else 0.0
  mem = _compiled_memory(compiled)
  b = int(config.input.batch_size)
  out = {
    "recipe": config.recipe,
    "image": _tower_desc(config.model.image),
    "attention": str(config.model.image.attention),
    "remat": bool(config.model.image.remat),
    "ema": config.ema.mode,
    "batch": b,
    "microbatches": step_lib.microbatches(config),
    "compile_s": round(compile_s, 2),
  }
  out.update(mem)
  if max_bytes and mem.get("mem_total_GiB", 0.0) * 2**30 > max_bytes:
    return dict(out, fits=False)
  state, m = compiled(state, batch, frozen)
  jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    state, m = compiled(state, batch, frozen)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  step_s = float(np.median(times))
  out.update(
    fits=True,
    step_s=round(step_s, 4),
    images_per_s=round(b / step_s, 1),
    step_tflop=None if flops is None else float(f"{flops / 1e12:.4g}"),
  )
  if flops and peak_tflops:
    out["flop_utilisation"] = round(flops / step_s / (peak_tflops * 1e12), 4)
  try:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      out["peak_mem_GiB"] = round(stats["peak_bytes_in_use"] / 2**30, 3)
  except Exception:  # pylint: disable=broad-except
    pass
  return out


def _compiled_memory(compiled) -> dict[str, float]:
  """XLA's compiled memory analysis per device (GiB): arguments, outputs, temporaries.

  Why next to step time: peak device memory is not reported on every platform (XLA:CPU keeps the
  temporaries and has no memory stats), and remat/scan changes show up in `temp` first.
  For TPU pods, `python -m tipsito.plan` gives the same numbers for the real topology.
  """
  try:
    ma = compiled.memory_analysis()
    return {
      "mem_args_GiB": round(ma.argument_size_in_bytes / 2**30, 4),
      "mem_out_GiB": round(ma.output_size_in_bytes / 2**30, 4),
      "mem_temp_GiB": round(ma.temp_size_in_bytes / 2**30, 4),
      "mem_total_GiB": round(
        (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes)
        / 2**30,
        4,
      ),
    }
  except Exception:  # pylint: disable=broad-except  # not every backend implements it
    return {}


def _tower_desc(img) -> str:
  """'p16 w768 d12' for an image tower config (patch, width, depth)."""
  return f"p{img.patch_size} w{img.width} d{img.depth}"


def device_memory_limit() -> Optional[int]:
  """Bytes one device can hold (`memory_stats()['bytes_limit']`), None where the platform does not say
  (XLA:CPU)."""
  try:
    return int((jax.devices()[0].memory_stats() or {})["bytes_limit"])
  except Exception:  # pylint: disable=broad-except
    return None


def run_bench(
  config,
  recipes: Sequence[str] = (),
  ema_modes: Sequence[str] = (),
  *,
  steps: int = 5,
  batch: int = 0,
  peak_tflops: float = 0.0,
  microbatches: Sequence[int] = (),
  attentions: Sequence[str] = (),
  remats: Sequence[bool] = (),
  batch_candidates: Sequence[int] = (),
) -> list[dict]:
  """Benchmarks the config for each requested recipe x EMA mode x attention x remat x micro-batch count;
  adds ratios to the first entry. With `batch_candidates` (largest first), each entry runs at the first
  batch whose compiled memory fits the device (the last candidate is run regardless)."""
  import ml_collections as mlc  # pylint: disable=import-outside-toplevel

  rows = []
  for r in recipes or [config.recipe]:
    for e in ema_modes or [None]:
      c = mlc.ConfigDict(config.to_dict())
      if r != config.recipe:  # same model sizes, the other recipe's losses/parts/views.
        ref = defaults.base_config(r, "tiny/16")
        for k in ("loss", "ema"):
          c[k] = ref[k]
        c.input.views = ref.input.views
        c.input.mask_ratio = ref.input.mask_ratio
        c.input.num_local = c.input.num_local or ref.input.num_local
        c.model.image.use_mask_token = ref.model.image.use_mask_token
        c.model.image.num_cls_tokens = ref.model.image.num_cls_tokens
        c.model.embed_dim = c.model.image.width if ref.model.embed_dim else None
        c.model.text.out_dim = c.model.embed_dim
        c.model.text.flavour = ref.model.text.flavour
        c.model.logit_scale_max = ref.model.logit_scale_max
        c.recipe = r
      if e is not None:
        if not {"dino", "ibot"} & set(k for k, v in c.loss.items() if v):
          continue
        c.ema.mode = e
      if batch:
        c.input.batch_size = batch
      for att, remat, k in itertools.product(attentions or [None], remats or [None], microbatches or [None]):
        ck = mlc.ConfigDict(c.to_dict())
        if k is not None:
          ck.input.microbatches = int(k)
        for t in ("image", "text", "fusion"):
          if att is not None and t in ck.model:
            ck.model[t].attention = "cudnn" if att == CUDNN_MASK else att
          if remat is not None and t in ("image", "text"):
            ck.model[t].remat = bool(remat)
        rows.append(_bench_row(ck, att, batch_candidates, steps=steps, peak_tflops=peak_tflops))
  rows = [r for r in rows if r.get("fits", True)]
  if rows:
    base = rows[0]["step_s"]
    base_flop = rows[0].get("step_tflop")
    for row in rows:
      row["step_time_vs_first"] = round(row["step_s"] / base, 3)
      if base_flop and row.get("step_tflop"):
        row["flops_vs_first"] = round(row["step_tflop"] / base_flop, 3)
  return rows


def _bench_row(config, attention: Optional[str], batch_candidates: Sequence[int], **kw) -> dict:
  """`_bench_fitting`; for `--attention cudnn_mask`, the cudnn core handed the towers' right padding as an
  explicit boolean mask (layers.LENGTH_CORES emptied for this row) instead of key sequence lengths."""
  if attention != CUDNN_MASK:
    return _bench_fitting(config, batch_candidates, **kw)
  saved = layers.LENGTH_CORES
  layers.LENGTH_CORES = ()
  try:
    return dict(_bench_fitting(config, batch_candidates, **kw), attention=CUDNN_MASK)
  finally:
    layers.LENGTH_CORES = saved


def _bench_fitting(config, batch_candidates: Sequence[int], **kw) -> dict:
  """`bench_one` at the largest of `batch_candidates` whose compiled memory fits (the config's batch when
  none are given); the last candidate runs even if the compiler's count says it does not fit."""
  if not batch_candidates:
    return bench_one(config, **kw)
  limit = device_memory_limit()
  for i, b in enumerate(batch_candidates):
    config.input.batch_size = int(b)
    row = bench_one(config, max_bytes=None if i == len(batch_candidates) - 1 else limit, **kw)
    if row.get("fits", True):
      return row
  return row


MARKDOWN_COLUMNS = (
  "recipe | image | attention | remat | batch | step (s) | images/s | TFLOP/step | FLOP util. | "
  "compiled memory (GiB) | time/image vs clip | FLOPs/image vs clip"
)


def markdown_table(rows: Sequence[dict]) -> str:
  """The rows (`--jsonl` lines) as a markdown table; the last two columns compare each row's time and
  FLOPs per image with the clip row of the same attention and remat (the recipe's cost over CLIP, next to
  what its FLOPs predict)."""

  def per_image(r, k):
    return r[k] / r["batch"] if r.get(k) else None

  def ratio(a, b):
    return "-" if a is None or not b else f"{a / b:.2f}"

  lines = ["| " + MARKDOWN_COLUMNS + " |", "|" + "---|" * len(MARKDOWN_COLUMNS.split("|"))]
  for r in rows:
    clip = next(
      (
        c
        for c in rows
        if c["recipe"] == "clip" and (c["attention"], c["remat"]) == (r["attention"], r["remat"])
      ),
      None,
    )
    util = r.get("flop_utilisation")
    cells = [
      r["recipe"],
      r.get("image", ""),
      r["attention"],
      "on" if r["remat"] else "off",
      r["batch"],
      f"{r['step_s']:.4f}",
      f"{r['images_per_s']:.1f}",
      "-" if r.get("step_tflop") is None else f"{r['step_tflop']:.3f}",
      "-" if util is None else f"{100 * util:.1f}%",
      "-" if r.get("mem_total_GiB") is None else f"{r['mem_total_GiB']:.2f}",
      ratio(per_image(r, "step_s"), clip and per_image(clip, "step_s")),
      ratio(per_image(r, "step_tflop"), clip and per_image(clip, "step_tflop")),
    ]
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  return "\n".join(lines)


def _flag_bool(name: str, value: str) -> bool:
  if value.lower() not in _BOOLS:
    raise app.UsageError(f"--{name}: {value!r} is not one of true, false")
  return _BOOLS[value.lower()]


def main(argv: Sequence[str]) -> None:
  """Prints a table and one JSON line."""
  del argv
  if FLAGS.markdown:
    with open(FLAGS.markdown) as f:
      print(markdown_table([json.loads(line) for line in f if line.strip()]))
    return
  distributed.configure_jax()
  if FLAGS.config is None:
    raise app.UsageError("--config is required")
  try:
    distributed.initialize_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  rows = run_bench(
    FLAGS.config,
    FLAGS.recipes,
    FLAGS.ema,
    steps=FLAGS.steps,
    batch=FLAGS.batch,
    peak_tflops=FLAGS.peak_tflops,
    microbatches=[int(k) for k in FLAGS.microbatches],
    attentions=FLAGS.attention,
    remats=[_flag_bool("remat", v) for v in FLAGS.remat],
    batch_candidates=[int(b) for b in FLAGS.batch_candidates],
  )
  if FLAGS.jsonl:
    with open(FLAGS.jsonl, "a") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
  keys = list(dict.fromkeys(k for r in rows for k in r))
  print(" | ".join(keys))
  for r in rows:
    print(" | ".join(str(r.get(k, "")) for k in keys))
  print(json.dumps({"bench": rows, "machine": provenance.machine()}))  # XLA:CPU times are the processor's
  sys.stdout.flush()


run = command.entry_point(_define_flags, main)  # the shared command tail (tipsito/command.py)


if __name__ == "__main__":
  run()
