#!/usr/bin/env bash
# `fastmtp bench --url` against vLLM's OpenAI-compatible server (CPU), through the SGLang-API
# adapter (fastmtp_sglang/serving/vllm_proxy.py): two `vllm serve` processes (K=0 and K), one adapter each.
#
#   bench/pipelines/vllm_serve_bench.sh [OUT] [K]      # default OUT bench/results/vllm_cpu/serve_bench, K 3
#
# K may list several (1,3: one server each, beside the K=0 one). AUTO_TABLE=FILE adds a server
# that runs vLLM's K per batch size from that file (fastmtp serve --steps auto --adaptive-config,
# benched as arm auto); EMIT=1 passes --emit-engine-config (with CONCURRENCY), which writes such a
# file from this run's static arms (OUT/vllm_k_per_batch_size.json).
#
# Environment: PYTHON (default ../vllm-venv/bin/python), DTYPE (default float32), TARGET (default:
# the demo target, materialised if needed), DRAFT (default the shipped head), LIMIT (prompts per
# Spec-Bench category, default 1), TOKENS (default 64), REPEATS (default 1), CONCURRENCY (e.g.
# 1,2,4,8,16: throughput under load instead of one request at a time; the bench then loads each
# vLLM server through its own OpenAI API, found through the adapter's /server_info), PER_CLIENT
# (with CONCURRENCY: requests each client sends at least, default 2), BENCH_ARGS (more flags for
# `fastmtp bench`, split on spaces, e.g. "--schedule sandwich --block-requests 16").
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT=${1:-bench/results/vllm_cpu/serve_bench}
K=${2:-3}
PYTHON=${PYTHON:-$REPO/../vllm-venv/bin/python}
DTYPE=${DTYPE:-float32}
DRAFT=${DRAFT:-$REPO/fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3}
LIMIT=${LIMIT:-1}
TOKENS=${TOKENS:-64}
export HF_HUB_OFFLINE=1
TARGET=${TARGET:-$("$PYTHON" -c 'from fastmtp_sglang.core.demo_target import materialize_smollm2 as m; print(m(progress=False))')}
LOGS=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

serve() {  # K vLLM-port adapter-port [table]: the README's command, then an adapter in front
    local draft=() steps=$1 table=() adaptive=()
    [[ $1 != 0 ]] && draft=(--draft "$DRAFT")
    if [[ $1 == auto ]]; then
        table=(--adaptive-config "$AUTO_TABLE"); adaptive=(--adaptive)
        steps=$("$PYTHON" -c "from fastmtp_sglang.serving.engine_config import read_vllm_table as r; print(r('$AUTO_TABLE')[1])")
    fi
    "$PYTHON" -m fastmtp_sglang serve --engine vllm --target "$TARGET" "${draft[@]}" \
        --steps "$1" "${table[@]}" --port "$2" --dtype "$DTYPE" -- --enforce-eager --max-model-len 2048 \
        > "$LOGS/vllm-k$1.log" 2>&1 &
    pids+=($!)
    "$PYTHON" -m fastmtp_sglang.cli.vllm_proxy --vllm "http://127.0.0.1:$2" --steps "$steps" \
        "${adaptive[@]}" --draft "$DRAFT" --port "$3" > "$LOGS/proxy-k$1.log" 2>&1 &
    pids+=($!)
    # one server at a time: two engine cores starting together on 2 cores take twice as long each
    "$PYTHON" -c "from fastmtp_sglang.serving.client import wait_for_health as w; w('http://127.0.0.1:$3', 900)"
    urls+=(--url "http://127.0.0.1:$3")
}
urls=()
arms=0
i=0
for k in 0 ${K//,/ } ${AUTO_TABLE:+auto}; do
    serve "$k" $((8100 + i)) $((30100 + i))
    [[ $k != 0 ]] && arms="$arms,$k"
    i=$((i + 1))
done
"$PYTHON" -m fastmtp_sglang bench "${urls[@]}" \
    --steps "$arms" --target "$TARGET" --prompts bench/data/spec_bench.jsonl \
    --limit-per-category "$LIMIT" --max-new-tokens "$TOKENS" --temperature 0 --out "$OUT" \
    --repeats "${REPEATS:-1}" ${CONCURRENCY:+--concurrency "$CONCURRENCY" --per-client "${PER_CLIENT:-2}"} ${EMIT:+--emit-engine-config} ${BENCH_ARGS:-} \
    --label "vLLM $DTYPE (CPU), K=0 vs K=${arms#0,}${CONCURRENCY:+ under load}"
echo "vLLM logs: $LOGS"
