"""`fastmtp features`: flags for :func:`fastmtp_sglang.training.features.open_or_build` (its module
docstring is the help)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training import features as lib
from fastmtp_sglang.cli.init_head import layer_list
from fastmtp_sglang.training.features import FEATURE_DTYPES, open_or_build
from fastmtp_sglang.training.features_reuse import reusable_rows


def _run(args: argparse.Namespace) -> int:
    from fastmtp_sglang.core.hardware import default_device
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.training.data import load_examples

    target = load_target(args.target, dtype=args.dtype, device=default_device(args.device))
    vocab = int(target.config.get("vocab_size") or target.lm_head.weight.shape[0])
    examples, counts = load_examples(args.data, target.tokenizer, vocab, args.max_len, 1,
                                     args.max_sequences)
    if not examples:
        raise FastMTPError(f"{args.data}: no usable rows ({counts.lines} lines)")
    aux = tuple(args.aux_layers or ())
    reuse = None
    if args.reuse and not (Path(args.out) / lib.INDEX).is_file():
        key = lib.make_key(target, args.target, args.data, args.max_len, args.max_sequences,
                           args.feature_dtype, args.topk, aux)
        reuse = reusable_rows(args.reuse, key, examples, target.tokenizer, vocab,
                              lambda s: print(s, file=sys.stderr, flush=True))
    store = open_or_build(target, args.target, args.data, examples, args.out, args.max_len,
                          args.max_sequences, args.feature_dtype, args.topk, not args.no_progress,
                          aux_layers=aux, reuse=reuse)
    print(f"feature cache {store.path}: {len(store)} sequences, {store.index['tokens']} tokens, "
          f"{store.nbytes / 2**20:.0f} MiB")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("features", help="cache the target's hidden states (and top-k logits) for training",
                       description=lib.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--data", required=True, help="training JSONL (as `fastmtp distill` writes)")
    p.add_argument("--out", required=True, help="cache directory to create")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per sequence, as `train "
                   "--max-len` (default 1024; must match the training run)")
    p.add_argument("--max-sequences", type=int, default=None, help="first N usable rows (as train)")
    p.add_argument("--topk", type=int, default=0, help="also store the target's top-k "
                   "log-probabilities per token for --loss kl (default 0 = none)")
    p.add_argument("--feature-dtype", default="bfloat16", choices=tuple(FEATURE_DTYPES),
                   help="dtype of the stored hidden states (default bfloat16)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the target's dtype for the forward (default float32, as train)")
    p.add_argument("--aux-layers", type=layer_list, default=None,
                   help="also store these middle layers' residual streams, for a head made with "
                   "`init-head --aux-layers` (default none)")
    p.add_argument("--reuse", action="append", default=[], metavar="CACHE",
                   help="copy the rows this finished cache holds (same target and settings; "
                   "matched by token ids through the data file it recorded) instead of running "
                   "the target over them; repeatable")
    p.add_argument("--device", default=None, help="where the target runs: cpu or cuda "
                   "(default: cuda when available, as train)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
