#!/usr/bin/env bash
# The README "Planning a pod run" table: compiles each paper config's train step for its TPU slice on this
# machine (no TPU needed; pip install -e ".[tpu-plan]") and prints one markdown row per config.
#   bash launch/plan_paper_configs.sh [ROW ...]      (default: every row; full logs in workdirs/plan/)
# Rows compile one after another (minutes each on 2 CPU cores); pass row names to run a subset.
# PLAN_ATTENTION=xla,splash compiles each row once per attention core (rows named "ROW [xla]", "ROW [splash]";
# workdirs/plan/ROW.txt also says what splash saves per chip).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p workdirs/plan
declare -A ROWS=(
  [tipsv2_g14]="configs/tipsv2_g14.py --topology v5p:8x8x8"
  [tipsv2_g14_fsdp]="configs/tipsv2_g14.py --topology v5p:8x8x8 --config.mesh.data=1 --config.mesh.fsdp=-1"
  [tipsv2_g14_full_ema]="configs/tipsv2_g14.py:ema=full --topology v5p:8x8x8"
  [tipsv2_g14_hires]="configs/tipsv2_g14_hires.py --topology v5p:8x8x8"
  [distill_B]="configs/tipsv2_distill.py:student=B --topology v5p:8x8x8"
  [distill_L]="configs/tipsv2_distill.py:student=L --topology v5p:8x8x8"
  [distill_So400m]="configs/tipsv2_distill.py:student=So400m --topology v5p:8x8x8"
  [ito_b16]="configs/ito_b16.py --topology v5p:4x4x8"
  [tipsito_b16]="configs/tipsito_b16.py --topology v5p:4x4x8"
  # The paper batch on small slices with exact gradient accumulation (input.microbatches): K = 1 and K.
  [tipsv2_b14_v5e16]="configs/tipsv2_g14.py:variant=B/14 --topology v5e:4x4 --microbatches 4"
  [tipsv2_b14_v5e16_k8]="configs/tipsv2_g14.py:variant=B/14 --topology v5e:4x4 --microbatches 8"
  [ito_b16_v5e8]="configs/ito_b16.py --topology v5e:2x4 --config.model.image.remat=True --config.model.text.remat=True --microbatches 8"
)
ORDER=(tipsv2_g14 tipsv2_g14_fsdp tipsv2_g14_full_ema tipsv2_g14_hires distill_B distill_L distill_So400m ito_b16 tipsito_b16
       tipsv2_b14_v5e16 tipsv2_b14_v5e16_k8 ito_b16_v5e8)
SCAN="--config.model.image.scan=True --config.model.text.scan=True"
python -c "from tipsito.planning import pod; print(pod.TABLE_HEADER)"
for row in "${@:-${ORDER[@]}}"; do
  read -r cfg rest <<<"${ROWS[$row]:?unknown row $row; rows: ${ORDER[*]}}"
  # shellcheck disable=SC2086  # $rest and $SCAN are flag lists
  python -m tipsito.plan --config "$cfg" $rest $SCAN --noevals --table_row "$row" ${PLAN_ATTENTION:+--attention "$PLAN_ATTENTION"} \
    >"workdirs/plan/$row.txt" 2>"workdirs/plan/$row.log"
  grep -E "^\| $row( \[[a-z]+\])? \|" "workdirs/plan/$row.txt" || true  # one row per K (and attention)
done
