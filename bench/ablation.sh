#!/usr/bin/env bash
# The training-signal ablation (issue 14) on the demo target: every arm trains from the same init
# on the same prefix of the same self-distilled data, same steps, same seed, and is scored by
# `fastmtp curve` (held-out training-time tau and served tau at K=1..5 on the dev prompts).
#
#   bash bench/ablation.sh [PIPELINE_DIR] [TOKENS]
#
# Needs what `STAGE=distill bash bench/demo_pipeline.sh` builds (distill.jsonl, init/) and builds
# the rest, resumably:
#   - features over distill.jsonl with the target's top-32 log-probabilities (KL arms);
#   - a greedy continuation of one prompt in two (temperature 0), mixed into a second data file
#     whose prefix holds the same number of response tokens (the "sampled + greedy" arm).
# Arms: ce (one label per position, today's default), kl (KL to the target's top-32), ce+kl;
# then "sampled+greedy" with the best of those losses; the best two are repeated with seed 1.
# Results: OUT/curve.{json,md,png} per data file; bench/results/ablation/ collects them.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-runs/demo-pipeline-v2}
TOK=${2:-250000}
EPOCHS=${EPOCHS:-2}
LR=${LR:-1e-3}
BIN=${BIN:-.venv/bin}
T=$("$BIN/python" -c "from fastmtp_sglang.demo_target import materialize_smollm2; print(materialize_smollm2())")
[[ -f $W/distill.jsonl && -f $W/init/config.json ]] || {
    echo "run STAGE=distill bash bench/demo_pipeline.sh $W first" >&2; exit 1; }
common=(--steps 3 --epochs "$EPOCHS" --batch-size 8 --max-len 512 --lr "$LR" --dtype bfloat16 --compute-dtype bfloat16
        --group-by-length)
dev=(--serve-steps 1,2,3,4,5 --dev-prompts bench/data/spec_bench.jsonl --dev-per-category 1
     --heldout-rows 200)

"$BIN/fastmtp" features --target "$T" --data "$W/distill.jsonl" --out "$W/features" --max-len 512 --topk 32 --dtype bfloat16

# 1. the loss: CE on the sampled labels vs KL to the target's top-32 vs both
"$BIN/fastmtp" curve --target "$T" --init "$W/init" --data "$W/distill.jsonl" --out "$W/ablation-loss" \
    --features "$W/features" --tokens "$TOK" "${dev[@]}" \
    --arm ce="--loss ce" --arm kl="--loss kl --kl-topk 32" --arm ce+kl="--loss ce+kl --kl-topk 32" \
    --arm ce-seed1="--loss ce --seed 1" --arm kl-seed1="--loss kl --kl-topk 32 --seed 1" \
    -- "${common[@]}"

# 2. the data: greedy continuations of the same prompts mixed in (half of the token budget)
if [[ ! -f $W/greedy.jsonl.done ]]; then
    "$BIN/python" - "$W" <<'EOF'
import json, sys
w = sys.argv[1]
seen, rows = set(), []
for line in open(f"{w}/distill.jsonl", encoding="utf-8"):
    r = json.loads(line)
    if r["prompt_id"] not in seen:
        seen.add(r["prompt_id"])
        rows.append({"id": r["prompt_id"], "prompt": r["prompt"]})
with open(f"{w}/greedy-prompts.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(x, ensure_ascii=False) + "\n" for x in rows[::2])
EOF
    "$BIN/fastmtp" distill --target "$T" --prompts "$W/greedy-prompts.jsonl" --n 1 --temperature 0 \
        --max-new-tokens 256 --exclude bench/data/spec_bench.jsonl bench/data/c_eval_zh.jsonl \
        --out "$W/greedy.jsonl"
    touch "$W/greedy.jsonl.done"
fi
# interleave: one greedy row after every sampled row until the greedy rows run out
[[ -f $W/mixed.jsonl ]] || "$BIN/python" - "$W" <<'EOF'
import itertools, sys
w = sys.argv[1]
a = open(f"{w}/distill.jsonl", encoding="utf-8").readlines()
b = open(f"{w}/greedy.jsonl", encoding="utf-8").readlines()
out = [x for pair in itertools.zip_longest(a, b) for x in pair if x is not None]
open(f"{w}/mixed.jsonl", "w", encoding="utf-8").writelines(out)
EOF
"$BIN/fastmtp" features --target "$T" --data "$W/mixed.jsonl" --out "$W/features-mixed" --max-len 512 --topk 32 --dtype bfloat16
"$BIN/fastmtp" curve --target "$T" --init "$W/init" --data "$W/mixed.jsonl" --out "$W/ablation-data" \
    --features "$W/features-mixed" --tokens "$TOK" "${dev[@]}" \
    --arm sampled+greedy-ce="--loss ce" --arm sampled+greedy-kl="--loss kl --kl-topk 32" \
    -- "${common[@]}"

mkdir -p bench/results/ablation
for d in ablation-loss ablation-data; do
    cp "$W/$d/curve.json" "bench/results/ablation/$d.json"
    cp "$W/$d/curve.md" "bench/results/ablation/$d.md"
    [[ -f $W/$d/curve.png ]] && cp "$W/$d/curve.png" "bench/results/ablation/$d.png"
done
echo "results in bench/results/ablation/"
