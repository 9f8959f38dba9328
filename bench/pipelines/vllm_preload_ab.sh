#!/usr/bin/env bash
# vLLM (CPU) with and without Intel OpenMP preloaded: one vLLM server at a time for K=1 (shipped
# head) and K=0, each started once with LD_PRELOAD empty and once with the venv's libiomp5.so,
# one greedy request of 128 tokens timed 4 times each (tokens/s printed). Direction only; the
# numbers in docs/vllm_backend.md come from this script, idle machine.
#
#   PYTHON=/tmp/fastmtp-ci-vllm-venv/bin/python bash bench/pipelines/vllm_preload_ab.sh
set -u
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
P=${PYTHON:-../vllm-venv/bin/python}
T=${TARGET:-$("$P" -c 'from fastmtp_sglang.core.demo_target import materialize_smollm2 as m; print(m(progress=False))')}
D=$PWD/fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3
IOMP=$("$P" -c 'import sys; print(sys.prefix)')/lib/libiomp5.so
LOGS=$(mktemp -d)
lscpu | grep -E "Model name"
for K in 1 0; do for pre in "" "$IOMP"; do
    dr=(); [[ $K != 0 ]] && dr=(--draft "$D")
    # LD_PRELOAD set (empty or not) is left alone by `fastmtp serve`
    LD_PRELOAD=$pre "$P" -m fastmtp_sglang serve --engine vllm --target "$T" "${dr[@]}" --steps $K \
        --port 8199 --dtype float32 -- --enforce-eager --max-model-len 2048 > "$LOGS/k$K-${#pre}.log" 2>&1 &
    pid=$!
    "$P" -c "from fastmtp_sglang.serving.client import wait_for_health as w; w('http://127.0.0.1:8199', 600)"
    for i in 1 2 3 4; do
        s=$(date +%s.%N)
        curl -s 127.0.0.1:8199/v1/completions -H 'content-type: application/json' -d "{\"model\":\"$T\",\"prompt\":\"Write a short story about a robot who learns to paint. Once upon a time\",\"max_tokens\":128,\"temperature\":0,\"ignore_eos\":true}" > /dev/null
        e=$(date +%s.%N)
        echo "K=$K preload=${pre:+iomp} run$i $(echo "128/($e-$s)" | bc -l | cut -c1-6) tok/s"
    done
    kill $pid; wait $pid 2>/dev/null; sleep 3
done; done
echo "logs: $LOGS"
