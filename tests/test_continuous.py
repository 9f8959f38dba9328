"""Continuous batching in the reference engine (``start`` / ``join`` / ``step``): requests that
join a running batch between cycles, and leave it when done, get exactly the tokens they get
alone (fp32 greedy) for every drafter, with drafts accepted and rejected in the same batch and
live attention (so a KV-cache or rollback error changes tokens); the slot cache is repacked
without changing outputs; K is clamped at the context limit so every K returns what K=0 does;
and sampled outputs over many cycles follow the target's own distribution."""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.decode import batch as batch_mod
from fastmtp_sglang.decode import engine as engine_mod
from fastmtp_sglang.decode.auto import AutoK, StepCosts
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.ngram import NgramDrafter
from fastmtp_sglang.decode.sampling import SamplingParams
from test_engine import random_head, successor_world, tiny_target

FLAT = StepCosts({1: 50.0, 2: 51.0, 4: 53.0, 6: 55.0}, draft_step=3.0, extend=2.0)
PROMPTS = [[1, 5, 7, 9, 11], [3, 4], [8, 8, 8, 8, 8, 8, 8, 8, 2, 40, 41], [60, 61, 62],
           [20, 30, 20, 30, 20, 30, 20], [90, 2]]
N_NEW = [20, 9, 26, 1, 17, 23]


@pytest.fixture(scope="module")
def live_world():
    """The successor world with its attention and MLP turned back on at a small scale: the
    target mostly predicts x+1 (so the perfect-successor head is often accepted) but its
    tokens depend on the whole context through live attention, and it departs from x+1 often
    enough that drafts are rejected too."""
    return live_successor_world()


def live_successor_world():
    t, head = successor_world()
    torch.manual_seed(7)
    with torch.no_grad():
        for layer in t.model.model.layers:
            layer.self_attn.v_proj.weight.normal_(0, 0.3)
            layer.self_attn.o_proj.weight.normal_(0, 0.15)
            layer.mlp.down_proj.weight.normal_(0, 0.05)
    return t, head


def _alone(eng, prompt, n):
    return eng.generate([Request(list(prompt), SamplingParams(max_new_tokens=n))])[0].output_ids


def _staggered(eng, prompts, n_new, schedule):
    """Run requests through start/join/step: ``schedule[i]`` = the step before which request
    i joins. Returns ({i: output ids}, every result's cycle logs)."""
    reqs = [Request(list(p), SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, n_new)]
    first = [i for i, s in enumerate(schedule) if s == 0]
    b = eng.start([reqs[i] for i in first], first)
    out, cycles, step = {}, [], 0
    while len(b) or len(out) + len(b) < len(reqs):
        step += 1
        join = [i for i, s in enumerate(schedule) if s == step]
        if join:
            eng.join(b, [reqs[i] for i in join], join)
        for key, res in eng.step(b):
            out[key] = res.output_ids
            cycles += res.metrics.cycles
    return out, cycles


def _engines(t, head):
    return {
        "plain": ReferenceEngine(t, head, 0),
        "head3": ReferenceEngine(t, head, 3),
        "lookup3": ReferenceEngine(t, None, 3, drafter=NgramDrafter()),
        "auto": ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=False)),
        "hybrid": ReferenceEngine(t, head, 3, drafter=NgramDrafter(), auto=AutoK(FLAT, 3, calibrate=False), hybrid=True),
    }


@pytest.mark.parametrize("arm", ["plain", "head3", "lookup3", "auto", "hybrid"])
def test_joining_rows_get_the_tokens_they_get_alone(live_world, arm):
    t, head = live_world
    eng = _engines(t, head)[arm]
    want = {i: _alone(eng, p, n) for i, (p, n) in enumerate(zip(PROMPTS, N_NEW))}
    got, cycles = _staggered(eng, PROMPTS, N_NEW, schedule=[0, 0, 1, 2, 2, 5])
    assert got == want
    if arm != "plain":  # drafts were both accepted and rejected, in one batch
        acc = [c.accepted for c in cycles if c.drafted]
        assert sum(a >= 2 for a in acc) >= 3, f"too few accepted drafts to test anything: {acc}"
        assert any(c.accepted < c.drafted for c in cycles if c.drafted)


