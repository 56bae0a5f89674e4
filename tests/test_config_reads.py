"""No fallback reads of config keys outside tipsito/config/ (issue 34 item 2), read from the source with `ast`.

Why: the schema (tipsito/config/schema.py) declares every key with its default, a validated config has every
key, and a workdir's config.json written before a key existed is upgraded when read
(tipsito/config/run_file.py). A `cfg.get("key", default)` elsewhere is a second default that can differ
from the schema's, and that a renamed key would silently take. So code outside tipsito/config/ reads
`config.input.microbatches`, never `config.input.get("microbatches", 1)`.

A fallback read is a call `x.get("k", d)`, `getattr(x, "k", d)` or `_get(x, "k"[, d])` whose key "k" is the
name of a schema key or sub-dict (any dotted part of a `schema.KEYS` / `schema.TREES` path). `ALLOWED` holds
the calls on dicts that are not configs but share a key name (parameter trees, report rows), `PENDING` the
config reads not converted yet, each with its reason: the test fails on any other, and on an entry that no
longer matches a call (so both lists only shrink).

`python tests/test_config_reads.py [ROOT]` prints the fallback reads of the tree at ROOT (default: this
checkout) and their count.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tipsito"
CONFIG_PACKAGE = "tipsito/config/"

# (file, key): why that call is not a read of a config key.
ALLOWED = {
  (
    "tipsito/interop/hf_dpt.py",
    "min_depth",
  ): "a Hugging Face DPT config.json (its own defaults), not a config",
  (
    "tipsito/interop/hf_dpt.py",
    "max_depth",
  ): "a Hugging Face DPT config.json (its own defaults), not a config",
  ("tipsito/planning/costs.py", "text"): "the parameter tree's text tower (absent for image-only recipes)",
  ("tipsito/evals/evaluator.py", "tokenizer"): "an attribute of the encoder object, not a config key",
  ("tipsito/evals/segmentation.py", "patch_size"): "an attribute of the encoder object, not a config key",
  ("tipsito/info.py", "sharding"): "a row of the `info` report (tipsito/planning/costs.py), not a config",
  ("tipsito/models/splash.py", "model"): "the mesh's axis sizes (`mesh.shape`), not the config",
  (
    "tipsito/planning/pod.py",
    "microbatches",
  ): "rows of the plan report (a failed row lacks it), not a config",
  ("tipsito/planning/pod.py", "recipe"): "rows of the plan report, not a config",
  ("tipsito/planning/pod.py", "mesh"): "rows of the plan report, not a config",
  ("tipsito/planning/pod.py", "sharding"): "`getattr(array, 'sharding')`: a jax array's sharding",
  ("tipsito/bench/step_bench.py", "image"): "rows of the step benchmark report, not a config",
  ("tipsito/interop/hf_tipsv2.py", "patch_size"): "a Hugging Face config.json's `vision_config`, with "
  "Tipsv2Config's own defaults for keys it leaves out: not a tipsito config",
  ("tipsito/interop/hf_tipsv2.py", "vocab_size"): "a Hugging Face config.json's `text_config`, with "
  "Tipsv2Config's own defaults: not a tipsito config",
  ("tipsito/train/teacher.py", "image"): "the EMA parameter tree (no EMA image tower: the student's)",
}

# (file, key): config reads with a fallback not converted yet, and why. None is left: an export's config.json
# (the towers' module kwargs) is upgraded in one place too (tipsito/export_format.py: upgrade_config, with
# tipsito/models/kwargs.py: complete_tower_config), and a standalone eval config's optional keys are filled
# from the schema (tipsito/config/defaults.py: eval_config_values).
PENDING: dict[tuple[str, str], str] = {}


@dataclasses.dataclass(frozen=True)
class Read:
  """One fallback read: where, which form, which key, and the call as written."""

  file: str  # relative to the root, '/'-separated
  line: int
  form: str  # 'get', 'getattr' or '_get'
  key: str
  call: str


def schema_key_names() -> frozenset[str]:
  """Every dotted part of a declared key or sub-dict path ('input', 'microbatches', 'model', 'image', ...)."""
  sys.path.insert(0, str(ROOT))
  from tipsito.config import schema  # pylint: disable=import-outside-toplevel

  paths = [k.path for k in schema.KEYS] + [t.path for t in schema.TREES]
  return frozenset(part for p in paths for part in p.split(".") if part != "*")


def _str_arg(node: ast.Call, i: int):
  if len(node.args) > i and isinstance(node.args[i], ast.Constant) and isinstance(node.args[i].value, str):
    return node.args[i].value
  return None


def reads_in(source: str, file: str, names: frozenset[str]) -> list[Read]:
  """The fallback reads of schema key `names` in one module's `source`."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Call):
      continue
    fn, form, key = node.func, None, None
    n_args = len(node.args) + len(node.keywords)
    if isinstance(fn, ast.Attribute) and fn.attr == "get" and n_args >= 2:
      form, key = "get", _str_arg(node, 0)
    elif isinstance(fn, ast.Name) and fn.id == "getattr" and n_args >= 3:
      form, key = "getattr", _str_arg(node, 1)
    elif isinstance(fn, ast.Name) and fn.id == "_get":  # a helper whose missing default is None
      form, key = "_get", _str_arg(node, 1)
    if form and key in names:
      out.append(Read(file, node.lineno, form, key, ast.unparse(node)))
  return out


