"""`fastmtp bench`: tau, acceptance and speedup across K, in-process or against servers.

  fastmtp bench --engine reference --target T --draft D --steps 0,1,2,3 \\
      --prompts bench/data/spec_bench.jsonl --limit-per-category 2 --out R/
  fastmtp bench --url http://127.0.0.1:30000 --url http://127.0.0.1:30001 --target T \\
      --prompts bench/data/spec_bench.jsonl --out R/
  fastmtp bench --engine reference --target T --draft D --steps 0,1,3,auto --ngram-steps 3 \\
      --concurrency 1,2,4,8,16 --prompts bench/data/spec_bench.jsonl --out R/

bench/data/spec_bench.jsonl also ships in the wheel: --prompts "$(python -m fastmtp_sglang.cli.prompt_files spec_bench.jsonl)"
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
import shlex
import sys
from pathlib import Path

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.prompts import load_prompt_ids
from fastmtp_sglang.decode.auto_setup import AutoSpec, parse_steps


def run(args: argparse.Namespace) -> int:
    from fastmtp_sglang.benchmark.sweep import run_in_process, run_urls, summarize, write_results

    if args.url:  # everything the servers lack, in one message, before any other check
        require_servers(args)
    cfg = config_from_args(args)
    if args.concurrency:
        from fastmtp_sglang.cli.bench_concurrency import run_concurrency

        return run_concurrency(args, cfg, load_in_process)
    meta = {"command": "fastmtp " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "target": args.target, "draft": args.draft,
            "label": args.label or default_label(args, cfg)}
    if args.url and cfg.ngram_steps:
        raise FastMTPError("--ngram-steps runs prompt lookup in-process: drop --url (or run "
                           "prompt lookup on the server side)")
    if args.url and cfg.leaf_steps:
        raise FastMTPError("--leaf-steps runs the reference engine in-process: drop --url")
    if args.url:
        from transformers import AutoTokenizer

        from fastmtp_sglang.benchmark.sweep import servers_by_k

        urls, drafts = servers_by_k(args.url)
        missing = [k for k in cfg.steps if k not in urls]
        if missing:
            raise FastMTPError(f"no server for K={missing}: servers report K={sorted(urls, key=str)}; start "
                               "one server per K (K=0 is a server without speculation)")
        if not args.target:
            raise FastMTPError("--url needs --target (a directory with the tokenizer) for the chat template")
        tok = AutoTokenizer.from_pretrained(args.target)
        prompts = load_prompt_ids(tok, args.prompts, args.limit_per_category, args.category, not args.raw)
        samples = run_urls(urls, [(i, c, t) for i, c, t, _ in prompts], cfg, not args.no_progress)
        meta.update(engine="servers: " + ", ".join(f"K={k} {u}" for k, u in sorted(urls.items(), key=str))
                    + " (servers report no draft/verify time split)",
                    draft=args.draft or "; ".join(f"K={k}: {d}" for k, d in sorted(drafts.items(), key=str) if k))
    else:
        target, head, prompts, vocab = load_in_process(args, cfg)
        samples = run_in_process(target, head, [(i, c, ids) for i, c, _, ids in prompts], cfg,
                                 not args.no_progress, draft_vocab=vocab)
        vdesc = "full vocabulary" if vocab is None else "draft vocab " + ", ".join(vocab.tables.names)
        dtype = str(target.model.dtype).replace("torch.", "")
        meta.update(engine=f"reference engine in-process, {dtype}, batch 1, {vdesc}",
                    vocab=None if vocab is None else vocab.tables.names, dtype=dtype)
    meta["prompts"] = len(prompts)
    meta["config"] = asdict(cfg)  # (after the run: the auto arm's K range is settled by then)
    results = summarize(samples, cfg)
    write_results(Path(args.out), results, meta, samples)
    from fastmtp_sglang.benchmark.sweep import markdown

    print(markdown(results, meta))
    print(f"wrote {args.out}/results.json, results.md, results.png")
    # a contaminated run is written (its acceptance numbers stand); the report says why its
    # speedups are withheld, and so does results.json (timing_check)
    return 0


def require_servers(args: argparse.Namespace) -> None:
    """Refuse at once, naming every need, a --url run its servers cannot serve: each speedup is
    over a K=0 server (plain decoding) of the same run, every K asked for by --steps needs a
    server, and a server that picks K itself (auto) is benched under load (--steps auto
    --concurrency LEVELS)."""
    from fastmtp_sglang.benchmark.sweep import servers_by_k

    try:
        urls, _ = servers_by_k(args.url)
        asked, auto = parse_steps(args.steps)
    except FastMTPError:
        return  # a server out of reach, or bad --steps: the checks that follow say which
    have = sorted(urls, key=str)
    needs = []
    if 0 not in urls:
        needs.append("a server at K=0 (plain decoding, the baseline of every speedup: e.g. "
                     "`fastmtp serve --target T --steps 0 --port 30001`), given with its own --url")
    missing = [k for k in asked if k and k not in urls]
    if missing:
        needs.append(f"a server for each K that --steps asks for (K={missing}), or --steps with "
                     f"only the K the servers run ({','.join(str(k) for k in have)})")
    if "auto" in urls and not (auto and args.concurrency):
        needs.append("for the server that picks K itself (auto): --steps auto --concurrency "
                     "LEVELS (e.g. 1,2,4,8): it is benched under load")
    if needs:
        raise FastMTPError(f"the servers at --url run K={have}; fastmtp bench --url needs "
                           + "; and ".join(f"({i}) {n}" for i, n in enumerate(needs, 1)))


def load_in_process(args: argparse.Namespace, cfg):
    """(target, head or None, prompts, draft vocabulary or None) for an in-process run."""
    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.core.target import load_target, require_fits
    from fastmtp_sglang.vocab.draft_vocab import resolve_vocab

    if not args.target:
        raise FastMTPError("--engine reference needs --target")
    target = load_target(args.target, dtype=args.dtype)
    head = None
    if max(cfg.steps) > 0 or cfg.auto_steps:
        if not args.draft:
            raise FastMTPError("K > 0 needs --draft")
        head = load_head(args.draft, target.embed, target.lm_head, dtype=target.model.dtype)
        require_fits(head.draft_config, target.config, where=f"draft {args.draft}")
    prompts = load_prompt_ids(target.tokenizer, args.prompts, args.limit_per_category,
                              args.category, not args.raw)
    vocab = resolve_vocab(args.vocab, target.tokenizer, target.lm_head, args.vocab_extra, args.draft)
    return target, head, prompts, vocab


def config_from_args(args: argparse.Namespace):
    from fastmtp_sglang.benchmark.sweep import BenchConfig

    try:
        steps, auto = parse_steps(args.steps)
        steps = steps or [0]
        if auto and args.url and not args.concurrency:
            raise FastMTPError("--steps auto with --url is a server that picks K itself, benched "
                               "under load: add --concurrency (or drop --url: the reference "
                               "engine in-process)")
        return BenchConfig(steps, args.max_new_tokens, args.temperature,
                           args.top_p, args.top_k, args.repeats, args.seed,
                           warmup=not args.no_warmup, max_spread=args.max_spread,
                           ngram_steps=parse_steps(args.ngram_steps, "--ngram-steps")[0]
                           if args.ngram_steps else [],
                           auto=AutoSpec.from_cli_args(args) if auto else None,
                           leaf_steps=parse_steps(args.leaf_steps, "--leaf-steps")[0]
                           if getattr(args, "leaf_steps", "") else [],
                           leaf_width=getattr(args, "draft_width", 3))
    except ValueError as exc:
        raise FastMTPError(str(exc)) from None


def default_label(args: argparse.Namespace, cfg) -> str:
    """A title a reader understands: what was run, not the output folder's name."""
    target = Path(args.target).name if args.target else "server"
    draft = Path(args.draft.rstrip("/")).name if args.draft else ("servers" if args.url else "no draft")
    ks = ",".join(str(k) for k in cfg.steps)
    return f"{target} + {draft}: K={ks}, {'greedy' if cfg.temperature == 0 else f'T={cfg.temperature}'}"


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", default="0,1,2,3,4", help="comma-separated K values (K=0 is always "
                   "added: it is the baseline; default 0,1,2,3,4); 'auto' adds an arm whose K is "
                   "chosen every cycle from this machine's measured costs (in-process)")
    AutoSpec.add_cli_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1 = off)")
    p.add_argument("--top-k", type=int, default=-1, help="top-k (default -1 = off)")
    p.add_argument("--repeats", type=int, default=3, help="runs of the prompt set; tokens/s is "
                   "the median (default 3; with 1 the run-to-run check cannot run)")
    p.add_argument("--ngram-steps", default="", help="also run prompt lookup (n-gram drafting, "
                   "the model-free peer) at these K, comma-separated, in the same run and table "
                   "(in-process only; default none)")
    p.add_argument("--leaf-steps", default="", help="also run the head with leaves at these K, "
                   "comma-separated: each drafted position verifies --draft-width candidates (the "
                   "head's draft and its next choices) in the same target forward (in-process only; "
                   "default none)")
    p.add_argument("--draft-width", type=int, default=3, help="candidates per drafted position of "
                   "the --leaf-steps arms (default 3)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of one "
                   "prompt at every K (timings then include first-call costs: not for publishing)")
    p.add_argument("--max-spread", type=float, default=0.15, help="timing guard: largest allowed "
                   "(max - min) / median, over repeats, of one arm's paired speedup (the arm over K=0 "
                   "on the same prompt and repeat) before the run is called contaminated; plain "
                   "tokens/s may drift with the machine (default 0.15)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="in-process target dtype (default auto: bfloat16 where the CPU has bf16 units, "
                        "avx512_bf16 or AMX, or on CUDA; float32 elsewhere)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--vocab", default=None, help="draft vocabulary (in-process): default the "
                   "draft's own tables if it lists any, else full; full; "
                   "auto (shipped tables for the target's tokenizer, one per language, picked per "
                   "request), or comma-separated table files / builtin:<tokenizer>/<lang>-<N>")
    p.add_argument("--vocab-extra", choices=("none", "prompt"), default="none",
                   help="add each request's prompt tokens to its draft table (default none)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="tau, acceptance and speedup across K",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=[], help="server URL, repeated: one "
                   "server per K, and always one at K=0 (a server without speculation, `fastmtp "
                   "serve --steps 0`): every speedup is over it; each server's K is read from its "
                   "/server_info. A server started with --steps auto is benched with --steps auto "
                   "--concurrency LEVELS, beside the K=0 server. Omit for in-process")
    p.add_argument("--engine", choices=("reference",), default="reference",
                   help="in-process engine when no --url is given")
    p.add_argument("--target", help="target model directory (tokenizer and, in-process, weights)")
    p.add_argument("--draft", help="draft directory (in-process)")
    p.add_argument("--prompts", nargs="+", required=True, help="prompt files (Spec-Bench, C-Eval, "
                   "{id, prompt} JSONL; the shipped ones: python -m fastmtp_sglang.cli.prompt_files)")
    p.add_argument("--limit-per-category", type=int, default=None, help="first N prompts of each category")
    p.add_argument("--category", action="append", default=None, help="only this category (repeatable)")
    p.add_argument("--raw", action="store_true", help="send prompts as they are, no chat template")
    p.add_argument("--out", required=True, help="output directory for results.json/.md/.png")
    p.add_argument("--label", default=None, help="title for the report (default: target + draft, "
                   "K values, decoding mode)")
    p.add_argument("--concurrency", default=None, help="comma-separated levels, e.g. 1,2,4,8,16: "
                   "throughput under load instead of batch-1 latency; at each level that many "
                   "closed-loop streaming clients share the prompt list, per arm (results."
                   "concurrency in results.json, a plot of throughput against concurrency)")
    p.add_argument("--requests-per-level", type=int, default=None, help="--concurrency: requests "
                   "per level and arm (default: the number of prompts; at least --per-client "
                   "per client)")
    p.add_argument("--per-client", type=int, default=2, help="--concurrency: requests each client "
                   "sends at least, per level and arm (default 2; more keeps a high level's "
                   "ramp-up and drain a smaller part of its time)")
    p.add_argument("--length-spread", type=float, default=0.0, help="--concurrency: give each "
                   "request its own token budget, uniform within this fraction of --max-new-tokens "
                   "(0.5 with 64: 32..96; the same budgets for every arm). Default 0: every request "
                   "runs to --max-new-tokens, which keeps plain decoding's batch in step")
    p.add_argument("--schedule", choices=("levels", "sandwich"), default="levels",
                   help="--concurrency: 'levels' runs each arm's whole level once per repeat, arms "
                        "rotated; 'sandwich' runs short blocks, each arm's between two K=0 blocks, "
                        "in rounds until every ratio over K=0 is settled (cancels a VM's drift)")
    p.add_argument("--block-requests", type=int, default=16, help="--schedule sandwich: requests per "
                   "block (at least --per-client per client)")
    p.add_argument("--bound", type=float, default=0.02, help="--schedule sandwich: stop a level when "
                   "every arm's ratio is known to this relative 95%% half-width (default 0.02)")
    p.add_argument("--min-rounds", type=int, default=3, help="--schedule sandwich: rounds at least")
    p.add_argument("--max-rounds", type=int, default=12, help="--schedule sandwich: rounds at most")
    p.add_argument("--level-budget", type=float, default=None, help="--schedule sandwich: seconds a "
                   "level may take before it stops unsettled, after --min-rounds at least (default: no limit)")
    p.add_argument("--emit-engine-config", action="store_true", help="--concurrency: also write "
                   "the K-per-batch-size tables this run measured, for SGLang "
                   "(--speculative-adaptive-config) and vLLM (num_speculative_tokens_per_batch_size)")
    add_common(p)
    p.set_defaults(func=run)
