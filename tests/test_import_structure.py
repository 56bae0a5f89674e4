"""The package's import structure, read from its own source with `ast`: no circle between files or between
subpackages, no function-local import of a tipsito module without a reason on its line, and no library
module importing a `python -m` command-line module.

Why a test: function-local imports and imports under `if TYPE_CHECKING:` hide a dependency from a reader
but not from the structure; every import of a tipsito module counts here, wherever it is written.

`python tests/test_import_structure.py [ROOT] [--step]` prints the figures of the tree at ROOT (default:
this checkout): files, import edges, circles, function-local imports with their reasons, library modules
importing command-line modules; `--step` adds the files one training step runs code in (`step_files`).

What is not fixed yet lives in `PENDING`, each entry with the reason it is still there: the tests fail on
anything new, and on an entry that no longer exists (so the list only shrinks).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import sys
from typing import Iterable, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tipsito"

# What the structure still has, outside the modules of the one-way assembly (issue 19 items 1-3, 5), with
# the reason each is still there. Remove an entry when it is fixed (the tests say so).
PENDING = {
  # circles between files, as the set of files in the knot
  "file_circles": {},
  # subpackage circles, as the set of subpackages in the knot
  "subpackage_circles": {},
  # (library module, the `python -m` module it imports)
  "library_imports_of_cli": {},
  # module -> function-local imports of tipsito modules without a reason on their line
  "unexplained_local_imports": {},
  # module -> (string literals of a batch field used as a key there, the reason they are still there)
  "batch_field_literals": {},
  # (config module, module outside CONFIG_MAY_IMPORT it imports): the reason it still does
  "config_imports": {},
}

# The layer contract of tipsito/config/ (issue 34 item 1, issue 44 item 1): a config is a leaf that builds
# and validates without the model, data, eval or training code, so tipsito/config/*.py import, outside the
# config package, only the leaves: the enumerations (tipsito/choices.py, which imports nothing) and the
# path helper (tipsito/paths.py, etils only). The eval settings' keys are the schema's, and what needs the
# tokenizer or the data on disk is checked before training outside the config (tipsito/train/loop.py).
CONFIG_MAY_IMPORT = frozenset({"tipsito.choices", "tipsito.paths"})
# Modules that import nothing but the standard library's `__future__` and `typing` (the names every layer
# may share: tipsito/choices.py), so that importing them can never pull a layer in.
LEAVES = frozenset({"tipsito.choices"})

# The declared batch (issue 34 item 3): a batch field's name is a string only where the batch is declared
# (tipsito/data/batch.py: the constants in its `FIELDS`) and where the pipeline fills it; everywhere else it
# is read through those constants, so a renamed or added field is one edit there, not a search.
BATCH_DECLARATION = "tipsito.data.batch"
BATCH_FIELD_MODULES = frozenset(
  {BATCH_DECLARATION, "tipsito.data.pipeline", "tipsito.data.grain_ops", "tipsito.data.eval_input"}
)
# Field names that also name something else in the package (the image and text towers' params and config
# sections, a source record's image, label and captions, the segmentation eval type, a tower's depth): their
# literals count only where they key a batch, i.e. a container whose expression says `batch`
# (`batch["image"]`, `host_batch.get("text")`, `batch = {...}`). Every other field name counts as any string
# but a docstring (a tuple of names such as a loss term's `fields` too).
SHARED_FIELD_NAMES = frozenset({"image", "text", "label", "captions", "segmentation", "depth"})


@dataclasses.dataclass(frozen=True)
class Import:
  """One import of a tipsito module: who imports what, where, and whether inside a function."""

  source: str  # importing module, dotted
  target: str  # imported tipsito module, dotted (a file of the package)
  line: int
  local: bool  # inside a function body
  comment: str  # the comment on the import's line ('' when none)


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every .py file of the package."""
  out = {}
  for f in sorted((root / PACKAGE).rglob("*.py")):
    parts = list(f.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = f
  return out


def _is_package(name: str, files: dict[str, pathlib.Path]) -> bool:
  return files[name].name == "__init__.py"


def _resolve(name: str, files: dict[str, pathlib.Path]) -> Optional[str]:
  """The package file a dotted name lives in: the longest prefix that is a module of the package."""
  parts = name.split(".")
  for n in range(len(parts), 0, -1):
    cand = ".".join(parts[:n])
    if cand in files:
      return cand
  return None


def _comment(lines: list[str], lineno: int) -> str:
  line = lines[lineno - 1]
  return line.split("#", 1)[1].strip() if "#" in line else ""


def imports_of(module: str, files: dict[str, pathlib.Path]) -> list[Import]:
  """Every import of a tipsito module in `module`'s file (module level, in functions, relative too)."""
  text = files[module].read_text()
  lines = text.splitlines()
  tree = ast.parse(text)
  out: list[Import] = []
  package = module if _is_package(module, files) else module.rpartition(".")[0]

  def visit(node: ast.AST, local: bool) -> None:
    for child in ast.iter_child_nodes(node):
      in_fn = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        for a in child.names:
          if a.name == PACKAGE or a.name.startswith(PACKAGE + "."):
            add(_resolve(a.name, files), child, local)
      elif isinstance(child, ast.ImportFrom):
        if child.level:
          base = package.split(".")
          base = base[: len(base) - (child.level - 1)]
          mod = ".".join(base + ([child.module] if child.module else []))
        else:
          mod = child.module or ""
        if not (mod == PACKAGE or mod.startswith(PACKAGE + ".")):
          continue
        for a in child.names:
          sub = f"{mod}.{a.name}"
          add(sub if sub in files else _resolve(mod, files), child, local)
      visit(child, in_fn)

  def add(target: Optional[str], node: ast.stmt, local: bool) -> None:
    if target is not None and target != module:
      out.append(Import(module, target, node.lineno, local, _comment(lines, node.lineno)))

  visit(tree, False)
  return out


def all_imports(files: Optional[dict[str, pathlib.Path]] = None) -> list[Import]:
  files = files or module_files()
  return [imp for m in files for imp in imports_of(m, files)]


def subpackage(module: str) -> str:
  """`tipsito.train.step` -> 'train'; a top-level module is its own node (`tipsito.export` -> 'export')."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else PACKAGE


def _graph(edges: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
  graph: dict[str, set[str]] = {}
  for a, b in edges:
    if a != b:
      graph.setdefault(a, set()).add(b)
      graph.setdefault(b, set())
  return graph


def knots(edges: Iterable[tuple[str, str]]) -> list[frozenset]:
  """The strongly connected components with more than one node (Tarjan): each holds one or more circles."""
  graph = _graph(edges)
  index, low, stack, on_stack, comps = {}, {}, [], set(), []
  counter = [0]

  def strongconnect(v: str) -> None:
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        strongconnect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(frozenset(comp))

  sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
  for v in sorted(graph):
    if v not in index:
      strongconnect(v)
  return comps


def circles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
  """One circle (a -> ... -> a) per knot (`knots`), in the same order."""
  edges = set(edges)
  graph = _graph(edges)
  return [_one_circle(graph, set(k)) for k in knots(edges)]


def _one_circle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
  """A shortest circle through the component's smallest node (breadth-first inside the component)."""
  start = min(comp)
  prev = {start: None}
  queue = [start]
  while queue:
    v = queue.pop(0)
    for w in sorted(graph[v] & comp):
      if w == start:
        path = [v]
        while prev[path[-1]] is not None:
          path.append(prev[path[-1]])
        return list(reversed(path)) + [start]
      if w not in prev:
        prev[w] = v
        queue.append(w)
  return sorted(comp)


def is_cli(path: pathlib.Path) -> bool:
  """A `python -m` module: `if __name__ == "__main__":` or an absl `app.run(...)` call at module level, or
  the `__init__.py` of a package run with `python -m` (it has a `__main__.py`)."""
  if path.name == "__init__.py" and (path.parent / "__main__.py").is_file():
    return True
  tree = ast.parse(path.read_text())
  for node in tree.body:
    if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
      names = [n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)]
      consts = [n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)]
      if "__name__" in names and "__main__" in consts:
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
      f = node.value.func
      if isinstance(f, ast.Attribute) and f.attr == "run" and getattr(f.value, "id", None) == "app":
        return True
  return False


