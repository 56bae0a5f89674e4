#!/usr/bin/env bash
# N JAX processes on this machine, as on an N-host pod (CPU: gloo collectives; FAKE_DEVICES per process):
#   bash launch/local_multiprocess.sh N [CONFIG] [WORKDIR] [--config.k=v ...]
# e.g. bash launch/local_multiprocess.sh 2 configs/demo.py workdirs/demo_2proc --config.total_steps=20
# Each process runs `python -m tipsito.train --distributed --coordinator_address=127.0.0.1:PORT
# --num_processes=N --process_id=I`; process I appends to WORKDIR/process_I.log, process 0 also to the
# terminal. Exit status: 0 done, 75 preempted (SIGTERM to this script or any process: every process saves
# the same step; run the same command again to resume), else the first failing process's status.
# PORT (default: a free one) and FAKE_DEVICES (default 4 devices per process on CPU) can be set.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:?usage: $0 N [CONFIG] [WORKDIR] [--config.k=v ...]}"; shift
CONFIG="${1:-configs/demo.py}"; shift || true
WORKDIR="${1:-workdirs/$(basename "${CONFIG%%:*}" .py)_${N}proc}"; shift || true
PORT="${PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${FAKE_DEVICES:-4}"
mkdir -p "$WORKDIR"
pids=()
stop() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap stop TERM INT
for ((i = 0; i < N; i++)); do
  python -m tipsito.train --distributed --coordinator_address="127.0.0.1:$PORT" --num_processes="$N" \
    --process_id="$i" --config "$CONFIG" --workdir "$WORKDIR" "$@" >> "$WORKDIR/process_$i.log" 2>&1 &
  pids+=("$!")
done
tail -n 0 -f "$WORKDIR/process_0.log" --pid="${pids[0]}" &
status=0
for p in "${pids[@]}"; do
  while true; do  # `wait` returns early when a trapped signal arrives: wait again for the real status
    set +e; wait "$p"; rc=$?; set -e
    if kill -0 "$p" 2>/dev/null; then continue; fi
    break
  done
  if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
done
echo "local_multiprocess: $N processes finished, exit status $status (logs: $WORKDIR/process_*.log)" >&2
exit "$status"
