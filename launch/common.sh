#!/usr/bin/env bash
# Shared helpers for the TPU pod scripts (sourced, not run). Why: v5e and v5p differ only in accelerator
# type, runtime version and zone; every step (create, install, run on all workers, logs, delete) is the
# same gcloud sequence.
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME}"
: "${ZONE:?set ZONE}"
: "${PROJECT:=$(gcloud config get-value project 2>/dev/null)}"
REPO_URL="${REPO_URL:-}"          # git URL of tipsito; empty = copy the local checkout with scp
REMOTE_DIR="${REMOTE_DIR:-tipsito}"
WORKDIR="${WORKDIR:?set WORKDIR (e.g. gs://bucket/runs/tipsv2_g14)}"

tpu() { gcloud compute tpus tpu-vm "$@" --zone="$ZONE" --project="$PROJECT"; }
on_all() { tpu ssh "$TPU_NAME" --worker=all --command="$1"; }

cmd_create() {
  tpu create "$TPU_NAME" --accelerator-type="$ACCELERATOR" --version="$RUNTIME" ${SPOT:+--spot}
}

cmd_install() {
  if [[ -n "$REPO_URL" ]]; then
    on_all "rm -rf $REMOTE_DIR && git clone -q $REPO_URL $REMOTE_DIR"
  else
    local here; here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    tar -C "$here" --exclude=.git --exclude=workdirs -czf /tmp/tipsito_src.tgz .
    tpu scp /tmp/tipsito_src.tgz "$TPU_NAME":/tmp/ --worker=all
    on_all "mkdir -p $REMOTE_DIR && tar -C $REMOTE_DIR -xzf /tmp/tipsito_src.tgz"
  fi
  on_all "cd $REMOTE_DIR && pip install -q -e . 'jax[tpu]==0.10.2' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html"
}

# Runs training on every worker (one JAX process per host; --distributed calls jax.distributed.initialize()).
# Exit status of the train process on each host (output: /tmp/tipsito_train.log): 0 done; 75 preempted
# (SIGTERM on any host: every host saved the same step); 76 a peer host disappeared (the others named it
# in one line and stopped). After 75 or 76 (and after a slice was recreated), `run` again resumes from
# WORKDIR's latest checkpoint.
cmd_run() {
  local config="$1"; shift
  on_all "cd $REMOTE_DIR && nohup python -m tipsito.train --distributed --config $config --workdir $WORKDIR $* > /tmp/tipsito_train.log 2>&1 & echo \$! > /tmp/tipsito_train.pid"
}

cmd_logs() { tpu ssh "$TPU_NAME" --worker=0 --command="tail -n 200 -f /tmp/tipsito_train.log"; }
cmd_stop() { on_all "kill -TERM \$(cat /tmp/tipsito_train.pid) || true"; }   # SIGTERM: checkpoint, exit 75
cmd_delete() { tpu delete "$TPU_NAME" --quiet; }

dispatch() {
  local cmd="${1:-}"; shift || true
  case "$cmd" in
    create|install|logs|stop|delete) "cmd_$cmd" ;;
    run) cmd_run "$@" ;;
    *) echo "usage: $0 {create|install|run CONFIG [--config.k=v ...]|logs|stop|delete}" >&2; exit 2 ;;
  esac
}
