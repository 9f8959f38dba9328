"""`fastmtp bench --concurrency 1,2,4,...`: the flags' side of fastmtp_sglang.benchmark.concurrency
(in-process reference servers, one per arm, or the servers given with --url)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.prompts import load_prompt_ids


def check_sandwich_args(args: argparse.Namespace) -> None:
    """--schedule sandwich's numbers, refused with what to give instead."""
    if getattr(args, "schedule", "levels") != "sandwich":
        return
    if args.block_requests < 1:
        raise FastMTPError(f"--block-requests must be >= 1, got {args.block_requests}")
    if not 0 < args.bound < 1:
        raise FastMTPError(f"--bound is a relative half-width in (0, 1), e.g. 0.02; got {args.bound}")
    if not 1 <= args.min_rounds <= args.max_rounds:
        raise FastMTPError(f"need 1 <= --min-rounds <= --max-rounds, got {args.min_rounds}, {args.max_rounds}")
    if args.level_budget is not None and args.level_budget <= 0:
        raise FastMTPError(f"--level-budget is seconds > 0, got {args.level_budget}")


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise FastMTPError(f"--concurrency takes comma-separated integers like 1,4,16; got {text!r}") from None
    if not levels or levels[0] < 1:
        raise FastMTPError(f"--concurrency needs levels >= 1; got {text!r}")
    return levels


def _in_process(args: argparse.Namespace, cfg, levels: list[int], progress: bool, load):
    """(runners by arm key, prompts' ids, engine description, servers to shut down, more meta)."""
    from fastmtp_sglang.benchmark.concurrency import closed_loop
    from fastmtp_sglang.benchmark.sweep import arm_key, build_engines
    from fastmtp_sglang.serving.app import ReferenceServer
    from fastmtp_sglang.serving.options import ServerOptions

    target, head, prompts, vocab = load(args, cfg)
    engines = build_engines(target, head, cfg, draft_vocab=vocab, progress=progress,
                            cost_batches=tuple(lv for lv in levels if lv > 1))
    servers, runners = [], {}
    top = max(levels)
    cycles: dict = {}  # {arm: {level: {K: [cycles, seconds, rows summed]}}}
    extra = {"cycles": cycles}
    auto = next((e.auto for e in engines.values() if e.auto is not None), None)
    if auto is not None:  # what the auto arm believes a cycle costs at each level (ms per K)
        extra["auto_cycle_ms_by_batch"] = {str(lv): [round(auto.costs.cycle_ms(k, lv), 2)
                                                     for k in range(auto.kmax + 1)] for lv in levels}
    for (drafter, k), eng in engines.items():
        srv = ReferenceServer(eng, ServerOptions(port=0, max_batch=top, max_queue=4 * top + 16))
        srv.start(engine_thread=False)  # the engine runs on this (the main) thread: drive()
        servers.append(srv)

        def runner(bodies, level, srv=srv, eng=eng, key=arm_key(drafter, k)):
            eng.cycle_stats = {}
            try:
                return srv.drive(lambda: closed_loop(srv.url, bodies, level))
            finally:  # where this arm's cycles went at this level, over all its blocks
                mine = cycles.setdefault(key, {}).setdefault(str(level), {})
                for kc, (n, sec, rows) in eng.cycle_stats.items():
                    acc = mine.setdefault(str(kc), [0, 0.0, 0])
                    acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + sec, acc[2] + rows

        runners[arm_key(drafter, k)] = runner
    dtype = str(target.model.dtype).replace("torch.", "")
    vdesc = "full vocabulary" if vocab is None else "draft vocab " + ", ".join(vocab.tables.names)
    desc = (f"reference server in-process (one per arm, continuous batching up to {top} rows, "
            f"engine on the main thread), {dtype}, {vdesc}")
    return runners, [ids for _, _, _, ids in prompts], desc, servers, extra


