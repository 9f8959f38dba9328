"""The cost curve of one speculative cycle on this machine, per dtype: plain step, verify of n
tokens, draft step, draft extend, each beside its memory-bound floor (weights read once / measured
read bandwidth). Run it on an idle machine.

    python bench/cost_curve.py --out bench/results/cost_curve                 # demo target + shipped head
    python bench/cost_curve.py --target T --draft D --dtypes float32 --out R/
    python bench/cost_curve.py --dtypes float32 --sampled --out R/            # + rows at temperature 1

Writes R/costs.json (one curve per dtype, with the CPU's model and flags), R/costs.md and
R/costs.png (ms against tokens per forward, floor dashed). Library: fastmtp_sglang.decode.costs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.decode.costs import markdown, measure
from fastmtp_sglang.vocab.draft_vocab import resolve_vocab


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (dtype, c) in enumerate(curves.items()):
        ns = sorted(int(n) for n in c["verify_ms"])
        color = f"C{i}"
        ax.plot(ns, [c["verify_ms"][n] for n in ns], "o-", color=color, label=f"target forward, {dtype}")
        ax.axhline(c["verify_floor_ms"], color=color, ls="--", lw=1, label=f"memory floor, {dtype}")
        if c.get("extend_ms"):
            ax.plot(ns, [c["extend_ms"][n] for n in ns], "s:", color=color, ms=4, label=f"draft extend, {dtype}")
    ax.set_xlabel("new tokens per forward (1 = plain step; K+1 = verify at K)")
    ax.set_ylabel("ms (median)")
    cpu = next(iter(curves.values()))["cpu"]
    ax.set_title(f"{cpu['model'][:48]}\n{', '.join(cpu['flags'])}", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: the demo target)")
    p.add_argument("--draft", default=None, help="draft directory (default: the shipped demo head; "
                   "'none' = target only)")
    p.add_argument("--vocab", default=None, help="as fastmtp bench --vocab (default: the draft's tables)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    p.add_argument("--ns", default="1,2,3,4,5,6,8", help="new tokens per forward (default 1,2,3,4,5,6,8)")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache (default 200)")
    p.add_argument("--batch", type=int, default=1, help="rows per forward, each with its own "
                   "--context cache (default 1; continuous batching serves 4-16)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per shape (median; default 15)")
    p.add_argument("--stock", action="store_true", help="also time the engine's target through "
                   "transformers' forward (' transformers forward': without decode/lean_forward.py), then "
                   "without fused projections (' unfused') and with transformers' own DynamicCache, sdpa "
                   "attention and F.linear (' stock': the engine before decode/slot_cache.py and "
                   "cpu_kernels/packed_linear.py)")
    p.add_argument("--sampled", action="store_true", help="also time the plain step and the draft "
                   "step when the request samples at temperature 1 (the token drawn, the draft's q "
                   "built), beside the greedy ones in the same interleaved rounds")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    if args.target is None:
        from fastmtp_sglang.core.demo_target import materialize_smollm2

        args.target = str(materialize_smollm2())
    if args.draft is None:
        from fastmtp_sglang.cli.demo import shipped_head

        args.draft = str(shipped_head())
    ns = tuple(int(x) for x in args.ns.split(","))
    curves, tables = {}, {}
    for dtype in args.dtypes.split(","):
        target = load_target(args.target, dtype=dtype)
        head = vocab = None
        if args.draft != "none":
            head = load_head(args.draft, target.embed, target.lm_head, dtype=target.model.dtype)
            vocab = resolve_vocab(args.vocab, target.tokenizer, target.lm_head, "none", args.draft)
        variants = [("", False, True, True)]
        if args.stock:  # engine, its parts undone one by one, engine again: drift shows as engine != again
            variants += [(" transformers forward", False, True, False), (" unfused", False, False, False),
                         (" stock", True, True, False), (" again", False, True, True)]
        for suffix, stock, fuse, lean in variants:
            curve = measure(target, head, vocab, ns=ns, context=args.context, repeats=args.repeats,
                            batch=args.batch, stock=stock, fuse=fuse, lean=lean, sampled=args.sampled)
            curves[dtype + suffix] = curve.to_json()
            tables[dtype + suffix] = markdown(curve)
            print(f"{dtype}{suffix}\n{tables[dtype + suffix]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "target": args.target,
            "draft": args.draft, "vocab": args.vocab or "the draft's own tables"}
    (out / "costs.json").write_text(json.dumps({"meta": meta, "curves": curves}, indent=2) + "\n")
    md = [f"# Cost curve\n\n`{meta['command']}`\n"]
    for dtype, c in curves.items():
        ratio8 = c["verify_ratio"].get(8)
        md.append(f"## {dtype}\n\nplain step {c['plain_ms']:.1f} ms = {c['plain_over_floor']:.1f}x its memory "
                  "floor" + (f"; verify 8 tokens = {ratio8:.2f}x a plain step" if ratio8 else "") + "\n")
        md.append(tables[dtype])
    (out / "costs.md").write_text("\n".join(md) + "\n")
    plot(curves, out / "costs.png")
    print(f"wrote {out}/costs.json, costs.md, costs.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
