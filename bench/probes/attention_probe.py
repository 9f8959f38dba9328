"""One attention call of the demo target's shape (9 query heads, 3 key/value heads, head dim 64)
over a masked slot cache, as the engine makes it: PyTorch's ``scaled_dot_product_attention``
with ``enable_gqa=True`` (what the engine called before) against the call with each key/value
head's query heads folded into its query rows (``core/attention.py: grouped_attention``, what it
calls now), and, for reference, the written-out maths (bf16 matmuls, softmax in fp32). Rows 1,
4, 16; 311 and 800 slots; 1, 2 and 4 queries per row (a plain step, verifies); fp32 and bf16.
Per-call medians, interleaved; max difference of each against the GQA call. Idle machine.

    python bench/probes/attention_probe.py --out bench/results/attention_probe
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
import torch.nn.functional as F

from fastmtp_sglang.core.attention import grouped_attention
from fastmtp_sglang.decode.costs import cpu_description

NH, NKV, D = 9, 3, 64  # SmolLM2-135M


def _median_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


def _math(q, k, v, mask, scale):
    B, _, S, _ = q.shape
    rep = NH // NKV
    qg = q.reshape(B, NKV, rep * S, D)
    m = mask.repeat(1, 1, rep, 1)
    s = (qg @ k.transpose(-1, -2)).float() * scale
    p = s.masked_fill(~m, float("-inf")).softmax(-1).to(q.dtype)
    return (p @ v).view(B, NH, S, D)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/attention_probe", help="output folder")
    ap.add_argument("--repeats", type=int, default=40, help="timed calls per variant and shape")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for B in (1, 4, 16):
            for T in (311, 800):
                for S in (1, 2, 4):
                    q = torch.randn(B, NH, S, D, dtype=dtype)
                    k, v = (torch.randn(B, NKV, T, D, dtype=dtype) for _ in range(2))
                    mask = torch.ones(B, 1, S, T, dtype=torch.bool)
                    mask[:, :, :, :T // 10] = False  # holes, as rejected slots leave
                    fns = {
                        "gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125,
                                                                      enable_gqa=True),
                        "folded": lambda: grouped_attention(q, k, v, mask, 0.125),
                        "math": lambda: _math(q, k, v, mask, 0.125),
                    }
                    ref = fns["gqa"]().float()
                    us = {n: [] for n in fns}
                    for r in range(3):  # rotate the order
                        for n in list(fns)[r:] + list(fns)[:r]:
                            us[n].append(_median_us(fns[n], args.repeats // 3))
                    row = {"dtype": str(dtype).replace("torch.", ""), "rows": B, "slots": T, "queries": S}
                    for n, f in fns.items():
                        row[f"{n}_us"] = round(statistics.median(us[n]), 1)
                        row[f"{n}_max_diff"] = float((f().float() - ref).abs().max())
                    rows.append(row)
                    print(row, flush=True)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_description()
    (out / "results.json").write_text(json.dumps({"command": cmd, "cpu": cpu, "rows": rows}, indent=1) + "\n")
    md = ["# One attention call: sdpa's GQA path vs folded query heads", "",
          f"- command: `{cmd}`", f"- CPU: {cpu['model']}; flags {' '.join(cpu['flags'])}; "
          f"{cpu['threads']} threads", "- per-call median, µs; folded = core/attention.py (what the engine runs)", "",
          "| dtype | rows | slots | queries | GQA call | folded | written-out maths | folded vs GQA |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['dtype']} | {r['rows']} | {r['slots']} | {r['queries']} | {r['gqa_us']:.0f} | "
                  f"{r['folded_us']:.0f} | {r['math_us']:.0f} | {r['gqa_us'] / r['folded_us']:.2f}x |")
    (out / "results.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}/results.json, results.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
