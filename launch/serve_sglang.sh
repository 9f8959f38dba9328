#!/usr/bin/env bash
# Serve a target model with a FastMTP draft head on SGLang 0.5.23 (GPU).
#
#   launch/serve_sglang.sh TARGET DRAFT [K] [-- extra SGLang flags]
#
#   TARGET  the target model: a Hugging Face directory or hub id (SGLang's --model-path)
#   DRAFT   a FastMTP draft directory (`fastmtp convert` / `fastmtp init-head` / `fastmtp train`)
#   K       draft tokens per verification (default 3); 0 = plain server, no speculation
#
# Environment: PORT (default 30000), HOST (default 127.0.0.1), PYTHON (default python).
# Example:
#   launch/serve_sglang.sh ~/.cache/fastmtp/smollm2-135m-instruct drafts/smollm2-k3 3 \
#       -- --mem-fraction-static 0.5
#
# This is what `fastmtp serve --engine sglang --target TARGET --draft DRAFT --steps K` runs
# (fastmtp_sglang/serving/sglang_launch.py); read it to adapt the command by hand.
set -euo pipefail

# TARGET DRAFT [K] [--] into TARGET, DRAFT and K; the extra flags are left in "$@"
source "$(dirname "$0")/serve_args.sh"
PORT=${PORT:-30000}
HOST=${HOST:-127.0.0.1}
PYTHON=${PYTHON:-python}

args=(--model-path "$TARGET" --host "$HOST" --port "$PORT")

if [[ $K -gt 0 ]]; then
    # SGLang's registry imports every module of this package and registers its EntryClass
    # (FastMTPForCausalLM, the name in the draft's config.json "architectures"). Spawned
    # scheduler processes inherit the variable; registering inside a wrapper script that then
    # calls launch_server would not reach them. (An installed fastmtp-sglang also registers
    # through its sglang.srt.plugins entry point; the variable works without installing.)
    export SGLANG_EXTERNAL_MODEL_PACKAGE=fastmtp_sglang.models

    args+=(
        # The stock EAGLE worker runs the one draft head K times, feeding back its own hidden
        # state (EagleDraftWorker.draft_forward).
        --speculative-algorithm EAGLE
        --speculative-draft-model-path "$DRAFT"
        --speculative-num-steps "$K"
        # A chain, not a tree: one candidate per step, so K + 1 tokens are verified per cycle
        # (the K drafts and the bonus token).
        --speculative-eagle-topk 1
        --speculative-num-draft-tokens "$((K + 1))"
        # Not --enable-multi-layer-eagle: that expects one module per step.
    )
fi

# Extra flags go last, unchanged, for example:
#   --mem-fraction-static 0.5                 share the GPU with other servers
#   --dtype bfloat16                          the draft runs in the server's dtype: with "auto"
#                                             a float32 draft directory would run in float16
#   --speculative-token-map hot_ids.pt        SGLang's one global compressed draft vocabulary
#                                             (TP=1 only; not with rejection sampling)
#   --disable-cuda-graph                      debug the draft eagerly
set -x
exec "$PYTHON" -m sglang.launch_server "${args[@]}" "$@"
