#!/usr/bin/env bash
# Which training lever moves the demo head most, at one equal budget: arms of `fastmtp curve` on
# the same prefix of head_demo.sh's data, features and table (every arm reads one cache), each
# scored on the same held-out rows (simulated greedy walk at K=3) and served on Spec-Bench dev.
#
#   bash bench/pipelines/levers.sh [HEAD_DEMO_OUT] [OUT]
#   ARMS="kl acc" POINT=400000 bash bench/pipelines/levers.sh runs/data-v3/train15872/head-v3
#
# HEAD_DEMO_OUT is a finished (or started) head_demo.sh output: its data.jsonl (held-out rows
# last), features/ (top-32) and table/ are reused, nothing is recomputed. The arms:
#   kl       the shipped loss (KL to the target's top-32), beta 0.6: the baseline
#   acc      -log of the acceptance rate sum min(p, q) over the top-32 (LK losses, arXiv 2602.23881)
#   ce+acc   cross-entropy to the sampled token plus acc
#   beta08   kl with step weights decaying as 0.8^(k-1) (later steps weigh more)
#   beta04   kl with 0.4^(k-1) (step 1, the bottleneck, weighs more)
#   bs4      kl at batch 4: twice the optimizer steps over the same tokens, at about the same CPU
# One epoch over POINT response tokens, LR 6e-3 (head_steps' schedule), batch 8, bf16. Every
# point resumes: rerun the same command after a stop. Results: OUT/curve.md (copied to RESULTS).
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${1:-runs/data-v3/train15872/head-v3}
OUT=${2:-$H/levers}
POINT=${POINT:-600000}
EPOCHS=${EPOCHS:-1}
LR=${LR:-6e-3}
ARMS=${ARMS:-"kl acc ce+acc beta08 beta04"}
RESULTS=${RESULTS:-bench/results/levers}
BIN=${BIN:-.venv/bin}
T=$("$BIN/python" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2; print(materialize_smollm2())")
for f in "$H/data.jsonl" "$H/features/index.json" "$H/table/en-16384.pt"; do
    [[ -f $f ]] || { echo "$f is missing: run bench/pipelines/head_demo.sh first" >&2; exit 1; }
done
INIT=${INIT:-$(dirname "$H")/init}
arms=()
for a in $ARMS; do
    case $a in
        kl) arms+=(--arm "kl=--loss kl --kl-topk 32") ;;
        acc) arms+=(--arm "acc=--loss acc --kl-topk 32") ;;
        ce+acc) arms+=(--arm "ce+acc=--loss ce+acc --kl-topk 32") ;;
        beta08) arms+=(--arm "beta08=--loss kl --kl-topk 32 --beta 0.8") ;;
        beta04) arms+=(--arm "beta04=--loss kl --kl-topk 32 --beta 0.4") ;;
        bs4) arms+=(--arm "bs4=--loss kl --kl-topk 32 --batch-size 4") ;;
        *) echo "ARMS holds kl, acc, ce+acc, beta08, beta04, bs4" >&2; exit 1 ;;
    esac
done
mkdir -p "$OUT"
"$BIN/fastmtp" curve --target "$T" --init "$INIT" --data "$H/data.jsonl" --out "$OUT" \
    --features "$H/features" --tokens "$POINT" --heldout-rows 200 "${arms[@]}" \
    --serve-steps 3 --dev-prompts bench/data/spec_bench.jsonl --dev-per-category 1 \
    -- --steps 3 --epochs "$EPOCHS" --batch-size 8 --max-len 512 --lr "$LR" --dtype bfloat16 \
       --compute-dtype bfloat16 --group-by-length --save-every 200 --eval-every 200 \
       --vocab "$H/table/en-16384.pt"
mkdir -p "$RESULTS"
cp "$OUT/curve.json" "$OUT/curve.md" "$RESULTS/"
for f in curve.png curve_steps.png; do if [[ -f $OUT/$f ]]; then cp "$OUT/$f" "$RESULTS/"; fi; done
echo "results in $RESULTS/"
