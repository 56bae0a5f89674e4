#!/usr/bin/env bash
# TPU v5e pod: TPU_NAME=t ZONE=us-west4-a WORKDIR=gs://b/run ACCELERATOR=v5litepod-256 \
#   bash launch/tpu_v5e.sh {create|install|run configs/tipsv2_g14.py:variant=L/14|logs|stop|delete}
# The training mesh comes from config.mesh (default: FSDP over all chips); resumes automatically from
# WORKDIR after preemption (exit 75; use SPOT=1 for spot capacity and just re-run `run`) or a lost host
# (the others exit 76: re-run `run` the same way).
ACCELERATOR="${ACCELERATOR:-v5litepod-256}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5-lite}"
source "$(dirname "$0")/common.sh"
dispatch "$@"
