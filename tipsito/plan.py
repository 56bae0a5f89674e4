"""`python -m tipsito.plan --config F[:args] --topology v5p:8x8x8 [--num_slices N] [--json] [--search]`

Plans a TPU pod run from any machine (a laptop CPU is enough): compiles the real jitted train step (and the
evals' forward passes) ahead of time for a TPU topology that is not present and prints per chip what XLA's
memory and cost analyses say (parameters, optimizer state, EMA, batch, temporaries, the total against the
chip's HBM, FLOPs, estimated step time, compile time). `--search` tries remat policy x scan x mesh split x
per-chip batch, then micro-batches (exact gradient accumulation, `input.microbatches`) when nothing
smaller fits, and prints the fastest configuration that fits with `--headroom`, as `--config.k=v`
overrides to paste. `--microbatches K` also compiles K = 1 and reports both. `--attention xla,splash`
compiles the step once per attention core and prints what each saves against the first. `--table_row
NAME` prints the README plan table's row (launch/plan_paper_configs.sh).

This file is the command (flags -> one library call -> print); what is compiled, searched and reported is
tipsito/planning/pod.py, and why in docs/pods.md. Needs libtpu: `pip install -e ".[tpu-plan]"`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

# Compile-only use of libtpu: no TPU is attached, so JAX's own backend is the CPU, and libtpu gets the
# host/accelerator hints it would otherwise warn about (they do not change what is compiled).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ml_collections as mlc  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from tipsito import command  # noqa: E402
from tipsito.planning import pod  # noqa: E402  # the library: what is compiled and reported


def _define_flags() -> None:
  """Defines the CLI flags (idempotent; only when run as a program)."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  if "topology" in flags.FLAGS:
    return
  config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py[:args]).")
  flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:8x8x8 (512 chips), v5e:16x16, v5p:2x2x1.")
  flags.DEFINE_integer("num_slices", 1, "Slices of --topology joined over DCN (multislice).")
  flags.DEFINE_bool("json", False, "Also print one JSON line with every report.")
  flags.DEFINE_bool("evals", True, "Also compile the evals' forward passes (config.evals).")
  flags.DEFINE_bool("search", False, "Search remat x scan x mesh split x per-chip batch (see --search_*).")
  flags.DEFINE_float(
    "headroom",
    0.1,
    "Search: fraction of HBM left free for what the compiler does not "
    "count (fragmentation, runtime buffers).",
  )
  flags.DEFINE_list("search_remat", list(pod.SEARCH_REMAT), "Search: remat policies ('none' = no remat).")
  flags.DEFINE_list("search_scan", ["true"], "Search: scan settings (true,false).")
  flags.DEFINE_list("search_model", ["1"], "Search: sizes of the 'model' mesh axis (fsdp = the rest).")
  flags.DEFINE_list(
    "search_data",
    ["1", "0"],
    "Search: sizes of the 'data' mesh axis (0 = all chips: pure data parallel; 1 = pure FSDP).",
  )
  flags.DEFINE_list("search_batch_per_chip", [], "Search: per-chip batches (default: the config's).")
  flags.DEFINE_list(
    "search_microbatches",
    ["1", "2", "4", "8"],
    "Search: numbers of micro-batches "
    "(input.microbatches), tried after every remat setting of the one before.",
  )
  flags.DEFINE_integer(
    "microbatches",
    0,
    "Plan the train step with this many micro-batches "
    "(input.microbatches) and with 1, and report both (0 = the config's).",
  )
  flags.DEFINE_string("teacher_variant", "g/14", "Distillation recipes: the teacher's image preset.")
  flags.DEFINE_string("table_row", None, "Also print the train step as one README table row named so.")
  flags.DEFINE_list(
    "attention",
    [],
    "Plan the train step once per attention core (model.{image,text,fusion}.attention), e.g. xla,splash, "
    "and print what each saves against the first (default: the config's).",
  )


def main(argv: Sequence[str]) -> None:
  """Prints the per-chip report(s) (and the search result)."""
  command.no_arguments(argv)
  f = flags.FLAGS
  if f.config is None or not f.topology:
    raise app.UsageError(
      "--config and --topology are required, e.g. --config configs/tipsv2_g14.py --topology v5p:8x8x8"
    )
  try:
    devices = pod.topology_devices(f.topology, f.num_slices)
  except pod.PlanError as e:
    raise app.UsageError(str(e)) from None
  config = f.config
  config.lock()
  config = mlc.ConfigDict(config.to_dict())
  topo = f.topology + (f" x{f.num_slices} slices" if f.num_slices > 1 else "")
  if f.search:
    bools = {"true": True, "false": False}
    res = pod.search(
      config,
      devices,
      topology=f.topology,
      headroom=f.headroom,
      remats=f.search_remat,
      scans=[bools[s.lower()] for s in f.search_scan],
      meshes=pod.mesh_splits(len(devices), [int(x) for x in f.search_model], [int(x) for x in f.search_data]),
      batches_per_chip=[int(x) for x in f.search_batch_per_chip] or None,
      teacher_variant=f.teacher_variant,
      microbatches=[int(x) for x in f.search_microbatches],
    )
    best = res["best"]
    if best is None:
      print(f"search: nothing fits {topo} with {100 * f.headroom:.0f}% headroom")
    else:
      print(pod.format_report(best))
      print(
        f"search: fastest that fits with {100 * f.headroom:.0f}% headroom:\n  "
        f"{pod.format_overrides(best['overrides'])}"
      )
    if f.json:
      print(json.dumps({"plan_search": res}, default=str))
    sys.stdout.flush()
    return
  ks = [f.microbatches] if f.microbatches else [int(config.input.microbatches)]
  if ks[0] > 1:
    ks = [1] + ks  # K = 1 first: what the micro-batches save and cost
  reports = [
    dict(
      pod.plan_train(
        pod.apply_overrides(config, {"input.microbatches": k, **pod.attention_overrides(a)}),
        devices,
        topology=topo,
        teacher_variant=f.teacher_variant,
      ),
      attention=a or str(config.model.image.attention),
    )
    for a in f.attention or [None]
    for k in ks
  ]
  if f.evals:
    reports += pod.plan_evals(config, devices, topology=topo)
  for r in reports:
    print(pod.format_report(r))
  if len(f.attention) > 1:
    print(pod.attention_savings([r for r in reports if r["what"] == "train_step"]))
  if f.table_row:
    for r in reports:
      if r["what"] == "train_step":
        print(pod.table_row(f.table_row + (f" [{r['attention']}]" if f.attention else ""), r))
  if f.json:
    print(json.dumps({"plan": reports}, default=str))
  sys.stdout.flush()


run = command.entry_point(_define_flags, main)  # tipsito-plan


if __name__ == "__main__":
  run()