def _reason(comment: str) -> str:
  """The reason a comment gives; a bare linter pragma (`pylint: disable=...`, `noqa`) is no reason."""
  parts = [p.strip() for p in comment.split("#")]
  return " ".join(p for p in parts if p and not p.startswith(("pylint:", "noqa", "type:")))


@functools.lru_cache(maxsize=None)
def figures(root: pathlib.Path = ROOT) -> dict:
  """The structure in numbers, from the code's own imports."""
  files = module_files(root)
  imps = all_imports(files)
  file_edges = {(i.source, i.target) for i in imps}
  sub_edges = {(subpackage(a), subpackage(b)) for a, b in file_edges if subpackage(a) != subpackage(b)}
  local = [i for i in imps if i.local]
  clis = sorted(m for m, f in files.items() if is_cli(f))
  lib_to_cli = sorted({(i.source, i.target) for i in imps if i.target in clis and i.source not in clis})
  unexplained: dict[str, int] = {}
  for i in local:
    if not _reason(i.comment):
      unexplained[i.source] = unexplained.get(i.source, 0) + 1
  return {
    "files": len(files),
    "import_edges": len(file_edges),
    "subpackage_edges": len(sub_edges),
    "file_circles": circles(file_edges),
    "file_knots": knots(file_edges),
    "subpackage_circles": circles(sub_edges),
    "subpackage_knots": knots(sub_edges),
    "local_imports": local,
    "unexplained_local_imports": unexplained,
    "cli_modules": clis,
    "library_imports_of_cli": lib_to_cli,
  }


