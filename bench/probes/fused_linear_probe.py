"""Would fusing the target's small projections pay on this CPU? Times q/k/v as three matmuls
against one fused matmul, and gate/up as two against one, at the demo target's shapes
(SmolLM2-135M: hidden 576, 9 query and 3 key/value heads of 64, intermediate 1536), for the row
counts a cycle uses (1 = plain step, K+1 = verify, 16 x (K+1) = a batch of 16). Run it on an
idle machine:

    python bench/probes/fused_linear_probe.py --out bench/results/fused_linear_probe

Each variant's median over ``--repeats`` calls, interleaved and rotated (decode/costs.py: interleaved_ms), with
the CPU's model and flags; the weights' bytes / the median = the bandwidth the kernel reached.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fastmtp_sglang.decode.costs import cpu_description, interleaved_ms

H, Q, KV, I = 576, 576, 192, 1536


def _probe(rows: int, dtype: torch.dtype, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, H, generator=g).to(dtype)
    wq, wk, wv = (torch.randn(n, H, generator=g).to(dtype) for n in (Q, KV, KV))
    wg, wu = (torch.randn(I, H, generator=g).to(dtype) for _ in range(2))
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    calls = {
        "qkv_separate": lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)),
        "qkv_fused": lambda: F.linear(x, wqkv).split([Q, KV, KV], -1),
        "gate_up_separate": lambda: (F.linear(x, wg), F.linear(x, wu)),
        "gate_up_fused": lambda: F.linear(x, wgu).chunk(2, -1),
    }
    med = {k: statistics.median(v) for k, v in interleaved_ms(calls, repeats, warmup=5).items()}
    nbytes = {"qkv": wqkv.numel() * wqkv.element_size(), "gate_up": wgu.numel() * wgu.element_size()}
    return {"rows": rows, "ms": med,
            "gbps": {k: nbytes[k.rsplit("_", 1)[0]] / (v / 1e3) / 1e9 for k, v in med.items()},
            "fused_speedup": {"qkv": med["qkv_separate"] / med["qkv_fused"],
                              "gate_up": med["gate_up_separate"] / med["gate_up_fused"]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,64", help="rows per matmul (default 1,4,8,16,64)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="default bfloat16,float32")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per variant (default 200)")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    res = {d: [_probe(int(r), getattr(torch, d), args.repeats) for r in args.rows.split(",")]
           for d in args.dtypes.split(",")}
    meta = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "cpu": cpu_description(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    lines = ["# Fused projections: one matmul instead of three (q/k/v) or two (gate/up)", "",
             f"`{meta['command']}`; CPU {meta['cpu']['model']} ({', '.join(meta['cpu']['flags'])}), "
             f"{meta['threads']} threads, torch {meta['torch']}", "",
             "| dtype | rows | q/k/v separate ms | fused ms | speedup | gate/up separate ms | fused ms | speedup | fused GB/s (qkv / gate-up) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d, rows in res.items():
        for r in rows:
            m, s, b = r["ms"], r["fused_speedup"], r["gbps"]
            lines.append(f"| {d} | {r['rows']} | {m['qkv_separate']:.3f} | {m['qkv_fused']:.3f} | "
                         f"{s['qkv']:.2f}x | {m['gate_up_separate']:.3f} | {m['gate_up_fused']:.3f} | "
                         f"{s['gate_up']:.2f}x | {b['qkv_fused']:.0f} / {b['gate_up_fused']:.0f} |")
    (out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
