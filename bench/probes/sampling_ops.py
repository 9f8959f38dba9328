"""What one sampled token costs beside a greedy one, op by op, at the demo target's vocabulary.

    python bench/probes/sampling_ops.py --out bench/results/sampling_cost/ops

Question: why did a plain step at temperature 1 cost 8 ms more than a greedy one (issue of
2026-12-05: 32.4 against 24.2 ms on an AMD EPYC with avx512_bf16)? Times, at V = 49,152 and 1 or
4 rows (a plain step; a K=3 verify), the median of 200 calls after 20 warm-ups, 2 threads:
argmax; ``logits_to_probs`` without a filter (T=1, top_p 1, top_k -1: now a softmax) and with
top_p 0.95 (the sort both filters need); one draw per row with ``sampling.sample`` (inverse CDF)
and with ``torch.multinomial`` (what ``sample`` was). Writes OUT/ops.json and OUT/ops.md with the
CPU's model name and flags. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fastmtp_sglang.core.hardware import cpu_summary
from fastmtp_sglang.decode.sampling import logits_to_probs, sample

V = 49152


def median_ms(fn, n: int = 200, warm: int = 20) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows_out = {}
    for rows in (1, 4):
        x = torch.randn(rows, V, generator=g) * 3
        ones, off = torch.ones(rows), torch.full((rows,), -1)
        probs = torch.softmax(x, -1)
        rows_out[rows] = {
            "argmax": median_ms(lambda: x.argmax(-1)),
            "logits_to_probs, no filter": median_ms(lambda: logits_to_probs(x, ones, ones, off)),
            "logits_to_probs, top_p 0.95 (sort)": median_ms(lambda: logits_to_probs(x, ones, ones * 0.95, off)),
            "draw: sampling.sample (inverse CDF), per row": median_ms(
                lambda: [sample(probs[i:i + 1], g) for i in range(rows)]),
            "draw: torch.multinomial, per row": median_ms(
                lambda: [torch.multinomial(probs[i:i + 1], 1, generator=g) for i in range(rows)]),
        }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_summary()
    (out / "ops.json").write_text(json.dumps({"vocab": V, "threads": a.threads, "cpu": cpu,
                                              "median_ms": rows_out}, indent=1) + "\n")
    names = list(rows_out[1])
    lines = [f"# Sampling ops at V = {V} (median of 200, ms)", "",
             f"`python bench/probes/sampling_ops.py --out {a.out}`; CPU: {cpu}", "",
             "| op | 1 row | 4 rows |", "|---|---|---|"]
    lines += [f"| {n} | {rows_out[1][n]:.3f} | {rows_out[4][n]:.3f} |" for n in names]
    (out / "ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
