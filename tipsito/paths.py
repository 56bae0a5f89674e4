"""User-given paths (workdir, data_dir, init_from, export dir, teacher, tokenizer): local or remote.

Why one helper: TPU users keep everything in GCS, and `os.path.abspath('gs://b/run')` silently turns a
bucket URL into a local folder. Local paths are made absolute (with ~ expanded); URLs (gs://, ...) are
kept as they are; both become `etils.epath.Path`, which TFDS and Orbax use as well.
"""

from __future__ import annotations

import contextlib
import os
import re

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


# How long a gs:// operation is retried before it fails: gcsfs (`gcsfs.retry.retry_request`) makes 6
# attempts per request on 408/429/5xx and dropped connections, sleeping min(2**(k-1) + U(0, 1), 32) s
# between them: about 31-36 s in all (docs/training.md, "Object-store faults").
GCSFS_RETRY_BOUND_S = 36
# tensorstore (Orbax's array data): its `gcs_request_retries` default, 32 retries sleeping 1 s doubling to
# 32 s: about 15 min per request (docs/training.md, "Object-store faults", says why it is not shortened).
TENSORSTORE_RETRY_BOUND_S = 900
CHECKPOINT_RETRY_BOUND = (
  f"gcsfs: about {GCSFS_RETRY_BOUND_S} s per request; tensorstore's array data: about "
  f"{TENSORSTORE_RETRY_BOUND_S // 60} min"
)


class StorageUnavailable(SystemExit):
  """An object-store operation failed after its client's own retries (an outage, or lost permissions).

  A SystemExit: the command ends with this one message and exit status 1, no traceback (the traceback of
  a client's last retry names neither the operation nor the path). The message says what was being done,
  on which path, and what to check; a run stopped this way resumes from its last complete checkpoint.
  """

  def __init__(self, operation: str, path: str, error: BaseException, *, bound: str = ""):
    last = " ".join(str(error).split())[:300] or type(error).__name__
    within = f" ({bound})" if bound else ""
    self.message = (
      f"tipsito: {operation} {path} failed: the object store did not answer after its client's retries"
      f"{within}; last error: {type(error).__name__}: {last}. Check this host's network to the store, "
      f"that the bucket exists and this account may read and write it (e.g. `gcloud storage ls "
      f"{path}`), and the provider's status page; then run the same command again: the run resumes from "
      "its last complete checkpoint."
    )
    super().__init__(self.message)
    self.operation, self.path = operation, path

  def __str__(self) -> str:
    return self.message


# tensorstore's error once its GCS retries are spent ("ABORTED: All 32 retry attempts failed: ...
# [http_response_code='503']"), or an answer it does not retry that is a server's (5xx, 429, 408).
_TENSORSTORE_GAVE_UP = re.compile(r"All \d+ retry attempts failed|http_response_code='(?:408|429|5\d\d)'")


def is_storage_outage(error: BaseException) -> bool:
  """Whether `error` (or one it came from) is a transport or server failure of an object-store client:
  gcsfs's HttpError (429/5xx), aiohttp's client errors, a timeout, a tensorstore UNAVAILABLE /
  DEADLINE_EXCEEDED, or tensorstore's retries spent on 408/429/5xx answers. Not a missing object, a
  refused precondition, a bad request or a damaged file."""
  seen = set()
  e: BaseException | None = error
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError)):
      return False
    mod = type(e).__module__ or ""
    text = str(e)
    if mod.startswith(("gcsfs", "aiohttp", "google.auth", "requests")) or isinstance(e, TimeoutError):
      return True
    if "UNAVAILABLE" in text or "DEADLINE_EXCEEDED" in text or _TENSORSTORE_GAVE_UP.search(text):
      return True
    e = e.__cause__ or e.__context__
  return False


@contextlib.contextmanager
def storage_errors_named(operation: str, path, *, bound: str = ""):
  """An object-store outage inside (an error its client raised after its own retries, on a URL `path`)
  becomes one `StorageUnavailable` naming `operation` and `path`; every other error passes unchanged.

  Why: the checkpoint, export and config paths all end the same way under an outage (docs/training.md,
  "Object-store faults"): one line, exit status 1, what to check, and the run resumes from its last
  complete checkpoint. A StorageUnavailable raised inside (a SystemExit) passes through as it is; gcsfs's
  own record of its last retry loses its traceback (`quiet_gcsfs_retry_tracebacks`)."""
  if is_url(path):
    quiet_gcsfs_retry_tracebacks()
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  # re-raised unless it is an outage
    if is_url(path) and is_storage_outage(e):
      raise StorageUnavailable(operation, os.fspath(path), e, bound=bound) from None
    raise


class _OneLineRetryLog:
  """A logging filter for gcsfs: its 'out of retries' / 'non-retriable' records lose their traceback.

  Why: gcsfs logs every failed request with `logger.exception`, so an outage printed one raw traceback
  per operation before the caller's own error (five, in the run that led to this); the caller's error
  (StorageUnavailable) is the one that names the operation and the path."""

  def filter(self, record) -> bool:
    if record.exc_info:
      record.exc_info, record.exc_text = None, None
    return True


def quiet_gcsfs_retry_tracebacks() -> None:
  """Installs `_OneLineRetryLog` on the `gcsfs` logger once (idempotent)."""
  import logging  # pylint: disable=import-outside-toplevel

  log = logging.getLogger("gcsfs")
  if not any(isinstance(f, _OneLineRetryLog) for f in log.filters):
    log.addFilter(_OneLineRetryLog())
