"""Fingerprints of the 7 recipes' train steps: a refactor that must not change behaviour prints the same.

Why: "behaviour bitwise unchanged" is a claim about numbers, so it is checked on numbers. For each recipe
(the tiny configs of tests/test_recipes_all.py) three jitted train steps run on one fixed synthetic batch,
and the sha256 of every parameter, optimizer-state and EMA leaf of the final TrainState, and of each
logged metric over the steps, is printed. Run it before and after a change on the same machine and compare
(XLA:CPU is deterministic for a fixed build and processor; a different processor may round differently,
so this is a tool, not a CI test):

  python tests/fingerprint_recipes.py > before.json   # on the old commit
  python tests/fingerprint_recipes.py --compare before.json

Where a change is meant to alter values by rounding only, the size of the change is what to report:
`--dump D` also writes each recipe's final state to D/<recipe>.npz, and `--against D` prints, per recipe,
the largest absolute difference of any leaf from that dump and the largest relative to the leaf's largest
value (the dump may come from another commit's checkout of this script).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from conftest import run_synthetic_steps  # noqa: E402
from test_recipes_all import tiny  # noqa: E402
from tipsito.config import validation as config_validation  # noqa: E402

RECIPES = ("clip", "siglip", "ito", "tips", "tipsv2", "tipsito", "distill")
STEPS = 3


def digest(tree) -> str:
  """sha256 over the leaves of a pytree, in flattening order, with their paths, dtypes and shapes."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(jax.device_get(leaf))
    h.update(jax.tree_util.keystr(path).encode())
    h.update(f"{a.dtype}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()


def leaves(state) -> dict[str, np.ndarray]:
  """{path: value} of every leaf of a TrainState."""
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in flat}


# Leaves whose gradient is zero in exact arithmetic (softmax is invariant to a bias added to every key), so
# their values, and the optimizer state of them, are rounding noise of any change: reported apart.
NOISE_LEAVES = "['key']['bias']"


def largest_change(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> dict:
  """Over the parameters (`.params`) both states have, attention key biases aside (NOISE_LEAVES): the
  largest absolute difference with its leaf, and the largest relative to that leaf's largest magnitude."""
  out = {"abs": 0.0, "abs_leaf": None, "rel": 0.0, "rel_leaf": None}
  for k in sorted(set(before) & set(after)):
    if not k.startswith(".params") or NOISE_LEAVES in k:
      continue
    a, b = before[k].astype(np.float64), after[k].astype(np.float64)
    if a.shape != b.shape or not np.issubdtype(before[k].dtype, np.floating) or not a.size:
      continue
    d = float(np.max(np.abs(a - b)))
    r = d / max(float(np.max(np.abs(a))), 1e-30)
    if d > out["abs"]:
      out.update(abs=d, abs_leaf=k)
    if r > out["rel"]:
      out.update(rel=r, rel_leaf=k)
  return out


def fingerprint(recipe: str, dump: str | None = None, against: str | None = None) -> dict:
  c = tiny(recipe)
  config_validation.validate(c, num_devices=1)
  _, state, _, hist = run_synthetic_steps(c, STEPS)
  if dump:
    np.savez(pathlib.Path(dump) / f"{recipe}.npz", **leaves(state))
  if against:
    with np.load(pathlib.Path(against) / f"{recipe}.npz") as f:
      change = largest_change(dict(f), leaves(state))
    print(f"{recipe}: largest change {change}", file=sys.stderr)
  keys = sorted(hist[0])
  metrics = {k: hashlib.sha256(json.dumps([h[k] for h in hist]).encode()).hexdigest()[:16] for k in keys}
  return {"state": digest(state), "metrics": metrics, "loss_total": [h["loss/total"] for h in hist]}


def differences(before: dict, after: dict) -> list[str]:
  """What differs between two fingerprints of one recipe. A metric only one side logs is reported
  apart: a change that adds a metric keeps the state and every earlier metric bitwise equal."""
  out = []
  if before["state"] != after["state"]:
    out.append("state")
  for k in sorted(set(before["metrics"]) & set(after["metrics"])):
    if before["metrics"][k] != after["metrics"][k]:
      out.append(k)
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--compare", help="a JSON file printed by an earlier run; exit 1 on any difference")
  p.add_argument("--recipes", default=",".join(RECIPES))
  p.add_argument("--dump", help="also write each recipe's final state to DUMP/<recipe>.npz")
  p.add_argument(
    "--against", help="print the largest change of each recipe's state from AGAINST/<recipe>.npz"
  )
  args = p.parse_args()
  if args.dump:
    pathlib.Path(args.dump).mkdir(parents=True, exist_ok=True)
  out = {r: fingerprint(r, args.dump, args.against) for r in args.recipes.split(",")}
  print(json.dumps(out, indent=1, sort_keys=True))
  if args.compare:
    before = json.loads(pathlib.Path(args.compare).read_text())
    diff = {r: d for r in out if (d := differences(before[r], out[r]))}
    for r in out:
      added = sorted(set(out[r]["metrics"]) - set(before[r]["metrics"]))
      if added:
        print(f"{r}: metrics added {added}", file=sys.stderr)
    print(
      f"{len(out) - len(diff)} of {len(out)} recipes equal" + (f"; differ: {diff}" if diff else ""),
      file=sys.stderr,
    )
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
  main()
