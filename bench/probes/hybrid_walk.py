"""What the head adds beside prompt lookup, on held-out text: a greedy walk over each held-out
response in which every cycle takes prompt lookup's proposal where it matches (a suffix of at
least ``--min-match`` tokens, as ``--steps auto`` trusts it) and the head's drafts elsewhere, at
K drafts a cycle. Acceptance only (no speed is read), so it may run beside other work.

    python bench/probes/hybrid_walk.py --work runs/sampling-levers \\
        --heads init=runs/sampling-levers/init,kl=runs/sampling-levers/heads/kl,hyb=... --out R.json

For each head: per lookup match length, the drafts lookup and the head would each have had
accepted at every anchor with such a match (``by_match``); and the walk of the head alone (the training-time ``tau_walk`` of the curve), of
lookup alone (a cycle without a match emits one token), of the hybrid rule, and of an oracle
that picks the better source each cycle (an upper bound no rule reaches). ``WORK`` is a
`bench/pipelines/sampling_levers.sh` folder: its data (the held-out rows are the last
``--heldout-rows``), its feature cache (the target's hidden states) and its table.

A proxy for ``auto``, not ``auto``: auto picks by acceptance estimates and cost, drafts lookup up
to 8 tokens, and its verified text is its own; here both sources draft K and the text is the
held-out sampled response.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def walks(hits: torch.Tensor, right: torch.Tensor, match: torch.Tensor, prompt_len: int,
          length: int, min_match: int) -> dict[str, list[int]]:
    """The accepted count of each cycle of four walks over one sequence: head (hits [K, T]
    leading hits, as objective.acceptance walks them), lookup, hybrid, oracle."""
    steps = hits.shape[0]
    run = hits[:, :length].long().cumprod(0)
    out: dict[str, list[int]] = {"head": [], "lookup": [], "hybrid": [], "oracle": []}
    took: list[int] = []  # hybrid cycles: 1 where it took lookup's proposal
    for name in list(out):
        j = max(prompt_len - 1, 0)
        while j <= length - 3:
            avail = min(steps, length - 2 - j)
            h = int(run[:avail, j].sum())
            has = int(match[j]) >= min_match
            lk = min(int(right[j]), avail) if has else 0
            a = {"head": h, "lookup": lk, "hybrid": lk if has else h, "oracle": max(h, lk)}[name]
            out[name].append(a)
            if name == "hybrid":
                took.append(int(has))
            j += a + 1
    out["took_lookup"] = took
    return out


def by_match(hits: torch.Tensor, right: torch.Tensor, match: torch.Tensor, prompt_len: int,
             length: int, acc: dict) -> None:
    """Every anchor of the response (not a walk): per lookup match length, how many drafts lookup
    and the head would each have had accepted there, summed into ``acc[m] = [anchors, lookup,
    head]``: where a short match is worse than the head on average, the rule should not take it."""
    steps = hits.shape[0]
    run = hits[:, :length].long().cumprod(0)
    for j in range(max(prompt_len - 1, 0), length - 2):
        m = int(match[j])
        if not m:
            continue
        avail = min(steps, length - 2 - j)
        a = acc.setdefault(m, [0, 0, 0])
        a[0] += 1
        a[1] += min(int(right[j]), avail)
        a[2] += int(run[:avail, j].sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="a sampling_levers.sh folder")
    ap.add_argument("--heads", required=True, help="name=DIR,name=DIR,...")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--heldout-rows", type=int, default=200)
    ap.add_argument("--min-match", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from fastmtp_sglang.core.demo_target import materialize_smollm2
    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.decode.costs import cpu_description
    from fastmtp_sglang.training.data import collate, load_examples
    from fastmtp_sglang.training.features import FeatureStore
    from fastmtp_sglang.training.lookup_cover import lookup_proposals
    from fastmtp_sglang.training.objective import Projection, draft_hits
    from fastmtp_sglang.vocab.tables import load_table

    work = Path(a.work)
    target = load_target(str(materialize_smollm2()), dtype="float32")
    vocab = int(target.config.get("vocab_size") or target.lm_head.weight.shape[0])
    examples, _ = load_examples(work / "data.jsonl", target.tokenizer, vocab, a.max_len)
    held = list(range(len(examples) - a.heldout_rows, len(examples)))
    store = FeatureStore(work / "features")
    props = {i: lookup_proposals(examples[i].ids.tolist(), examples[i].prompt_len, a.steps) for i in held}
    res = {"cpu": cpu_description(), "work": str(work), "heldout_rows": a.heldout_rows,
           "steps": a.steps, "min_match": a.min_match, "heads": {}, "tau_walk": {}}
    for name, d in (x.split("=", 1) for x in a.heads.split(",")):
        head = load_head(d, target.embed, target.lm_head, dtype=torch.float32).eval()
        table = next(Path(d).glob("en-*.pt"), None)
        ids = load_table(table, target.tokenizer).ids if table is not None else None
        proj = Projection(target.lm_head, ids)
        acc: dict[str, list[int]] = {}
        per_m: dict[int, list[int]] = {}
        for s in range(0, len(held), 4):
            part = held[s:s + 4]
            batch = collate([examples[i] for i in part], [store(i, examples[i].ids) for i in part],
                            torch.device("cpu"))
            hits = draft_hits(head, batch, proj, a.steps)
            for r, i in enumerate(part):
                e = examples[i]
                for k, v in walks(hits[r], *props[i], e.prompt_len, len(e.ids), a.min_match).items():
                    acc.setdefault(k, []).extend(v)
                by_match(hits[r], *props[i], e.prompt_len, len(e.ids), per_m)
        res["heads"][name] = d
        took = acc.pop("took_lookup")
        res["tau_walk"][name] = {k: round(1 + sum(v) / len(v), 4) for k, v in acc.items()}
        res["tau_walk"][name]["hybrid_lookup_share"] = round(sum(took) / len(took), 4)
        res.setdefault("by_match", {})[name] = {
            str(m): {"anchors": n, "lookup_accepted": round(lk / n, 4), "head_accepted": round(hd / n, 4)}
            for m, (n, lk, hd) in sorted(per_m.items())}
        print(name, "by match length:", res["by_match"][name], flush=True)
        print(name, res["tau_walk"][name], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