# --------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------


def _fmt(circle: list[str]) -> str:
  return " -> ".join(circle)


def test_no_import_circle_between_files():
  f = figures()
  new = [
    f"{_fmt(c)}   (knot of {len(k)} files)"
    for c, k in zip(f["file_circles"], f["file_knots"])
    if k not in PENDING["file_circles"]
  ]
  assert not new, "import circles between files:\n  " + "\n  ".join(new)
  stale = set(PENDING["file_circles"]) - set(f["file_knots"])
  assert not stale, f"fixed, remove from PENDING['file_circles']: {[sorted(k) for k in stale]}"


def test_no_import_circle_between_subpackages():
  f = figures()
  new = [
    f"{_fmt(c)}   (knot: {', '.join(sorted(k))})"
    for c, k in zip(f["subpackage_circles"], f["subpackage_knots"])
    if k not in PENDING["subpackage_circles"]
  ]
  assert not new, "import circles between subpackages:\n  " + "\n  ".join(new)
  stale = set(PENDING["subpackage_circles"]) - set(f["subpackage_knots"])
  assert not stale, f"fixed, remove from PENDING['subpackage_circles']: {[sorted(k) for k in stale]}"


def test_function_local_imports_of_tipsito_give_a_reason():
  bad = [i for i in all_imports() if i.local and not _reason(i.comment)]
  counts: dict[str, int] = {}
  for i in bad:
    counts[i.source] = counts.get(i.source, 0) + 1
  pending = PENDING["unexplained_local_imports"]
  new = [i for i in bad if counts[i.source] > pending.get(i.source, 0)]
  assert not new, (
    "function-local imports of tipsito modules without a reason in a comment on the same "
    "line (import at module level, or say why not):\n  "
    + "\n  ".join(f"{i.source}:{i.line} imports {i.target}" for i in new)
  )
  fewer = {m: (n, counts.get(m, 0)) for m, n in pending.items() if counts.get(m, 0) < n}
  assert not fewer, f"fewer unexplained imports than PENDING says (lower the counts): {fewer}"


def test_no_library_module_imports_a_cli_module():
  found = set(figures()["library_imports_of_cli"])
  pending = set(PENDING["library_imports_of_cli"])
  assert not found - pending, (
    "library modules importing `python -m` modules (move the code they need into "
    "a library module):\n  " + "\n  ".join(f"{s} imports {t}" for s, t in sorted(found - pending))
  )
  assert not pending - found, (
    f"fixed, remove from PENDING['library_imports_of_cli']: {sorted(pending - found)}"
  )


def config_imports_outside(imps: Iterable[Import]) -> set[tuple[str, str]]:
  """(config module, imported module) for every import from tipsito/config/ outside the contract."""
  return {
    (i.source, i.target)
    for i in imps
    if subpackage(i.source) == "config"
    and subpackage(i.target) != "config"
    and i.target not in CONFIG_MAY_IMPORT
  }


def test_config_imports_only_the_light_modules_of_its_contract():
  found = config_imports_outside(all_imports())
  pending = set(PENDING["config_imports"])
  assert not found - pending, (
    "tipsito/config/ imports modules outside CONFIG_MAY_IMPORT (a config must build without the model, "
    "data or training code: move the names it needs into tipsito/choices.py or tipsito/config/):\n  "
    + "\n  ".join(f"{s} imports {t}" for s, t in sorted(found - pending))
  )
  assert not pending - found, f"fixed, remove from PENDING['config_imports']: {sorted(pending - found)}"


