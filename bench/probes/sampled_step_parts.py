"""Where a sampled draft step's time goes at batch 1 (T=1, no top-p/top-k) on the engine's path:
``sample_draft`` whole and its parts (the table's logits, softmax at the temperature, the draw,
q spread into the vocabulary) beside the greedy pick, back to back ("hot") and right after a
target step ("cold": a cycle's first draft step). Shipped head, demo target, bf16, its en table;
medians. Nothing else should run meanwhile.

    python bench/probes/sampled_step_parts.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fastmtp_sglang.core.demo_target import materialize_smollm2
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.cpu_kernels.packed_linear import pack_for_inference
from fastmtp_sglang.decode.batch import sample_draft, spread_slots
from fastmtp_sglang.decode.costs import cpu_description
from fastmtp_sglang.decode.lean_forward import lean_forward_for
from fastmtp_sglang.decode.sampling import logits_to_probs, sample_each
from fastmtp_sglang.decode.slot_cache import SlotCache, use_gqa_sdpa
from fastmtp_sglang.vocab.draft_vocab import resolve_vocab

HEAD = Path(__file__).resolve().parents[2] / "fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here too")
    args = ap.parse_args()
    t = load_target(str(materialize_smollm2()), dtype="bfloat16")
    head = load_head(str(HEAD), t.embed, t.lm_head, dtype=torch.bfloat16)
    use_gqa_sdpa(t.model)
    pack_for_inference(t.model, head)
    fwd = lean_forward_for(t.model, "auto")
    vocab = resolve_vocab(None, t.tokenizer, t.lm_head, draft_dir=str(HEAD))
    g0 = torch.Generator().manual_seed(0)
    L = 200
    with torch.inference_mode():
        ids = torch.randint(0, 1000, (1, L + 1), generator=g0)
        g = torch.randn(1, head.cfg.hidden_size, generator=g0).bfloat16()
        tidx, _ = vocab.choose(ids[:, :L], torch.ones(1, L, dtype=torch.bool))
        one, no_k, gens = torch.ones(1), torch.full((1,), -1), [torch.Generator().manual_seed(1)]
        cache = SlotCache()
        t.model.model(input_ids=ids[:, :L], position_ids=torch.arange(L)[None],
                      attention_mask=torch.ones(1, L, dtype=torch.long), past_key_values=cache, use_cache=True)

        def target_step():
            fwd(ids[:, L:], torch.tensor([[L]]), torch.ones(1, L + 1, dtype=torch.long), cache)
            cache.crop(-1)

        lg, slot_ids = vocab.compressed_logits(g, tidx, None)
        probs = logits_to_probs(lg, one, one, no_k)
        calls = {"sample_draft": lambda: sample_draft(vocab, g, tidx, None, one, one, no_k, gens),
                 "greedy pick": lambda: vocab.greedy(g, tidx, None),
                 "table logits (compressed_logits)": lambda: vocab.compressed_logits(g, tidx, None),
                 "softmax (logits_to_probs)": lambda: logits_to_probs(lg, one, one, no_k),
                 "draw (sample_each)": lambda: sample_each(probs, gens),
                 "q spread (spread_slots)": lambda: spread_slots(probs, slot_ids, vocab.vocab_size)}

        def med_us(fn, n, cold):
            ts = []
            for i in range(n + 5):
                if cold:
                    target_step()
                t0 = time.perf_counter()
                fn()
                if i >= 5:
                    ts.append(time.perf_counter() - t0)
            return round(statistics.median(ts) * 1e6, 1)

        res = {"cpu": cpu_description(), "threads": torch.get_num_threads(),
               "hot_us": {k: med_us(f, 300, False) for k, f in calls.items()},
               "cold_us": {k: med_us(f, 60, True) for k, f in calls.items()}}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
