"""The draft projection alone on CPU: full lm_head vs the compressed head's torch path, per table.

    python bench/projection_cpu.py --target ~/.cache/fastmtp/smollm2-135m-instruct \
        --tables vocab_tables/smollm2/en-16384.pt vocab_tables/smollm2/en-8192.pt \
        --out bench/results/projection_cpu

Batch 1 and 4 (one draft step), bf16, median of --runs timings after warm-up; the full and
compressed paths alternate inside one loop so that machine noise hits both alike.
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

from fastmtp_sglang.kernels.compressed_head import compressed_head_torch
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.vocab.tables import TableSet


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--tables", nargs="+", required=True)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target = load_target(args.target, dtype="bfloat16", tokenizer=False)
    w = target.lm_head.weight.detach()
    rows = []
    for path in args.tables:
        ts = TableSet.from_paths([path])
        tw = ts.gather_weight(w)
        for b in (1, 4):
            h = torch.randn(b, w.shape[1], dtype=w.dtype)
            idx = torch.zeros(b, dtype=torch.long)
            full, comp = [], []
            with torch.inference_mode():
                for i in range(args.runs + 10):
                    t = time.perf_counter(); (h @ w.T).argmax(-1); d1 = time.perf_counter() - t
                    t = time.perf_counter()
                    compressed_head_torch(h, w, ts.tables, ts.lens, idx, table_weight=tw)
                    d2 = time.perf_counter() - t
                    if i >= 10:
                        full.append(d1); comp.append(d2)
            f, c = statistics.median(full) * 1e3, statistics.median(comp) * 1e3
            rows.append({"table": ts.names[0], "batch": b, "full_ms": f, "compressed_ms": c, "ratio": f / c})
            print(f"{ts.names[0]} B={b}: full {f:.3f} ms, compressed {c:.3f} ms, {f / c:.2f}x", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python bench/projection_cpu.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (out / "results.json").write_text(json.dumps({"command": cmd, "vocab": int(w.shape[0]),
                                                  "hidden": int(w.shape[1]), "rows": rows}, indent=1))
    lines = [f"# Draft projection on CPU (V={w.shape[0]}, H={w.shape[1]}, bf16, median of {args.runs})",
             "", f"Command: `{cmd}`", "", "| table | batch | full lm_head + argmax (ms) | compressed (ms) | cheaper |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['table']} | {r['batch']} | {r['full_ms']:.3f} | {r['compressed_ms']:.3f} | {r['ratio']:.2f}x |"
              for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
