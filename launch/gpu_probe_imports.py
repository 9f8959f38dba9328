"""Import SGLang's server stack and our model class; print what loaded, as JSON.

    python launch/gpu_probe_imports.py [--simulate-cuda] [--out FILE]

Used three ways: on a CPU machine over the full SGLang install (``gpu_bundle.py imports``: which
distributions the server really imports), over the unpacked offline bundle (``gpu_bundle.py
check``), and on the GPU machine before the first server starts (``gpu_lease.sh run``).
``--simulate-cuda`` makes torch report one Hopper GPU (compute capability 9.0) so that the
CUDA-only import branches run (sgl_kernel picks ``sm90/common_ops``; a stub ``libcuda.so.1`` on
``LD_LIBRARY_PATH`` stands in for the driver library it links). It never runs a kernel.
Exit 0 when every module imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types
from importlib import metadata

MODULES = (
    "sgl_kernel",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.sampler",
    "fastmtp_sglang.models.fastmtp",
)


def simulate_cuda() -> None:
    import torch

    props = types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200 (simulated)",
                                  total_memory=141 << 30, multi_processor_count=132)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: props.name
    torch.cuda.get_device_properties = lambda device=None: props


def loaded_distributions() -> dict[str, dict]:
    """Distribution -> version and where it was loaded from, for every imported top-level module."""
    top = {name.split(".")[0] for name in list(sys.modules)}
    owners = metadata.packages_distributions()
    out: dict[str, dict] = {}
    for name in sorted(top):
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", []) or []), None)
        for dist in owners.get(name, []):
            try:
                version = metadata.version(dist)
            except metadata.PackageNotFoundError:
                version = None
            out.setdefault(dist, {"version": version, "from": where, "modules": []})["modules"].append(name)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate-cuda", action="store_true", help="report one H200 to torch (CPU checks)")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    # the route the bundle takes: no flashinfer kernels (docs/sglang_backend.md, GPU route)
    os.environ.setdefault("SGLANG_IS_FLASHINFER_AVAILABLE", "false")
    import torch

    if a.simulate_cuda and not torch.cuda.is_available():
        simulate_cuda()
    results = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
            results[name] = "ok"
        except BaseException as exc:  # noqa: BLE001 - report every failure, keep probing
            results[name] = f"{type(exc).__name__}: {exc}"[:600]
    report = {"python": sys.version.split()[0], "torch": torch.__version__,
              "simulated_cuda": bool(a.simulate_cuda), "imports": results,
              "distributions": loaded_distributions()}
    text = json.dumps(report, indent=1, sort_keys=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps(results, indent=1))
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
