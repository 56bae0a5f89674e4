#!/usr/bin/env bash
# N JAX processes on this machine, as on an N-host pod (CPU: gloo collectives; FAKE_DEVICES per process):
#   bash launch/local_multiprocess.sh N [CONFIG] [WORKDIR] [--config.k=v ...]
# e.g. bash launch/local_multiprocess.sh 2 configs/demo.py workdirs/demo_2proc --config.total_steps=20
# Each process runs `python -m tipsito.train --distributed --coordinator_address=127.0.0.1:PORT
# --num_processes=N --process_id=I`; process I appends to WORKDIR/process_I.log, process 0 also to the
# terminal. Exit status: 0 done; 75 preempted (SIGTERM to this script or any process: every process saves
# the same step); 76 a process disappeared (killed, crashed: the others named it and stopped; see
# tipsito/distributed/peer_loss.py); after 75 or 76 the same command again resumes from the latest checkpoint.
# Otherwise the first failing process's status. RESTARTS=K relaunches all N processes up to K times
# after a 75 or 76 that this script did not cause itself (default 0: exit and let you or a restart policy
# decide).
# PORT (default: a free one per launch) and FAKE_DEVICES (default 4 devices per process on CPU) can be set.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:?usage: $0 N [CONFIG] [WORKDIR] [--config.k=v ...]}"; shift
CONFIG="${1:-configs/demo.py}"; shift || true
WORKDIR="${1:-workdirs/$(basename "${CONFIG%%:*}" .py)_${N}proc}"; shift || true
RESTARTS="${RESTARTS:-0}"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${FAKE_DEVICES:-4}"
mkdir -p "$WORKDIR"
pids=()
stopping=0  # set once this script got SIGTERM / Ctrl-C: then never relaunch
stop() { stopping=1; for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap stop TERM INT

launch_once() {  # starts N processes, waits for all; sets $status
  local port="${PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
  pids=()
  for ((i = 0; i < N; i++)); do
    python -m tipsito.train --distributed --coordinator_address="127.0.0.1:$port" --num_processes="$N" \
      --process_id="$i" --config "$CONFIG" --workdir "$WORKDIR" "$@" >> "$WORKDIR/process_$i.log" 2>&1 &
    pids+=("$!")
  done
  tail -n 0 -f "$WORKDIR/process_0.log" --pid="${pids[0]}" &
  local rcs=() p rc
  for p in "${pids[@]}"; do
    while true; do  # `wait` returns early when a trapped signal arrives: wait again for the real status
      set +e; wait "$p"; rc=$?; set -e
      if kill -0 "$p" 2>/dev/null; then continue; fi
      break
    done
    rcs+=("$rc")
  done
  # 76 (a peer disappeared) wins over the lost process's own 137/134; then 75 when every other one is
  # 0 or 75; else the first failure.
  status=0
  for rc in "${rcs[@]}"; do if [[ $rc -eq 76 ]]; then status=76; fi; done
  if [[ $status -eq 0 ]]; then
    for rc in "${rcs[@]}"; do
      if [[ $rc -ne 0 && $rc -ne 75 ]]; then status=$rc; break; fi
      if [[ $rc -eq 75 ]]; then status=75; fi
    done
  fi
  echo "local_multiprocess: $N processes finished, exit statuses ${rcs[*]} -> $status (logs: $WORKDIR/process_*.log)" >&2
}

for ((attempt = 0; ; attempt++)); do
  launch_once "$@"
  if [[ ($status -eq 75 || $status -eq 76) && $attempt -lt $RESTARTS && $stopping -eq 0 ]]; then
    echo "local_multiprocess: relaunching to resume ($((attempt + 1)) of $RESTARTS)" >&2
    continue
  fi
  break
done
if [[ $status -eq 75 || $status -eq 76 ]]; then
  echo "local_multiprocess: run the same command again to resume from the latest checkpoint" >&2
fi
exit "$status"
