"""Closed-loop load on the engine alone (no HTTP, no threads): C clients, each sending its next
prompt as soon as its previous answer finishes, driven the way the reference server's loop drives
the engine (joins between cycles, up to C rows). Times joins and cycles apart, per arm, so an
arm's loss under load can be split into prefill (joins), cycles and bookkeeping.

    python bench/probes/closed_loop_probe.py --clients 16 --requests 80 --arms 0,auto,auto0 --rounds 3 [--length-spread 0.5]

Arms: an integer K (the head at K; 0 = plain decoding), ``lookupK`` (prompt lookup), ``auto``
(the hybrid auto engine), ``auto0`` (the same engine with a margin no drafting can beat: what
auto's machinery costs when it never drafts), ``autoW`` (the same engine with each catch-up
spread over the rows' whole budgets, as before 2026-12-06, not capped by the head cycles that
followed catch-ups: AutoK._head_share), ``autoP`` (an unseen K priced as before 2026-12-06:
from K=0's ratio, not its kind's: AutoK._inherited). ``--deep``: auto's K range from this machine's costs,
as ``fastmtp bench --steps auto`` runs it (default: K <= 3). Rounds rotate the arms' order.
``--interleave``: every arm's loop runs at once, one cycle of each in turn, so the machine's
speed changes hit every arm alike (each arm is timed on its own joins and cycles; the arms
share the target's weights, so none finds them colder than another). Direction only:
the bench (``fastmtp bench --concurrency``) is the measurement.
"""
import argparse
import statistics
import time
import types

import torch

from fastmtp_sglang.benchmark.concurrency import request_budgets
from fastmtp_sglang.cli.demo import shipped_head
from fastmtp_sglang.core.demo_target import materialize_smollm2
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.prompts import load_prompt_ids
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.decode.auto_setup import AutoSpec, build_auto_engine, measure_costs
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.ngram import NgramDrafter
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.vocab.draft_vocab import resolve_vocab


# auto's drafting choices: (rows, K, predicted tokens, predicted ms, K=0's predicted ms, head),
# then what the cycle emitted, took (ms) and spent of that reading prompts (ms, loop())
CHOICES = []
OWNERS = []   # the AutoK that made each choice (arms interleaved share CHOICES)


def _spy_choices():
    """Record what auto predicted for each drafting cycle it chose (tokens, ms), to hold
    against what the cycle emitted and took."""
    from fastmtp_sglang.decode.auto import AutoK, expected_tokens
    real = AutoK.plan_hybrid

    def plan_hybrid(self, heads, lookups, zero_run, deferred=0, once=0.0, left=1.0, splice=False):
        k, use, head = real(self, heads, lookups, zero_run, deferred, once, left, splice)
        if k:
            tot = 0.0
            for h, lk, take in zip(heads, lookups, use):
                if take:  # (a spliced row is counted as its padded proposal: a lower bound)
                    tot += expected_tokens(lk[0][:min(k, lk[1])], min(k, lk[1])) if lk and lk[1] else 1.0
                else:
                    tot += expected_tokens(h, k)
            ms = self.cycle_ms(k, len(heads), head_steps=head, deferred=deferred if head else 0, once=once)
            CHOICES.append([len(heads), k, tot, ms, self.cycle_ms(0, len(heads)), head])
            OWNERS.append(id(self))
        return k, use, head
    AutoK.plan_hybrid = plan_hybrid