def _servers(args: argparse.Namespace, cfg):
    from transformers import AutoTokenizer

    from fastmtp_sglang.benchmark.concurrency import closed_loop
    from fastmtp_sglang.benchmark.sweep import servers_by_k

    if cfg.ngram_steps:
        raise FastMTPError("--ngram-steps runs prompt lookup in-process: drop --url")
    if cfg.leaf_steps:
        raise FastMTPError("--leaf-steps runs the reference engine in-process: drop --url")
    if not args.target:
        raise FastMTPError("--url needs --target (a directory with the tokenizer) for the chat template")
    urls, _ = servers_by_k(args.url)
    arms: list[int | str] = list(cfg.steps) + (["auto"] if cfg.auto_steps else [])
    missing = [k for k in arms if k not in urls]
    if missing:
        raise FastMTPError(f"no server for K={missing}: servers report K={sorted(urls, key=str)}; "
                           "start one server per K (K=0 is a server without speculation; auto: "
                           "one that picks K itself, e.g. fastmtp serve --steps auto)")
    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompt_ids(tok, args.prompts, args.limit_per_category, args.category, not args.raw)
    from fastmtp_sglang.benchmark.concurrency import closed_loop_openai
    from fastmtp_sglang.serving.client import server_info

    runners, parts = {}, []
    for k in arms:
        info = server_info(urls[k])
        if info.get("engine") == "vllm" and info.get("vllm_url"):  # our adapter: load vLLM itself
            v = info["vllm_url"]
            runners[str(k)] = lambda bodies, level, v=v: closed_loop_openai(v, bodies, level)
            parts.append(f"K={k} vLLM {v} (OpenAI API, streamed; found through {urls[k]})")
        else:
            runners[str(k)] = lambda bodies, level, u=urls[k]: closed_loop(u, bodies, level)
            parts.append(f"K={k} {urls[k]}")
    desc = "servers: " + ", ".join(parts)
    return runners, [ids for _, _, _, ids in prompts], desc, [], {}


