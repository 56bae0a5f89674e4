"""A run's saved `config.json`: its file name, the key of the accepted resume changes, the readers, and the
one upgrade of a config written by an older tipsito.

Why in config/: validation checks `config.init_from` against the run it points at before anything is
written, and the config layer must not import the training code (tipsito/train/ sits above it); the
training workdir (tipsito/train/workdir.py) writes this file and reads it through these functions.

Why the upgrade is here: a workdir trained before a key existed has a config.json without it, and export,
evaluate, a workdir teacher, `init_from` and the resume guard all read that file. Filling the absent keys
once, from the schema's defaults (tipsito/config/schema.py), lets every reader read keys directly
(`config.input.microbatches`, never `.get("microbatches", 1)`), so a key's default lives in the schema
alone (tests/test_config_reads.py fails on a fallback read outside tipsito/config/).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional

from absl import logging

from tipsito import paths
from tipsito.config import recipes as recipes_lib
from tipsito.config import schema

CONFIG_FILE = "config.json"
# config.json key holding the accepted changes of earlier resumes (a list of {time, changes}).
HISTORY_KEY = "config_history"
# Keys the schema renamed, {old dotted path: new dotted path}: `upgrade` moves a saved value from the old
# key to the new one. None has been renamed since config.json was first written.
RENAMED: dict[str, str] = {}


class SavedConfigError(ValueError):
  """A saved config.json cannot be read as a training config of this tipsito (says which file and key)."""


def _lookup(tree: dict, path: str) -> Any:
  node = tree
  for part in path.split("."):
    if not isinstance(node, dict) or part not in node:
      return schema.ABSENT
    node = node[part]
  return node


def _put(tree: dict, path: str, value: Any) -> None:
  *head, leaf = path.split(".")
  node = tree
  for part in head:
    node = node.setdefault(part, {})
  node[leaf] = value


def _pop(tree: dict, path: str) -> Any:
  *head, leaf = path.split(".")
  node = _lookup(tree, ".".join(head)) if head else tree
  return node.pop(leaf, schema.ABSENT) if isinstance(node, dict) else schema.ABSENT


def upgrade(saved: dict, source: str) -> dict:
  """`saved` (a training config as a dict, e.g. a workdir's config.json) with every key this tipsito's
  schema declares for its recipe: a key absent from the file takes its schema default, a renamed key
  (RENAMED) moves to its new name. Logs what it filled; returns a new dict (`saved` is left as it is).

  Defaults that depend on the recipe, `total_steps` or `input.batch_size` are computed from the file's own
  values. The tower sizes depend on the variant, which the file does not name: one of those absent is an
  error naming `source` and the key (every config.json has them; they are the towers' shapes).
  """
  out = copy.deepcopy(saved)
  moved = []
  for old, new in RENAMED.items():
    value = _pop(out, old)
    if value is not schema.ABSENT and _lookup(out, new) is schema.ABSENT:
      _put(out, new, value)
      moved.append(f"{old} -> {new}")
  recipe_name = out["recipe"] if "recipe" in out else None
  if recipe_name not in recipes_lib.RECIPES:
    raise SavedConfigError(
      f"{source}: recipe {recipe_name!r} is not one of this tipsito's recipes {sorted(recipes_lib.RECIPES)}; "
      "it is not a tipsito training config, or one of a recipe since removed"
    )
  ctx = schema.Ctx(
    recipe=recipes_lib.get_recipe(recipe_name),
    variant=None,  # not saved: a default that needs it raises below
    text_variant=None,
    total_steps=_lookup(out, "total_steps"),
    batch_size=_lookup(out, "input.batch_size"),
  )
  filled = {}
  for key in schema.keys_for(ctx.recipe):
    if _lookup(out, key.path) is not schema.ABSENT:
      continue
    try:
      value = key.default_for(ctx)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
      raise SavedConfigError(
        f"{source} has no {key.path!r} and its default depends on the tower variant, which the file does not "
        f"name: add '{key.path}' to {source} ({key.doc})"
      ) from e
    if value is schema.ABSENT:
      raise SavedConfigError(f"{source} has no {key.path!r}, which has no default: add it to {source}")
    _put(out, key.path, value)
    filled[key.path] = value
  if moved or filled:
    logging.info(
      "%s was written by an older tipsito; upgraded to this schema: %s",
      source,
      "; ".join(moved + [f"{k} = {v!r} (schema default)" for k, v in filled.items()]),
    )
  return out


def read_config_json(workdir: str) -> tuple[Optional[dict], list]:
  """(saved training config as a dict, accepted-change history) of a workdir; (None, []) if none.

  The config is upgraded to this tipsito's schema (`upgrade`), so its readers find every key. An export's
  config.json (it has a 'format_version') is returned as it is, for the caller to refuse."""
  f = paths.as_path(workdir) / CONFIG_FILE
  if not f.is_file():
    return None, []
  saved = json.loads(f.read_text())
  history = list(saved.pop(HISTORY_KEY, []) or [])
  if "format_version" in saved:
    return saved, history
  return upgrade(saved, str(f)), history


def init_run_config(path: Optional[str]) -> Optional[dict]:
  """The saved config.json of the run an `init_from` path points at (the workdir, its `checkpoints/`
  folder or a step folder in it), or None when there is none to read."""
  if not path:
    return None
  p = paths.as_path(path)
  for d in (p, p.parent, p.parent.parent):
    if (d / CONFIG_FILE).is_file():
      saved, _ = read_config_json(str(d))
      return saved
  return None
