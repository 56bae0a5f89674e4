#!/usr/bin/env bash
# TPU v5p pod (TIPSv2 g/14 used 512 v5 chips): TPU_NAME=t ZONE=us-east5-a WORKDIR=gs://b/run \
#   ACCELERATOR=v5p-1024 bash launch/tpu_v5p.sh {create|install|run configs/tipsv2_g14.py|logs|stop|delete}
# Resumes from WORKDIR: after preemption (exit 75) or a lost host (the others exit 76), re-run `run`.
ACCELERATOR="${ACCELERATOR:-v5p-1024}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5}"
source "$(dirname "$0")/common.sh"
dispatch "$@"
