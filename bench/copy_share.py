"""How much of the target's answers prompt lookup would have drafted, per prompt source: the
offline prompt-lookup tau (up to 5 drafts a cycle, `NgramDrafter` defaults, as `fastmtp bench
--ngram-steps 5` drafts; the hybrid of `--steps auto` matches up to 4-grams) of the greedy rows of
a distilled file. A kind whose answers copy their prompt
(extraction, RAG) scores high here, as it does served; it says which training kinds give the head
copying to learn.

    python bench/copy_share.py runs/data-v3/distill.jsonl --sources runs/data-v3/corpus-tasks.jsonl \
        runs/data-v3/corpus-long.jsonl --from-row 24758
"""

from __future__ import annotations

import argparse
import collections
import json

from fastmtp_sglang.decode.ngram import NgramDrafter, NgramIndex


def lookup_cycles(prompt: list[int], response: list[int], k: int = 5) -> int:
    """Verify cycles prompt lookup needs to emit ``response`` when the target's answer is exactly
    it (greedy): each cycle accepts the drafts' longest matching prefix, then one target token."""
    idx = NgramIndex(NgramDrafter())
    j = cycles = 0
    while j < len(response):
        idx.sync(prompt, response[:j])
        drafts, _ = idx.propose_match(k)
        a = 0
        while a < len(drafts) and j + a < len(response) and drafts[a] == response[j + a]:
            a += 1
        j += a + 1
        cycles += 1
    return cycles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a distilled JSONL file (prompt_ids, response_ids, sampling_params)")
    ap.add_argument("--sources", nargs="*", default=[],
                    help="prompt files ({id, source, prompt}) naming each prompt's source; others count as 'other'")
    ap.add_argument("--from-row", type=int, default=0, help="skip the rows before this one")
    ap.add_argument("--drafts", type=int, default=5, help="lookup drafts per cycle")
    args = ap.parse_args()
    source = {}
    for f in args.sources:
        for line in open(f, encoding="utf-8"):
            r = json.loads(line)
            source[r["prompt"]] = r.get("source", "other")
    tally = collections.defaultdict(lambda: [0, 0, 0])  # tokens, cycles, rows
    for i, line in enumerate(open(args.data, encoding="utf-8")):
        if i < args.from_row:
            continue
        r = json.loads(line)
        if (r.get("sampling_params") or {}).get("temperature") != 0 or not r.get("response_ids"):
            continue
        t = tally[source.get(r.get("prompt"), "other")]
        t[0] += len(r["response_ids"])
        t[1] += lookup_cycles(r["prompt_ids"], r["response_ids"], args.drafts)
        t[2] += 1
    print("| source | greedy rows | lookup tau |\n|---|---|---|")
    for s, (tokens, cycles, rows) in sorted(tally.items()):
        print(f"| {s} | {rows} | {tokens / cycles:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
