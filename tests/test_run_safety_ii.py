"""Run safety II (one process): corrupt checkpoints, clean failure paths, CPU runs without libtpu, and the
decision of the peer-loss watch.

Why: each case here trapped or misled a user. A truncated or incomplete latest checkpoint was skipped on
resume, but training then reached that step again and Orbax refused to save it (StepAlreadyExistsError),
on every rerun; a failed run ended in hundreds of "Event loop is closed" lines and leaked shared memory
instead of its error; with the `[tpu-plan]` extra installed every CPU run started libtpu, printed its
errors and fought over its lock file. The multi-process cases (2 processes x 4 CPU devices, peer loss)
are tests/test_multihost_safety.py. Runs are tiny CLIP configs on 32 px shapes.
"""
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from tipsito import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  from tipsito.data import convert
  d = str(tmp_path_factory.mktemp("data"))
  convert.convert("shapes", d, split_sizes={"train": 32, "test": 8}, image_size=32, verbose=False,
                  num_workers=1)
  return d


CONFIG_FILE = textwrap.dedent('''
  """A tiny CLIP run on a prebuilt shapes dataset (args: data=DIR,steps=N,workers=W)."""
  from tipsito.config import defaults


  def get_config(arg=None):
    a = dict(kv.split("=", 1) for kv in arg.split(",")) if arg else {}
    c = defaults.tiny_config("clip", batch_size=8, total_steps=int(a.get("steps", 4)))
    c.max_len = 16
    c.model.text.update(dict(vocab_size=None, max_len=16, depth=1))
    c.model.image.update(dict(depth=1, posemb_grid=4))
    c.data = defaults.data_config("shapes", data_dir=a["data"], caption_keys=("caption_detailed",))
    c.ckpt.update(dict(every_steps=1, keep=5, async_save=True))
    c.input.num_workers = int(a.get("workers", 0))
    c.export.enabled = False
    return c
''')


def _cli_env(**extra):
  """The test's environment without JAX_PLATFORMS and TPU variables; C++ logs shown (level 0)."""
  env = {k: v for k, v in os.environ.items()
         if k != "JAX_PLATFORMS" and k not in distributed.TPU_ENV_VARS}
  env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="0")
  env.update(extra)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def _train_cmd(tmp_path, data_dir, workdir, *args, **cfg):
  f = tmp_path / "tiny_cfg.py"
  f.write_text(CONFIG_FILE)
  arg = ",".join([f"data={data_dir}"] + [f"{k}={v}" for k, v in cfg.items()])
  return [sys.executable, "-m", "tipsito.train", "--config", f"{f}:{arg}", "--workdir", str(workdir), *args]


# --- CPU runs never start libtpu ---------------------------------------------------------------------

def test_accelerator_evidence_reads_files_and_environment_only(tmp_path, monkeypatch):
  from jax._src import hardware_utils
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
  globs = (str(tmp_path / "accel*"), str(tmp_path / "vfio" / "[0-9]*"))
  assert distributed.accelerator_evidence({}, globs) is None
  (tmp_path / "vfio").mkdir()
  (tmp_path / "vfio" / "vfio").write_text("")  # the vfio control node exists without any device
  assert distributed.accelerator_evidence({}, globs) is None
  (tmp_path / "vfio" / "0").write_text("")
  assert distributed.accelerator_evidence({}, globs) == str(tmp_path / "vfio" / "0")
  assert distributed.accelerator_evidence({"TPU_WORKER_HOSTNAMES": "h0,h1"}, ()) == "$TPU_WORKER_HOSTNAMES"
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, None))
  assert distributed.accelerator_evidence({}, ()) == "4 TPU PCI device(s)"
  # An explicit JAX_PLATFORMS (even empty: "let JAX choose") is never overridden.
  assert distributed.select_platform({"JAX_PLATFORMS": ""}) is None


def test_platform_is_cpu_on_a_machine_without_accelerators():
  if distributed.accelerator_evidence() is not None:
    pytest.skip(f"this machine has an accelerator ({distributed.accelerator_evidence()})")
  code = ("from tipsito import distributed; import jax; print(distributed.select_platform()); "
          "print(jax.config.jax_platforms, jax.devices()[0].platform)")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_cli_env(), capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["cpu", "cpu", "cpu"], r.stdout


def test_two_cpu_trainings_at_once_never_touch_libtpu(tmp_path, data_dir):
  from tipsito import plan
  if not plan.libtpu_available():
    pytest.skip("libtpu not installed (pip install -e '.[tpu-plan]'): nothing to keep away")
  if distributed.accelerator_evidence() is not None:
    pytest.skip(f"this machine has an accelerator ({distributed.accelerator_evidence()})")
  env = _cli_env()
  assert "JAX_PLATFORMS" not in env
  procs = []
  for name in ("a", "b"):
    log = open(tmp_path / f"{name}.log", "w+")
    procs.append((subprocess.Popen(_train_cmd(tmp_path, data_dir, tmp_path / name, steps=2), cwd=ROOT,
                                   env=env, stdout=log, stderr=subprocess.STDOUT), log))
  deadline = time.time() + 600
  try:
    for p, _ in procs:
      p.wait(timeout=max(1.0, deadline - time.time()))
  finally:
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in procs:
    log.seek(0)
    text = log.read()
    log.close()
    assert p.returncode == 0, text[-4000:]
    assert "step 2/2" in text, text[-4000:]
    bad = re.findall(r".*(?:libtpu|\bTPU\b|backend 'tpu'|lock ?file).*", text, flags=re.IGNORECASE)
    assert not bad, bad[:5]