@pytest.mark.parametrize("arm", ["plain", "head3", "hybrid"])
def test_prompts_prefilled_in_length_groups_get_their_alone_tokens(live_world, arm):
    """A start or join whose prompts differ in length is prefilled in several forwards (less
    padding) and merged: every row still gets its alone tokens under its own key."""
    t, head = live_world
    eng = _engines(t, head)[arm]
    want = {i: _alone(eng, p, n) for i, (p, n) in enumerate(zip(PROMPTS, N_NEW))}
    eng.prefill_call_tokens = 0  # no fixed cost per forward: every distinct length its own group
    try:
        got, _ = _staggered(eng, PROMPTS, N_NEW, schedule=[0, 0, 0, 2, 2, 2])
    finally:
        eng.prefill_call_tokens = batch_mod.PREFILL_CALL_TOKENS
    assert got == want


def test_prefill_groups_cut_where_padding_costs_more_than_a_forward():
    from fastmtp_sglang.decode.batch import prefill_groups

    assert prefill_groups([]) == [] and prefill_groups([7]) == [[0]]
    assert prefill_groups([10, 12, 11]) == [[0, 1, 2]]             # one forward beats three
    assert prefill_groups([40, 769, 53, 660], call_tokens=128) == [[0, 2], [1, 3]]
    assert prefill_groups([5, 1000], call_tokens=128) == [[0], [1]]
    assert prefill_groups([5, 1000], call_tokens=10_000) == [[0, 1]]
    lens = [53, 64, 68, 65, 56, 210, 54, 58, 64, 769, 40, 85, 660]
    groups = prefill_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    cost = sum(128 + len(g) * max(lens[i] for i in g) for g in groups)
    assert cost < 0.35 * (128 + len(lens) * max(lens))            # vs one padded forward


def test_head_is_often_accepted_with_live_attention(live_world):
    t, head = live_world
    res = ReferenceEngine(t, head, 3).generate(
        [Request(list(p), SamplingParams(max_new_tokens=24)) for p in PROMPTS])
    acc = [c.accepted for r in res for c in r.metrics.cycles]
    assert 0.8 <= sum(acc) / len(acc) < 2.5  # accepted often, rejected often (1.37 at K=3)


def test_repacked_cache_gives_the_same_tokens(live_world, monkeypatch):
    t, head = live_world
    eng = ReferenceEngine(t, head, 4)
    want = {i: _alone(eng, p, n) for i, (p, n) in enumerate(zip(PROMPTS, N_NEW))}
    monkeypatch.setattr(batch_mod, "REPACK_SLACK", 0)  # repack at every cycle with a hole
    got, _ = _staggered(eng, PROMPTS, N_NEW, schedule=[0, 1, 1, 3, 4, 4])
    assert got == want


def test_slot_cache_stays_bounded_in_a_batch_that_never_empties(live_world):
    t, head = live_world
    eng = ReferenceEngine(t, head, 5)
    b = eng.start([Request([1, 2, 3], SamplingParams(max_new_tokens=10_000, ignore_eos=True))], [0])
    widest = 0
    for i in range(36):  # row 0 lives throughout (36 cycles of at most 6 tokens fit in 256)
        if i % 10 == 0:
            eng.join(b, [Request([4, 5], SamplingParams(max_new_tokens=8))], [f"j{i}"])
        eng.step(b)
        assert b.rows[0].key == 0
        widest = max(widest, int(b.valid.sum(1).max()))
        assert b.valid.shape[1] <= widest + batch_mod.REPACK_SLACK + 6


