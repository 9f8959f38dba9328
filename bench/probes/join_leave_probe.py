"""What a join and a leave cost a running batch of 15 rows (demo target, bf16, shipped head):
K=0 (no head) against the auto engine held at K=0 (the head's cache rides along), two rounds.

    python bench/probes/join_leave_probe.py

Prints the prefill of one request alone, ``join`` of one request into the batch (its prefill +
merge), and ``remove`` of one row (index select of every cache). Direction only: one call each.
"""
import time, torch
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.demo_target import materialize_smollm2
from fastmtp_sglang.cli.demo import shipped_head
from fastmtp_sglang.vocab.draft_vocab import resolve_vocab
from fastmtp_sglang.core.prompts import load_prompt_ids
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.decode.auto import AutoK, StepCosts
from fastmtp_sglang.decode.ngram import NgramDrafter
torch.set_num_threads(2)
T = materialize_smollm2(); D = shipped_head()
target = load_target(str(T), dtype="bfloat16")
head = load_head(str(D), target.embed, target.lm_head, dtype=target.model.dtype)
vocab = resolve_vocab(None, target.tokenizer, target.lm_head, "none", str(D))
prompts = load_prompt_ids(target.tokenizer, "bench/data/spec_bench.jsonl", 2, None, True)
ids = [p[-1] for p in prompts][:17]
never = StepCosts({1: 1.0, 2: 1000.0, 4: 3000.0}, 100.0, 100.0)
engs = {"0": ReferenceEngine(target, None, 0, None),
        "auto0": ReferenceEngine(target, head, 3, None, draft_vocab=vocab, drafter=NgramDrafter(max_ngram=4),
                                 auto=AutoK(never, 3, calibrate=False), hybrid=True)}
for rep in range(2):
  for a, e in engs.items():
    b = e.start([Request(list(x), SamplingParams(max_new_tokens=200, temperature=0.0)) for x in ids[:15]], list(range(15)))
    for _ in range(5): e.step(b)
    with torch.inference_mode():
        t = time.perf_counter(); pre = e.start([Request(list(ids[16]), SamplingParams(max_new_tokens=200))], [99]); tp = time.perf_counter() - t
        t = time.perf_counter(); e.join(b, [Request(list(ids[16]), SamplingParams(max_new_tokens=200))], [98]); tj = time.perf_counter() - t
        t = time.perf_counter(); b.remove(b.rows[:1]); tr = time.perf_counter() - t
    print(a, rep, f"prefill alone {tp*1e3:.0f} ms, join {tj*1e3:.0f} ms, remove {tr*1e3:.1f} ms, dcache cap {getattr(b.dcache,'capacity',None)}")
