"""The AVX-512 build of the products (cpu_kernels/amx.c with FASTMTP_VECTOR) against oneDNN's
bf16 products on its own prepared weights, at 1 to 256 rows: a Llama layer's three weights of the
demo target's shapes (gate/up 3072 x 576, down 576 x 1536, q/k/v 960 x 576), ms per layer, two
threads. On an AMX machine run it with AMX masked, so oneDNN runs what a CPU without AMX runs:

    python bench/probes/without_amx.py bench/probes/vector_products_probe.py
"""
import time

import torch

from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.cpu_kernels import packed_linear as pl
from fastmtp_sglang.decode.costs import cpu_description


def _ms(f, xs, reps: int) -> float:
    for _ in range(3):
        f(xs)
    t0 = time.perf_counter()
    for _ in range(reps):
        f(xs)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    torch.set_num_threads(2)
    lib, why = amx._load("vector")
    if lib is None:
        raise SystemExit(f"no vector build here: {why}")
    amx._state["lib"] = lib
    cpu = cpu_description()
    print(f"cpu: {cpu['model']}, flags {' '.join(cpu['flags'])}, {cpu['threads']} threads")
    g = torch.Generator().manual_seed(0)
    shapes = ((3072, 576), (576, 1536), (960, 576))  # gate/up, down, q/k/v
    ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in shapes]
    packed = [amx.pack(w) for w in ws]
    dnn = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), pl._HINT) for w in ws]
    for M in (1, 2, 4, 8, 9, 16, 64, 256):
        xs = [torch.randn(M, w.shape[1], generator=g).to(torch.bfloat16) for w in ws]
        reps = max(5, 400 // M)
        vec = _ms(lambda xs: [amx.linear(x, p) for x, p in zip(xs, packed)], xs, reps)
        one = _ms(lambda xs: [torch.ops.mkldnn._linear_pointwise(x, d, None, "none", [], "")
                              for x, d in zip(xs, dnn)], xs, reps)
        print(f"{M:4d} rows: vector build {vec:.3f} ms, oneDNN {one:.3f} ms ({one / vec:.2f}x)")


if __name__ == "__main__":
    main()
