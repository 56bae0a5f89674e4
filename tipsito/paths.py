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
