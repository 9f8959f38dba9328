#!/usr/bin/env bash
# Issue 21's protocol, on an idle machine: one `fastmtp bench` run on the Spec-Bench dev prompts
# (2 per category, 128 new tokens, 3 repeats, greedy) with plain decoding, the shipped head at
# K=1..5, prompt lookup at 3 and 5, and `auto` (hybrid head + prompt lookup, K <= 5), each arm
# paired with plain decoding on the same prompt and repeat; then the cost curve of every
# engine variant (stock transformers, prepared weights unfused, the engine) on the same machine.
#
#   bash bench/pipelines/speculation_pays.sh [OUT]    # default bench/results/speculation_pays
#
# Environment: BIN (default .venv/bin), LIMIT (prompts per category, default 2), TOKENS (128),
# REPEATS (3), DTYPE (auto).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench/results/speculation_pays}
BIN=${BIN:-.venv/bin}
T=$("$BIN/python" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2; print(materialize_smollm2())")
D=fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3
"$BIN/fastmtp" bench --engine reference --target "$T" --draft "$D" --steps 0,1,2,3,4,5,auto \
    --auto-max-steps 5 --ngram-steps 3,5 --prompts bench/data/spec_bench.jsonl \
    --limit-per-category "${LIMIT:-2}" --max-new-tokens "${TOKENS:-128}" --repeats "${REPEATS:-3}" \
    --dtype "${DTYPE:-auto}" --out "$OUT" --no-progress
"$BIN/python" bench/cost_curve.py --dtypes bfloat16,float32 --stock --out "$OUT/costs"
echo "results in $OUT/ (results.md, costs/costs.md)"