@pytest.mark.parametrize("arm", ["plain", "head3", "lookup3", "auto", "hybrid"])
def test_context_limit_every_k_returns_what_plain_decoding_does(live_world, arm):
    t, head = live_world
    ctx = 24
    plain = ReferenceEngine(t, head, 0, max_context=ctx)
    eng = {"plain": plain, "head3": ReferenceEngine(t, head, 3, max_context=ctx),
           "lookup3": ReferenceEngine(t, None, 3, max_context=ctx, drafter=NgramDrafter()),
           "auto": ReferenceEngine(t, head, 3, max_context=ctx, auto=AutoK(FLAT, 3, calibrate=False)),
           "hybrid": ReferenceEngine(t, head, 3, max_context=ctx, drafter=NgramDrafter(),
                                     auto=AutoK(FLAT, 3, calibrate=False), hybrid=True)}[arm]
    for n in (ctx - 1, ctx - 2, ctx - 4, 5, 2):
        prompt = [(7 * i + 3) % 97 for i in range(n)]
        reqs = lambda: [Request(prompt, SamplingParams(max_new_tokens=1000))]  # noqa: E731
        want = plain.generate(reqs())[0]
        got = eng.generate(reqs())[0]
        assert len(want.output_ids) == ctx - n           # the sequence fills the context exactly
        assert got.output_ids == want.output_ids
        assert got.finish_reason["type"] == "length"


def _exact_marginals(t, prompt, n, temperature):
    """The target's own distribution over its next n tokens, by enumeration (tiny vocab):
    returns the joint [V]*n as a tensor."""
    v = t.config["vocab_size"]
    joint = torch.ones(1)
    seqs = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = t.model(seqs).logits[:, -1].float() / temperature
            p = torch.softmax(logits, -1)                                   # [S, V]
            joint = (joint[:, None] * p).reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(v, 0),
                              torch.arange(v).repeat(seqs.shape[0])[:, None]], dim=1)
    return joint.view(*([v] * n))


