"""User-given paths (workdir, data_dir, init_from, export dir, teacher, tokenizer): local or remote.

Why one helper: TPU users keep everything in GCS, and `os.path.abspath('gs://b/run')` silently turns a
bucket URL into a local folder. Local paths are made absolute (with ~ expanded); URLs (gs://, ...) are
kept as they are; both become `etils.epath.Path`, which TFDS and Orbax use as well.
"""

from __future__ import annotations

import os

from etils import epath


def is_url(path) -> bool:
  """Whether `path` names remote storage (gs://bucket/..., or any other scheme epath knows)."""
  return "://" in os.fspath(path)


def resolve(path) -> str:
  """The canonical string form: absolute local path, or the URL without a trailing slash."""
  p = os.fspath(path)
  if is_url(p):
    return p.rstrip("/")
  return os.path.abspath(os.path.expanduser(p))


def as_path(path) -> epath.Path:
  """`epath.Path` of `resolve(path)`."""
  return epath.Path(resolve(path))


def join(path, *parts: str) -> str:
  """`resolve(path)` joined with `parts` ('/'-separated for URLs too)."""
  return os.fspath(as_path(path).joinpath(*parts))


def expand_braces(pattern: str) -> list[str]:
  """webdataset / bash brace expansion: 'a/{000..002}.tar' -> ['a/000.tar', 'a/001.tar', 'a/002.tar'];
  '{x,y}' lists too, several groups multiply. A numeric range keeps the zero padding of its first end."""
  import re  # pylint: disable=g-import-not-at-top

  m = re.search(r"\{([^{}]*)\}", pattern)
  if m is None:
    return [pattern]
  head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end() :]
  rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
  if rng:
    lo, hi = int(rng.group(1)), int(rng.group(2))
    width = len(rng.group(1))
    choices = [f"{i:0{width}d}" for i in range(lo, hi + 1)]
  elif "," in body:
    choices = body.split(",")
  else:
    return [head + "{" + body + "}" + t for t in expand_braces(tail)]
  return [head + c + t for c in choices for t in expand_braces(tail)]


def glob(pattern: str) -> list[str]:
  """Sorted matches of a glob pattern, local or remote (gs://bucket/dir/*.tar through epath)."""
  import glob as glob_lib  # pylint: disable=g-import-not-at-top

  if not is_url(pattern):
    return sorted(glob_lib.glob(pattern))
  # epath globs relative to the longest prefix without a wildcard.
  parts = pattern.split("/")
  fixed = next(i for i, p in enumerate(parts) if any(ch in p for ch in "*?["))
  root = "/".join(parts[:fixed])
  return sorted(os.fspath(p) for p in epath.Path(root).glob("/".join(parts[fixed:])))


def isfile(path) -> bool:
  """os.path.isfile for local paths, epath's is_file for URLs."""
  return epath.Path(path).is_file() if is_url(path) else os.path.isfile(path)


def isdir(path) -> bool:
  """os.path.isdir for local paths, epath's is_dir for URLs."""
  return epath.Path(path).is_dir() if is_url(path) else os.path.isdir(path)


def open_binary(path):
  """A readable binary file object, local or remote (seekable: gcsfs files are)."""
  return epath.Path(path).open("rb") if is_url(path) else open(path, "rb")
