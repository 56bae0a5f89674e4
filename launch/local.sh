#!/usr/bin/env bash
# Local run (CPU or a single GPU/TPU host): bash launch/local.sh [CONFIG] [WORKDIR] [--config.k=v ...]
# Defaults to the demo. FAKE_DEVICES=8 simulates an 8-device mesh on CPU (sharding checks).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${1:-configs/demo.py}"; shift || true
WORKDIR="${1:-workdirs/$(basename "${CONFIG%%:*}" .py)}"; shift || true
if [[ -n "${FAKE_DEVICES:-}" ]]; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${FAKE_DEVICES}"
fi
exec python -m tipsito.train --config "$CONFIG" --workdir "$WORKDIR" "$@"