@pytest.mark.parametrize("arm", ["head3", "lookup3", "hybrid", "auto"])
def test_sampled_outputs_follow_the_target_over_many_cycles(arm):
    """Four sampled tokens per request (three cycles after the prefill's), thousands of
    requests in staggered batches: each position's marginal and the joint of positions 2-3
    match the target's exact distribution. A prompt that repeats gives prompt lookup matches."""
    v, n_tok, temp = 6, 4, 1.0
    t = tiny_target("llama", seed=4, vocab=v)
    head = random_head(t, "mimo", seed=5)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    eng = {"head3": ReferenceEngine(t, head, 3),
           "lookup3": ReferenceEngine(t, None, 3, drafter=NgramDrafter()),
           # (row_margin 0: FLAT prices verification free at any batch size, and these batches
           # of thousands of rows are to draft)
           "hybrid": ReferenceEngine(t, head, 3, drafter=NgramDrafter(), hybrid=True,
                                     auto=AutoK(FLAT, 3, calibrate=False, row_margin=0.0)),
           "auto": ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=False, row_margin=0.0))}[arm]
    joint = _exact_marginals(t, prompt, n_tok, temp)
    n = 3000
    reqs = [Request(prompt, SamplingParams(temperature=temp, max_new_tokens=n_tok, seed=100 + i))
            for i in range(n)]
    b = eng.start(reqs[:n // 2], list(range(n // 2)))
    outs, cycles, step = {}, [], 0
    while len(b) or step == 0:
        if step == 1:  # the second half joins a batch whose rows are mid-request
            eng.join(b, reqs[n // 2:], list(range(n // 2, n)))
        step += 1
        for key, res in eng.step(b):
            outs[key] = res.output_ids
            cycles += res.metrics.cycles
    got = torch.tensor([outs[i] for i in range(n)])                            # [n, 4]
    assert any(c.accepted >= 2 for c in cycles), "no cycle accepted two drafts"
    assert any(c.accepted < c.drafted for c in cycles)
    for pos in range(n_tok):
        want = joint.sum(dim=[d for d in range(n_tok) if d != pos])
        emp = torch.bincount(got[:, pos], minlength=v).float() / n
        tv = 0.5 * (emp - want).abs().sum().item()
        assert tv < 0.05, f"position {pos}: total variation {tv:.3f}"
    want23 = joint.sum(dim=[0, 1]).reshape(-1)
    emp23 = torch.bincount(got[:, 2] * v + got[:, 3], minlength=v * v).float() / n
    assert 0.5 * (emp23 - want23).abs().sum().item() < 0.09


def test_rows_join_a_batch_with_deferred_extends_without_a_catch_up(live_world):
    """auto's K=0 cycles defer the head's extend; a join no longer catches up first: the new
    rows' deferred entries repeat their last prompt position, so the catch-up, when the batch
    next drafts, leaves every row's head state as a catch-up at the join would have (fp32), and
    every row still gets its alone tokens."""
    t, head = live_world
    eng = ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=False))
    reqs = [Request(list(p), SamplingParams(max_new_tokens=n)) for p, n in zip(PROMPTS[:4], (20, 9, 26, 7))]
    eng.prefill_call_tokens = 0  # the two joiners (11 and 3 tokens) are prefilled apart, then merged

    @torch.inference_mode()
    def run(catch_up_first: bool):
        plan = iter([0, 0, 0] + [3] * 100)
        eng._choose = lambda b: next(plan)
        b = eng.start(reqs[:2], [0, 1])
        for _ in range(3):
            eng.step(b)
        assert len(b.deferred) == 3
        if catch_up_first:
            eng._catch_up(b)
        eng.join(b, reqs[2:], [2, 3])
        if not catch_up_first:
            assert len(b.deferred) == 3 and all(x.shape[0] == 4 for d in b.deferred for x in d)
        assert [r.head_prompt is not None for r in b.rows] == [not catch_up_first] * 2 + [True, True]
        eng._catch_up(b)  # (after a catch-up first: the joiners' prompts alone)
        assert all(r.head_prompt is None for r in b.rows) and not b.deferred
        return b

    deferred, caught = run(False), run(True)
    assert [r.key for r in deferred.rows] == [r.key for r in caught.rows]
    assert torch.allclose(deferred.g, caught.g, atol=1e-5, rtol=1e-5)
    done = {}
    while len(deferred):
        done.update((k, r.output_ids) for k, r in eng.step(deferred))
    eng._choose = lambda b: 3
    assert done == {i: _alone(ReferenceEngine(t, head, 3), r.input_ids, r.params.max_new_tokens)
                    for i, r in enumerate(reqs)}


def test_rows_at_k0_never_run_the_head_until_they_draft(live_world):
    """auto defers the head's extend over a prompt to the row's first drafting cycle: rows that
    join and leave a batch decoding at K=0 never run the head; when the batch then drafts, the
    prompts of the rows still there run as one padded forward (the shorter one repeats its last
    position) and every row gets its alone tokens (fp32)."""
    t, head = live_world
    eng = ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=False))
    eng.prefill_call_tokens = 1000  # one group: the flush pads the 7-token prompt to 11
    calls, seen = [], []
    real = eng._head
    eng._head = lambda *a: calls.append(tuple(a[1].shape)) or real(*a)
    plan = iter([0] * 6 + [3] * 100)
    eng._choose = lambda b: seen.append(len(calls)) or next(plan)
    n_new = [3, 2, 30, 1, 25]
    out, _ = _staggered(eng, PROMPTS[:5], n_new, [0, 1, 1, 2, 4])
    assert seen[6] == 0  # six cycles at K=0, four prompts prefilled: no head call
    assert calls[0] == (2, 11)  # rows 2 and 4 (rows 0, 1, 3 finished at K=0): one forward
    assert out == {i: _alone(ReferenceEngine(t, head, 3), PROMPTS[i], n) for i, n in enumerate(n_new)}


def test_deferred_extends_are_bounded_and_the_output_is_unchanged(live_world, monkeypatch):
    """A batch that stays at K=0 keeps at most DEFER_MAX positions of deferred extends (the
    oldest are forgotten: the head drafts worse, the output is the target's), in at most
    DEFER_PARTS parts."""
    t, head = live_world
    monkeypatch.setattr(engine_mod, "DEFER_MAX", 3)
    eng = ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=False))
    plan = iter([0] * 8 + [3] * 100)
    eng._choose = lambda b: next(plan)
    req = Request(list(PROMPTS[0]), SamplingParams(max_new_tokens=20))
    b = eng.start([req], [0])
    monkeypatch.setattr(type(b), "DEFER_PARTS", 2)
    for i in range(8):
        eng.step(b)
        assert b.deferred_positions() == min(i + 1, 3) and len(b.deferred) <= 2
    done = {}
    while len(b):
        done.update((k, r.output_ids) for k, r in eng.step(b))
    assert done[0] == _alone(ReferenceEngine(t, head, 3), PROMPTS[0], 20)
