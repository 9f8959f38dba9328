"""Self-distillation throughput on CPU: response tokens/s of distill's in-process generator (the
serving engine at K=0 fed from a queue, ``decode/generator.py``) at several batch sizes, and of
the HTTP path (`fastmtp serve --engine reference` + `fastmtp distill --url`), side by side in one
process, same prompts, same sampling (T=0.6, top-p 0.95, top-k 20).

    python bench/distill_throughput.py --out bench/results/distill_throughput \\
        --batches 1,16,32,64 --http-batch 16 --max-new-tokens 256

Each configuration first runs an untimed warm-up (a few prompts), then generates for
``prompts_per_slot x batch`` requests (at least ``--min-prompts``) of the shipped training set, so
every batch size is measured with its batch full for most of the run; ``--samples N`` makes
those N seeded samples of each prompt (as distill's ``--n``: copies admitted together share a
prefill). ``--rounds R`` repeats every in-process configuration R times, in an order rotated
each round, and reports the median. Tokens/s counts every generated token (kept or not) over
the wall time of the run. Nothing else should run meanwhile (docs/design.md section 6); the
script records the load average before and after and the CPU.

``--engines queue,capture`` adds the engine keeping what the feature cache stores (states and
top-32 log-probabilities, decode/capture.py: ``distill --target --with-features``), beside the
plain one: the cost of features kept in the same pass (the sink's disk writes are not counted).

The slot-batcher rows of bench/results/distill_throughput/ measured the retired second batcher
(``decode/batch_gen.py``, removed after commit 7e8d130, with its ``--engines slots`` arm: check
that commit out to run it again).
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
# --engines: the in-process generators, by the name their rows carry
ENGINES = {"queue": "engine at K=0 (decode/generator.py)",
           "capture": "engine at K=0 keeping features (top-32)"}


def prompts(tokenizer, n: int) -> list[list[int]]:
    from fastmtp_sglang.core.prompts import render_chat

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][:n]
    return [tokenizer(render_chat(tokenizer, r["prompt"]), add_special_tokens=False).input_ids for r in rows]


def run_local(target, ids: list[list[int]], batch: int, max_new: int, engine: str,
              samples: int = 1) -> dict:
    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.decode.generator import GenRequest, QueueGenerator
    from fastmtp_sglang.decode.sampling import SamplingParams

    eng = ReferenceEngine(target, None, 0)

    def go(sub):
        w = QueueGenerator(eng, batch).worker()
        t0 = time.perf_counter()
        futs = [w.submit(GenRequest(x, SamplingParams(temperature=0.6, top_p=0.95, top_k=20,
                                                      max_new_tokens=max_new, seed=i),
                                    **({"features": 32} if engine == "capture" else {})))
                for i, x in enumerate(sub)]
        w.close()
        w.run()  # on this (the main) thread: see GenWorker
        toks = sum(len(f.result().output_ids) for f in futs)
        return toks, time.perf_counter() - t0

    reqs = [x for x in ids for _ in range(samples)]
    go(reqs[: min(len(reqs), max(2, batch // 4))])  # warm-up: shapes, allocator, threads
    toks, secs = go(reqs)
    name = ENGINES[engine]
    return {"engine": f"{name}, batch {batch}" + (f", {samples} samples a prompt" if samples > 1 else ""),
            "generator": engine, "batch": batch, "samples": samples, "prompts": len(reqs),
            "tokens": toks, "seconds": round(secs, 1), "tokens_per_s": round(toks / secs, 1)}


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
    ap.add_argument("--engines", default="queue",
                    help="in-process generators, comma-separated: queue (the engine) and "
                         "capture (the engine keeping features)")
    ap.add_argument("--samples", type=int, default=1, help="seeded samples of each prompt")
    ap.add_argument("--rounds", type=int, default=1, help="repeats of every in-process configuration")
    args = ap.parse_args()
    unknown = sorted(set(args.engines.split(",")) - set(ENGINES))
    if unknown:
        ap.error(f"--engines {args.engines}: unknown {', '.join(unknown)}; choose from "
                 f"{', '.join(ENGINES)} (the slot batcher was retired, see the docstring)")

    import statistics

    import torch

    from fastmtp_sglang.core.hardware import cpu_summary
    from fastmtp_sglang.core.target import load_target

    if args.target is None:
        from fastmtp_sglang.core.demo_target import default_cache_dir, materialize_smollm2

        args.target = str(materialize_smollm2(default_cache_dir(), progress=False))
    target = load_target(args.target, dtype=args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    configs = [(e, int(b)) for b in args.batches.split(",") for e in args.engines.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for e, b in (order if r % 2 == 0 else order[::-1]):
            n = max(args.min_prompts, args.prompts_per_slot * b // args.samples)
            runs[(e, b)].append(run_local(target, prompts(target.tokenizer, n), b,
                                          args.max_new_tokens, e, args.samples))
            print(runs[(e, b)][-1], flush=True)
    rows = []
    for c in configs:
        med = sorted(runs[c], key=lambda x: x["tokens_per_s"])[len(runs[c]) // 2]
        rows.append(dict(med, rounds=[x["tokens_per_s"] for x in runs[c]],
                         median_tokens_per_s=statistics.median(x["tokens_per_s"] for x in runs[c])))
    if args.http_batch:
        import tempfile

        n = max(args.min_prompts, args.prompts_per_slot * args.http_batch)
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(run_http(args.target, n, args.http_batch, args.max_new_tokens, args.dtype, Path(tmp)))
        print(rows[-1], flush=True)
    base = next((r["tokens_per_s"] for r in rows if r["batch"] == 1 and r.get("generator") == "queue"), None)
    meta = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "target": args.target, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "sampling": "T=0.6, top-p 0.95, top-k 20, one seed per prompt",
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "cpu": cpu_summary(),
            "rounds": args.rounds, "samples": args.samples,
            "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Self-distillation throughput (CPU)", "", f"Command: `{meta['command']}`", "",
             f"Target `{Path(args.target).name}` in {args.dtype}, {meta['cpus']} CPUs, "
             f"{meta['threads']} torch threads; {meta['sampling']}; up to {args.max_new_tokens} "
             f"new tokens; load average {load_before[0]:.2f} before, "
             f"{meta['load_avg_after'][0]:.2f} after. CPU: {meta['cpu']}. Median of "
             f"{args.rounds} round(s), configurations rotated each round.", "",
             "| generator | requests | response tokens | seconds | tokens/s (median) | each round | vs batch 1 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = f"{r['tokens_per_s'] / base:.1f}x" if base else "-"
        each = ", ".join(str(x) for x in r.get("rounds", [r["tokens_per_s"]]))
        lines.append(f"| {r['engine']} | {r['prompts']} | {r['tokens']} | {r['seconds']} | "
                     f"{r['tokens_per_s']} | {each} | {rel} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
