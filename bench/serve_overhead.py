"""Does a served request decode as fast as the same request in-process? Three ways to run the
same greedy requests one at a time, interleaved per prompt and repeat:

- ``in-process``: ReferenceEngine.generate in this process (the baseline);
- ``fastmtp serve``: the CLI server in its own process, engine loop on its main thread;
- ``worker thread``: ReferenceServer.start() in a process of its own, the engine loop on a
  worker thread (what the server did before continuous batching moved it to the main thread).

Each way runs in a process where only one thread uses PyTorch: a process in which two threads
both ran OpenMP regions was measured 15-18% slower for either of them (each team's idle threads
spin while the other team works, on 2 cores).

Decode tokens/s is the engine's own (meta_info decode_tokens_per_s: decode time only, the same
clock as in-process), so HTTP and tokenization are not in it; end-to-end tokens/s is reported
beside it. Run it on an idle machine.

    python bench/serve_overhead.py --out bench/results/serve_overhead          # demo target, shipped head
    python bench/serve_overhead.py --target T --draft D --steps 3 --dtype float32 --out R/

Writes R/results.json and R/results.md (with the CPU's model and flags).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fastmtp_sglang.cli.demo import shipped_head
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.prompts import load_prompt_ids
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.decode.costs import cpu_description
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.serving import client
from fastmtp_sglang.vocab.draft_vocab import resolve_vocab

REPO = Path(__file__).resolve().parents[1]


# the worker-thread server in a process of its own: argv target, draft, steps, dtype
THREADED = """
import sys, time
from fastmtp_sglang.serving.reference import load_reference_server
t, d, k, dt = sys.argv[1:5]
srv = load_reference_server(t, d, int(k), host="127.0.0.1", port=0, dtype=dt)
srv.start()
print("listening on", srv.url, flush=True)
time.sleep(10 ** 6)
"""


def _start(cmd: list[str], log: Path, procs: list) -> str:
    """Start a server process, return its URL once it answers /health."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    procs.append(proc)
    while True:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            client.wait_for_health(m.group(1), timeout=120, process=proc)
            return m.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[:4]} did not start:\n{log.read_text()}")
        time.sleep(0.2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--draft", default=None, help="default: the shipped head")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", default=str(REPO / "bench/data/spec_bench.jsonl"))
    p.add_argument("--limit-per-category", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.target is None:
        from fastmtp_sglang.core.demo_target import materialize_smollm2

        a.target = str(materialize_smollm2())
    a.draft = a.draft or str(shipped_head())
    target = load_target(a.target, dtype=a.dtype)
    dtype = str(target.model.dtype).replace("torch.", "")
    head = load_head(a.draft, target.embed, target.lm_head, dtype=target.model.dtype)
    vocab = resolve_vocab(None, target.tokenizer, target.lm_head, "none", a.draft)
    engine = ReferenceEngine(target, head, a.steps, draft_vocab=vocab)
    prompts = [ids for *_, ids in load_prompt_ids(target.tokenizer, [a.prompts],
                                                   a.limit_per_category, None, True)]
    greedy = {"temperature": 0.0, "max_new_tokens": a.max_new_tokens}

    Path(a.out).mkdir(parents=True, exist_ok=True)
    serve = [sys.executable, "-m", "fastmtp_sglang", "serve", "--engine", "reference", "--target",
             a.target, "--draft", a.draft, "--steps", str(a.steps), "--dtype", dtype, "--port", "0"]
    threaded = [sys.executable, "-c", THREADED, a.target, a.draft, str(a.steps), dtype]
    procs = []
    try:
        url = _start(serve, Path(a.out) / "serve.log", procs)
        thread_url = _start(threaded, Path(a.out) / "threaded.log", procs)

        def in_process(ids):
            r = engine.generate([Request(list(ids), SamplingParams(**greedy))])[0]
            s = r.metrics.summary()
            return s["decode_tokens_per_s"], None, r.output_ids

        def served(u):
            def run(ids):
                t0 = time.perf_counter()
                out = client.generate(u, input_ids=list(ids), sampling_params=greedy)
                e2e = len(out["output_ids"]) / (time.perf_counter() - t0)
                return out["meta_info"]["decode_tokens_per_s"], e2e, out["output_ids"]
            return run

        ways = {"in-process": in_process, "fastmtp serve (main thread)": served(url),
                "worker thread": served(thread_url)}
        for fn in ways.values():  # warm-up: every shape once
            fn(prompts[0])
        rows = {w: [] for w in ways}
        same = {w: 0 for w in ways}
        i = 0
        for rep in range(a.repeats):
            for ids in prompts:
                names = list(ways)
                order = names[i % len(names):] + names[: i % len(names)]
                i += 1
                outs = {}
                for w in order:
                    dec, e2e, toks = ways[w](ids)
                    rows[w].append((rep, dec, e2e))
                    outs[w] = toks
                for w in ways:
                    same[w] += outs[w] == outs["in-process"]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)

    def per_repeat(w, k):
        return [statistics.mean(x[k] for x in rows[w] if x[0] == r) for r in range(a.repeats)]

    base = per_repeat("in-process", 1)
    res = {}
    for w in ways:
        dec = per_repeat(w, 1)
        ratio = [d / b for d, b in zip(dec, base)]
        res[w] = {"decode_tokens_per_s": statistics.median(dec), "decode_repeats": dec,
                  "vs_in_process": statistics.median(ratio),
                  "e2e_tokens_per_s": (statistics.median(per_repeat(w, 2)) if w != "in-process" else None),
                  "same_output_as_in_process": f"{same[w]}/{len(rows[w])}"}
    cpu = cpu_description()
    meta = {"command": "python bench/serve_overhead.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
            "cpu": cpu, "dtype": dtype, "steps": a.steps, "prompts": len(prompts),
            "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "target": a.target, "draft": a.draft}
    out = Path(a.out)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    lines = [f"# Served vs in-process decoding (K={a.steps}, {dtype})", "",
             f"- command: `{meta['command']}`",
             f"- CPU: {cpu['model']}; flags {' '.join(cpu['flags'])}; {cpu['threads']} threads",
             f"- {len(prompts)} Spec-Bench prompts x {a.max_new_tokens} new tokens, greedy, one request "
             f"at a time, {a.repeats} repeats, the three ways interleaved per prompt", "",
             "| way | decode tokens/s (engine clock) | x in-process | end-to-end tokens/s | same output |",
             "|---|---:|---:|---:|---|"]
    for w, r in res.items():
        e2e = f"{r['e2e_tokens_per_s']:.1f}" if r["e2e_tokens_per_s"] else "-"
        lines.append(f"| {w} | {r['decode_tokens_per_s']:.1f} | {r['vs_in_process']:.3f} | {e2e} | "
                     f"{r['same_output_as_in_process']} |")
    md = "\n".join(lines) + "\n"
    (out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
