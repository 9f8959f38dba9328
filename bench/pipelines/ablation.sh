#!/usr/bin/env bash
# The training-signal ablation (issue 14) on the demo target: every arm trains from the same init
# on the same rows of the same self-distilled data, same optimizer steps, same seed, with the
# compressed table it serves with, and is scored by `fastmtp curve` (held-out training-time tau
# and served tau at K=1..5 on the Spec-Bench dev prompts, one per category, greedy).
#
#   bash bench/pipelines/ablation.sh [PIPELINE_DIR] [TOKENS]          # all stages, resumable
#   STAGE=loss bash bench/pipelines/ablation.sh                        # one stage: prep|loss|data|seed|lr|report
#
# Needs what `STAGE=distill bash bench/pipelines/demo_pipeline.sh` builds (distill.jsonl, init/).
#   prep: OUT/data.jsonl = TOKENS response tokens of training rows + the 200 held-out rows (the
#         layout of bench/pipelines/curve_demo.sh), the en-16384 table built from the target's own
#         responses (training rows only), the feature cache with the target's top-32 log-probs.
#   loss: ce (one sampled label per position, the old default) vs kl (to the target's top-32,
#         renormalised on the table) vs ce+kl.
#   data: a greedy continuation of every training prompt replaces that prompt's last sample
#         (same prompts, same row count, ~1/4 greedy), trained with LOSS_WINNER.
#   seed: SEED_ARMS (the best two) again with --seed 1, for the noise level.
#   lr:   LOSS_WINNER at each LR of LRS (default 3e-3) instead of 1e-3 (the recipe, not the signal).
#   report: bench/results/ablation/ (one table, one plot) via bench/ablation_report.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-runs/demo-pipeline-v2}
TOK=${2:-120000}
OUT=${OUT:-$W/ablation}
STAGE=${STAGE:-all}
LOSS_WINNER=${LOSS_WINNER:-kl}
SEED_ARMS=${SEED_ARMS:-kl,ce}
HELD=200
source bench/pipelines/demo_env.sh
mkdir -p "$OUT"
TABLE=$OUT/table/en-16384.pt
common=(--steps 3 --epochs 2 --batch-size 8 --max-len 512 --lr 1e-3 --dtype bfloat16
        --compute-dtype bfloat16 --group-by-length --vocab "$TABLE")
curve=(--target "$T" --init "$W/init" --tokens "$TOK" --heldout-rows "$HELD" --serve-steps 1,2,3,4,5
       --dev-prompts bench/data/spec_bench.jsonl --dev-per-category 1)
declare -A LOSS=([ce]="--loss ce" [kl]="--loss kl --kl-topk 32" [ce+kl]="--loss ce+kl --kl-topk 32")
run() { [[ $STAGE == all || $STAGE == "$1" ]]; }

if run prep; then
    [[ -f $OUT/data.jsonl ]] || "$BIN/python" bench/demo_data.py prefix "$W/distill.jsonl" "$OUT/data.jsonl" "$TOK" "$HELD"
    if [[ ! -f $TABLE ]]; then
        "$BIN/python" bench/demo_data.py corpus "$W/distill.jsonl" "$OUT/table-corpus.jsonl" "$HELD"
        "$BIN/fastmtp" build-vocab --tokenizer "$T" --lang en --size 16384 \
            --corpus "$OUT/table-corpus.jsonl" --out "$OUT/table" --quiet
    fi
    "$BIN/fastmtp" features --target "$T" --data "$OUT/data.jsonl" --out "$OUT/features" \
        --max-len 512 --topk 32 --dtype bfloat16
fi
if run loss; then
    "$BIN/fastmtp" curve "${curve[@]}" --data "$OUT/data.jsonl" --out "$OUT/loss" --features "$OUT/features" \
        --arm ce="${LOSS[ce]}" --arm kl="${LOSS[kl]}" --arm ce+kl="${LOSS[ce+kl]}" -- "${common[@]}"
fi
if run data; then
    if [[ ! -f $OUT/greedy.jsonl.done ]]; then
        "$BIN/python" bench/demo_data.py prompts "$OUT/data.jsonl" "$OUT/greedy-prompts.jsonl" "$HELD"
        "$BIN/fastmtp" distill --target "$T" --prompts "$OUT/greedy-prompts.jsonl" --n 1 --temperature 0 \
            --max-new-tokens 256 --exclude bench/data/spec_bench.jsonl bench/data/c_eval_zh.jsonl \
            --out "$OUT/greedy.jsonl"
        touch "$OUT/greedy.jsonl.done"
    fi
    [[ -f $OUT/mixed.jsonl ]] || "$BIN/python" bench/demo_data.py mix "$OUT/data.jsonl" "$OUT/greedy.jsonl" "$OUT/mixed.jsonl" "$HELD"
    "$BIN/fastmtp" features --target "$T" --data "$OUT/mixed.jsonl" --out "$OUT/features-mixed" \
        --max-len 512 --topk 32 --dtype bfloat16
    "$BIN/fastmtp" curve "${curve[@]}" --data "$OUT/mixed.jsonl" --out "$OUT/data" --features "$OUT/features-mixed" \
        --arm "greedy-mix-$LOSS_WINNER=${LOSS[$LOSS_WINNER]}" -- "${common[@]}"
fi
if run seed; then
    arms=()
    IFS=, read -ra names <<< "$SEED_ARMS"
    for a in "${names[@]}"; do arms+=(--arm "$a-seed1=${LOSS[$a]} --seed 1"); done
    "$BIN/fastmtp" curve "${curve[@]}" --data "$OUT/data.jsonl" --out "$OUT/seed" --features "$OUT/features" \
        "${arms[@]}" -- "${common[@]}"
fi
if run lr; then  # not a signal arm: is 1e-3 too low for so few steps? (the winner loss at LRS)
    arms=()
    for lr in ${LRS:-3e-3}; do arms+=(--arm "$LOSS_WINNER-lr$lr=${LOSS[$LOSS_WINNER]} --lr $lr"); done
    "$BIN/fastmtp" curve "${curve[@]}" --data "$OUT/data.jsonl" --out "$OUT/lr" --features "$OUT/features" \
        "${arms[@]}" -- "${common[@]}"
fi
if run report; then
    "$BIN/python" bench/ablation_report.py "$OUT" bench/results/ablation
fi
