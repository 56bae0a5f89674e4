"""tipsito/studies/provenance.py: the allocator a process runs under, as recorded with its machine.

Why a test of its own: step times on XLA:CPU differ by 20-25 % between glibc's malloc and jemalloc with
freed memory retained (docs/performance.md), so the benchmarks and studies record which one ran; that record
must name the allocator the process really has, read in a fresh process started each way.
"""

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

_PRINT_ALLOCATOR = (
  "import json; from tipsito.studies import provenance; print(json.dumps(provenance.allocator()))"
)
_DEBIAN_JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
_JEMALLOC = _DEBIAN_JEMALLOC if os.path.exists(_DEBIAN_JEMALLOC) else ctypes.util.find_library("jemalloc")


def _allocator_of_a_process(**env) -> dict:
  base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
  out = subprocess.run(
    [sys.executable, "-c", _PRINT_ALLOCATOR],
    env={**base, **env, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_plain_process_runs_the_c_library_allocator():
  assert _allocator_of_a_process() == {"name": "libc", "conf": None}


@pytest.mark.skipif(not _JEMALLOC, reason="needs Debian's libjemalloc2 (.ci/run installs it)")
def test_a_process_under_preloaded_jemalloc_says_so_with_its_settings():
  """Break check: a record that ignores the mapped libraries (always 'libc') fails here."""
  conf = "retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1"
  assert _allocator_of_a_process(LD_PRELOAD=_JEMALLOC, MALLOC_CONF=conf) == {"name": "jemalloc", "conf": conf}
