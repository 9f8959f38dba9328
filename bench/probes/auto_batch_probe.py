"""Plain decoding against `auto` on one engine batch of B rows (no server, no joins): the demo
target in bf16 with the shipped head, B Spec-Bench dev prompts x 64 tokens, two rounds.

    python bench/probes/auto_batch_probe.py 16 0,auto

Prints per arm the prefill, the cycles, the wall time and the median full-batch cycle; for auto
the K it drafted per row-cycle, how many took prompt lookup, and its calibration per (K, batch
class). Direction only (one run per round). Before the probe budget (design 6.7) auto took
9.5-10.9 s against K=0's 6.0-6.5 s at B=16; after it 6.9-8.3 s against 6.0-6.7 s.
"""
import sys, time, torch
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.demo_target import materialize_smollm2
from fastmtp_sglang.cli.demo import shipped_head
from fastmtp_sglang.vocab.draft_vocab import resolve_vocab
from fastmtp_sglang.core.prompts import load_prompt_ids
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.decode.auto_setup import AutoSpec, build_auto_engine, measure_costs
torch.set_num_threads(2)
B = int(sys.argv[1]); arms = sys.argv[2].split(",")
T = materialize_smollm2(); D = shipped_head()
target = load_target(str(T), dtype="bfloat16")
head = load_head(str(D), target.embed, target.lm_head, dtype=target.model.dtype)
vocab = resolve_vocab(None, target.tokenizer, target.lm_head, "none", str(D))
prompts = load_prompt_ids(target.tokenizer, "bench/data/spec_bench.jsonl", 2, None, True)
ids = [p[-1] for p in prompts][:B]
def mk(arm):
    if arm == "auto":
        cs = [measure_costs(AutoSpec(3), target, head, vocab, batch=b) for b in (1, B)]
        return build_auto_engine(AutoSpec(3), target, head, cs[0], None, vocab, cs[1:])
    k = int(arm)
    return ReferenceEngine(target, head if k else None, k, None, draft_vocab=vocab if k else None)
engs = {a: mk(a) for a in arms}
for rep in range(2):
  for a, eng in engs.items():
    reqs = [Request(list(x), SamplingParams(max_new_tokens=64, temperature=0.0)) for x in ids]
    t0 = time.perf_counter()
    b = eng.start(reqs, list(range(B)))
    tp = time.perf_counter() - t0
    log = []; res = []
    toks = 0
    while len(b):
        t = time.perf_counter(); n = len(b)
        done = eng.step(b)
        res.extend(done)
        log.append((n, (time.perf_counter() - t) * 1e3))
    tot = time.perf_counter() - t0
    full = [ms for n, ms in log if n == B]
    print(a, rep, f"prefill {tp*1e3:.0f} ms, cycles {len(log)}, total {tot:.2f}s, full-batch cycle median {sorted(full)[len(full)//2] if full else 0:.1f} ms over {len(full)}")
    if a == "auto":
        from collections import Counter
        print('  drafted', Counter(c.drafted for _, r in res for c in r.metrics.cycles), 'lookup', sum(c.source=='lookup' for _, r in res for c in r.metrics.cycles))
        ks = {}
        print("  auto calib", {k: round(v, 2) for k, v in eng.auto.calib.items()})
        print("  cycle_ms model at B", [round(eng.auto.cycle_ms(k, B), 1) for k in range(4)])
