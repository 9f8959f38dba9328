"""Which fine-tune of the head accepts more when sampling? tau of several heads at K, at several
temperatures, on the same prompts: every prompt of the set in one batch of the reference engine
(lossless rejection sampling, each request its own seed), so a head/temperature pair costs one
batched run, not a bench's two arms per prompt. Acceptance only: no speed is read, so it may run
beside other work.

    python bench/probes/lever_tau.py --heads init=DIR,kl=DIR2 [--temperatures 0,0.7,1.0] [--steps 3] \\
        [--widths 1,2,3] [--prompts bench/data/spec_bench.jsonl] [--per-category 2] \\
        [--max-new-tokens 128] --out R.json

``--widths``: also draft with leaves (decode/leaves.py), each width a run of its own, keyed
``name+wW`` (width 1 keeps the head's own name).

``--draft-temp-scales``: also sample the head's drafts at the request's temperature times each
scale (q = softmax(z / (T s)) over the table; verification is unchanged, so the output stays the
target's whatever q is), keyed ``name@sS``: whether a sharper or flatter draft distribution
overlaps the target's more when sampling.

tau = tokens emitted in decode cycles / cycles, over all requests (docs/design.md section 2), with
the per-position acceptance A_k; each head drafts over its own tables, bf16 where native.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", required=True, help="name=DIR,name=DIR,... (draft directories)")
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--steps", type=int, default=3, help="K drafted every cycle")
    ap.add_argument("--prompts", default="bench/data/spec_bench.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--widths", default="1", help="candidates per drafted position, comma-separated")
    ap.add_argument("--draft-temp-scales", default="1", help="comma-separated: the draft's "
                    "temperature as a multiple of the request's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from fastmtp_sglang.core.demo_target import materialize_smollm2
    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.core.hardware import fast_bf16
    from fastmtp_sglang.core.prompts import load_prompt_ids
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.decode.costs import cpu_description
    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.vocab.draft_vocab import resolve_vocab

    dtype = "bfloat16" if fast_bf16() else "float32"
    t = load_target(str(materialize_smollm2()), dtype=dtype)
    prompts = load_prompt_ids(t.tokenizer, [args.prompts], args.per_category, None, True)
    heads = dict(x.split("=", 1) for x in args.heads.split(","))
    temps = [float(x) for x in args.temperatures.split(",")]
    res = {"cpu": cpu_description(), "dtype": dtype, "steps": args.steps, "prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "seed": args.seed, "heads": heads, "tau": {}}
    for name, d in heads.items():
        head = load_head(d, t.embed, t.lm_head, dtype=getattr(torch, dtype))
        vocab = resolve_vocab(None, t.tokenizer, t.lm_head, draft_dir=d)
        for w in (int(x) for x in args.widths.split(",")):
            for sc in (float(x) for x in args.draft_temp_scales.split(",")):
                key = (name if w == 1 else f"{name}+w{w}") + ("" if sc == 1.0 else f"@s{sc:g}")
                with _draft_temp_scale(sc):
                    _tau_at(res, key, ReferenceEngine(t, head, args.steps, draft_vocab=vocab, width=w),
                            [x for x in temps if x > 0 or sc == 1.0], prompts, args)
        del head
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


class _draft_temp_scale:
    """Within: the head's sampled drafts over a table at temperature x ``scale`` (probe only)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __enter__(self):
        from fastmtp_sglang.decode import batch

        self.real = real = batch.sample_draft
        sc = self.scale
        if sc != 1.0:
            batch.sample_draft = lambda vocab, g, tidx, extra, temp, top_p, top_k, gens: real(
                vocab, g, tidx, extra, temp * sc, top_p, top_k, gens)
        return self

    def __exit__(self, *exc):
        from fastmtp_sglang.decode import batch

        batch.sample_draft = self.real


def _tau_at(res: dict, name: str, eng, temps: list[float], prompts, args) -> None:
    """tau of one engine at each temperature, into ``res["tau"][name]``."""
    from fastmtp_sglang.decode.engine import Request
    from fastmtp_sglang.decode.sampling import SamplingParams

    for temp in temps:
        reqs = [Request(ids, SamplingParams(temperature=temp, max_new_tokens=args.max_new_tokens,
                                            seed=args.seed + i)) for i, (_, _, _, ids) in enumerate(prompts)]
        t0 = time.perf_counter()
        out = eng.generate(reqs)
        cycles = [c for r in out for c in r.metrics.cycles]
        n = len(cycles)
        tau = sum(c.accepted + 1 for c in cycles) / n
        a_k = [sum(c.accepted >= k for c in cycles) / n for k in range(1, args.steps + 1)]
        res["tau"].setdefault(name, {})[str(temp)] = {"tau": round(tau, 4), "cycles": n,
                                                     "A_k": [round(a, 4) for a in a_k],
                                                     "leaf_share": round(sum(c.leaf for c in cycles) / n, 4)}
        print(f"{name} T={temp}: tau {tau:.3f} over {n} cycles, A_k "
              f"{'/'.join(f'{100 * a:.0f}' for a in a_k)} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
