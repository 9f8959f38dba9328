"""Compressed draft head: Triton kernel vs torch reference vs the full-vocabulary matmul (GPU).

    python bench/kernel_bench.py                      # H=4096, V=151936, S=16384/32768, B=1..64
    python bench/kernel_bench.py --smoke              # tiny sizes on CPU under TRITON_INTERPRET=1

For every table size S and batch size B, each provider computes the same thing, the top-1 draft
token and its log-probability:

- ``triton``: ``compressed_head_triton`` (gathered rows of the [V, H] head, fused argmax + LSE);
- ``triton-pregathered``: the same kernel reading ``weight[tables]`` gathered once ([L, S, H]);
- ``torch``: ``compressed_head_torch`` on CUDA (sync-free: every row against every table);
- ``full``: ``hidden @ weight.T`` over the whole vocabulary, then argmax and log_softmax.

The draft step is memory-bound: the time floor is reading the head rows once. "GB/s" is the
ideal traffic (the head rows a provider must read: the tables the batch uses for the compressed
providers, all V rows for ``full``, plus the hidden states) divided by the median time, and
"% peak" compares it with the device's memory bandwidth (H200: 4.8 TB/s; ``--peak-tbps``
overrides). Times are medians over ``--repeats`` runs of ``--iters`` calls, timed with CUDA
events, each call replayed from a CUDA graph as SGLang's decode does (``--no-graph``: eager,
which adds Python launch overhead). Results go to ``bench/results/kernel/`` as JSON and Markdown.
Without CUDA (and without ``--smoke``) it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Peak HBM bandwidth, bytes/s, by device-name fragment (vendor datasheets; first match wins).
PEAK_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("A10G", 0.6e12),
    ("A10", 0.6e12),
    ("L4", 0.3e12),
    ("RTX 4090", 1.008e12),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096, help="hidden size H (default 4096)")
    p.add_argument("--vocab", type=int, default=151936, help="full vocabulary V, rows of the head (default 151936, Qwen2)")
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768], help="table sizes S to sweep")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="batch sizes B to sweep")
    p.add_argument("--tables", type=int, default=2, help="tables L in the set (the others are half as long; default 2)")
    p.add_argument("--mix", choices=["same", "alternate"], default="same",
                   help="rows' tables: all on table 0 (a one-language batch), or alternating over the L tables")
    p.add_argument("--extra", type=int, default=0, help="extra ids per row (the prompt-token option; 0 = none)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--providers", nargs="+", default=["triton", "triton-pregathered", "torch", "full"],
                   choices=["triton", "triton-pregathered", "torch", "full"])
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    p.add_argument("--iters", type=int, default=20, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported")
    p.add_argument("--no-graph", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--peak-tbps", type=float, default=None, help="device peak memory bandwidth in TB/s (default: by name)")
    p.add_argument("--out", default=None, help="output folder (default bench/results/kernel; --smoke: a temp folder)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check under TRITON_INTERPRET=1 at a tiny size (H=64, V=1000, S=128/256, B=1,3)")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.vocab, args.sizes, args.batch = 64, 1000, [128, 256], [1, 3]
        args.warmup, args.iters, args.repeats, args.no_graph = 1, 1, 3, True
        if args.extra == 0:
            args.extra = 8
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        # must precede the first import of triton (it decides at decoration time)
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("kernel_bench: skipped: no CUDA device here. Run it on a GPU machine, or with --smoke for a "
              "CPU check of the script under TRITON_INTERPRET=1.")
        return 0
    import triton

    from fastmtp_sglang.kernels import compressed_head as ch

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    H, V = args.hidden, args.vocab
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(V, H, generator=gen) * H**-0.5).to(device=device, dtype=dtype)

    if args.smoke:
        dev_name, peak = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter", None
    else:
        dev_name = torch.cuda.get_device_name(device)
        peak = args.peak_tbps * 1e12 if args.peak_tbps else next((bw for k, bw in PEAK_BANDWIDTH if k in dev_name), None)

    def timer(fn) -> tuple[float, str]:
        """Median microseconds per call, and how it was timed."""
        if args.smoke:
            fn()
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(runs), "perf_counter, interpreter"
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        call, how = fn, "eager"
        if not args.no_graph:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                call, how = graph.replay, "cuda graph"
            except Exception as exc:  # noqa: BLE001 - report and fall back to eager timing
                how = f"eager (graph capture failed: {type(exc).__name__}: {exc})"
                torch.cuda.synchronize()
        runs = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                call()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end) * 1e3 / args.iters)
        return statistics.median(runs), how

    rows, checks = [], []
    for S in args.sizes:
        L = args.tables
        lens = [S] + [max(1, S // 2)] * (L - 1)
        tables = torch.full((L, S), -1, dtype=torch.int64)
        for l, n in enumerate(lens):
            tables[l, :n] = torch.randperm(V, generator=gen)[:n]
        tables = tables.to(device)
        table_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        table_weight = weight[tables.clamp(0, V - 1)].contiguous() if "triton-pregathered" in args.providers else None
        for B in args.batch:
            hidden = torch.randn(B, H, generator=gen).to(device=device, dtype=dtype)
            if args.mix == "same":
                table_idx = torch.zeros(B, dtype=torch.int64, device=device)
            else:
                table_idx = (torch.arange(B) % L).to(device)
            extra = None
            if args.extra:
                extra = torch.randint(0, V, (B, args.extra), generator=gen).to(device)
            used = sorted(set(table_idx.tolist()))
            rows_read = sum(lens[l] for l in used) + (B * args.extra)
            ideal_compressed = rows_read * H * elt + B * H * elt
            ideal_full = V * H * elt + B * H * elt

            def full():
                logits = (hidden @ weight.T).float()
                top = logits.argmax(dim=1)
                return top, torch.log_softmax(logits, dim=1).gather(1, top[:, None]).squeeze(1)

            providers = {
                "triton": lambda: ch.compressed_head_triton(hidden, weight, tables, table_lens, table_idx, extra),
                "triton-pregathered": lambda: ch.compressed_head_triton(
                    hidden, weight, tables, table_lens, table_idx, extra, table_weight=table_weight),
                "torch": lambda: ch.compressed_head_torch(hidden, weight, tables, table_lens, table_idx, extra),
                "full": full,
            }
            # correctness first: kernel vs reference on the same inputs
            ref = ch.compressed_head_torch(hidden.float(), weight.float(), tables, table_lens, table_idx, extra)
            for name in ("triton", "triton-pregathered"):
                if name in args.providers:
                    got = providers[name]()
                    checks.append({
                        "S": S, "B": B, "provider": name,
                        "top_id_agreement": (got[0] == ref[0]).double().mean().item(),
                        "max_abs_logprob_diff": (got[1] - ref[1]).abs().max().item(),
                    })
            results = {}
            for name in args.providers:
                us, how = timer(providers[name])
                results[name] = us
                ideal = ideal_full if name == "full" else ideal_compressed
                gbps = ideal / (us * 1e-6) / 1e9
                rows.append({
                    "S": S, "B": B, "provider": name, "median_us": round(us, 2), "ideal_bytes": ideal,
                    "GBps": round(gbps, 1), "pct_peak": round(100 * gbps * 1e9 / peak, 1) if peak else None,
                    "timing": how,
                })
            for r in rows[-len(args.providers):]:
                if "full" in results:
                    r["speedup_vs_full"] = round(results["full"] / r["median_us"], 2)
            print(f"S={S:6d} B={B:3d} " + "  ".join(f"{k}={v:9.1f}us" for k, v in results.items()), flush=True)

    env = {
        "device": dev_name,
        "peak_bytes_per_s": peak,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "command": "python bench/kernel_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="kernel_bench_smoke_")) if args.smoke
                                           else Path(__file__).resolve().parent / "results" / "kernel")
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_bench.json").write_text(json.dumps({"env": env, "rows": rows, "checks": checks}, indent=1) + "\n")
    (out / "kernel_bench.md").write_text(markdown(env, rows, checks))
    print(f"wrote {out / 'kernel_bench.json'} and {out / 'kernel_bench.md'}")
    bad = [c for c in checks if c["top_id_agreement"] < 0.99 or c["max_abs_logprob_diff"] > 1e-2]
    if bad:
        print(f"kernel_bench: MISMATCH between kernel and reference: {bad[:3]}", file=sys.stderr)
        return 1
    return 0


def markdown(env: dict, rows: list[dict], checks: list[dict]) -> str:
    cfg = env["config"]
    peak = env["peak_bytes_per_s"]
    lines = [
        "# Compressed draft head: kernel benchmark",
        "",
        f"Device: {env['device']}" + (f", peak {peak / 1e12:.2f} TB/s" if peak else "") +
        f"; torch {env['torch']}, triton {env['triton']}.",
        f"H={cfg['hidden']}, V={cfg['vocab']}, dtype {cfg['dtype']}, L={cfg['tables']} tables (mix: {cfg['mix']}), "
        f"extra ids per row: {cfg['extra']}; median of {cfg['repeats']} runs x {cfg['iters']} calls.",
        "",
        f"Command: `{env['command']}`",
        "",
        "| S | B | provider | median us | GB/s (ideal bytes) | % peak | speedup vs full | timing |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['S']} | {r['B']} | {r['provider']} | {r['median_us']:.1f} | {r['GBps']:.1f} | "
            f"{r['pct_peak'] if r['pct_peak'] is not None else '-'} | {r.get('speedup_vs_full', '-')} | {r['timing']} |"
        )
    if checks:
        worst = min(c["top_id_agreement"] for c in checks)
        diff = max(c["max_abs_logprob_diff"] for c in checks)
        lines += ["", f"Kernel vs torch reference (fp32): top-1 agreement >= {worst:.4f}, max |logprob diff| {diff:.2e}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
