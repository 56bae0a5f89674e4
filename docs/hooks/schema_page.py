"""mkdocs hook: fills docs/schema.md with every config key, from `python -m tipsito.info --schema --json`.

Why: the key reference must never drift from tipsito/config/schema.py, so it is generated at build time
(the page in the repository holds only the placeholder) by the same command a user runs.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

PLACEHOLDER = "<!-- schema-table -->"


def _schema_rows() -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  out = subprocess.run(
    [sys.executable, "-m", "tipsito.info", "--schema", "--json"],
    check=True,
    capture_output=True,
    text=True,
    env=env,
  ).stdout
  return json.loads(out)


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def schema_markdown(rows: list[dict]) -> str:
  """One section per top-level group (`optim`, `input`, ...; plain keys under 'Top level'), one table row
  per key: key, type, default, allowed values, safe on resume, description."""
  groups = collections.OrderedDict()
  for row in rows:
    head = row["key"].split(".")[0] if "." in row["key"] else "Top level"
    groups.setdefault(head, []).append(row)
  parts = [f"{len(rows)} keys in {len(groups)} groups.\n"]
  for head, items in groups.items():
    title = head if head == "Top level" else f"`{head}`"
    parts.append(
      f"## {title}\n\n| Key | Type | Default | Allowed | Safe on resume | Description |\n|---|---|---|---|---|---|"
    )
    for r in items:
      safe = "yes" if r["safe"] else "no"
      parts.append(
        f"| `{r['key']}` | {_cell(r['type'])} | {_cell(r['default'])} | {_cell(r['allowed'])} | {safe} | {_cell(r['doc'])} |"
      )
    parts.append("")
  return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001  (mkdocs hook signature)
  if PLACEHOLDER not in markdown:
    return markdown
  return markdown.replace(PLACEHOLDER, schema_markdown(_schema_rows()))
