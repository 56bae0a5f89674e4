"""`python -m tipsito.info --sharding --devices N --processes P` plans a pod from one machine.

Why: the specs printed must be those of the target mesh (not of the 1-device mesh of the machine
running `info`), and the per-process summary must state what each host does.
"""

import numpy as np
import pytest

from tipsito.config import defaults
from tipsito import info


def _config():
  c = defaults.tiny_config("tipsito", batch_size=8)
  c.sharding.min_size = 1
  return c


def test_plan_uses_the_target_mesh():
  out = info.compute_info(_config(), with_sharding=True, devices=8, processes=2)
  plan, rows = out["sharding_plan"], out["sharding"]
  assert plan["mesh"] == {"data": 1, "fsdp": 8, "model": 1}
  assert any("fsdp" in r["spec"] for r in rows)
  total = out["student_params"] * 4  # float32
  assert total / 8 <= plan["params_bytes_per_device"] < total
  for r in rows:
    n = int(np.prod(r["shape"])) * 4
    assert r["bytes_per_device"] == (n // 8 if "fsdp" in r["spec"] else n), r
  assert "4 devices and 4 examples of the global batch 8 per process" in plan["per_process"]
  one = info.compute_info(_config(), with_sharding=True, devices=1)
  assert one["sharding_plan"]["params_bytes_per_device"] == total
  assert not any("fsdp" in r["spec"] for r in one["sharding"])


def test_plan_rejects_batch_not_divisible_by_processes():
  with pytest.raises(ValueError, match="batch_size=8 is not divisible by --processes=3"):
    info.compute_info(_config(), with_sharding=True, devices=3, processes=3)
