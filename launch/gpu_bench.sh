#!/usr/bin/env bash
# The prepared GPU check (issue 36): on one NVIDIA GPU with no network, run the model and loss tests (they
# need no data), then the train-step benchmark of clip and ito at B/16 and tipsv2 and tipsito at B/14, in
# bf16, at the largest global batch in {256, 128, 64} whose compiled memory fits the GPU, with the xla and
# the cudnn attention core (sequence lengths; cudnn_mask: an explicit mask), remat off and on. Writes, under OUT (default workdirs/gpu_bench):
#   pytest.txt  the tests' output            rows.jsonl  one JSON line per benchmark row
#   table.md    the markdown table (step time, images/s, FLOP utilisation against the GPU's bf16 peak,
#               compiled memory, time and FLOPs per image against clip's), the commands and the pytest summary
#   bash launch/gpu_bench.sh [OUT]                       on the GPU machine (about 8 minutes on one H200)
#   GPU_BENCH_DRY=1 bash launch/gpu_bench.sh OUT         on CPU: tiny configs, xla only, no tests (CI:
#                                                        tests/test_gpu_bench_dry.py)
# GPU_BENCH_BUDGET_S (default 420; none when dry): no new benchmark run starts after this many seconds, so the script ends
# inside a 10-minute device call; rows are ordered most wanted first (xla, cudnn, cudnn_mask without remat first).
# Missing Python packages (the GPU image has jax, flax, optax, orbax; not ml_collections) travel as wheels
# in .whl/ (the device tool's README): they are installed into /tmp/site when that folder exists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-workdirs/gpu_bench}
mkdir -p "$OUT"
: >"$OUT/rows.jsonl"
DRY=${GPU_BENCH_DRY:-0}
BUDGET=${GPU_BENCH_BUDGET_S:-$([[ $DRY == 1 ]] && echo 1000000 || echo 420)}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -d .whl ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

if [[ $DRY == 1 ]]; then
  RUNS=("configs/demo.py:recipe=clip,batch=8,size=32 --recipes clip,ito"
        "configs/demo.py:recipe=tipsv2,batch=8,size=32 --recipes tipsv2,tipsito")
  ATTENTIONS=(xla) REMATS=(true) BATCHES=8,4 STEPS=1
else
  RUNS=("configs/clip_b16.py --recipes clip,ito"
        "configs/tipsv2_g14.py:variant=B/14 --recipes tipsv2,tipsito")
  # cudnn takes the towers' right padding as sequence lengths (tipsito/models/layers.py LENGTH_CORES);
  # cudnn_mask is the same core handed an explicit boolean mask, measured next to it (issue 43).
  ATTENTIONS=(xla cudnn cudnn_mask) REMATS=(false true) BATCHES=256,128,64 STEPS=5
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
  } >"$OUT/device.txt" 2>&1
  # Several test processes share the GPU: no process may take most of its memory up front.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 "$PY" -m pytest -q -p no:cacheprovider -n 4 \
    tests/test_models_*.py tests/test_losses_*.py >"$OUT/pytest.txt" 2>&1
  echo "pytest exit $?" >>"$OUT/pytest.txt"
fi

export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
start=$SECONDS
for remat in "${REMATS[@]}"; do
  for attention in "${ATTENTIONS[@]}"; do
    for run in "${RUNS[@]}"; do
      if ((SECONDS - start > BUDGET)); then
        echo "budget of ${BUDGET}s spent: skipped $run --attention $attention --remat $remat" | tee -a "$OUT/skipped.txt"
        continue
      fi
      read -r cfg rest <<<"$run"
      # shellcheck disable=SC2086  # $rest is a flag list
      "$PY" -m tipsito.bench.step_bench --config "$cfg" $rest --attention "$attention" --remat "$remat" \
        --batch_candidates "$BATCHES" --steps "$STEPS" --jsonl "$OUT/rows.jsonl" \
        >>"$OUT/bench.log" 2>&1 || echo "failed: $cfg $rest --attention $attention --remat $remat" | tee -a "$OUT/skipped.txt"
    done
  done
done

{
  echo "# GPU benchmark ($(date -u +%F), $(head -1 "$OUT/device.txt" 2>/dev/null || echo CPU dry run))"
  echo
  echo "Command: \`bash launch/gpu_bench.sh\`; rows: \`python -m tipsito.bench.step_bench --config CFG --recipes R1,R2"
  echo "--attention A --remat M --batch_candidates $BATCHES --steps $STEPS\` per config, attention and remat."
  echo
  [[ -f "$OUT/pytest.txt" ]] && echo "Tests: $(grep -E 'passed|failed|error' "$OUT/pytest.txt" | tail -1)" && echo
  "$PY" -m tipsito.bench.step_bench --markdown "$OUT/rows.jsonl"
  [[ -f "$OUT/skipped.txt" ]] && echo && sed 's/^/- /' "$OUT/skipped.txt"
} >"$OUT/table.md"
cat "$OUT/table.md"
