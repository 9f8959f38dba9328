#!/usr/bin/env bash
# Learning curves on the demo target with real self-distilled data (issue 10, item 3): FastMTP
# (K=3, recursive) and vanilla MTP (step 1 only) trained on growing prefixes of the pipeline's
# data, scored on fixed held-out rows (training-time tau) and on the Spec-Bench dev prompts
# (served tau, 1 per category, K=1 and 3, greedy).
#
#   POINTS=40000,120000 bash bench/pipelines/curve_demo.sh [PIPELINE_DIR] [OUT]
#
# Needs `STAGE=distill bash bench/pipelines/demo_pipeline.sh` (distill.jsonl, init/). The curve's data file
# is built the same way whatever the size of distill.jsonl: its first 200 rows are the held-out
# rows (moved to the end, where `fastmtp curve` takes them from) and the training prefixes are
# read from row 200 on, so a later run with more data and larger POINTS trains its small points
# on exactly the same rows and scores every point on the same held-out text.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-runs/demo-pipeline-v2}
OUT=${2:-$W/curve}
POINTS=${POINTS:-40000,120000}
HELD=200
source bench/pipelines/demo_env.sh
mkdir -p "$OUT"
max=$(tr , '\n' <<< "$POINTS" | sort -n | tail -1)
"$BIN/python" bench/demo_data.py prefix "$W/distill.jsonl" "$OUT/data.jsonl" "$max" "$HELD"
"$BIN/fastmtp" curve --target "$T" --init "$W/init" --data "$OUT/data.jsonl" --out "$OUT" \
    --tokens "$POINTS" --arm fastmtp= --arm vanilla=--vanilla --heldout-rows "$HELD" \
    --serve-steps 1,3 --dev-prompts bench/data/spec_bench.jsonl --dev-per-category 1 \
    -- --steps 3 --epochs 2 --batch-size 8 --max-len 512 --lr 1e-3 --dtype bfloat16 \
       --compute-dtype bfloat16 --group-by-length
mkdir -p bench/results/curve_demo
cp "$OUT/curve.json" "$OUT/curve.md" bench/results/curve_demo/
[[ -f $OUT/curve.png ]] && cp "$OUT/curve.png" bench/results/curve_demo/
echo "results in bench/results/curve_demo/"
