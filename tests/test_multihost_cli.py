"""The distributed flags of the command lines: listed by --help, checked before JAX starts.

Why: outside Cloud TPU a multi-host run is only possible if `--coordinator_address/--num_processes/
--process_id` exist and are documented where users look (`--help`), for train, evaluate and bench.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("--distributed", "--coordinator_address", "--num_processes", "--process_id")


def _run(*args):
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run(
    [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )


@pytest.mark.parametrize(
  "module,own",
  [
    ("tipsito.train", ("--config", "--workdir")),
    ("tipsito.evaluate", ("--config", "--checkpoint")),
    ("tipsito.bench.step_bench", ("--config", "--steps")),
  ],
)
def test_help_lists_the_distributed_flags(module, own):
  proc = _run(module, "--help")
  text = proc.stdout + proc.stderr
  assert "Try --helpfull" in text, text[-2000:]  # absl prints the help and exits 1
  for flag in own + FLAGS:
    assert flag + ":" in text or f"--[no]{flag[2:]}:" in text, (flag, text[-3000:])


def test_process_flags_without_distributed_are_refused():
  proc = _run(
    "tipsito.train", "--config", "configs/demo.py", "--workdir", "/nonexistent/w", "--num_processes=2"
  )
  assert proc.returncode != 0
  assert "--num_processes needs --distributed" in proc.stderr