def leaf_imports(module: str, files: dict[str, pathlib.Path]) -> list[str]:
  """The modules a leaf imports other than `__future__` and `typing` (anywhere in the file)."""
  out = []
  for node in ast.walk(ast.parse(files[module].read_text())):
    if isinstance(node, ast.Import):
      out += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      out.append("." * node.level + (node.module or ""))
  return [m for m in out if m not in ("__future__", "typing")]


def test_leaves_import_nothing():
  files = module_files()
  bad = {m: leaf_imports(m, files) for m in sorted(LEAVES) if leaf_imports(m, files)}
  assert not bad, f"leaf modules (LEAVES) must import nothing: {bad}"


def batch_fields(files: dict[str, pathlib.Path]) -> frozenset:
  """The field names tipsito/data/batch.py declares: the string constants its `FIELDS` tuple lists."""
  tree = ast.parse(files[BATCH_DECLARATION].read_text())
  consts, listed = {}, []
  for node in tree.body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
      name, value = node.targets[0].id, node.value
      if isinstance(value, ast.Constant) and isinstance(value.value, str):
        consts[name] = value.value
      elif name == "FIELDS" and isinstance(value, ast.Tuple):
        listed = [e.id for e in value.elts if isinstance(e, ast.Name)]
  return frozenset(consts[n] for n in listed)


@dataclasses.dataclass(frozen=True)
class FieldLiteral:
  """A batch field's name written as a string: a key (`x["f"]`, `x.get("f")`, `"f" in x`, `{"f": ...}`) or,
  for the names not in `SHARED_FIELD_NAMES`, any string but a docstring."""

  module: str
  line: int
  field: str
  code: str  # the expression, as written


def field_literals(module: str, files: dict[str, pathlib.Path], fields: frozenset) -> list[FieldLiteral]:
  """The literals of batch fields in `module` (see `SHARED_FIELD_NAMES` for the names that count only as
  the key of a container that says `batch`)."""
  tree = ast.parse(files[module].read_text())
  out: list[FieldLiteral] = []
  docstrings = {
    id(n.body[0].value)
    for n in ast.walk(tree)
    if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    and n.body
    and isinstance(n.body[0], ast.Expr)
    and isinstance(n.body[0].value, ast.Constant)
  }

  keys: set[int] = set()  # the constants found as keys (each literal counts once)

  def key(node: ast.AST, field_node: ast.AST, container: str, code: ast.AST) -> None:
    f = field_node.value if isinstance(field_node, ast.Constant) else None
    if isinstance(f, str) and f in fields and (f not in SHARED_FIELD_NAMES or "batch" in container.lower()):
      out.append(FieldLiteral(module, node.lineno, f, ast.unparse(code)))
      keys.add(id(field_node))

  assigned = {  # a dict literal -> the names it is assigned to
    id(n.value): " ".join(ast.unparse(t) for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
    for n in ast.walk(tree)
    if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Dict)
  }
  for node in ast.walk(tree):
    if isinstance(node, ast.Subscript):
      key(node, node.slice, ast.unparse(node.value), node)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
      if node.func.attr in ("get", "pop", "setdefault"):
        key(node, node.args[0], ast.unparse(node.func.value), node)
    elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
      key(node, node.left, ast.unparse(node.comparators[0]), node)
    elif isinstance(node, ast.Dict):
      for k in node.keys:
        if k is not None:
          key(node, k, assigned.get(id(node), ""), node)
    if isinstance(node, ast.Constant) and node.value in fields - SHARED_FIELD_NAMES:
      if id(node) not in docstrings and id(node) not in keys:
        out.append(FieldLiteral(module, node.lineno, node.value, repr(node.value)))
  return sorted(set(out), key=lambda x: (x.line, x.field, x.code))


def all_field_literals(files: Optional[dict[str, pathlib.Path]] = None) -> list[FieldLiteral]:
  """`field_literals` of every module outside `BATCH_FIELD_MODULES`."""
  files = files or module_files()
  fields = batch_fields(files)
  return [f for m in sorted(files) if m not in BATCH_FIELD_MODULES for f in field_literals(m, files, fields)]


