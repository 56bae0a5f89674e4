"""`python -m tipsito.info --config F[:args] [--json] [--sharding [--devices N --processes P]]`: what a
config costs, without memory. `python -m tipsito.info [--config F] --schema` lists every config key with
its type, default, allowed values or range, whether it is safe to change on resume and its description
(tipsito/config/schema.py), and with --config each key's value there. `--sharding` lists every parameter's PartitionSpec on the mesh the config
resolves to for N devices (an abstract mesh: plan a 256-chip pod on a laptop), the parameter bytes per
device, and what each of the P processes (hosts) does.

Why: before asking for a pod you want parameter counts per tower and per training-only part, the size of
the whole train state (params, optimiser state, EMA teacher) and the saving of TIPSv2's head-only EMA over
a full EMA teacher — all computed with `jax.eval_shape`, so a ViT-g/14 costs nothing to inspect.
"""

from __future__ import annotations

import json
import sys
from typing import Sequence

from absl import flags

from tipsito import command
from tipsito import distributed
from tipsito.planning.costs import (  # noqa: F401  (the library, also re-exported for callers of this module)
  PAPER_SAVING_B,
  compute_info,
  crop_geometry,
  effective_weights,
  optimizer_convention,
  schema_rows,
  schema_table,
  sharding_plan,
)

FLAGS = flags.FLAGS


def _define_flags() -> None:
  if "json" in FLAGS:
    return
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py[:args]).")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
  flags.DEFINE_bool("sharding", False, "Also list the sharding of every parameter (on --devices).")
  flags.DEFINE_integer("devices", 0, "With --sharding: devices of the target job (0 = this machine's).")
  flags.DEFINE_integer("processes", 1, "With --sharding: JAX processes (hosts) of the target job.")
  flags.DEFINE_bool(
    "schema",
    False,
    "Print every config key (type, default, allowed values or range, "
    "safe on resume, description) and exit; with --config, also each key's value there.",
  )


def _table(info: dict) -> str:
  lines = [f"recipe {info['recipe']}  image {info['image_variant']}"]
  lines.extend(info.get("training_crops", {}).get("lines", []))
  for k, v in info["towers"].items():
    lines.append(f"  tower {k:<12s} {v / 1e6:10.2f}M")
  for k, v in info["parts"].items():
    lines.append(f"  part  {k:<12s} {v / 1e6:10.3f}M")
  lines.append(f"  student total      {info['student_params'] / 1e6:10.2f}M")
  lines.append(f"  EMA ({info['ema_mode']:<4s})         {info['ema_params'] / 1e6:10.2f}M")
  lines.append(f"  optimizer state    {info['optimizer_state_params'] / 1e6:10.2f}M ({info['optimizer']})")
  lines.append(f"  optimizer: {info['optimizer_convention']}")
  lines.append(f"  train state        {info['train_state_GiB']:10.3f} GiB")
  e = info.get("ema_comparison")
  if e:
    lines.append(
      f"  head-only vs full EMA: {e['train_state_params_head_only_ema'] / 1e6:.1f}M vs "
      f"{e['train_state_params_full_ema'] / 1e6:.1f}M params "
      f"({100 * e['fraction_saved']:.1f}% saved; vision side "
      f"{100 * e['vision_side_fraction_saved']:.1f}%; bytes {100 * e['bytes_fraction_saved']:.1f}%)"
    )
    lines.append("  " + e["explanation"])
  for r in info.get("effective_weights", []):
    lines.append(f"  weight {r['pair']}: {r['weight']:g}" + (f" ({r['note']})" if r["note"] else ""))
  plan = info.get("sharding_plan")
  if plan:
    lines.append(
      f"  sharding on {plan['devices']} devices, mesh {plan['mesh']}: params "
      f"{plan['params_bytes_per_device'] / 2**20:.1f} MiB per device"
    )
    lines.append(f"  {plan['processes']} process(es): {plan['per_process']}")
  for row in info.get("sharding", []):
    lines.append(f"  {row['path']:<70s} {str(row['shape']):<20s} {row['spec']}")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
  """Prints the info table or JSON."""
  command.no_arguments(argv)
  if FLAGS.schema:
    rows = schema_rows(FLAGS.config)
    print(json.dumps(rows) if FLAGS.json else schema_table(rows))
    sys.stdout.flush()
    return
  distributed.configure_jax()
  info = compute_info(
    FLAGS.config, with_sharding=FLAGS.sharding, devices=FLAGS.devices, processes=FLAGS.processes
  )
  print(json.dumps(info) if FLAGS.json else _table(info))
  sys.stdout.flush()


run = command.entry_point(_define_flags, main)  # tipsito-info


if __name__ == "__main__":
  run()
