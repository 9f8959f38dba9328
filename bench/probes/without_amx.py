"""Run a bench script on an AMX machine as it would run on a CPU with AVX-512 bf16 but no AMX
(AMD EPYC Zen 4 and 5, Intel Cooper Lake): what our kernels see of the CPU loses its ``amx_*``
flags (so ``cpu_kernels.amx`` is not loaded and the head's step runs the vector path), and
oneDNN, under PyTorch's bf16 matmuls, is capped at AVX-512 bf16 (``ONEDNN_MAX_CPU_ISA``).

    python bench/probes/without_amx.py bench/cost_curve.py --dtypes bfloat16 --ns 1,4,8 --repeats 21 --out R

The model name the results carry ends in "(AMX masked)". What this does not change: the
machine's caches, memory bandwidth and clocks, which are this CPU's, not a Zen 4's; so it times
the code path such a CPU runs, on this CPU's memory system (the floor each curve reports is
measured in the same run). ``--check``: print the ISA oneDNN picks for a bf16 matmul and exit.
"""
import os
import runpy
import sys

os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"  # (read by oneDNN at its first primitive)

from fastmtp_sglang.core import hardware  # noqa: E402

_model, _flags = hardware._cpuinfo()
_masked = (f"{_model} (AMX masked)", frozenset(f for f in _flags if not f.startswith("amx")))
hardware._cpuinfo = lambda: _masked


def _check() -> None:
    """oneDNN's verbose lines for one bf16 matmul: the ISA it ran on."""
    os.environ["ONEDNN_VERBOSE"] = "1"
    import torch

    a = torch.randn(4, 576, dtype=torch.bfloat16)
    torch.nn.functional.linear(a, torch.randn(1536, 576, dtype=torch.bfloat16))
    from fastmtp_sglang.cpu_kernels import amx

    print("cpu_kernels.amx available:", amx.available(), "-", amx.unavailable_reason())


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        _check()
        raise SystemExit(0)
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