def fallback_reads(root: pathlib.Path = ROOT, names: frozenset[str] | None = None) -> list[Read]:
  """Every fallback read of a schema key in the package's modules outside tipsito/config/."""
  names = schema_key_names() if names is None else names
  out = []
  for f in sorted((root / PACKAGE).rglob("*.py")):
    rel = f.relative_to(root).as_posix()
    if not rel.startswith(CONFIG_PACKAGE):
      out.extend(reads_in(f.read_text(), rel, names))
  return out


def test_no_fallback_read_of_a_schema_key_outside_config():
  new = [r for r in fallback_reads() if (r.file, r.key) not in ALLOWED and (r.file, r.key) not in PENDING]
  assert not new, (
    "read these config keys directly (the schema, tipsito/config/schema.py, holds their defaults; a saved "
    "config.json gains missing keys in tipsito/config/run_file.py), or, for a dict that is not a config, "
    "add (file, key) to ALLOWED in tests/test_config_reads.py with the reason:\n"
    + "\n".join(f"  {r.file}:{r.line}: {r.call}" for r in new)
  )


def test_allowed_and_pending_entries_still_match_a_call():
  found = {(r.file, r.key) for r in fallback_reads()}
  stale = [e for e in sorted(set(ALLOWED) | set(PENDING)) if e not in found]
  assert not stale, f"remove these entries from tests/test_config_reads.py (no such call any more): {stale}"


def test_the_scanner_finds_each_form_and_only_on_schema_keys():
  names = schema_key_names()
  assert {"microbatches", "input", "patch_size", "evals"} <= names and "*" not in names
  src = """
a = config.input.get("microbatches", 1)
b = getattr(config.model.image, "patch_size", 16)
c = _get(inp, "views", "two_views")
d = _get(inp, "views")
e = row.get("microbatches", default=1)
ok1 = config.input.get("microbatches")  # no default: not a fallback
ok2 = config.input.microbatches
ok3 = row.get("not_a_key", 1)
ok4 = getattr(obj, "patch_size")
"""
  got = [(r.line, r.form, r.key) for r in reads_in(src, "x.py", names)]
  assert got == [
    (2, "get", "microbatches"),
    (3, "getattr", "patch_size"),
    (4, "_get", "views"),
    (5, "_get", "views"),
    (6, "get", "microbatches"),
  ]


def test_no_get_helper_left_in_the_data_package():
  """The two `_get(cfg, key, default)` helpers of tipsito/data/sources.py and pipeline.py are gone."""
  for f in ("tipsito/data/sources.py", "tipsito/data/pipeline.py"):
    tree = ast.parse((ROOT / f).read_text())
    assert not [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_get"], f


if __name__ == "__main__":
  reads = fallback_reads(pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
  for r in reads:
    tag = "allowed" if (r.file, r.key) in ALLOWED else "pending" if (r.file, r.key) in PENDING else "NEW"
    print(f"{r.file}:{r.line}: [{tag}] {r.call}")
  print(f"{len(reads)} fallback reads of schema key names outside {CONFIG_PACKAGE}")
