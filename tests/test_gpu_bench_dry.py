"""launch/gpu_bench.sh in its dry mode (GPU_BENCH_DRY=1: tiny configs on CPU, xla attention, remat on).

Why: the GPU script runs only in sessions that are lent a GPU; the dry run keeps its commands, the
step_bench flags it passes (--attention, --remat, --batch_candidates, --jsonl, --markdown) and the table it
writes from rotting in between. About a minute of CPU.
"""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_gpu_bench_dry_run_writes_rows_and_table(tmp_path):
  out = tmp_path / "bench"
  env = dict(os.environ, GPU_BENCH_DRY="1", PYTHON=sys.executable, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    ["bash", str(ROOT / "launch" / "gpu_bench.sh"), str(out)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not (out / "skipped.txt").exists(), (out / "skipped.txt").read_text()
  rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
  assert [r["recipe"] for r in rows] == ["clip", "ito", "tipsv2", "tipsito"]
  for r in rows:
    # The overrides reached the model: attention and remat as asked, the first batch candidate (XLA:CPU
    # reports no memory limit, so nothing is ruled out), one measured step.
    assert (r["attention"], r["remat"], r["batch"], r["fits"]) == ("xla", True, 8, True)
    assert r["step_s"] > 0 and r["step_tflop"] > 0 and r["mem_total_GiB"] > 0
  table = (out / "table.md").read_text()
  lines = [x for x in table.splitlines() if x.startswith("| ")]
  assert lines[0].startswith("| recipe | image | attention | remat | batch | step (s)")
  assert [x.split(" | ")[0][2:] for x in lines[1:]] == ["clip", "ito", "tipsv2", "tipsito"]
  # Per-image time and FLOPs against clip's: 1.00 for clip itself, the measured ratios for the others.
  clip, ito = rows[0], rows[1]
  assert lines[1].endswith("| 1.00 | 1.00 |")
  want = f"| {ito['step_s'] / clip['step_s']:.2f} | {ito['step_tflop'] / clip['step_tflop']:.2f} |"
  assert lines[2].endswith(want)


def test_cudnn_mask_rows_give_cudnn_the_mask(monkeypatch):
  """`--attention cudnn,cudnn_mask` (the GPU rows of issue 43): both set the towers' core to cudnn; the
  cudnn_mask row traces with LENGTH_CORES empty (the towers pass the boolean mask), the cudnn row with
  lengths, and LENGTH_CORES is restored after. No GPU needed: the benchmark itself is replaced."""
  from tipsito.bench import step_bench
  from tipsito.config import defaults
  from tipsito.models import layers

  seen = []

  def fake(config, batch_candidates, **kw):
    seen.append((config.model.text.attention, config.model.fusion.attention, layers.LENGTH_CORES))
    return {"attention": config.model.image.attention, "step_s": 1.0}

  monkeypatch.setattr(step_bench, "_bench_fitting", fake)
  rows = step_bench.run_bench(defaults.tiny_config("ito"), attentions=["cudnn", "cudnn_mask"])
  assert seen == [("cudnn", "cudnn", ("cudnn",)), ("cudnn", "cudnn", ())]
  assert [r["attention"] for r in rows] == ["cudnn", "cudnn_mask"]
  assert layers.LENGTH_CORES == ("cudnn",)
