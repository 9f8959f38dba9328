"""`fastmtp distill`: flags for :func:`fastmtp_sglang.training.distill.distill` (its module
docstring is the help), and SIGTERM stopping a run the way Ctrl-C does."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
from pathlib import Path

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training import distill as lib
from fastmtp_sglang.training.distill import DistillConfig, distill
from fastmtp_sglang.training.distill_drivers import MAX_BACKOFF_S
from fastmtp_sglang.training.distill_io import stats_path


# flags whose default is DistillConfig's field of the same name
_FLAG_DEFAULTS = ("batch_size", "dtype", "n", "temperature", "top_p", "top_k", "max_new_tokens",
                  "concurrency", "feature_dtype", "max_len", "retries", "backoff", "timeout",
                  "seed", "max_repeat_fraction")


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a batch scheduler, a background job whose SIGINT the shell ignores)
    stops a run the way Ctrl-C does: requests in flight are dropped, the files stay whole and a
    rerun resumes."""
    import signal

    def stop(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def _temperatures(text: str) -> float | tuple[float, ...]:
    """``--temperature``: one number, or a comma-separated list of them."""
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or a comma-separated list of numbers, "
                                         f"got {text!r}") from None
    return vals[0] if len(vals) == 1 else vals


def run(args: argparse.Namespace) -> int:
    cfg = DistillConfig(
        url=args.url, prompts=args.prompts, out=args.out, tokenizer=args.tokenizer,
        target=args.target, batch_size=args.batch_size, dtype=args.dtype,
        target_name=args.target_name, n=args.n, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
        retries=args.retries, backoff=args.backoff, timeout=args.timeout,
        exclude=args.exclude or [], drop_truncated=args.drop_truncated, limit=args.limit,
        system=args.system, seed=args.seed, max_repeat_fraction=args.max_repeat_fraction,
        progress=not args.no_progress, with_features=args.with_features,
        feature_dtype=args.feature_dtype, feature_topk=args.feature_topk, max_len=args.max_len)
    _stop_on_sigterm()
    try:
        stats = distill(cfg)
    except KeyboardInterrupt:
        print(f"fastmtp distill: stopped; rerun the same command to resume ({cfg.out} holds only "
              "whole lines)", file=sys.stderr)
        raise
    except FastMTPError:
        if stats_path(Path(cfg.out)).exists():
            print(f"fastmtp distill: statistics so far in {stats_path(Path(cfg.out))}", file=sys.stderr)
        raise
    print(stats.summary())
    print(f"fastmtp distill: {stats.lines_in_output} samples in {cfg.out}; statistics in "
          f"{stats_path(Path(cfg.out))}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="self-distilled training data: the target's own responses",
                       description=lib.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", action="append", help="SGLang-compatible server, e.g. "
                     "http://127.0.0.1:30000; repeat it for several servers (requests go to the "
                     "one with the fewest in flight; a router in front of many is one --url)")
    src.add_argument("--target", help="generate in this process from this model directory "
                     "(continuous batching on CPU; no server)")
    p.add_argument("--batch-size", type=int, help="with --target: rows decoded together "
                   "(default %(default)s; 2-core CPU, 135M model: 224 response tokens/s, 22x "
                   "batch 1; 128 is no faster; bench/results/distill_throughput)")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16", "auto"),
                   help="with --target: model dtype (default %(default)s; auto = bfloat16 on "
                        "CPUs with bf16 units or CUDA, float32 elsewhere)")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                   help="prompt files (JSONL: training {id, source, prompt}, Spec-Bench, C-Eval, "
                        "{prompt|text})")
    p.add_argument("--out", required=True, help="output JSONL; appended to (resumed) if it exists")
    p.add_argument("--tokenizer", default=None, help="the target's tokenizer directory, for the chat "
                   "template (default: the server's tokenizer_path, if a local directory)")
    p.add_argument("--target-name", default=None, help="the target's identity written to each line "
                   "(default: the server's model_path)")
    p.add_argument("--n", type=int, help="samples per prompt (default %(default)s)")
    p.add_argument("--temperature", type=_temperatures,
                   help="sampling temperature (default %(default)s); 0 = greedy. A "
                        "comma-separated list gives one per sample index: sample k of a prompt "
                        "uses item k mod its length (e.g. "
                        "--n 8 --temperature 0.6,0.6,0.6,0.6,0.8,1.0,0,0.9: one greedy answer per "
                        "prompt, the rest sampled)")
    p.add_argument("--top-p", type=float,
                   help="nucleus mass in (0, 1] (default %(default)s); 1 = off")
    p.add_argument("--top-k", type=int, help="top-k tokens (default %(default)s); -1 = off")
    p.add_argument("--max-new-tokens", type=int,
                   help="response length limit in tokens (default %(default)s)")
    p.add_argument("--concurrency", type=int,
                   help="with --url: requests in flight per server (default %(default)s)")
    p.add_argument("--with-features", default=None, metavar="DIR",
                   help="also keep the target's hidden states as the feature cache DIR for "
                   "`fastmtp train --features DIR`, in the same pass: with --target the engine's "
                   "own (and --feature-topk log-probabilities), with --url those the server "
                   "returns with each answer (SGLang's return_hidden_states; start it with "
                   "--enable-return-hidden-states; needs the target's directory, --tokenizer, "
                   "or the server's model_path when local: the cache's key hashes its config, "
                   "tokenizer and weight files)")
    p.add_argument("--feature-topk", type=int, default=None,
                   help="with --with-features and --target: top-k log-probabilities kept per "
                   "token, for --loss kl (default 32; with --url 0: servers return none)")
    p.add_argument("--feature-dtype", choices=("bfloat16", "float16", "float32"),
                   help="with --with-features: dtype of the stored hidden states (default "
                   "%(default)s, as `fastmtp features`)")
    p.add_argument("--max-len", type=int,
                   help="with --with-features: tokens per sequence, as `train --max-len` (default "
                   "%(default)s; the cache is opened only by a run with the same value)")
    p.add_argument("--retries", type=int,
                   help="retries per request on connection errors, timeouts and 5xx (default "
                   "%(default)s); 0 = none")
    p.add_argument("--backoff", type=float,
                   help=f"first retry delay in seconds, doubling after each (default %(default)s; "
                   f"max {MAX_BACKOFF_S:g} s)")
    p.add_argument("--timeout", type=float, help="seconds per request (default %(default)s)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="FILE",
                   help="evaluation files: prompts overlapping their texts are refused (the "
                   "shipped ones: python -m fastmtp_sglang.cli.prompt_files)")
    p.add_argument("--drop-truncated", action="store_true",
                   help="drop responses cut at --max-new-tokens (default: keep and count them)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts (after --exclude)")
    p.add_argument("--system", default=None, help="system message before each prompt "
                   "(default: the chat template's own)")
    p.add_argument("--seed", type=int,
                   help="base of the per-sample sampling seeds (default %(default)s)")
    p.add_argument("--max-repeat-fraction", type=float,
                   help="drop a response when one repeated n-gram covers more than this fraction "
                        "of its tokens (default %(default)s); 1 = off")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # the defaults are DistillConfig's (one spelling; its __post_init__ checks the values)
    p.set_defaults(func=run, **{f.name: f.default for f in dataclasses.fields(DistillConfig)
                                if f.name in _FLAG_DEFAULTS})
