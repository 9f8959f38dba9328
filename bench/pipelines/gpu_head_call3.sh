#!/usr/bin/env bash
# The third call of a GPU lease that trains the demo head (bench/pipelines/gpu_head.sh): the
# demo target's GGUF reaches a machine with no package index in three parts, one per call (a
# call carries 64 MiB, the working tree ~30 MB of it). Prepare once, here (gpu_head.sh's header):
#   mkdir -p .gpu && echo /.gpu/ >> .git/info/exclude && split -n 3 -d GGUF .gpu/gguf.part
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/whl gguf==0.19.0
# call 1, carry [.gpu/gguf.part00]: mkdir -p /tmp/parts && cp .gpu/gguf.part00 /tmp/parts/
# call 2 (within the 30 s the machine stays warm), carry [.gpu/gguf.part01]: the same for part01
# call 3, carry [.gpu/gguf.part02, .gpu/whl], timeout 600:
#   LIMIT=585 DEADLINE=540 bash bench/pipelines/gpu_head_call3.sh
# As run on an H200 on 2026-12-04 (bench/results/gpu_head/): the three calls held the machine
# 502 s; this one ran 451 s (features of 7.4M tokens in 46 s, 761 optimizer steps at batch 32).
# The head and its curve land in $OUT/head, the log in $OUT/gpu_head.log; killed at LIMIT, the
# newest checkpoint (every SAVE_EVERY steps) is copied instead. Score the head on a CPU with the
# protocol in bench/results/gpu_head/README.md.
set -u
cd "$(dirname "$0")/../.."
T0=$(date +%s)
PY=${PYTHON:-python3}
GH=${GH:-/tmp/gh}
# the package-dir mapping pip install makes (pyproject), as links in the lent machine's copy of the tree
for d in kernels vocab_tables; do [[ -e fastmtp_sglang/$d ]] || ln -s ../$d fastmtp_sglang/$d; done
[[ -e fastmtp_sglang/eval_data ]] || ln -s ../bench/data fastmtp_sglang/eval_data
cat /tmp/parts/gguf.part00 /tmp/parts/gguf.part01 .gpu/gguf.part02 > /tmp/parts/g.gguf || {
    echo "gpu_head_call3: a part of the GGUF is missing (calls 1-2 leave them in /tmp/parts)" >&2; exit 2; }
sha256sum /tmp/parts/g.gguf
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHON=$PY
nvidia-smi -L || true
mkdir -p "$OUT/head"
GGUF=/tmp/parts/g.gguf DEADLINE=${DEADLINE:-520} MAX_EPOCHS=${MAX_EPOCHS:-8} SAVE_EVERY=${SAVE_EVERY:-250} \
    timeout -s TERM "${LIMIT:-565}" bash bench/pipelines/gpu_head.sh "$GH" "$OUT/head" > "$OUT/gpu_head.log" 2>&1
rc=$?
echo "gpu_head rc=$rc after $(( $(date +%s) - T0 )) s"
if [[ ! -f $OUT/head/model.safetensors ]]; then  # killed: the newest checkpoint
    H=$(ls -d "$GH"/head/fastmtp/*/ 2>/dev/null | head -1)
    [[ -n $H ]] && cp "$H/model.safetensors" "$H/config.json" "$H/train_log.jsonl" "$OUT/head/"
fi
ls -la "$OUT/head"
tr '\r' '\n' < "$OUT/gpu_head.log" | grep -v '^$' | grep -v "Loading weights" | tail -40