def cycles_markdown(cycles: dict) -> str:
    """Where each in-process arm's cycles went per level: how many, at which K, their mean rows
    and ms (from ReferenceEngine.cycle_stats; empty for servers at --url)."""
    if not cycles:
        return ""
    lines = ["", "Cycles per arm and level (every block of the level; time = draft + verify + "
             "extend, joins' prefills not included):", "",
             "| concurrency | arm | cycles | at K=0 | mean rows | ms per K=0 cycle | ms per drafting cycle | "
             "share of time drafting |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for arm, by_level in cycles.items():
        for level, by_k in sorted(by_level.items(), key=lambda kv: int(kv[0])):
            n = sum(v[0] for v in by_k.values())
            if not n:
                continue
            sec = sum(v[1] for v in by_k.values())
            rows = sum(v[2] for v in by_k.values())
            z = by_k.get("0", [0, 0.0, 0])
            dn, ds = n - z[0], sec - z[1]
            zero_ms = f"{1e3 * z[1] / z[0]:.1f}" if z[0] else "-"
            draft_ms = f"{1e3 * ds / dn:.1f}" if dn else "-"
            lines.append(f"| {level} | {arm} | {n} | {z[0] / n:.0%} | {rows / n:.1f} | {zero_ms} | "
                         f"{draft_ms} | {ds / sec:.0%} |" if sec else f"| {level} | {arm} | {n} | - | - | - | - | - |")
    return "\n".join(lines) + "\n"


def run_concurrency(args: argparse.Namespace, cfg, load) -> int:
    """``load(args, cfg)`` -> (target, head, prompts, vocab): cli.bench.load_in_process."""
    from fastmtp_sglang.benchmark.concurrency import (apply_sandwich, budget_range, markdown, plot,
                                                      run_levels, run_levels_sandwiched,
                                                      summarize_levels)
    from fastmtp_sglang.decode.costs import cpu_description

    levels = parse_levels(args.concurrency)
    progress = not args.no_progress
    if args.requests_per_level is not None and args.requests_per_level < 1:
        raise FastMTPError(f"--requests-per-level must be >= 1, got {args.requests_per_level}")
    if args.per_client < 1:
        raise FastMTPError(f"--per-client must be >= 1, got {args.per_client}")
    check_sandwich_args(args)
    budget_range(args.max_new_tokens, args.length_spread)  # a bad spread fails before any load
    runners, prompts, desc, servers, extra = (_servers(args, cfg) if args.url
                                       else _in_process(args, cfg, levels, progress, load))
    per_level = args.requests_per_level or len(prompts)
    sampling = {**cfg.sampling_params(), "seed": cfg.seed}
    sandwiched = getattr(args, "schedule", "levels") == "sandwich"
    try:
        if sandwiched:
            runs, verdicts = run_levels_sandwiched(
                runners, prompts, levels, sampling, args.block_requests, per_client=args.per_client,
                bound=args.bound, min_rounds=args.min_rounds, max_rounds=args.max_rounds,
                budget_s=args.level_budget, warmup=cfg.warmup, progress=progress,
                length_spread=args.length_spread)
        else:
            runs = run_levels(runners, prompts, levels, sampling, per_level, cfg.repeats,
                              warmup=cfg.warmup, progress=progress, per_client=args.per_client,
                              length_spread=args.length_spread)
    finally:
        for srv in servers:
            srv.shutdown()
    table = summarize_levels(runs)
    if sandwiched:
        extra["sandwich"] = apply_sandwich(table, verdicts, args.bound)
    cpu = cpu_description()
    meta: dict[str, Any] = {
        "command": "fastmtp " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "label": args.label or f"{Path(args.target).name} + "
                               f"{Path(args.draft.rstrip('/')).name if args.draft else 'servers'}",
        "engine": desc, "cpu": f"{cpu['model']}; flags {' '.join(cpu['flags'])}; "
                               f"{cpu['threads']} threads",
        "levels": levels, "prompts": len(prompts), "per_level": per_level, "per_client": args.per_client,
        "repeats": cfg.repeats, "max_new_tokens": cfg.max_new_tokens,
        "length_spread": args.length_spread,
        "sampling": sampling, "target": args.target, "draft": args.draft,
        **extra,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": {"concurrency": table},
               "runs": [{"arm": r.arm, "level": r.level, "repeat": r.repeat, "wall_s": r.wall_s,
                         "output_tokens": r.output_tokens,
                         "requests": [vars(x) for x in r.records]} for r in runs]}
    if args.emit_engine_config:
        payload["engine_config"] = _engine_config(table, cfg, out)
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(out / "results.json")
    md = markdown(table, meta) + cycles_markdown(meta.get("cycles") or {})
    if "engine_config" in payload:
        md += _engine_config_md(payload["engine_config"])
    (out / "results.md").write_text(md)
    plot(table, out / "results.png", meta["label"])
    print(md)
    print(f"wrote {out}/results.json, results.md, results.png")
    return 0


def _engine_config(table: dict, cfg, out: Path) -> dict[str, Any]:
    """The best static K per level, as SGLang's and vLLM's K-per-batch-size settings."""
    from fastmtp_sglang.serving import engine_config as ec

    best = ec.best_k_by_batch(table)
    kmax = max(cfg.steps)
    res: dict[str, Any] = {"best_k_by_batch": {str(b): k for b, k in best.items()}}
    if kmax >= 1:
        res["sglang_args"] = ec.sglang_adaptive_args(best, kmax, out / "sglang_adaptive.json")
        ranges = ec.vllm_k_per_batch_size(best, kmax)
        res["vllm_num_speculative_tokens_per_batch_size"] = ranges
        ec.write_vllm_table(ranges, out / "vllm_k_per_batch_size.json")
        res["vllm_table"] = str(out / "vllm_k_per_batch_size.json")
    return res


def _engine_config_md(ec: dict[str, Any]) -> str:
    lines = ["", "K per batch size measured here (best static K at each concurrency):", "",
             "- " + ", ".join(f"batch {b}: K={k}" for b, k in ec["best_k_by_batch"].items())]
    if "sglang_args" in ec:
        lines.append(f"- SGLang 0.5.23: `{' '.join(map(str, ec['sglang_args']))}`")
        lines.append("- vLLM 0.32 speculative_config: `\"num_speculative_tokens_per_batch_size\": "
                     f"{json.dumps(ec['vllm_num_speculative_tokens_per_batch_size'])}` "
                     f"(`fastmtp serve --engine vllm --steps auto --adaptive-config {ec['vllm_table']}`)")
    return "\n".join(lines) + "\n"
