#!/usr/bin/env bash
# One step of the lease protocol, run ON the lent GPU machine (no package index there).
# launch/gpu_lease.py plans the calls and says which step each one runs:
#
#   bash launch/gpu_lease.sh probe   # call 1: what the image holds (nvidia-smi, g++, nvcc, pip list)
#   bash launch/gpu_lease.sh part    # calls 2..N-1: keep the bundle part this call carried
#   bash launch/gpu_lease.sh run     # call N: unpack, install, import check, launch/gpu_e2e.py
#
# Every call first copies the bundle parts it carried (.gpu_bundle/*) to /tmp/fastmtp-lease/parts,
# which stays while the machine is warm (30 s idle), so the calls must follow one another at once.
# Environment: OUT (the device tool's results folder), DEADLINE (seconds for gpu_e2e.py, default 420),
# STEPS (default 0,3,1,2,4,5), PYTHON (default python3).
set -uo pipefail
MODE=${1:?usage: gpu_lease.sh probe|part|run}
REPO=$(cd "$(dirname "$0")/.." && pwd)
LEASE=/tmp/fastmtp-lease
OUT=${OUT:-$LEASE/out}
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-420}
STEPS=${STEPS:-0,3,1,2,4,5}
mkdir -p "$LEASE/parts" "$OUT"
cp "$REPO"/.gpu_bundle/* "$LEASE/parts/" 2>/dev/null
echo "[gpu_lease $(date -u +%T)] $MODE: parts here: $(cd "$LEASE/parts" && ls | tr '\n' ' ')"

case $MODE in
probe)
    {
        date -u
        nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        echo "g++: $(command -v g++ && g++ --version | head -1)"
        echo "nvcc: $(command -v nvcc && nvcc --version | tail -1)"
        echo "ninja: $(command -v ninja)"
        "$PY" --version; "$PY" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
        df -h /tmp | tail -1
    } > "$OUT/probe.txt" 2>&1
    "$PY" -m pip list --format=freeze > "$OUT/image_pip_list.txt" 2>&1
    cat "$OUT/probe.txt"
    ;;
part)
    ;;
run)
    set -e
    cd "$LEASE"   # never the repository root: its kernels/ folder would shadow PyPI's kernels
    "$PY" "$REPO/launch/gpu_bundle.py" unpack --bundle "$LEASE/parts" --dest "$LEASE"
    echo "[gpu_lease $(date -u +%T)] unpacked; installing fastmtp-sglang from the carried tree"
    # our package from the carried tree, with the bundle's setuptools, no index; should pip refuse,
    # the same layout by hand (pyproject.toml's package-dir: kernels/ and vocab_tables/ inside)
    if ! PYTHONPATH="$LEASE/site" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
            --target "$LEASE/ours" "$REPO"; then
        echo "[gpu_lease] pip install failed; copying the package layout instead"
        rm -rf "$LEASE/ours" && mkdir -p "$LEASE/ours"
        cp -r "$REPO/fastmtp_sglang" "$LEASE/ours/"
        cp -r "$REPO/kernels" "$LEASE/ours/fastmtp_sglang/kernels"
        cp -r "$REPO/vocab_tables" "$LEASE/ours/fastmtp_sglang/vocab_tables"
        cp -r "$REPO/bench/data" "$LEASE/ours/fastmtp_sglang/eval_data"
    fi
    export PYTHONPATH="$LEASE/site:$LEASE/ours" PYTHONUNBUFFERED=1
    set +e
    echo "[gpu_lease $(date -u +%T)] installed; the import check on the GPU"
    "$PY" "$REPO/launch/gpu_probe_imports.py" --out "$OUT/imports.json"
    echo "[gpu_lease $(date -u +%T)] launch/gpu_e2e.py, deadline ${DEADLINE} s"
    EXPECTED=()
    [[ -f $LEASE/parts/expected.json ]] && EXPECTED=(--expected "$LEASE/parts/expected.json")
    timeout $((DEADLINE + 90)) "$PY" "$REPO/launch/gpu_e2e.py" --out "$LEASE/e2e" --dtype float32 \
        --route bundle --steps "$STEPS" --deadline-s "$DEADLINE" --concurrency 1,4,16 "${EXPECTED[@]}"
    rc=$?
    cp "$LEASE/e2e/e2e.md" "$LEASE/e2e/e2e.json" "$OUT/" 2>/dev/null
    [[ -d $LEASE/e2e ]] && tar czf "$OUT/e2e_results.tgz" -C "$LEASE" e2e
    echo "[gpu_lease $(date -u +%T)] gpu_e2e.py exit $rc"
    exit $rc
    ;;
*)
    echo "gpu_lease.sh: unknown step $MODE (probe|part|run)" >&2
    exit 2
    ;;
esac
