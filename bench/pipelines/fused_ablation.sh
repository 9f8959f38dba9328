#!/usr/bin/env bash
# Issue 23, item 2: does a head that also reads the target's middle layers (EAGLE-3's fused
# features) accept more than the last-layer head, on the same data, steps and start?
#
#   bash bench/pipelines/fused_ablation.sh [PIPELINE_DIR] [OUT]
#   POINTS=250000 EPOCHS=2 LR=6e-3 AUX=3,15 bash bench/pipelines/fused_ablation.sh
#
# Two `fastmtp curve` runs over one prefix of the self-distilled data (the first 200 rows held
# out, as head_demo.sh): arm "last" from the shipped recipe's init (W/init), arm "fused" from the
# same weights with aux layers added (`init-head --from W/init --aux-layers AUX`: fc = [0|0|I],
# so both start as the same head). Each arm has its own feature cache (the fused one stores the
# aux layers). Same table, loss (KL to the cached top-32), LR, schedule, seed and data order.
# AUX=3,15 for the 30-layer SmolLM2-135M: the streams leaving layers 2 and 14 (a low and a middle
# layer, as EAGLE-3's 2 and L/2), beside the post-norm last hidden state the head already reads
# (instead of EAGLE-3's L-3: the fused head then contains the last-layer head exactly). Every
# step resumes: rerun the same command after a stop.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-runs/demo-pipeline-v2}
OUT=${2:-$W/fused-ablation}
POINTS=${POINTS:-250000}
EPOCHS=${EPOCHS:-2}
LR=${LR:-6e-3}
AUX=${AUX:-3,15}
SIZE=${SIZE:-16384}
SERVE=${SERVE:-1,3}
RESULTS=${RESULTS:-bench/results/fused_ablation}
HELD=200
source bench/pipelines/demo_env.sh
mkdir -p "$OUT"
[[ -f $OUT/data.jsonl ]] || "$BIN/python" bench/demo_data.py prefix "$W/distill.jsonl" "$OUT/data.jsonl" "$POINTS" "$HELD"
TABLE=$OUT/table/en-$SIZE.pt
if [[ ! -f $TABLE ]]; then
    "$BIN/python" bench/demo_data.py corpus "$W/distill.jsonl" "$OUT/table-corpus.jsonl" "$HELD"
    "$BIN/fastmtp" build-vocab --tokenizer "$T" --lang en --size "$SIZE" \
        --corpus "$OUT/table-corpus.jsonl" --out "$OUT/table" --quiet
fi
[[ -f $OUT/init-fused/config.json ]] || "$BIN/fastmtp" init-head --target "$T" --from "$W/init" \
    --aux-layers "$AUX" --dtype float32 "$OUT/init-fused"
common=(--steps 3 --epochs "$EPOCHS" --batch-size 8 --max-len 512 --lr "$LR" --dtype bfloat16
        --compute-dtype bfloat16 --group-by-length --save-every 200 --eval-every 50
        --vocab "$TABLE")
for arm in last fused; do
    init=$W/init
    [[ $arm == fused ]] && init=$OUT/init-fused
    "$BIN/fastmtp" curve --target "$T" --init "$init" --data "$OUT/data.jsonl" --out "$OUT/$arm" \
        --features "$OUT/features-$arm" --tokens "$POINTS" --heldout-rows "$HELD" \
        --arm "$arm=--loss kl --kl-topk 32" --serve-steps "$SERVE" \
        --dev-prompts bench/data/spec_bench.jsonl --dev-per-category 1 -- "${common[@]}"
done
mkdir -p "$RESULTS"
for arm in last fused; do
    mkdir -p "$RESULTS/$arm"
    cp "$OUT/$arm/curve.json" "$OUT/$arm/curve.md" "$RESULTS/$arm/"
    if [[ -f $OUT/$arm/curve_steps.png ]]; then cp "$OUT/$arm/curve_steps.png" "$RESULTS/$arm/"; fi
done
echo "results in $RESULTS/{last,fused}/; heads in $OUT/<arm>/<arm>/$POINTS/"
