"""Planning a TPU pod run from any machine (a laptop CPU is enough): the library behind `python -m
tipsito.plan` (tipsito/plan.py: the command, its flags and docs/pods.md).

`plan_train` builds the train state and the batch abstractly (shapes and shardings only, no parameter is
materialised), compiles the real jitted train step (`tipsito.train.step.jit_train_step`) ahead of time for
a TPU topology that is not present (`topology_devices`, `topology_mesh`), and reports per chip what XLA's
compiled memory analysis and cost analysis say: parameters, optimizer state, EMA, batch, temporaries, the
total against the chip's HBM, FLOPs per step, the cost model's estimated step time (where it reports one)
and the compile time. `plan_evals` compiles the evals' forward passes the same way. `search` tries remat
policy x scan x mesh split x per-chip batch, then micro-batches (exact gradient accumulation,
`input.microbatches`) when nothing smaller fits, and returns the fastest configuration that fits with the
headroom, as config overrides (`format_overrides`: `--config.k=v` flags to paste).
`attention_overrides` / `attention_savings`: the step once per attention core of the towers and the fusion
module (tipsito/models/layers.py ATTENTIONS; splash is the Pallas TPU kernel, tipsito/models/splash.py) and
what each saves in temporaries and total bytes per chip. `format_report` and `table_row` print a report
(the README plan table: launch/plan_paper_configs.sh).

Why: whether ViT-g/14 at batch 8192 fits 512 v5p chips, what head-only EMA saves in bytes per chip, and
whether the sharding rules partition as intended must be known before renting the pod. JAX compiles for
an abstract topology (`jax.experimental.topologies`) when `libtpu` is installed: `pip install -e
".[tpu-plan]"` (the libtpu that jax[tpu] pins; nothing changes for CPU users who skip it). No TPU is
attached, so JAX's own backend stays the CPU: the command sets `JAX_PLATFORMS=cpu` before JAX is imported.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np

from tipsito import distributed
from tipsito.config import recipes as recipes_lib
from tipsito.config import validation as config_validation
from tipsito.data import batch as batch_lib
from tipsito.evals import registry as eval_registry
from tipsito.train import observability
from tipsito.train import sharding
from tipsito.train import step as step_lib
from tipsito.train import teacher as teacher_lib

GiB = 2**30
# HBM per chip by topology prefix (the name JAX's topology API takes: "<generation>:<shape>").
HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v5litepod": 16.0, "v5p": 95.0, "v6e": 32.0}
# Remat settings the search tries, as (remat, remat_policy): cheapest first.
SEARCH_REMAT = ("none", "dots_saveable", "nothing_saveable")


class PlanError(ValueError):
  """Bad plan input (topology, flags) or libtpu missing; the message says what to do."""


def libtpu_available() -> bool:
  """True when JAX can compile for abstract TPU topologies (the `libtpu` package is importable)."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  return importlib.util.find_spec("libtpu") is not None


def hbm_gib(topology: str) -> float:
  """HBM per chip of a topology name such as 'v5p:8x8x8' (HBM_GIB)."""
  gen = topology.split(":", 1)[0].lower()
  if gen not in HBM_GIB:
    raise PlanError(
      f"--topology {topology!r}: unknown chip generation {gen!r}; known: {sorted(HBM_GIB)} "
      "(e.g. v5p:8x8x8, v5e:16x16)"
    )
  return HBM_GIB[gen]


def topology_devices(topology: str, num_slices: int = 1) -> list:
  """Compile-only TPU devices of `topology` (x `num_slices` slices joined over DCN)."""
  if not libtpu_available():
    raise PlanError(
      "tipsito.plan compiles for TPU topologies through libtpu, which is not installed: "
      "pip install -e '.[tpu-plan]'"
    )
  hbm_gib(topology)
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  # Compile-only devices claim no chip, so planning must not take (or wait for) libtpu's one-process lock:
  # another process on the machine (a second pytest worker, a run with libtpu installed) may hold it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  kw = {"num_slices": int(num_slices)} if int(num_slices) > 1 else {}
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw)
  except Exception as e:  # pylint: disable=broad-except
    raise PlanError(
      f"--topology {topology!r} (num_slices={num_slices}): libtpu refused it ({e}); use "
      "'<generation>:<chips per axis>', e.g. v5p:2x2x1, v5p:8x8x8, v5e:2x2, v5e:16x16"
    ) from e
  return list(desc.devices)


