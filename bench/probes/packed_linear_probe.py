"""Does a weight laid out once for oneDNN pay on this CPU? Times ``F.linear`` against the prepared
forward of cpu_kernels/packed_linear.py at the demo target's projection shapes (SmolLM2-135M: q/k/v,
o, gate, up, down, lm_head) for the row counts a cycle uses, and checks the outputs are
bit-identical. fp32 rows time MKL's packed sgemm for comparison (the engine does not use it).
Run it on an idle machine:

    python bench/probes/packed_linear_probe.py --out bench/results/packed_linear_probe

Each variant's median over ``--repeats`` calls, interleaved and rotated (decode/costs.py: interleaved_ms), with
the CPU's model and flags; the weight's bytes / the median = the bandwidth the kernel reached.
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

from fastmtp_sglang.cpu_kernels.packed_linear import _HINT, available
from fastmtp_sglang.decode.costs import cpu_description, interleaved_ms

H = 576
SHAPES = {"q": (576, H), "k/v": (192, H), "o": (576, 576), "gate/up": (1536, H), "down": (576, 1536),
          "lm_head": (49152, H)}


def probe(name: str, rows: int, dtype: torch.dtype, repeats: int) -> dict:
    out_f, in_f = SHAPES[name]
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    if dtype == torch.bfloat16:
        wp = torch.ops.mkldnn._reorder_linear_weight(w, _HINT)
        packed = lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")  # noqa: E731
        label = "onednn_prepared"
    else:
        wp = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        packed = lambda: torch.ops.mkl._mkl_linear(x, wp, w, None, rows)  # noqa: E731
        label = "mkl_packed_exact_rows"
    reps = max(repeats // 10, 10) if name == "lm_head" else repeats
    med = {k: statistics.median(v) for k, v in
           interleaved_ms({"f_linear": lambda: F.linear(x, w), label: packed}, reps).items()}
    nbytes = w.numel() * w.element_size()
    diff = (F.linear(x, w).float() - packed().float()).abs().max().item()
    return {"shape": name, "rows": rows, "dtype": str(dtype).replace("torch.", ""), "ms": med,
            "gbps": {k: nbytes / (v / 1e3) / 1e9 for k, v in med.items()},
            "speedup": med["f_linear"] / med[label], "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16", help="rows per call (default 1,2,4,8,16)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not available():
        print("this torch build has no oneDNN linear ops", file=sys.stderr)
        return 1
    res = []
    for dtype in args.dtypes.split(","):
        for name in SHAPES:
            for rows in (int(r) for r in args.rows.split(",")):
                r = probe(name, rows, getattr(torch, dtype), args.repeats)
                res.append(r)
                print(f"{r['dtype']:8s} {name:8s} rows {rows:2d}: " + "  ".join(
                    f"{k} {v:.3f} ms" for k, v in r["ms"].items()) + f"  {r['speedup']:.2f}x  "
                    f"max |diff| {r['max_abs_diff']:.1e}", flush=True)
    cpu = cpu_description()
    meta = {"command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
            "cpu": cpu, "torch": torch.__version__, "hint": _HINT}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    md = ["# Linear layers on prepared oneDNN weights vs F.linear", "",
          f"`{meta['command']}`; CPU {cpu['model']} ({', '.join(cpu['flags'])}), {cpu['threads']} threads, "
          f"torch {torch.__version__}", "",
          "bf16: the engine's path (cpu_kernels/packed_linear.py). fp32: MKL's packed sgemm at the exact row "
          "count it was packed for (not used: not bit-identical).", "",
          "| dtype | shape | rows | F.linear ms | prepared ms | speedup | GB/s (F / prepared) | max abs diff |",
          "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in res:
        (a, b), (ga, gb) = r["ms"].values(), r["gbps"].values()
        md.append(f"| {r['dtype']} | {r['shape']} | {r['rows']} | {a:.3f} | {b:.3f} | {r['speedup']:.2f}x | "
                  f"{ga:.0f} / {gb:.0f} | {r['max_abs_diff']:.1e} |")
    (out / "results.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}/results.json, results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