def _inherited_before(self, key):
    """AutoK._inherited before 2026-12-06: K=0's ratio at the class, or the same K's at the class
    below, not the ratios of the other Ks of its kind at the class (the autoP arm)."""
    k, cls = key[0], key[1]
    own = self.calib.get((0, cls), 1.0)
    if k and cls > 1:
        below = self._calib_key(k, cls // 2, head_steps=not key[2:])
        own = max(own, self.calib.get(below, own))
    return own


def loop(eng, prompts, clients, requests, tokens, spread, st):
    """One closed-loop level as a generator that yields after each cycle; its totals go into
    ``st`` (join and cycle seconds are its own, whatever runs between its cycles). ``spread``:
    each request its own budget (fastmtp bench --length-spread)."""
    todo = [prompts[i % len(prompts)] for i in range(requests)]
    budgets = request_budgets(requests, tokens, spread) if spread else [tokens] * requests
    nxt, b = 0, None
    st.update(join_s=0.0, step_s=0.0, joins=0, cycles=0, rows_sum=0, out_tok=0)
    waiting = min(clients, requests)  # clients with a request ready to join
    while nxt < requests or (b is not None and len(b)):
        n = min(waiting, requests - nxt)
        if n:
            reqs = [Request(list(todo[nxt + i]), SamplingParams(max_new_tokens=budgets[nxt + i], temperature=0.0))
                    for i in range(n)]
            keys = list(range(nxt, nxt + n))
            t = time.perf_counter()
            if b is None or not len(b):
                b = eng.start(reqs, keys)
            else:
                eng.join(b, reqs, keys)
            st["join_s"] += time.perf_counter() - t
            st["joins"] += 1
            nxt += n
            waiting -= n
        t = time.perf_counter()
        st["rows_sum"] += len(b)
        nc = len(CHOICES)
        outs = {id(r): len(r.out) for r in b.rows}
        rows = list(b.rows)
        done = eng.step(b)
        dt = time.perf_counter() - t
        st["step_s"] += dt
        if len(CHOICES) > nc:  # a drafting cycle: what it emitted and took
            CHOICES[-1] += [sum(len(r.out) - outs[id(r)] for r in rows), 1e3 * dt,
                            1e3 * getattr(eng, "_prompts_s", 0.0)]
        st["cycles"] += 1
        for _, res in done:
            st["out_tok"] += len(res.output_ids)
            waiting += 1
        yield


def _totals(st, wall):
    return dict(wall=wall, tok_s=st["out_tok"] / wall, join_s=st["join_s"], step_s=st["step_s"],
                joins=st["joins"], cycles=st["cycles"], rows=st["rows_sum"] / max(st["cycles"], 1),
                other_s=wall - st["join_s"] - st["step_s"])


def run(eng, prompts, clients, requests, tokens, spread=0.0):
    """One closed-loop level alone; returns a dict of totals."""
    st: dict = {}
    t0 = time.perf_counter()
    for _ in loop(eng, prompts, clients, requests, tokens, spread, st):
        pass
    return _totals(st, time.perf_counter() - t0)


def run_interleaved(engs, order, prompts, clients, requests, tokens, spread=0.0):
    """Every arm's closed loop at once, one cycle of each in turn (``order``), so a machine that
    slows or speeds up does so for every arm alike; an arm's time is its own joins and cycles."""
    sts = {arm: {} for arm in order}
    gens = {arm: loop(engs[arm], prompts, clients, requests, tokens, spread, sts[arm]) for arm in order}
    while gens:
        for arm in [a for a in order if a in gens]:
            try:
                next(gens[arm])
            except StopIteration:
                del gens[arm]
    return {arm: _totals(st, st["join_s"] + st["step_s"]) for arm, st in sts.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--arms", default="0,auto,auto0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=2, help="prompts per Spec-Bench category")
    ap.add_argument("--deep", action="store_true", help="auto's K range as fastmtp bench chooses it")
    ap.add_argument("--interleave", action="store_true",
                    help="run the arms' loops at once, one cycle of each in turn (paired timing)")
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="each request its own budget within this fraction of --tokens")
    a = ap.parse_args()
    torch.set_num_threads(2)
    _spy_choices()
    target = load_target(str(materialize_smollm2()), dtype="bfloat16")
    D = shipped_head()
    head = load_head(str(D), target.embed, target.lm_head, dtype=target.model.dtype)
    vocab = resolve_vocab(None, target.tokenizer, target.lm_head, "none", str(D))
    prompts = [p[-1] for p in load_prompt_ids(target.tokenizer, "bench/data/spec_bench.jsonl", a.limit, None, True)]
    engs = {}
    curves = None
    for arm in a.arms.split(","):
        if arm.startswith("auto"):
            spec = AutoSpec() if a.deep else AutoSpec(3)
            if curves is None:
                curves = [measure_costs(spec, target, head, vocab, batch=bb)
                          for bb in sorted({1, 2, 4, 8, a.clients})]
            eng = build_auto_engine(spec, target, head, curves[0], None, vocab, curves[1:])
            if arm == "auto0":
                eng.auto.margin = 0.99
            if arm == "autoW":
                eng.auto._track_run = lambda *args: None
            if arm == "autoP":
                eng.auto._inherited = types.MethodType(_inherited_before, eng.auto)
        elif arm.startswith("lookup"):
            eng = ReferenceEngine(target, None, int(arm[6:]), None, drafter=NgramDrafter())
        else:
            k = int(arm)
            eng = ReferenceEngine(target, head if k else None, k, None, draft_vocab=vocab if k else None)
        eng.rows_hint = a.clients
        engs[arm] = eng
    names = list(engs)
    for arm in names:  # warm-up
        run(engs[arm], prompts, min(4, a.clients), 8, 16)
    res = {arm: [] for arm in names}
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        inter = (run_interleaved(engs, order, prompts, a.clients, a.requests, a.tokens, a.length_spread)
                 if a.interleave else None)
        for arm in order:
            r = inter[arm] if inter else run(engs[arm], prompts, a.clients, a.requests, a.tokens,
                                             a.length_spread)
            res[arm].append(r)
            print(f"round {rnd} {arm:>8}: {r['tok_s']:6.1f} tok/s wall {r['wall']:.2f}s join {r['join_s']:.2f}s "
                  f"({r['joins']}) step {r['step_s']:.2f}s ({r['cycles']} cycles, {r['rows']:.1f} rows) "
                  f"other {r['other_s']:.2f}s", flush=True)
    base = res[names[0]]
    for arm in names:
        rat = [x['tok_s'] / y['tok_s'] for x, y in zip(res[arm], base)]
        print(f"{arm:>8}: median {statistics.median(x['tok_s'] for x in res[arm]):.1f} tok/s, "
              f"vs {names[0]} {statistics.median(rat):.3f} ({', '.join(f'{v:.3f}' for v in rat)})")
        e = engs[arm]
        if arm in ("auto", "autoP"):
            from fastmtp_sglang.decode.auto import batch_class
            by = {}
            for c, owner in zip(CHOICES, OWNERS):
                if len(c) == 9 and owner == id(e.auto):
                    by.setdefault((batch_class(c[0]), c[1], c[5]), []).append(c)
            for key, cs in sorted(by.items()):
                n = len(cs)
                print(f"   class {key[0]:>2} K={key[1]} head={key[2]}: {n} cycles; tokens predicted "
                      f"{sum(c[2] for c in cs):.0f} emitted {sum(c[6] for c in cs)}; ms predicted "
                      f"{sum(c[3] for c in cs):.0f} took {sum(c[7] for c in cs):.0f} (reading prompts "
                      f"{sum(c[8] for c in cs):.0f}); K=0 priced "
                      f"{sum(c[4] for c in cs) / n:.1f} ms a cycle")
        if e.auto is not None:
            print("   calib", {k: round(v, 2) for k, v in sorted(e.auto.calib.items(), key=str)})


if __name__ == "__main__":
    main()
