"""The demo target's 120 projections of one decode step (30 layers x q/k/v, o, gate/up, down;
212 MB of bf16 weights, more than the CPU's caches keep warm between steps) at 1..512 rows:
oneDNN on prepared weights (cpu_kernels/packed_linear.py before AMX tiles) against the AMX kernel
of cpu_kernels/amx.py, interleaved, medians; with the read bandwidth measured in the same run.
Random weights of the demo target's shapes (the time does not depend on the values). Run it on
an idle machine.

    python bench/probes/cpu_kernels_probe.py --out bench/results/cpu_kernels_probe
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.decode.costs import cpu_description, read_bandwidth

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30   # SmolLM2-135M, fused q/k/v, gate/up


def _median_s(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="rows per product")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not amx.available():
        print(f"the AMX kernel is unavailable here: {amx.unavailable_reason()}")
        return 2
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g).to(torch.bfloat16) for o, i in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    tiles = [amx.pack(w) for w in ws]
    mb = sum(w.numel() * 2 for w in ws) / 1e6
    rows = {}
    for M in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(M, i, generator=g).to(torch.bfloat16) for i in (576, 1536)}

        def run_onednn():
            for (_, i), w in zip(SHAPES, onednn):
                torch.ops.mkldnn._linear_pointwise(xs[i], w, None, "none", [], "")

        def run_amx():
            for (_, i), w in zip(SHAPES, tiles):
                amx.linear(xs[i], w)

        best = {"onednn": [], "amx": []}
        for _ in range(2):  # interleaved: drift hits both
            best["onednn"].append(_median_s(run_onednn, args.repeats))
            best["amx"].append(_median_s(run_amx, args.repeats))
        rows[M] = {k: min(v) * 1e3 for k, v in best.items()}
        print(f"{M:4d} rows: oneDNN {rows[M]['onednn']:6.1f} ms ({mb / rows[M]['onednn']:5.1f} GB/s)  "
              f"AMX tiles {rows[M]['amx']:6.1f} ms ({mb / rows[M]['amx']:5.1f} GB/s)")
    bw = read_bandwidth() / 1e9
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    res = {"command": cmd, "cpu": cpu_description(), "weights_mb": mb, "read_bandwidth_gbs": bw,
           "floor_ms": mb / bw, "ms": rows}
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    cpu = res["cpu"]
    md = [f"# 120 projections of a decode step: oneDNN vs AMX tiles\n\n`{cmd}`\n",
          f"CPU: {cpu['model']} ({', '.join(cpu['flags'])}), {cpu['threads']} threads; "
          f"{mb:.0f} MB of bf16 weights; read bandwidth {bw:.1f} GB/s (floor {mb / bw:.1f} ms)\n",
          "| rows | oneDNN ms | AMX tiles ms | speedup |", "|---|---|---|---|"]
    md += [f"| {M} | {r['onednn']:.1f} | {r['amx']:.1f} | {r['onednn'] / r['amx']:.2f}x |" for M, r in rows.items()]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}/results.json, results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
