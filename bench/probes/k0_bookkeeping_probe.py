"""What does auto's machinery cost a cycle at K=0? The K=0 engine and auto with a margin no
drafting can beat (``auto0``: the same cycles and joins) run the same closed loop interleaved
cycle by cycle (closed_loop_probe.run_interleaved), with each engine method's time summed per
cycle (and per join): the difference per part is auto's bookkeeping when it does not draft.

    python bench/probes/k0_bookkeeping_probe.py [--clients 8] [--requests 48] [--rounds 2]
"""
import argparse
import sys, time, collections
sys.path.insert(0, "bench/probes")
import closed_loop_probe as c
import torch
from fastmtp_sglang.cli.demo import shipped_head
from fastmtp_sglang.core.demo_target import materialize_smollm2
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.prompts import load_prompt_ids
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.decode.auto_setup import AutoSpec, build_auto_engine, measure_costs
from fastmtp_sglang.decode.engine import ReferenceEngine
from fastmtp_sglang.decode import engine as E, auto as A
from fastmtp_sglang.decode.costs import cpu_description
from fastmtp_sglang.vocab.draft_vocab import resolve_vocab
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--clients", type=int, default=8)
ap.add_argument("--requests", type=int, default=48)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--rounds", type=int, default=2)
args = ap.parse_args()
sys.argv = sys.argv[:1]
torch.set_num_threads(2)
T = collections.defaultdict(float)


def wrap(cls, name):
    real = getattr(cls, name)
    def f(self, *a, **k):
        t = time.perf_counter()
        try:
            return real(self, *a, **k)
        finally:
            T[(id(self), name)] += time.perf_counter() - t
    setattr(cls, name, f)


for n in ("_choose", "_draft", "_verify", "_draft_extend", "_advance", "_collect", "step", "join"):
    wrap(E.ReferenceEngine, n)
wrap(A.AutoK, "observe_cycle")
target = load_target(str(materialize_smollm2()), dtype="bfloat16")
D = shipped_head()
head = load_head(str(D), target.embed, target.lm_head, dtype=target.model.dtype)
vocab = resolve_vocab(None, target.tokenizer, target.lm_head, "none", str(D))
prompts = [p[-1] for p in load_prompt_ids(target.tokenizer, "bench/data/spec_bench.jsonl", 2, None, True)]
spec = AutoSpec()
curves = [measure_costs(spec, target, head, vocab, batch=bb) for bb in sorted({1, 2, 4, 8, args.clients})]
eng = build_auto_engine(spec, target, head, curves[0], None, vocab, curves[1:])
eng.auto.margin = 0.99
eng.rows_hint = args.clients
k0 = ReferenceEngine(target, None, 0, None)
k0.rows_hint = args.clients
engs = {"auto0": eng, "0": k0}
for e in engs.values():
    c.run(e, prompts, 4, 8, 16)
T.clear()
cyc = joins = 0
for rnd in range(args.rounds):
    r = c.run_interleaved(engs, ["0", "auto0"] if rnd % 2 == 0 else ["auto0", "0"], prompts,
                          args.clients, args.requests, args.tokens, 0.0)
    assert r["0"]["cycles"] == r["auto0"]["cycles"], "auto0 ran other cycles than K=0"
    cyc += r["0"]["cycles"]
    joins += r["0"]["joins"] - 1  # (the first is a start, not a join)
print(f"ms per cycle over {cyc} cycles of {args.clients} clients (cpu: {cpu_description()['model']}, "
      f"flags {' '.join(cpu_description()['flags'])})")
for arm, e in engs.items():
    print(arm, {n: round(1e3 * T[(id(e), n)] / cyc, 3) for n in ("step", "_choose", "_draft", "_verify", "_draft_extend", "_advance", "_collect")},
          "observe", round(1e3 * T[(id(e.auto), "observe_cycle")] / cyc, 3) if e.auto else None,
          f"| join: {1e3 * T[(id(e), 'join')] / joins:.2f} ms over {joins}")