def test_batch_fields_are_read_by_name():
  from tipsito.data import batch  # pylint: disable=import-outside-toplevel

  assert batch_fields(module_files()) == set(batch.FIELDS)  # the check reads the declaration right
  found: dict[str, list[FieldLiteral]] = {}
  for f in all_field_literals():
    found.setdefault(f.module, []).append(f)
  pending = PENDING["batch_field_literals"]
  new = [f for m, fs in found.items() if len(fs) > pending.get(m, (0, ""))[0] for f in fs]
  assert not new, (
    "batch field names written as strings outside tipsito/data/batch.py and the pipelines that fill "
    "the batch (use the constants of tipsito/data/batch.py, e.g. `batch[batch_lib.IMAGE2]`):\n  "
    + "\n  ".join(f"{f.module}:{f.line}: {f.code}" for f in new)
  )
  fewer = {m: (n, len(found.get(m, []))) for m, (n, _) in pending.items() if len(found.get(m, [])) < n}
  assert not fewer, f"fewer batch field literals than PENDING says (lower the counts): {fewer}"


def test_the_batch_field_check_sees_literals(tmp_path):
  """The check on a package written for the purpose: each form is found, a tower's params are not."""
  pkg = tmp_path / PACKAGE
  (pkg / "data").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "data" / "__init__.py").write_text("")
  (pkg / "data" / "batch.py").write_text(
    'IMAGE = "image"\nIMAGE2 = "image2"\nMASK = "mask"\nOTHER = "other"\nFIELDS = (IMAGE, IMAGE2, MASK)\n'
  )
  (pkg / "user.py").write_text(
    "def f(batch, params, x):\n"
    '  a = batch["image"]\n'  # a shared name on a batch: found
    '  b = params["image"]\n'  # the image tower: not a batch field
    '  c = x.get("mask")\n'
    '  d = "image2" in x\n'
    '  host_batch = {"image": a}\n'
    '  e = {"image2": b, "other": c, "image": d}\n'  # "image" in a dict that is no batch: not found
    '  return a, b, c, d, e, host_batch, x["other"], ("image", "mask")\n'  # a tuple: the unshared name
    "def g():\n"
    '  "mask"\n'  # a docstring: not found
  )
  files = module_files(tmp_path)
  assert batch_fields(files) == {"image", "image2", "mask"}
  assert [(f.module, f.line, f.field) for f in all_field_literals(files)] == [
    ("tipsito.user", 2, "image"),
    ("tipsito.user", 4, "mask"),
    ("tipsito.user", 5, "image2"),
    ("tipsito.user", 6, "image"),
    ("tipsito.user", 7, "image2"),
    ("tipsito.user", 8, "mask"),
  ]


def test_the_checks_see_a_circle(tmp_path):
  """The circle finder on a package written for the purpose: a -> b -> a, function-local and relative."""
  pkg = tmp_path / PACKAGE
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from tipsito.sub import b\n")
  (pkg / "sub" / "b.py").write_text("def f():\n  from .. import a\n  return a\n")
  files = module_files(tmp_path)
  imps = all_imports(files)
  assert [(i.source, i.target, i.local) for i in imps] == [
    ("tipsito.a", "tipsito.sub.b", False),
    ("tipsito.sub.b", "tipsito.a", True),
  ]
  assert circles({(i.source, i.target) for i in imps}) == [["tipsito.a", "tipsito.sub.b", "tipsito.a"]]
  assert circles({(subpackage(i.source), subpackage(i.target)) for i in imps}) == [["a", "sub", "a"]]


# --------------------------------------------------------------------------------------------------------
# The load path (issue 44 item 3): `tipsito.load` (tipsito/inference.py) builds an export's towers and no
# more, so importing it runs no evaluation, data, objective or training module. What `enc.classify` and
# decoding files need (the zero-shot protocol, the eval decoder) is imported by the call that needs it
# (tipsito/inference_tools.py), and the tokenizer when an export ships one (tipsito/inference.py).
# --------------------------------------------------------------------------------------------------------
LOAD_MODULE = "tipsito.inference"
LOAD_MAY_NOT_IMPORT = (
  "tipsito.evals",
  "tipsito.data",
  "tipsito.objective",
  "tipsito.train",
  "tipsito.losses",
)


def import_closure(start: str, imps: Iterable[Import], files: dict[str, pathlib.Path]) -> set[str]:
  """The package modules importing `start` runs: its module-level imports, theirs, and so on, each with
  the packages (`__init__.py`) above it, which Python runs first."""
  edges: dict[str, set[str]] = {}
  for i in imps:
    if not i.local:
      edges.setdefault(i.source, set()).add(i.target)
  seen, todo = set(), [start]
  while todo:
    m = todo.pop()
    if m in seen:
      continue
    seen.add(m)
    parts = m.split(".")
    todo += [p for p in (".".join(parts[:n]) for n in range(1, len(parts))) if p in files]
    todo += sorted(edges.get(m, ()))
  return seen


