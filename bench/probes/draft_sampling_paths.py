"""A sampled draft step over the compressed table, drawn over the table's slots (what
``decode.batch.sample_draft`` does) against the full-width path it replaced (the compressed
logits scattered into the 49K vocabulary, softmax and draw over all of it), beside the greedy
step: demo target + shipped head, batch 1, temperature 1, interleaved rounds, medians.

    python bench/probes/draft_sampling_paths.py --out bench/results/sampling_cost/draft_step_paths

Question (2026-12-05): how much of a sampled draft step's extra cost was the full width? Run it
on an idle machine; writes OUT/paths.json with the CPU's model name and flags.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from fastmtp_sglang.cli.demo import shipped_head
from fastmtp_sglang.core.demo_target import materialize_smollm2
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.cpu_kernels.packed_linear import pack_for_inference
from fastmtp_sglang.decode.batch import sample_draft
from fastmtp_sglang.decode.costs import cpu_description, interleaved_ms
from fastmtp_sglang.decode.lean_head import LeanHead
from fastmtp_sglang.decode.sampling import logits_to_probs, sample
from fastmtp_sglang.kernels.compressed_head import compressed_head, scatter_to_full, slot_ids
from fastmtp_sglang.vocab.draft_vocab import resolve_vocab


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ctx", type=int, default=200, help="positions already in the head's cache")
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t = load_target(str(materialize_smollm2()), dtype=a.dtype)
    hd = str(shipped_head())
    head = load_head(hd, t.embed, t.lm_head, dtype=t.model.dtype)
    vocab = resolve_vocab(None, t.tokenizer, t.lm_head, draft_dir=hd)
    pack_for_inference(t.model, head)  # as the engine runs it
    H, ctx = head.cfg.hidden_size, a.ctx
    g0 = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (1, ctx + 4), generator=g0)
    hid = torch.randn(1, ctx, H, generator=g0).to(t.model.dtype)
    run = LeanHead(head).run
    with torch.inference_mode():
        cache = head.new_cache(1, ctx + 8)
        run(hid, ids[:, 1:ctx + 1], torch.arange(ctx)[None], cache)
        tok, pos, g = ids[:, ctx:ctx + 1], torch.tensor([[ctx]]), hid[:, -1]
        tidx, one, off = torch.zeros(1, dtype=torch.long), torch.ones(1), torch.full((1,), -1)
        gens = [torch.Generator().manual_seed(1)]

        def step():
            return run(g[:, None], tok, pos, cache)[:, 0]

        def full_width():  # the path before sample_draft
            x = step()
            _, _, lg = compressed_head(x.contiguous(), vocab.weight, vocab.tables.tables, vocab.tables.lens,
                                       tidx, None, return_logits=True, table_weight=vocab.table_weight)
            full = scatter_to_full(lg, slot_ids(vocab.tables.tables, vocab.tables.lens, tidx, None),
                                   vocab.vocab_size)
            sample(logits_to_probs(full.float(), one, one, off), gens[0])

        times = interleaved_ms({
            "greedy": lambda: vocab.greedy(step(), tidx, None),
            "sampled, table slots (sample_draft)": lambda: sample_draft(vocab, step(), tidx, None, one, one,
                                                                        off, gens),
            "sampled, full width (before)": full_width,
        }, repeats=a.repeats, warmup=5)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"cpu": cpu_description(), "dtype": a.dtype, "ctx": ctx, "repeats": a.repeats,
           "draft_step_ms": med, "ratio_to_greedy": {k: v / med["greedy"] for k, v in med.items()}}
    print(json.dumps(res, indent=1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paths.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
