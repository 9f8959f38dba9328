"""Training-time tau against served tau for the same heads on the same text.

For each prompt, the target's greedy answer is generated once (K=0, the reference engine); each
head is then (a) served on the prompt at K (reference engine, greedy) and (b) scored by the
trainer's simulated greedy acceptance (`tau_walk`: the cycles a greedy server runs over that very
text). In fp32 the two are the same computation by two code paths, so they must agree; a gap
means training and serving are not aligned.

    python bench/train_vs_serve.py --target T --heads NAME=DIR ... --prompts bench/data/spec_bench.jsonl \
        --limit-per-category 1 --steps 3 --out bench/results/train_vs_serve
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from fastmtp_sglang.core.prompts import load_prompt_ids
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.metrics import summarize_cycles
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.training.data import Example
from fastmtp_sglang.training.objective import training_tau


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=DRAFT_DIR")
    ap.add_argument("--prompts", nargs="+", required=True)
    ap.add_argument("--limit-per-category", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="float32 (default): exact agreement expected")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    target = load_target(args.target, dtype=args.dtype)
    prompts = load_prompt_ids(target.tokenizer, args.prompts, args.limit_per_category, None, True)
    plain = ReferenceEngine(target, None, 0)
    examples = []
    for _, _, _, ids in prompts:
        r = plain.generate([Request(list(ids), SamplingParams(max_new_tokens=args.max_new_tokens))])[0]
        examples.append(Example(torch.tensor(list(ids) + r.output_ids), len(ids)))
    rows = []
    for spec in args.heads:
        name, _, path = spec.partition("=")
        head = load_head(path, target.embed, target.lm_head, dtype=target.model.dtype)
        eng = ReferenceEngine(target, head, args.steps)
        served = []
        for (_, _, _, ids), ex in zip(prompts, examples):
            r = eng.generate([Request(list(ids), SamplingParams(max_new_tokens=args.max_new_tokens))])[0]
            served += [c.accepted for c in r.metrics.cycles]
        s = summarize_cycles(served, args.steps)
        t = training_tau(head, target, examples, args.steps)
        rows.append({"head": name, "draft": path, "served_tau": s["tau"], "served_A_k": s["A_k"],
                     "train_tau_walk": t["tau_walk"], "train_tau_all_anchors": t["tau_train"],
                     "train_A_k": t["A_k"]})
        print(f"{name}: served tau {s['tau']:.4f}, training-time tau (walk) {t['tau_walk']:.4f}",
              file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python bench/train_vs_serve.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (out / "results.json").write_text(json.dumps({"command": cmd, "steps": args.steps,
                                                  "dtype": args.dtype, "prompts": len(prompts),
                                                  "rows": rows}, indent=1))
    lines = [f"# Training-time tau vs served tau (K={args.steps}, {args.dtype}, {len(prompts)} prompts, "
             f"the target's greedy answers)", "", f"Command: `{cmd}`", "",
             "| head | served tau | training-time tau (cycle walk) | gap | every-anchor tau |",
             "|---|---|---|---|---|"]
    for r in rows:
        gap = (r["train_tau_walk"] - r["served_tau"]) / r["served_tau"]
        lines.append(f"| {r['head']} | {r['served_tau']:.4f} | {r['train_tau_walk']:.4f} | "
                     f"{100 * gap:+.2f}% | {r['train_tau_all_anchors']:.4f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