def test_load_imports_no_eval_or_data_module():
  files = module_files()
  loaded = import_closure(LOAD_MODULE, all_imports(files), files)
  bad = sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in LOAD_MAY_NOT_IMPORT))
  assert not bad, (
    f"importing {LOAD_MODULE} (tipsito.load) runs {bad}: import them in the function that needs them, "
    "with the reason on the line"
  )


# --------------------------------------------------------------------------------------------------------
# The files one training step runs code in (a figure, not a test: it compiles nothing but builds a model)
# --------------------------------------------------------------------------------------------------------


def step_files(recipe: str = "tipsito") -> dict[str, list[str]]:
  """The package files whose Python code runs for one training step of a tiny `recipe` config: from the
  config to the loss values (`step.build`, then tracing the jitted step: no compilation), and from the
  jitted step down (the tracing alone). Measured with `sys.setprofile` on the tree on `sys.path`."""
  import jax  # pylint: disable=import-outside-toplevel
  from tipsito.config import defaults  # pylint: disable=import-outside-toplevel
  from tipsito.train import step as step_lib  # pylint: disable=import-outside-toplevel

  try:
    from tipsito.data.synthetic import synthetic_batch  # pylint: disable=import-outside-toplevel
  except ImportError:  # before tipsito/data/synthetic.py
    from tipsito.bench.step_bench import synthetic_batch  # pylint: disable=import-outside-toplevel
  from tipsito.train import sharding  # pylint: disable=import-outside-toplevel

  config = defaults.tiny_config(recipe)
  pkg = str(pathlib.Path(step_lib.__file__).resolve().parent.parent)
  seen: list[set] = [set()]

  def prof(frame, event, arg):
    del arg
    if event == "call":
      f = frame.f_code.co_filename
      if f.startswith(pkg):
        seen[-1].add(str(pathlib.Path(f).resolve().relative_to(pathlib.Path(pkg).parent)))

  sys.setprofile(prof)
  try:
    setup = step_lib.build(config, vocab_size=100)
    batch = sharding.global_batch(synthetic_batch(config, seed=1, vocab_size=100), setup.mesh)
    fn = step_lib.jit_train_step(setup)
    seen.append(set())
    fn.trace(setup.state_shapes, batch, setup.frozen())
  finally:
    sys.setprofile(None)
  del jax
  skip = ("tipsito/data/synthetic.py", "tipsito/bench/step_bench.py", "tipsito/train/sharding.py")
  build_files = {f for f in seen[0] if f not in skip[:2]}
  return {"config_to_loss": sorted(build_files | seen[1]), "jitted_step_down": sorted(seen[1])}


def main(argv: list[str]) -> None:
  root = pathlib.Path(next((a for a in argv if not a.startswith("--")), ROOT)).resolve()
  f = figures(root)
  print(f"files: {f['files']}")
  print(f"import edges between files: {f['import_edges']} (between subpackages: {f['subpackage_edges']})")
  print(f"circles between files: {len(f['file_circles'])}")
  for c, k in zip(f["file_circles"], f["file_knots"]):
    print(f"  {_fmt(c)}   (knot of {len(k)} files)")
  print(f"circles between subpackages: {len(f['subpackage_circles'])}")
  for c, k in zip(f["subpackage_circles"], f["subpackage_knots"]):
    print(f"  {_fmt(c)}   (knot: {', '.join(sorted(k))})")
  n_unexplained = sum(f["unexplained_local_imports"].values())
  print(
    f"function-local imports of tipsito modules: {len(f['local_imports'])} "
    f"(without a reason: {n_unexplained})"
  )
  for i in f["local_imports"]:
    print(f"  {i.source}:{i.line} -> {i.target}  # {_reason(i.comment) or '(no reason)'}")
  print(f"python -m modules: {len(f['cli_modules'])}: {', '.join(f['cli_modules'])}")
  print(f"library modules importing a python -m module: {len(f['library_imports_of_cli'])}")
  for s, t in f["library_imports_of_cli"]:
    print(f"  {s} -> {t}")
  if "--step" in argv:
    sf = step_files()
    print(
      f"files one training step runs code in, config to loss values: {len(sf['config_to_loss'])}; "
      f"from the jitted step down: {len(sf['jitted_step_down'])}"
    )
    for k in ("config_to_loss", "jitted_step_down"):
      print(f"  {k}: {' '.join(sf[k])}")


if __name__ == "__main__":
  main(sys.argv[1:])