def topology_mesh(mesh_cfg, devices: list) -> jax.sharding.Mesh:
  """The (data, fsdp, model) mesh of `config.mesh` over topology devices (ICI-aware; DCN over slices)."""
  from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel

  slices = sorted({getattr(d, "slice_index", 0) or 0 for d in devices})
  if len(slices) > 1:
    shape = sharding.mesh_shape(mesh_cfg, len(devices))
    n = len(slices)
    # Slices split the outermost axis that they divide (data, else fsdp): only its gradient all-reduce
    # crosses DCN.
    for ax in range(3):
      if shape[ax] % n == 0:
        ici = list(shape)
        ici[ax] //= n
        dcn = [1, 1, 1]
        dcn[ax] = n
        arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        return jax.sharding.Mesh(arr, sharding.MESH_AXES)
    raise PlanError(f"config.mesh={dict(mesh_cfg)}: no mesh axis is divisible by num_slices={n}")
  return sharding.make_mesh(mesh_cfg, devices)


def abstract_batch(config, mesh) -> dict:
  """ShapeDtypeStructs of the global batch (every field the recipe needs, tipsito/data/batch.py), sharded
  like training."""
  return batch_lib.shape_spec(config, sharding=sharding.batch_sharding(mesh))


def _abstract(shapes, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def per_chip_bytes(tree) -> int:
  """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (the largest shard, i.e. chip 0)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
  return total


def _analyses(compiled) -> dict:
  """Memory and cost analysis of a compiled executable, per chip (bytes, FLOPs, seconds)."""
  ma = compiled.memory_analysis()
  out = {
    "argument_bytes": int(ma.argument_size_in_bytes),
    "output_bytes": int(ma.output_size_in_bytes),
    "alias_bytes": int(ma.alias_size_in_bytes),
    "temp_bytes": int(ma.temp_size_in_bytes),
    "code_bytes": int(ma.generated_code_size_in_bytes),
  }
  # Live at the peak: inputs, outputs not written in place of a donated input, temporaries, code.
  out["total_bytes"] = (
    out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"] + out["code_bytes"]
  )
  ca = compiled.cost_analysis()
  ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})
  out["flops"] = float(ca.get("flops", 0.0)) or None
  est = float(ca.get("optimal_seconds", -1.0))
  out["estimated_step_s"] = est if est > 0 else None
  return out


def plan_train(config, devices: list, *, topology: str = "", teacher_variant: str = "g/14") -> dict:
  """Compiles the train step of `config` for `devices`; returns the per-chip report (see module doc)."""
  distributed.configure_jax()
  # Shapes only: the text tower never tokenizes here, so a paper config needs no tokenizer file.
  config_validation.validate(config, num_devices=len(devices))
  mesh = topology_mesh(config.mesh, devices)
  teacher = (
    teacher_lib.abstract_teacher(config, teacher_variant)
    if recipes_lib.get_recipe(config.recipe).teacher == "frozen"
    else None
  )
  setup = step_lib.build(config, mesh, teacher=teacher)
  state = _abstract(setup.state_shapes, setup.state_shardings)
  batch = abstract_batch(config, mesh)
  frozen = {} if teacher is None else _abstract({"image": teacher.params}, setup.frozen_shardings)
  t0 = time.perf_counter()
  traced = step_lib.jit_train_step(setup).trace(state, batch, frozen)
  lowered = traced.lower()
  compiled, oom = _compile(lowered)
  compile_s = time.perf_counter() - t0
  if compiled is not None:
    # Per-chip bytes from the shardings the compiled executable actually takes (not just the requested
    # ones): a rule that does not partition as intended shows up here.
    in_sh = compiled.input_shardings[0]
    state, batch = _abstract(state, in_sh[0]), _abstract(batch, in_sh[1])
  b = int(config.input.batch_size)
  n = len(devices)
  other = {"step": state.step, "centers": state.centers, "rng": state.rng}
  report = {
    "what": "train_step",
    "recipe": config.recipe,
    "topology": topology,
    "chips": n,
    "mesh": dict(mesh.shape),
    "global_batch": b,
    "batch_per_chip": b / n,
    "microbatches": step_lib.microbatches(config),
    "ema": config.ema.mode,
    "ema_keys": list(setup.ctx.ema_keys),
    "image": _tower_desc(config.model.image),
    "text": _tower_desc(config.model.text),
    "params_bytes": per_chip_bytes(state.params),
    "opt_state_bytes": per_chip_bytes(state.opt_state),
    "ema_bytes": per_chip_bytes(state.ema),
    "other_state_bytes": per_chip_bytes(other),
    "batch_bytes": per_chip_bytes(batch),
    "frozen_bytes": per_chip_bytes(frozen),
    "params_replicated_bytes": sum(
      int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(state.params)
    ),
    "num_params": sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(state.params)),
    "compile_s": round(compile_s, 1),
  }
  report.update(_analyses(compiled) if compiled is not None else _oom_analyses(oom, report))
  # XLA's cost analysis counts a while-loop body once: with scanned towers the FLOPs (and the estimated
  # time) leave out depth-1 of the blocks. Memory analysis is not affected.
  # Micro-batches are a scan too. `matmul_flops_per_chip` counts every iteration (matmuls and convolutions
  # from the jaxpr, tipsito/train/observability.py), so rows with different K or scan compare on it.
  report["flops_count_scan_body_once"] = step_lib.microbatches(config) > 1 or any(
    bool(config.model[t].scan) for t in ("image", "text") if t in config.model and config.model[t]
  )
  report["matmul_flops_per_chip"] = observability.matmul_flops(traced.jaxpr)[0] / n
  if topology:
    report["hbm_bytes"] = int(hbm_gib(topology) * GiB)
    report["fits"] = compiled is not None and report["total_bytes"] <= report["hbm_bytes"]
  return report


_OOM_RE = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM")


def _compile(lowered):
  """(compiled, None), or (None, the compiler's message) when the TPU compiler refuses the program
  because its temporaries alone exceed HBM (it reports how much it would need)."""
  try:
    return lowered.compile(), None
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" in str(e) and _OOM_RE.search(str(e)):
      return None, str(e)
    raise


def _oom_analyses(message: str, report: dict) -> dict:
  """What an out-of-HBM compile still tells: the temporaries it needed; arguments from the shardings."""
  m = _OOM_RE.search(message)
  temp = int(float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024)
  args = sum(
    report[k]
    for k in (
      "params_bytes",
      "opt_state_bytes",
      "ema_bytes",
      "other_state_bytes",
      "batch_bytes",
      "frozen_bytes",
    )
  )
  return {
    "argument_bytes": args,
    "output_bytes": 0,
    "alias_bytes": 0,
    "temp_bytes": temp,
    "code_bytes": 0,
    "total_bytes": args + temp,
    "flops": None,
    "estimated_step_s": None,
    "compile_error": message.strip().splitlines()[-1][:300],
  }


def _tower_desc(cfg) -> str:
  """'scan,remat=dots_saveable' style summary of a tower's compile settings."""
  if not cfg:
    return "-"
  remat = cfg.remat_policy if cfg.remat else "none"
  return f"{'scan' if cfg.scan else 'unrolled'},remat={remat}"


def plan_evals(config, devices: list, *, topology: str = "") -> list[dict]:
  """Compiles the encoders' forward for each distinct (batch, image size) of `config.evals`.

  The eval batch is rounded up to a multiple of the batch-sharding devices (the evaluators pad the last
  batch the same way). Params are sharded like training params; segmentation evals compile the value path.
  """
  if not len(config.evals):
    return []
  mesh = topology_mesh(config.mesh, devices)
  recipe = recipes_lib.get_recipe(config.recipe)
  model = step_lib.build_model(config, recipe, teacher_width=None)
  s = int(config.input.global_size)
  params_shape = jax.eval_shape(
    lambda k: model.init(
      k,
      jnp.zeros((1, s, s, 3), jnp.uint8),
      jnp.ones((1, int(config.max_len)), jnp.int32),
      method=type(model).init_all,
    ),
    jax.random.PRNGKey(0),
  )["params"]
  rules = [tuple(r) for r in config.sharding.rules]
  params = _abstract(
    params_shape, sharding.tree_shardings(params_shape, mesh, rules, min_size=int(config.sharding.min_size))
  )
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  seen, rows = set(), []
  for name, given in sorted(config.evals.items()):
    ev = eval_registry.resolved_config(name, given)  # what the evaluator reads, its defaults included
    size = int(ev["image_size"])
    bsz = -(-int(ev["batch_size"]) // shards) * shards
    values = ev["type"] == "segmentation"
    key = (bsz, size, values)
    if key in seen:
      continue
    seen.add(key)
    images = jax.ShapeDtypeStruct((bsz, size, size, 3), jnp.uint8, sharding=sharding.batch_sharding(mesh))
    ids = jax.ShapeDtypeStruct((bsz, int(config.max_len)), jnp.int32, sharding=sharding.batch_sharding(mesh))

    def forward(p, x, t, values=values):
      out = model.apply({"params": p}, x, method=lambda m, x: m.image(x, return_values=values))
      if "text" in recipe.parts:
        out["text"] = model.apply({"params": p}, t, method=type(model).encode_text)["pooled"]
      return out

    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
      compiled = jax.jit(forward).lower(params, images, ids).compile()
    row = {
      "what": f"eval_forward[{name}]",
      "topology": topology,
      "chips": len(devices),
      "global_batch": bsz,
      "image_size": size,
      "values": values,
      "params_bytes": per_chip_bytes(params),
      "batch_bytes": per_chip_bytes((images, ids)),
      "compile_s": round(time.perf_counter() - t0, 1),
    }
    row.update(_analyses(compiled))
    if topology:
      row["hbm_bytes"] = int(hbm_gib(topology) * GiB)
      row["fits"] = row["total_bytes"] <= row["hbm_bytes"]
    rows.append(row)
  return rows


# ---------------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the search grid."""

  remat: str  # 'none' or a remat policy, applied to both towers
  scan: bool
  mesh: tuple[int, int, int]  # (data, fsdp, model)
  batch_per_chip: int
  microbatches: int = 1  # input.microbatches (exact accumulation: less memory, one extra forward)

  def overrides(self, chips: int) -> dict[str, Any]:
    """The config keys this candidate sets, as {dotted key: value}."""
    d, f, m = self.mesh
    out = {}
    for tower in ("image", "text"):
      out[f"model.{tower}.scan"] = self.scan
      out[f"model.{tower}.remat"] = self.remat != "none"
      if self.remat != "none":
        out[f"model.{tower}.remat_policy"] = self.remat
    out.update(
      {
        "mesh.data": d,
        "mesh.fsdp": f,
        "mesh.model": m,
        "input.batch_size": self.batch_per_chip * chips // m,
        "input.microbatches": self.microbatches,
      }
    )
    return out


def apply_overrides(config, overrides: dict[str, Any]):
  """A copy of `config` with dotted-key overrides applied."""
  c = mlc.ConfigDict(config.to_dict())
  for k, v in overrides.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    if last in node or not isinstance(node, mlc.ConfigDict):
      node[last] = v
  return c


ATTENTION_TOWERS = ("image", "text", "fusion")


def attention_overrides(attention: Optional[str]) -> dict[str, str]:
  """The overrides that give every tower (and the fusion module) the attention core `attention`
  (tipsito/models/layers.py ATTENTIONS); None: none (the config's own)."""
  return {} if attention is None else {f"model.{t}.attention": attention for t in ATTENTION_TOWERS}


def attention_savings(reports: Sequence[dict]) -> str:
  """One line per report after the first with the same micro-batches: its temporaries and total per chip
  against the first attention core's (what splash saves over xla)."""
  lines = []
  for r in reports[1:]:
    ref = next((x for x in reports if x.get("microbatches") == r.get("microbatches")), None)
    if ref is None or ref is r:
      continue
    dt, dtot = r["temp_bytes"] - ref["temp_bytes"], r["total_bytes"] - ref["total_bytes"]
    lines.append(
      f"attention {r['attention']} vs {ref['attention']} (K={r.get('microbatches', 1)}): temporaries "
      f"{r['temp_bytes'] / GiB:.3f} vs {ref['temp_bytes'] / GiB:.3f} GiB ({dt / GiB:+.3f}), total per chip "
      f"{r['total_bytes'] / GiB:.3f} vs {ref['total_bytes'] / GiB:.3f} GiB ({dtot / GiB:+.3f})"
    )
  return "\n".join(lines)


def format_overrides(overrides: dict[str, Any]) -> str:
  """`--config.k=v` flags in the order given (pasteable after `--config F`)."""
  return " ".join(f"--config.{k}={v}" for k, v in overrides.items())


def mesh_splits(chips: int, model_sizes: Sequence[int] = (1,), data_sizes: Sequence[int] = (1, 0)) -> list:
  """(data, fsdp, model) splits of `chips` with the given model / data axis sizes, fsdp the rest.

  A data size of 0 means every chip the model axis leaves (pure data parallel, params replicated).
  """
  out = []
  for m, d in itertools.product(model_sizes, data_sizes):
    d = d or chips // m
    if chips % (m * d) == 0 and (d, chips // (m * d), m) not in out:
      out.append((d, chips // (m * d), m))
  return out


def search(
  config,
  devices: list,
  *,
  topology: str,
  headroom: float = 0.1,
  remats: Sequence[str] = SEARCH_REMAT,
  scans: Sequence[bool] = (True,),
  meshes: Optional[Sequence[tuple[int, int, int]]] = None,
  batches_per_chip: Optional[Sequence[int]] = None,
  teacher_variant: str = "g/14",
  microbatches: Sequence[int] = (1,),
  log=print,
) -> dict:
  """Compiles every candidate; returns {'rows': [...], 'best': row or None}.

  Fits: total bytes per chip <= (1 - headroom) x HBM. Fastest: the cost model's estimated time per
  example where it reports one, else FLOPs per example per chip. Within one (scan, mesh, batch), remat
  settings are tried cheapest-first, then each of them again with the next number of micro-batches
  (`microbatches`, ascending), and the rest skipped once one fits (more remat or more micro-batches only
  cost FLOPs and time).
  """
  chips = len(devices)
  meshes = list(meshes or mesh_splits(chips))
  if batches_per_chip is None:
    b = int(config.input.batch_size)
    batches_per_chip = [max(1, b // chips)]
  budget = (1.0 - float(headroom)) * hbm_gib(topology) * GiB
  rows = []
  for scan, mesh, bpc in itertools.product(scans, meshes, batches_per_chip):
    for k, remat in itertools.product(sorted(int(x) for x in microbatches), remats):
      cand = Candidate(remat, bool(scan), tuple(mesh), int(bpc), k)
      ov = cand.overrides(chips)
      try:
        r = plan_train(
          apply_overrides(config, ov), devices, topology=topology, teacher_variant=teacher_variant
        )
      except Exception as e:  # pylint: disable=broad-except  # e.g. a mesh the batch does not split over
        log(f"  {format_overrides(ov)}: failed ({type(e).__name__}: {str(e)[:200]})")
        continue
      r["overrides"] = ov
      r["fits_with_headroom"] = r["total_bytes"] <= budget
      r["cost_per_example"] = (r["estimated_step_s"] or r["flops"] or 0.0) / max(r["batch_per_chip"], 1e-9)
      rows.append(r)
      log(f"  {_short(r)}")
      if r["fits_with_headroom"]:
        break
  fitting = [r for r in rows if r["fits_with_headroom"]]
  best = min(fitting, key=lambda r: r["cost_per_example"]) if fitting else None
  return {"rows": rows, "best": best, "headroom": headroom}


def _short(r: dict) -> str:
  """One log line of a train-step report."""
  est = f", est {r['estimated_step_s']:.3f} s" if r.get("estimated_step_s") else ""
  return (
    f"{r['image']} mesh={r['mesh']} batch/chip={r['batch_per_chip']:g} "
    f"microbatches={r.get('microbatches', 1)}: "
    f"{r['total_bytes'] / GiB:.2f} GiB/chip{'' if not r.get('hbm_bytes') else ' of %.0f' % (r['hbm_bytes'] / GiB)}"
    f", {(r['flops'] or 0) / 1e12:.2f} TFLOP/chip{est}, compile {r['compile_s']} s"
  )


def format_report(r: dict) -> str:
  """Human-readable per-chip table of one report."""
  g = lambda k: f"{r[k] / GiB:9.3f} GiB"  # noqa: E731
  lines = [
    f"{r['what']} ({r.get('recipe', '')}) on {r['topology']}: {r['chips']} chips, mesh "
    f"{r.get('mesh', '')}, global batch {r['global_batch']}"
    + (f" in {r['microbatches']} micro-batches" if r.get("microbatches", 1) > 1 else "")
  ]
  if r["what"] == "train_step":
    lines.append(f"  towers: image {r['image']}, text {r['text']}; EMA {r['ema']} {r['ema_keys']}")
    lines.append(
      f"  parameters      {g('params_bytes')}  ({r['num_params'] / 1e6:.1f}M params, "
      f"{r['params_replicated_bytes'] / GiB:.3f} GiB replicated)"
    )
    lines.append(f"  optimizer state {g('opt_state_bytes')}")
    lines.append(f"  EMA             {g('ema_bytes')}")
    if r.get("frozen_bytes"):
      lines.append(f"  frozen teacher  {g('frozen_bytes')}")
  else:
    lines.append(f"  parameters      {g('params_bytes')}")
  lines.append(f"  batch           {g('batch_bytes')}")
  lines.append(f"  arguments       {g('argument_bytes')}  (compiled, incl. TPU tile padding)")
  lines.append(f"  temporaries     {g('temp_bytes')}")
  lines.append(
    f"  outputs         {g('output_bytes')}  ({r['alias_bytes'] / GiB:.3f} GiB in place of donated inputs)"
  )
  fits = ""
  if r.get("hbm_bytes"):
    fits = (
      f"  of {r['hbm_bytes'] / GiB:.0f} GiB HBM: {100 * r['total_bytes'] / r['hbm_bytes']:.0f}%, "
      f"{'fits' if r['fits'] else 'DOES NOT FIT'}"
    )
  lines.append(f"  total           {g('total_bytes')}{fits}")
  lines.append(
    f"  FLOPs per chip  {(r['flops'] or 0) / 1e12:9.3f} TFLOP per step"
    + ("  (scanned blocks counted once)" if r.get("flops_count_scan_body_once") else "")
  )
  if r.get("matmul_flops_per_chip"):
    lines.append(
      f"  matmul FLOPs    {r['matmul_flops_per_chip'] / 1e12:9.3f} TFLOP per step per chip, every "
      "scan iteration counted"
    )
  if r.get("compile_error"):
    lines.append(f"  compiler        {r['compile_error']}")
  lines.append(
    "  estimated step  "
    + (f"{r['estimated_step_s']:9.4f} s" if r["estimated_step_s"] else "  (the cost model reports none)")
  )
  lines.append(f"  compile time    {r['compile_s']:9.1f} s")
  return "\n".join(lines)


TABLE_HEADER = (
  "| row | topology | towers (image) | global batch | K | params | optimizer | EMA | temporaries "
  "| total / HBM per chip | fits | TFLOP/chip/step | compile |\n"
  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(name: str, r: dict) -> str:
  """One markdown row of the README plan table (per-chip GiB; `launch/plan_paper_configs.sh`)."""
  gib = lambda k: f"{r[k] / GiB:.2f}"  # noqa: E731
  return (
    f"| {name} | {r['topology']} ({r['chips']} chips) | {r['image']} | {r['global_batch']} | "
    f"{r.get('microbatches', 1)} | "
    f"{gib('params_bytes')} | {gib('opt_state_bytes')} | {gib('ema_bytes')} | {gib('temp_bytes')} | "
    f"{gib('total_bytes')} / {r['hbm_bytes'] / GiB:.0f} GiB | {'yes' if r['fits'] else '**no**'} | "
    f"{'-' if not r['flops'] else '%.1f%s' % (r['flops'] / 1e12, '*' if r.get('flops_count_scan_body_once') else '')}"
    f" | {r['compile_s']:.0f} s |"
  )
