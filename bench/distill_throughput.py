"""Self-distillation throughput on CPU: response tokens/s of the in-process slot generator at
several batch sizes and of the HTTP path (`fastmtp serve --engine reference` + `fastmtp distill
--url`), side by side in one process, same prompts, same sampling (T=0.6, top-p 0.95, top-k 20).

    python bench/distill_throughput.py --out bench/results/distill_throughput \\
        --batches 1,16,32,64 --http-batch 16 --max-new-tokens 256

Each configuration first runs an untimed warm-up (a few prompts), then generates for
``prompts_per_slot x batch`` prompts (at least ``--min-prompts``) of the shipped training set, so
every batch size is measured with its batch full for most of the run. Tokens/s counts every
generated token (kept or not) over the wall time of the run. Nothing else should run meanwhile
(docs/design.md section 6); the script records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "bench" / "train_prompts" / "alpaca_eval_instructions.jsonl"


def prompts(tokenizer, n: int) -> list[list[int]]:
    from fastmtp_sglang.core.prompts import render_chat

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][:n]
    return [tokenizer(render_chat(tokenizer, r["prompt"]), add_special_tokens=False).input_ids for r in rows]


def run_local(target, ids: list[list[int]], batch: int, max_new: int) -> dict:
    from fastmtp_sglang.decode.batch_gen import GenRequest, SlotGenerator
    from fastmtp_sglang.decode.sampling import SamplingParams

    def go(sub):
        w = SlotGenerator(target, batch, max(len(x) for x in sub) + max_new + 1).worker()
        t0 = time.perf_counter()
        futs = [w.submit(GenRequest(x, SamplingParams(temperature=0.6, top_p=0.95, top_k=20,
                                                      max_new_tokens=max_new, seed=i)))
                for i, x in enumerate(sub)]
        w.close()
        w.run()  # on this (the main) thread: see GenWorker
        toks = sum(len(f.result().output_ids) for f in futs)
        return toks, time.perf_counter() - t0, w.gen.steps

    go(ids[: min(len(ids), max(2, batch // 4))])  # warm-up: shapes, allocator, threads
    toks, secs, steps = go(ids)
    return {"engine": f"in-process, batch {batch}", "batch": batch, "prompts": len(ids),
            "tokens": toks, "seconds": round(secs, 1), "tokens_per_s": round(toks / secs, 1),
            "decode_steps": steps}


def run_http(target_dir: str, n: int, batch: int, max_new: int, dtype: str, tmp: Path) -> dict:
    """A real `fastmtp serve` process and `fastmtp distill --url` against it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = [sys.executable, "-m", "fastmtp_sglang"]
    srv = subprocess.Popen(exe + ["serve", "--engine", "reference", "--target", target_dir,
                                  "--steps", "0", "--port", str(port), "--max-batch", str(batch),
                                  "--dtype", dtype], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from fastmtp_sglang.serving import client

        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 180
        while True:
            try:
                client.server_info(url, timeout=2)
                break
            except Exception:  # noqa: BLE001 - still starting
                if time.time() > deadline or srv.poll() is not None:
                    raise RuntimeError("the reference server did not start")
                time.sleep(1)
        pfile = tmp / "prompts.jsonl"
        rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][:n]
        pfile.write_text("".join(json.dumps(r) + "\n" for r in rows))

        def distill(out: Path, limit: int) -> dict:
            cmd = exe + ["distill", "--url", url, "--tokenizer", target_dir, "--prompts", str(pfile),
                         "--out", str(out), "--max-new-tokens", str(max_new), "--concurrency",
                         str(batch), "--limit", str(limit), "--max-repeat-fraction", "1",
                         "--no-progress"]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            secs = time.perf_counter() - t0
            toks = sum(json.loads(x)["completion_tokens"] for x in out.read_text().splitlines())
            return {"tokens": toks, "seconds": secs}

        distill(tmp / "warm.jsonl", max(2, batch // 4))
        r = distill(tmp / "run.jsonl", n)
        return {"engine": f"HTTP: fastmtp serve (max-batch {batch}) + distill --url "
                          f"(concurrency {batch})", "batch": batch, "prompts": n,
                "tokens": r["tokens"], "seconds": round(r["seconds"], 1),
                "tokens_per_s": round(r["tokens"] / r["seconds"], 1)}
    finally:
        srv.terminate()
        srv.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="model directory (default: the demo target)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,16,32,64")
    ap.add_argument("--http-batch", type=int, default=16, help="0 = skip the HTTP path")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompts-per-slot", type=int, default=3)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    import torch

    from fastmtp_sglang.core.target import load_target

    if args.target is None:
        from fastmtp_sglang.core.demo_target import default_cache_dir, materialize_smollm2

        args.target = str(materialize_smollm2(default_cache_dir(), progress=False))
    target = load_target(args.target, dtype=args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        n = max(args.min_prompts, args.prompts_per_slot * b)
        rows.append(run_local(target, prompts(target.tokenizer, n), b, args.max_new_tokens))
        print(rows[-1], flush=True)
    if args.http_batch:
        import tempfile

        n = max(args.min_prompts, args.prompts_per_slot * args.http_batch)
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(run_http(args.target, n, args.http_batch, args.max_new_tokens, args.dtype, Path(tmp)))
        print(rows[-1], flush=True)
    base = next((r["tokens_per_s"] for r in rows if r["batch"] == 1 and "in-process" in r["engine"]), None)
    meta = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "target": args.target, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "sampling": "T=0.6, top-p 0.95, top-k 20, one seed per prompt",
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Self-distillation throughput (CPU)", "", f"Command: `{meta['command']}`", "",
             f"Target `{Path(args.target).name}` in {args.dtype}, {meta['cpus']} CPUs, "
             f"{meta['threads']} torch threads; {meta['sampling']}; up to {args.max_new_tokens} "
             f"new tokens; load average {load_before[0]:.2f} before, "
             f"{meta['load_avg_after'][0]:.2f} after.", "",
             "| engine | prompts | response tokens | seconds | tokens/s | vs batch 1 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        rel = f"{r['tokens_per_s'] / base:.1f}x" if base else "-"
        lines.append(f"| {r['engine']} | {r['prompts']} | {r['tokens']} | {r['seconds']} | "
                     f"{r['tokens_per_s']} | {rel} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
