"""`fastmtp synth-prompts`: flags for :func:`fastmtp_sglang.training.synth_prompts.synth_prompts`
(its module docstring is the help); writes the rows as JSONL."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from fastmtp_sglang.training import synth_prompts as lib
from fastmtp_sglang.training.synth_prompts import KINDS, synth_prompts


def run(args: argparse.Namespace) -> int:
    counts = {k: getattr(args, k) for k in KINDS}
    rows = synth_prompts(counts, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out)
    by = {k: sum(1 for r in rows if r["source"].split(":")[1] == k) for k in KINDS}
    print(f"wrote {len(rows)} prompts to {out}: " + ", ".join(f"{k} {v}" for k, v in by.items()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth-prompts", help="training prompts for RAG, summaries, translation, "
                       "maths and code from text shipped in packages",
                       description=lib.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output JSONL ({id, source, prompt} rows)")
    p.add_argument("--seed", type=int, default=0, help="choice and order seed (default 0)")
    for kind, n in (("rag", 300), ("summarize", 250), ("translate", 200), ("math", 250), ("code", 250)):
        p.add_argument(f"--{kind}", type=int, default=n, help=f"{kind} prompts (default {n})")
    p.set_defaults(func=run)
