#!/usr/bin/env bash
# The whole FastMTP pipeline for the demo target (SmolLM2-135M-Instruct), from nothing, on CPU:
#
#   materialise the target -> init-head -> self-distil (reference server, K=0) -> train a vanilla
#   head (1 step, teacher-forced) and a FastMTP head (K=3, train-as-you-serve) -> bench all heads
#   across K on the Spec-Bench subset.
#
#   bash bench/demo_pipeline.sh [WORKDIR]        (default runs/demo-pipeline)
#
# Settings are the ones the committed results in bench/results/ were made with (budget: one
# working session on 2 CPU cores). Environment overrides: N_PROMPTS (distilled prompts, default
# 458), EPOCHS (default 3), PORT (default 30100). Every step resumes or reuses what exists.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-runs/demo-pipeline}
N_PROMPTS=${N_PROMPTS:-458}
EPOCHS=${EPOCHS:-3}
PORT=${PORT:-30100}
BIN=${BIN:-.venv/bin}
mkdir -p "$W"

T=$("$BIN/python" -c "from fastmtp_sglang.demo_target import materialize_smollm2; print(materialize_smollm2())")
echo "target: $T"

[[ -f $W/init/config.json ]] || "$BIN/fastmtp" init-head --target "$T" "$W/init"

# self-distillation: the target's own answers (T=0.6, top-p 0.95, top-k 20) to the training prompts
if [[ ! -f $W/distill.done ]]; then
    "$BIN/fastmtp" serve --engine reference --target "$T" --steps 0 --port "$PORT" \
        --dtype bfloat16 --max-batch 16 --batch-window-ms 50 > "$W/server.log" 2>&1 &
    SERVER=$!
    trap 'kill $SERVER 2>/dev/null || true' EXIT
    "$BIN/python" -c "from fastmtp_sglang.client import wait_for_health; wait_for_health('http://127.0.0.1:$PORT', 300)"
    "$BIN/fastmtp" distill --url "http://127.0.0.1:$PORT" --tokenizer "$T" \
        --prompts fastmtp_sglang/data/train_prompts/alpaca_eval_instructions.jsonl \
                  fastmtp_sglang/data/train_prompts/self_instruct_seed.jsonl \
        --exclude bench/data/spec_bench.jsonl bench/data/c_eval_zh.jsonl \
        --max-new-tokens 256 --concurrency 16 --limit "$N_PROMPTS" --out "$W/distill.jsonl"
    kill $SERVER; trap - EXIT
    touch "$W/distill.done"
fi

common=(--target "$T" --init "$W/init" --data "$W/distill.jsonl" --epochs "$EPOCHS"
        --batch-size 4 --max-len 512 --lr 1e-3 --vocab vocab_tables/smollm2/en-16384.pt)
[[ -f $W/vanilla/config.json ]] || "$BIN/fastmtp" train "${common[@]}" --steps 3 --vanilla --out "$W/vanilla"
[[ -f $W/fastmtp-k3/config.json ]] || "$BIN/fastmtp" train "${common[@]}" --steps 3 --out "$W/fastmtp-k3"

# every head on the same prompts (Spec-Bench, 1 per category), greedy, K=0..5, in one process each
for head in init vanilla fastmtp-k3; do
    "$BIN/fastmtp" bench --engine reference --target "$T" --draft "$W/$head" --steps 0,1,2,3,4,5 \
        --prompts bench/data/spec_bench.jsonl --limit-per-category 1 --max-new-tokens 64 \
        --vocab full --label "SmolLM2-135M, $head head, full vocab" --out "$W/bench-$head"
done
"$BIN/fastmtp" bench --engine reference --target "$T" --draft "$W/fastmtp-k3" --steps 0,3 \
    --prompts bench/data/spec_bench.jsonl --limit-per-category 1 --max-new-tokens 64 \
    --vocab vocab_tables/smollm2/en-16384.pt --label "SmolLM2-135M, fastmtp-k3, en-16384" \
    --out "$W/bench-fastmtp-k3-en16384"
