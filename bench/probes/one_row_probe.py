"""Whether one row's bf16 products read memory faster on AVX-512 dot products or on AMX tiles,
and whether tiles read faster with several column blocks' chains at once (cpu_kernels/amx.c):
the en-16384 table's argmax at one row right after 320 MB were read (a target step's sweep of
the caches) as amx.c runs it (vector units), on tiles with one or three column blocks' chains at
once, with or without software prefetch, and ``torch.sum`` over the same bytes; the demo target's
121 products of a step at 1, 2, 4, 8 and 16 rows as amx.c runs them (three-chain tiles at every
row count; when the committed results were taken, vector units at one row), on tiles with one
chain (amx.c before 2026-12-06) and with three, and on vector units at 2-8 rows; the table's
products at 1-16 rows on tiles with one and three chains, in the caches and right after the
sweep; and which order of fp32 sums reproduces TDPBF16PS (none of five tried). Every arm is a bare ctypes call (amx.py's wrappers cost 10-50 us right after the
sweep: a probe that timed amx.c through them and the others bare favoured the others). Random
weights of the demo shapes, medians. Nothing else should run meanwhile; AMX CPUs only. Huge
pages: rerun with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch then advises them for its allocations).

    python bench/probes/one_row_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.cpu_kernels.loader import load_for_cpu
from fastmtp_sglang.decode.costs import cpu_description

SOURCE = Path(__file__).with_name("one_row_probe.c")
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # a step's products


def _ms(fn, n: int, sweep=None) -> float:
    ts = []
    for i in range(n + 5):
        if sweep is not None:
            sweep()
        t = time.perf_counter()
        fn()
        if i >= 5:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here too")
    args = ap.parse_args()
    if not amx.available():
        raise SystemExit(f"needs the AMX kernels: {amx.unavailable_reason()}")
    lib, why = load_for_cpu(SOURCE, "one_row_probe", amx.NEEDS)
    if lib is None or lib.probe_init() != 0:
        raise SystemExit(f"the probe's kernels: {why or 'the OS refused AMX tile data'}")
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.probe_tiles_argmax.argtypes = [P, P, I, I, P, I, I, L]
    lib.probe_tiles_linear.argtypes, lib.probe_tiles_linear.restype = [P, P, P, I, I, I, I, I], None
    for m in (2, 4, 8):
        fn = getattr(lib, f"probe_vector_linear{m}")
        fn.argtypes, fn.restype = [P, P, P, I, I, I], None
    lib.probe_rounding.argtypes, lib.probe_rounding.restype = [I, P], None
    T = torch.get_num_threads()
    torch.manual_seed(0)
    big = torch.randn(80_000_000)  # 320 MB: read before each cold call
    res: dict = {"cpu": cpu_description(), "threads": T}

    table = amx.pack((torch.randn(16384, 576) * 0.05).bfloat16())
    x = torch.randn(1, 576).bfloat16()
    out = torch.empty(1, dtype=torch.int64)
    want = amx.linear_argmax(x, table)
    ck = amx.library()  # bare calls: amx.py's wrappers cost 10-50 us right after the sweep
    arms = {"amx.c now (vector units at one row)": lambda: ck.fastmtp_linear_argmax_bf16_amx(
                x.data_ptr(), table.data.data_ptr(), 1, table.n, table.k, out.data_ptr(), T, None),
            "sum of the same bytes": lambda: table.data.view(torch.float32).sum()}
    for G, pd in ((1, 0), (3, 0), (1, 2048), (1, 8192), (3, 8192)):
        def f(G=G, pd=pd):
            lib.probe_tiles_argmax(x.data_ptr(), table.data.data_ptr(), table.n, table.k, out.data_ptr(), T, G, pd)
        f()
        assert torch.equal(out, want), (G, pd)   # the same pick (ties aside, the same sums' order)
        arms[f"tiles, {G} block chain(s), prefetch {pd} B"] = f
    res["table_argmax_cold_ms"] = {k: round(_ms(f, 60, big.sum), 3) for k, f in arms.items()}
    res["table_argmax_hot_ms"] = {k: round(_ms(f, 200), 3) for k, f in arms.items()}

    ws = [amx.pack((torch.randn(n, k) * 0.05).bfloat16()) for n, k in SHAPES]
    steps = {}
    for M in (1, 2, 4, 8, 16):
        xs = {k: torch.randn(M, k).bfloat16() for k in (576, 1536)}
        ys = [torch.empty(M, w.n, dtype=torch.bfloat16) for w in ws]
        arms = {"amx.c now": lambda: [ck.fastmtp_linear_bf16_amx(
            xs[w.k].data_ptr(), w.data.data_ptr(), None, y.data_ptr(), M, w.n, w.k, T) for w, y in zip(ws, ys)]}
        for G in (1, 3):
            arms[f"tiles, {G} block chain(s)"] = lambda G=G: [lib.probe_tiles_linear(
                xs[w.k].data_ptr(), w.data.data_ptr(), y.data_ptr(), M, w.n, w.k, T, G) for w, y in zip(ws, ys)]
            arms[f"tiles, {G} block chain(s)"]()
            # the same bits as amx.c whatever G
            assert all(torch.equal(y, amx.linear_rows(xs[w.k], w, None)) for w, y in zip(ws, ys)), G
        if 1 < M <= 8:
            arms["vector units"] = lambda fn=getattr(lib, f"probe_vector_linear{M}"): [
                fn(xs[w.k].data_ptr(), w.data.data_ptr(), y.data_ptr(), w.n, w.k, T) for w, y in zip(ws, ys)]
        ts = {k: [] for k in arms}
        for _ in range(3):  # alternated
            for k, f in arms.items():
                ts[k].append(_ms(f, 20))
        steps[M] = {k: round(statistics.median(v), 2) for k, v in ts.items()}
    res["products_of_a_step_ms"] = steps

    # where the three chains lose: a weight already in the caches (a draft's later steps)
    tab = {}
    for M in (1, 2, 4, 8, 16):
        xm, ym = torch.randn(M, 576).bfloat16(), torch.empty(M, table.n, dtype=torch.bfloat16)
        tab[M] = {}
        for G in (1, 3):
            def f(G=G):
                lib.probe_tiles_linear(xm.data_ptr(), table.data.data_ptr(), ym.data_ptr(), M, table.n, table.k, T, G)
            tab[M][f"tiles, {G} block chain(s): hot / cold"] = [round(_ms(f, 100) * 1e3), round(_ms(f, 30, big.sum) * 1e3)]
    res["table_products_us"] = tab

    bad = (ctypes.c_long * 6)()
    lib.probe_rounding(2000, bad)
    res["rounding_mismatches_of_32000"] = dict(zip(
        ["fma even then odd", "fma odd then even", "tile exact, one rounding into the sum",
         "tile exact and rounded, then added", "pair exact, one rounding", "VDPBF16PS"], list(bad)))
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
