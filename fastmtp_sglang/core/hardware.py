"""What this machine's CPU can do fast, read once from /proc/cpuinfo (Linux; elsewhere empty).

bf16 matmuls are fast on x86 only with native bf16 units (``avx512_bf16`` or AMX's ``amx_bf16``);
without them PyTorch emulates bf16 and an SmolLM2-135M forward grows linearly with the tokens per
forward (measured on an AVX2-only EPYC: 50 / 68 / 108 / 171 ms for 1 / 2 / 4 / 8 tokens, against
70 / 99 / 115 / 108 ms in fp32; docs/design.md section 6). So ``--dtype auto`` means bf16 on CUDA
and on CPUs with those units, fp32 elsewhere.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# the flags reported with every measurement: the ones that decide which CPU kernels are fast
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
                  "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]


def cpu_summary() -> str:
    """The CPU's model name and the vector / matrix flags that decide what pays on it
    (avx*, amx*, fma): what every committed timing names."""
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")) or f == "fma")
    return f"{cpu_model()} ({' '.join(flags) or 'no avx/amx flags'})"


def fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU has native bf16 matmul units."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_FLAGS)


def auto_dtype_name(device: str = "cpu", flags: frozenset[str] | None = None) -> str:
    """``--dtype auto``: bfloat16 on CUDA and on CPUs with bf16 units, float32 elsewhere."""
    if str(device).startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if fast_bf16(flags) else "float32"


def default_device(device: str | None = None) -> str:
    """``--device`` as train, features and curve read it: as given, else cuda when a GPU is
    visible, else cpu."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
