"""``--steps auto``: the controller's arithmetic, and the engine with K chosen per cycle staying
lossless (greedy output == plain greedy in fp32, sampled tokens follow the target) while the
chosen K follows the costs and the acceptance (a perfect drafter drafts Kmax, a useless one on a
machine where verification is expensive settles at K=0, probing now and then)."""

from __future__ import annotations

import pytest
import torch

import fastmtp_sglang.decode.engine as engine_mod
from fastmtp_sglang.decode.auto import AutoK, StepCosts, batch_class, expected_tokens
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.ngram import NgramDrafter, NgramIndex
from fastmtp_sglang.decode.sampling import SamplingParams
from test_engine import N_NEW, PROMPTS, V, greedy_reference, random_head, successor_world, tiny_target

FLAT = StepCosts({1: 50.0, 2: 51.0, 4: 53.0, 6: 55.0}, draft_step=3.0, extend=2.0)    # AMX bf16-like
STEEP = StepCosts({1: 50.0, 2: 100.0, 4: 200.0}, draft_step=5.0, extend=3.0)          # AVX2 bf16-like


def test_expected_tokens_and_costs():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0
    assert FLAT.verify_ms(3) == pytest.approx(52.0)          # interpolated
    assert FLAT.verify_ms(8) == pytest.approx(57.0)          # extrapolated along the last segment
    assert FLAT.cycle_ms(0) == 50.0                          # plain decoding: no draft work
    assert FLAT.cycle_ms(3) == pytest.approx(53.0 + 3 * 3.0 + 2.0)


def test_best_k_follows_costs_and_acceptance():
    auto = AutoK(FLAT, 5, calibrate=False)
    assert auto.best([[0.9] * 5]) == 5            # cheap verification, a good drafter: draft all
    assert auto.best([[0.02] * 5]) == 0           # nothing is ever accepted: plain decoding
    assert AutoK(STEEP, 5, calibrate=False).best([[0.6] * 5]) == 0  # expensive verification: 0.6 does not pay
    mid = AutoK(FLAT, 5, calibrate=False).best([[0.6, 0.3, 0.1, 0.1, 0.1]])
    assert 1 <= mid <= 2                          # acceptance falls off: a short chain
    # a batch shares one K: it maximises the rows' summed tokens per ms
    assert AutoK(FLAT, 5, calibrate=False).best([[0.9] * 5, [0.0] * 5]) >= 1


def test_update_observes_positions_up_to_the_first_rejection():
    auto = AutoK(FLAT, 4, prior=0.5, alpha=0.5, shared_alpha=0.0, calibrate=False)
    est = auto.new_estimate()
    auto.update(est, 4, 1)  # d1 accepted, d2 rejected, d3 and d4 not observed
    assert est == [0.75, 0.25, 0.5, 0.5]
    auto.update(est, 0, 0)  # a K=0 cycle observes nothing
    assert est == [0.75, 0.25, 0.5, 0.5]
    auto.update(est, 2, 2)  # both accepted: position 3 is not observed, but raised to position 2's
    assert est == [0.875, 0.625, 0.625, 0.5]
    auto.update(est, 4, 4)  # the whole chain: nothing beyond Kmax to raise
    assert est == [0.9375, 0.8125, 0.8125, 0.75]


def test_sampled_rows_observe_acceptance_probabilities():
    """A sampled row observes each verified position's probability of acceptance in place of its
    0/1 outcome (the same positions: up to the first rejection), and so does the shared estimate."""
    auto = AutoK(FLAT, 3, prior=0.5, alpha=0.5, shared_alpha=0.5, calibrate=False)
    est = auto.new_estimate()
    auto.update(est, 3, 1, probs=[0.6, 0.3, 0.9])  # d3 is past the first rejection: not observed
    assert est == pytest.approx([0.55, 0.4, 0.5])
    assert auto.shared["head"] == pytest.approx([0.55, 0.4, 0.5])
    auto.update(est, 2, 2, probs=[0.8, 0.4])  # whole chain: position 3 raised to position 2's
    assert est == pytest.approx([0.675, 0.4, 0.5])


def test_sampled_rows_move_at_their_own_alpha():
    """A sampled row's estimate moves by ``sampled_alpha``, a greedy row's by ``alpha``; the
    shared estimate by ``shared_alpha`` either way."""
    auto = AutoK(FLAT, 2, prior=0.5, alpha=0.4, sampled_alpha=0.1, shared_alpha=0.0, calibrate=False)
    greedy, sampled = auto.new_estimate(), auto.new_estimate()
    auto.update(greedy, 1, 1)
    auto.update(sampled, 1, 1, probs=[1.0])
    assert greedy[0] == pytest.approx(0.7) and sampled[0] == pytest.approx(0.55)
    assert AutoK(FLAT, 2, alpha=0.3).sampled_alpha == 0.3  # None: the one alpha
    with pytest.raises(ValueError, match="sampled_alpha"):
        AutoK(FLAT, 2, sampled_alpha=0.0)


def test_shared_estimate_is_a_mean_with_the_prior_until_alpha_weighs_more():
    """The shared estimate's first observations are averaged with the prior (worth
    SHARED_PRIOR_WEIGHT of them), position by position; once 1 / (weight + n) falls below
    ``shared_alpha`` it is a moving average at ``shared_alpha``. A source seen 20 times at 0.1
    is priced at ~0.18, not at the ~0.43 a moving average from the prior 0.5 left it at."""
    auto = AutoK(FLAT, 2, prior=0.5, alpha=0.2, shared_alpha=0.02, calibrate=False)
    w = AutoK.SHARED_PRIOR_WEIGHT
    for n in range(1, 21):
        auto.update(auto.new_estimate("lookup1"), 1, 0, "lookup1", probs=[0.1])
        assert auto.shared["lookup1"][0] == pytest.approx((w * 0.5 + n * 0.1) / (w + n))
    assert auto.shared["lookup1"][1] == 0.5  # position 2 not observed yet
    assert auto.shared["lookup1"][0] < 0.19
    # past 1 / (w + n) < shared_alpha the weight stays at shared_alpha
    for _ in range(100):
        auto.update(auto.new_estimate("lookup1"), 1, 0, "lookup1", probs=[0.1])
    before = auto.shared["lookup1"][0]
    auto.update(auto.new_estimate("lookup1"), 1, 0, "lookup1", probs=[0.9])
    assert auto.shared["lookup1"][0] == pytest.approx(before + 0.02 * (0.9 - before))
    # a row's own estimate keeps its alpha from the first observation
    row = auto.new_estimate("head")
    auto.update(row, 1, 1)
    assert row[0] == pytest.approx(0.5 + 0.2 * 0.5)


def test_new_requests_start_from_what_earlier_requests_measured():
    auto = AutoK(FLAT, 3, prior=0.5, alpha=0.2, shared_alpha=0.1, calibrate=False)
    for _ in range(200):  # requests whose head is never right
        auto.update(auto.new_estimate(), 3, 0)
    fresh = auto.new_estimate()
    assert fresh[0] < 0.01 and auto.best([fresh]) == 0  # the next request does not draft at once
    fresh[0] = 0.9
    assert auto.shared["head"][0] < 0.01  # a request's own estimate is its own copy


def test_probe_after_a_run_of_plain_cycles():
    # cheap verification: a K=1 probe loses ~1 ms against plain decoding, due after probe_every
    auto = AutoK(FLAT, 3, probe_every=4, calibrate=False)
    assert auto.choose([[0.1] * 3], zero_run=3) == 0
    assert auto.choose([[0.1] * 3], zero_run=4) == 1
    # expensive verification: the probe (108 ms for an expected 1.1 tokens) loses 53 ms against
    # plain decoding (50 ms a token); at a 2% budget it waits for 53 cycles at K=0
    steep = AutoK(STEEP, 3, probe_every=4, calibrate=False, probe_budget=0.02)
    assert steep.choose([[0.1] * 3], zero_run=52) == 0
    assert steep.choose([[0.1] * 3], zero_run=53) == 1
    # the head's catch-up over the skipped positions is part of what a probe costs
    assert FLAT.extend_ms(0) == 0.0 and FLAT.extend_ms(5) == 2.0  # no extend_by_n: one cost
    ext = StepCosts(dict(FLAT.verify), 3.0, 2.0, extend_by_n={1: 2.0, 4: 5.0})
    assert ext.extend_ms(8) == pytest.approx(9.0)  # extrapolated: 1 ms a position
    late = AutoK(ext, 3, probe_every=4, calibrate=False)
    assert late.cycle_ms(1, 1, deferred=8) == pytest.approx(ext.cycle_ms(1) + 9.0)
    assert late.cycle_ms(0, 1, deferred=8) == ext.cycle_ms(0)  # a K=0 cycle defers, pays nothing
    assert late.probe_due([[0.1] * 3], zero_run=8, deferred=0)
    assert not late.probe_due([[0.1] * 3], zero_run=8, deferred=8)  # 1 + 9 ms > 2% of 8 x 50 ms


def test_probes_at_a_large_batch_wait_for_their_budget():
    """At 16 rows a K=1 cycle costs 1.6x a plain one (measured on the AMX Xeon): a probe at
    every 8th cycle cost the auto arm a third of K=0's throughput under load; with the budget it
    waits until K=0's time pays for it, while one row at a time still probes after 8."""
    b16 = StepCosts({1: 85.0, 2: 135.0, 4: 144.0}, 0.5, 4.0)
    costs = StepCosts({1: 44.5, 2: 50.9, 4: 52.6}, 0.7, 2.0, by_batch={16: b16})
    auto = AutoK(costs, 3, probe_every=8, calibrate=False)
    rows = [[0.37] * 3] * 16
    assert auto.choose(rows, zero_run=8) == 0 and auto.probe_due(rows[:1], zero_run=8)
    due = next(z for z in range(8, 1000) if auto.choose(rows, zero_run=z) == 1)
    loss = auto.cycle_ms(1, 16) - 85.0 * 1.37
    assert due == pytest.approx(loss / (0.02 * 85.0), abs=1)
    with pytest.raises(ValueError):
        AutoK(FLAT, 0, calibrate=False)


def second_token_marginal(t, prompt: list[int], v: int) -> torch.Tensor:
    """The target's distribution of the second generated token, sum_x p(x | prompt) p(y | prompt, x)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        p1 = torch.softmax(t.model(ids).logits[0, -1].float(), -1)                 # [v]
        both = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], dim=1)    # [v, len + 1]
        p2 = torch.softmax(t.model(both).logits[:, -1].float(), -1)                 # [v, v]
        return p1 @ p2


def peaky_world(v: int):
    """A tiny target with ``v`` tokens and a random head whose distributions are peaked (its
    final norm scaled up), so its sampled drafts are accepted often enough to test with."""
    t = tiny_target("llama", seed=5, vocab=v)
    head = random_head(t, "deepseek", seed=9)
    with torch.no_grad():
        head.final_norm.weight.mul_(4.0)
    return t, head


@pytest.fixture(scope="module")
def llama():
    t = tiny_target("llama")
    return t, random_head(t, "mimo"), [greedy_reference(t, p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
@pytest.mark.parametrize("kmax", [1, 3, 5])
def test_auto_greedy_equals_plain_decoding(llama, costs, kmax):
    """Whatever K each cycle picks (K=0 cycles, probes, catch-up extends), greedy output is the
    target's own, batched and alone."""
    t, head, ref = llama
    eng = ReferenceEngine(t, head, kmax, auto=AutoK(costs, kmax, probe_every=3))
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS])
    assert [r.output_ids for r in res] == ref
    for p, want in zip(PROMPTS, ref):
        assert eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW))])[0].output_ids == want
    drafted = [c.drafted for r in res for c in r.metrics.cycles]
    assert set(drafted) <= set(range(kmax + 1))


def test_auto_perfect_drafter_drafts_kmax_and_switches_back_from_zero():
    """The successor world: every draft is right. Auto drafts Kmax once its estimates rise; after
    K=0 cycles (a pessimistic prior) the head catches up on the skipped positions and is still
    right, so the output is the target's and tau rises."""
    t, head = successor_world()
    auto = AutoK(FLAT, 4, prior=0.0, probe_every=2, calibrate=False)  # starts at K=0, probes, then learns
    r = ReferenceEngine(t, head, 4, auto=auto).generate(
        [Request([5], SamplingParams(max_new_tokens=40))])[0]
    assert r.output_ids == [(6 + i) % V for i in range(40)]
    drafted = [c.drafted for c in r.metrics.cycles]
    assert drafted[:2] == [0, 0] and 1 in drafted and drafted[-1] == 4
    assert all(c.accepted == c.drafted for c in r.metrics.cycles)  # never a rejection


def test_auto_useless_head_on_steep_costs_settles_at_zero(llama):
    t, head, ref = llama
    auto = AutoK(STEEP, 3, probe_every=8, calibrate=False)
    r = ReferenceEngine(t, head, 3, auto=auto).generate(
        [Request(PROMPTS[0], SamplingParams(max_new_tokens=N_NEW))])[0]
    assert r.output_ids == ref[0]
    drafted = [c.drafted for c in r.metrics.cycles]
    assert drafted.count(0) >= len(drafted) - 4  # plain decoding but for the probes


def test_auto_with_prompt_lookup_is_lossless(llama):
    t, _, ref = llama
    eng = ReferenceEngine(t, None, 3, drafter=NgramDrafter(), auto=AutoK(FLAT, 3, calibrate=False))
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS])
    assert [r.output_ids for r in res] == ref


def test_auto_sampled_tokens_follow_the_target():
    """Lossless sampling with K chosen per cycle: the first verified token follows the target's
    marginal (as tests/test_engine.py checks at fixed K)."""
    v = 12
    t, head = peaky_world(v)
    prompt = [4, 9, 2]
    want = second_token_marginal(t, prompt, v)
    n = 3000
    # (row_margin 0: a batch of 3000 rows that FLAT prices as free to verify is to draft)
    eng = ReferenceEngine(t, head, 2, max_context=16, auto=AutoK(FLAT, 2, calibrate=False, row_margin=0.0))
    res = eng.generate([Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=11 + i))
                        for i in range(n)])
    second = torch.tensor([r.output_ids[1] for r in res])
    emp = torch.bincount(second, minlength=v).float() / n
    tv = 0.5 * (emp - want).abs().sum().item()
    assert tv < 0.05, f"total variation {tv:.3f} between emitted and target marginals"
    assert any(c.drafted for r in res for c in r.metrics.cycles)  # drafts were verified


def test_the_engine_hands_auto_each_positions_chance_of_acceptance(monkeypatch):
    """Sampled: what a row's estimate observes at a position is the chance its draft is accepted
    there; over many rows its mean matches how often the drafts were accepted. Greedy: the
    outcomes themselves (no probabilities)."""
    v = 12
    t, head = peaky_world(v)
    seen = []
    real = AutoK.update
    monkeypatch.setattr(AutoK, "update", lambda self, est, k, acc, source="head", probs=None:
                        (seen.append((k, acc, probs)), real(self, est, k, acc, source, probs))[1])
    auto = AutoK(FLAT, 2, calibrate=False, row_margin=0.0)
    eng = ReferenceEngine(t, head, 2, max_context=16, auto=auto)
    n = 2000
    eng.generate([Request([4, 9, 2], SamplingParams(temperature=1.0, max_new_tokens=2, seed=i)) for i in range(n)])
    drafted = [(acc, probs) for k, acc, probs in seen if k]
    assert len(drafted) > n // 2 and all(len(p) == 2 and all(0.0 <= x <= 1.0 + 1e-6 for x in p)
                                         for _, p in drafted)
    rate = sum(acc >= 1 for acc, _ in drafted) / len(drafted)
    chance = sum(p[0] for _, p in drafted) / len(drafted)
    assert 0.05 < rate < 0.95 and abs(rate - chance) < 0.04, (rate, chance)
    seen.clear()
    eng.generate([Request([4, 9, 2], SamplingParams(max_new_tokens=6))])
    assert seen and all(probs is None for _, _, probs in seen)


def test_engine_refuses_an_auto_that_does_not_match_its_steps(llama):
    t, head, _ = llama
    with pytest.raises(ValueError, match="auto"):
        ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 2, calibrate=False))


REPEATS = [[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4], [8, 9, 10, 11, 8, 9], [2, 40, 41, 2, 40]]


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
def test_hybrid_greedy_equals_plain_decoding(llama, costs):
    """Head rows, prompt-lookup rows and K=0 cycles mixed in one batch: still the target's own
    greedy output, batched and alone."""
    t, head, _ = llama
    prompts = PROMPTS + REPEATS
    ref = [greedy_reference(t, p, N_NEW) for p in prompts]
    eng = ReferenceEngine(t, head, 3, drafter=NgramDrafter(max_ngram=3),
                          auto=AutoK(costs, 3, probe_every=3), hybrid=True)
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in prompts])
    assert [r.output_ids for r in res] == ref
    for p, want in zip(prompts, ref):
        assert eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW))])[0].output_ids == want


def test_hybrid_takes_prompt_lookup_where_it_is_right():
    """A target that repeats its prompt's cycle and a head that is never right: the rows switch
    to prompt lookup (whose estimate for long matches rises) and accept its drafts."""
    t, head = successor_world()  # target: x -> x+1; the prompt 10..14 then continues 15, 16, ...
    wrong = random_head(t, "split", seed=4)  # a head that does not know the successor rule
    eng = ReferenceEngine(t, wrong, 3, drafter=NgramDrafter(max_ngram=2), auto=AutoK(FLAT, 3, calibrate=False),
                          hybrid=True)
    # the continuation of 1..30 is 31, 32, ...: never in the prompt, so lookup has nothing right;
    # the prompt 5..20 followed by 5..9 makes the target continue 10, 11, ... which lookup finds
    r = eng.generate([Request(list(range(5, 21)) + list(range(5, 10)), SamplingParams(max_new_tokens=24))])[0]
    assert r.output_ids == [(10 + i) % V for i in range(24)]
    look = [c for c in r.metrics.cycles if c.source == "lookup"]
    assert look and sum(c.accepted for c in look) >= len(look)  # lookup drafts were taken and accepted


def test_hybrid_sampled_tokens_follow_the_target():
    v = 12
    t, head = peaky_world(v)
    prompt = [4, 9, 2, 4, 9]  # lookup proposes "2 ..." after "4 9"
    want = second_token_marginal(t, prompt, v)
    n = 3000
    auto = AutoK(FLAT, 2, calibrate=False, row_margin=0.0)  # (3000 rows that are to draft)
    auto.shared["lookup2"] = [0.9, 0.9]  # earlier requests found long lookup matches right
    eng = ReferenceEngine(t, head, 2, max_context=16, drafter=NgramDrafter(), auto=auto, hybrid=True)
    # rows of the repeating prompt take the lookup proposal; rows of [1, 7, 3] (no match) the head
    reqs = [Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=11 + i)) for i in range(n)]
    reqs += [Request([1, 7, 3], SamplingParams(temperature=1.0, max_new_tokens=2, seed=i)) for i in range(200)]
    res = eng.generate(reqs)
    second = torch.tensor([r.output_ids[1] for r in res[:n]])
    emp = torch.bincount(second, minlength=v).float() / n
    tv = 0.5 * (emp - want).abs().sum().item()
    assert tv < 0.05, f"total variation {tv:.3f} between emitted and target marginals"
    srcs = {c.source for r in res for c in r.metrics.cycles if c.drafted}
    assert "lookup" in srcs and "" in srcs  # both sources were verified in the mixed batches


def test_hybrid_needs_auto_a_head_and_a_drafter(llama):
    t, head, _ = llama
    with pytest.raises(ValueError, match="hybrid"):
        ReferenceEngine(t, head, 3, drafter=NgramDrafter(), hybrid=True)


def test_k_falls_to_zero_as_the_batch_grows():
    """K per batch size: cheap verification at batch 1, verification that grows with the rows
    at batch 16 (compute-bound): the same acceptance gets Kmax alone and K=0 in a batch of 16,
    a smaller K in between, and costs between measured batch sizes are interpolated."""
    b16 = StepCosts({1: 100.0, 2: 190.0, 4: 370.0, 6: 550.0}, draft_step=6.0, extend=8.0)
    costs = StepCosts(dict(FLAT.verify), FLAT.draft_step, FLAT.extend, by_batch={16: b16})
    assert costs.cycle_ms(2, 1) == FLAT.cycle_ms(2)
    assert costs.cycle_ms(2, 16) == pytest.approx(b16.cycle_ms(2))
    mid = costs.cycle_ms(2, 8)
    assert FLAT.cycle_ms(2) < mid < b16.cycle_ms(2)
    assert mid == pytest.approx(FLAT.cycle_ms(2) + (b16.cycle_ms(2) - FLAT.cycle_ms(2)) * 7 / 15)
    auto = AutoK(costs, 5)
    ks = {b: auto.best([[0.7] * 5] * b) for b in (1, 4, 8, 16, 32)}
    assert ks[1] == 5 and ks[16] == 0 and ks[32] == 0
    assert ks[1] >= ks[4] >= ks[8] >= ks[16]


def test_step_costs_from_batched_curves(llama_target):
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.decode.costs import measure

    t = load_target(llama_target.path, "float32")
    head = random_head(t, "deepseek")
    curves = [measure(t, head, ns=(1, 2, 3), context=16, repeats=2, warmup=1, bandwidth_mib=8,
                      batch=b) for b in (1, 4)]
    assert [c.batch for c in curves] == [1, 4]
    sc = StepCosts.from_curve(curves[0], curves[1:])
    assert set(sc.by_batch) == {4} and sc.by_batch[4].verify == curves[1].verify_ms
    assert sc.cycle_ms(2, 4) == pytest.approx(sc.by_batch[4].cycle_ms(2))


def test_measured_cycles_correct_the_curve():
    """A serving loop whose cycles at K=3 take twice what the curve says: after some cycles
    the controller prices K=3 at what it costs and drafts less; K=0 cycles that match the
    curve leave it as it was."""
    auto = AutoK(FLAT, 3)
    est = [[0.6] * 3]
    assert auto.best(est) == 3
    for _ in range(40):
        auto.observe_cycle(3, 1, 2 * FLAT.cycle_ms(3))
        auto.observe_cycle(0, 1, FLAT.cycle_ms(0))
    assert auto.cycle_ms(3, 1) == pytest.approx(2 * FLAT.cycle_ms(3), rel=0.05)
    assert auto.cycle_ms(0, 1) == pytest.approx(FLAT.cycle_ms(0))
    assert auto.best(est) < 3


def test_at_one_row_every_drafting_k_follows_the_cycles_of_any():
    """At one row the drafting K share one ratio: a K priced high by a slow stretch of its own
    cycles is priced again by the next cycles of any other K (a ratio per K moved only while
    that K ran, and a K that no longer ran kept its stale price); K=0 and prompt-lookup cycles
    keep their own. From two rows on each K keeps its own."""
    auto = AutoK(FLAT, 3)
    for _ in range(15):
        auto.observe_cycle(2, 1, 1.5 * FLAT.cycle_ms(2))
    assert auto.cycle_ms(2, 1) == pytest.approx(1.5 * FLAT.cycle_ms(2))
    for _ in range(15):  # the loop is fast again; only K=1 runs
        auto.observe_cycle(1, 1, FLAT.cycle_ms(1))
    assert auto.cycle_ms(2, 1) == pytest.approx(FLAT.cycle_ms(2))
    assert auto.cycle_ms(3, 1) == pytest.approx(FLAT.cycle_ms(3))
    assert auto.cycle_ms(0, 1) == pytest.approx(FLAT.cycle_ms(0))
    for _ in range(15):
        auto.observe_cycle(2, 1, 1.3 * FLAT.verify_at(3, 1), head_steps=False)  # prompt lookup's own
    assert auto.cycle_ms(2, 1) == pytest.approx(FLAT.cycle_ms(2))
    assert auto.cycle_ms(1, 1, head_steps=False) == pytest.approx(1.3 * FLAT.verify_at(2, 1))
    for _ in range(15):  # at 4 rows: per K (a K not yet run there starts from smaller ones')
        auto.observe_cycle(2, 4, 1.5 * FLAT.cycle_ms(2, 4))
    assert auto.cycle_ms(2, 4) == pytest.approx(1.5 * FLAT.cycle_ms(2, 4))
    assert auto.cycle_ms(1, 4) == pytest.approx(FLAT.cycle_ms(1, 4))
    assert auto.cycle_ms(3, 4) == pytest.approx(1.5 * FLAT.cycle_ms(3, 4))
    for _ in range(15):
        auto.observe_cycle(1, 4, FLAT.cycle_ms(1, 4))
    assert auto.cycle_ms(1, 4) == pytest.approx(FLAT.cycle_ms(1, 4))
    assert auto.cycle_ms(2, 4) == pytest.approx(1.5 * FLAT.cycle_ms(2, 4))
    assert auto.cycle_ms(3, 4) == pytest.approx(1.25 * FLAT.cycle_ms(3, 4))  # median of 1 and 1.5


def test_calibration_is_kept_per_batch_size_class():
    """Cycles at batch 16 that take twice the curve's price leave batch 1's prices alone."""
    from fastmtp_sglang.decode.auto import batch_class

    assert [batch_class(b) for b in (1, 2, 3, 4, 7, 8, 15, 16, 17)] == [1, 2, 2, 4, 4, 8, 8, 16, 16]
    auto = AutoK(FLAT, 3)
    for _ in range(60):
        auto.observe_cycle(1, 16, 2 * FLAT.cycle_ms(1, 16))
    assert auto.cycle_ms(1, 16) == pytest.approx(2 * FLAT.cycle_ms(1, 16), rel=0.05)
    assert auto.cycle_ms(1, 17) == pytest.approx(2 * FLAT.cycle_ms(1, 17), rel=0.05)
    assert auto.cycle_ms(1, 1) == FLAT.cycle_ms(1, 1) and auto.cycle_ms(1, 8) == FLAT.cycle_ms(1, 8)


def test_lookup_cycles_are_calibrated_apart_and_a_new_k_starts_from_the_class_below():
    """Cycles without the head (priced at the verify alone) keep their own ratio beside head
    cycles at the same K and batch class; a K not yet run at a class starts from the larger of
    K=0's ratio there and its own at the class below."""
    auto = AutoK(FLAT, 3)
    for _ in range(20):
        auto.observe_cycle(1, 1, 1.2 * FLAT.cycle_ms(1, 1))
        auto.observe_cycle(1, 1, 2.0 * FLAT.verify_ms(2), head_steps=False)
    assert auto.cycle_ms(1, 1) == pytest.approx(1.2 * FLAT.cycle_ms(1, 1), rel=0.01)
    assert auto.cycle_ms(1, 1, head_steps=False) == pytest.approx(2.0 * FLAT.verify_ms(2), rel=0.01)
    for _ in range(20):
        auto.observe_cycle(0, 8, 1.1 * FLAT.cycle_ms(0, 8))
        auto.observe_cycle(0, 16, 1.1 * FLAT.cycle_ms(0, 16))
        auto.observe_cycle(1, 4, 1.8 * FLAT.verify_ms(2), head_steps=False)
    assert auto.cycle_ms(1, 8, head_steps=False) == pytest.approx(1.8 * FLAT.verify_ms(2), rel=0.01)
    assert auto.cycle_ms(1, 8) == pytest.approx(1.1 * FLAT.cycle_ms(1, 8), rel=0.01)  # head: K=0's
    # two classes up, nothing measured at 8 for K=1 lookup: K=0's ratio at 16
    assert auto.cycle_ms(1, 16, head_steps=False) == pytest.approx(1.1 * FLAT.verify_ms(2), rel=0.01)


def test_drafting_must_beat_plain_decoding_by_the_margin():
    """A K whose expected throughput is 1-2% above K=0's is not worth the risk; 10% is."""
    costs = StepCosts({1: 50.0, 2: 60.0}, draft_step=0.0, extend=0.0)
    # K=1: (1 + a) / 60 against 1 / 50 -> gain = 50 (1 + a) / 60 - 1
    small, large = 60 / 50 * 1.015 - 1, 60 / 50 * 1.10 - 1    # acceptances giving +1.5% and +10%
    for margin, a, want in ((0.03, small, 0), (0.0, small, 1), (0.03, large, 1)):
        auto = AutoK(costs, 1, calibrate=False, margin=margin)
        assert auto.best([[a]]) == want, (margin, a)
        assert auto.plan_hybrid([[a]], [None], 0)[0] == want, (margin, a)
    with pytest.raises(ValueError):
        AutoK(costs, 1, margin=1.5)


def test_the_margin_grows_with_the_batch():
    """+10% promised at every size: one row drafts (margin 3%); 16 rows do not (3% + 15 x 1%),
    unless row_margin is 0; the hybrid's choice and the probe's room follow the same margin."""
    costs = StepCosts({1: 50.0, 2: 60.0}, draft_step=0.0, extend=0.0)
    a = 60 / 50 * 1.10 - 1
    auto = AutoK(costs, 1, calibrate=False)
    assert auto.margin_at(1) == pytest.approx(0.03) and auto.margin_at(16) == pytest.approx(0.18)
    assert auto.best([[a]]) == 1 and auto.best([[a]] * 16) == 0
    assert auto.plan_hybrid([[a]] * 16, [None] * 16, 0)[0] == 0
    auto.update([a], 1, 1)  # drafting observed: room() now judges by the shared estimate
    auto.shared["head"] = [a]
    assert auto.room(1) and not auto.room(16)
    flat = AutoK(costs, 1, calibrate=False, row_margin=0.0)
    assert flat.best([[a]] * 16) == 1 and flat.plan_hybrid([[a]] * 16, [None] * 16, 0)[0] == 1
    with pytest.raises(ValueError):
        AutoK(costs, 1, row_margin=-0.1)


def test_an_uncalibrated_k_inherits_k0s_overhead_at_its_batch_class():
    """Under load K=0's cycles take 1.5x the curve; K=1, never run yet at that batch size, is
    priced with the same overhead, not at the bare curve (which made drafting look cheap)."""
    auto = AutoK(FLAT, 3)
    for _ in range(60):
        auto.observe_cycle(0, 16, 1.5 * FLAT.cycle_ms(0, 16))
    assert auto.cycle_ms(1, 16) == pytest.approx(1.5 * FLAT.cycle_ms(1, 16), rel=0.05)
    assert auto.cycle_ms(1, 1) == FLAT.cycle_ms(1, 1)            # another batch class: untouched
    auto.observe_cycle(1, 16, FLAT.cycle_ms(1, 16))              # K=1's first cycle is weighed
    assert auto.cycle_ms(1, 16) == pytest.approx(1.5 * FLAT.cycle_ms(1, 16))  # against the inherited
    for _ in range(2):                                           # ratio; after a few, its own
        auto.observe_cycle(1, 16, FLAT.cycle_ms(1, 16))
    assert auto.cycle_ms(1, 16) == pytest.approx(FLAT.cycle_ms(1, 16))


def test_an_uncalibrated_k_inherits_its_kinds_ratio_at_its_class():
    """Lookup cycles at K=2 and K=4 of 16 rows took 2x and 2.4x their price: a lookup K not yet
    run there starts from the median of the smaller ones (K=5: 2.2x; K=3: 2x), not K=0's ratio
    (1.2x); K=1, smaller than both, keeps K=0's (a larger K's ratio could price it out for
    good); a head K at 16 rows (the other kind) and a lookup K at 8 rows (another class) keep
    what they had."""
    auto = AutoK(FLAT, 8)
    for _ in range(20):
        auto.observe_cycle(0, 16, 1.2 * FLAT.cycle_ms(0, 16))
        auto.observe_cycle(0, 8, 1.2 * FLAT.cycle_ms(0, 8))
    lk = lambda k, b: auto._model_ms(k, b, False, 0)  # noqa: E731  (the verify alone)
    assert auto.cycle_ms(5, 16, head_steps=False) == pytest.approx(1.2 * lk(5, 16))
    for _ in range(3):
        auto.observe_cycle(2, 16, 2.0 * lk(2, 16), head_steps=False)
        auto.observe_cycle(4, 16, 2.4 * lk(4, 16), head_steps=False)
    assert auto.cycle_ms(5, 16, head_steps=False) == pytest.approx(2.2 * lk(5, 16))
    assert auto.cycle_ms(3, 16, head_steps=False) == pytest.approx(2.0 * lk(3, 16))  # smaller Ks only
    assert auto.cycle_ms(1, 16, head_steps=False) == pytest.approx(1.2 * lk(1, 16))  # none smaller
    assert auto.cycle_ms(5, 16) == pytest.approx(1.2 * auto._model_ms(5, 16, True, 0))
    assert auto.cycle_ms(5, 8, head_steps=False) == pytest.approx(1.2 * lk(5, 8))
    # a K's own cycles take over from what it inherited
    for _ in range(3):
        auto.observe_cycle(5, 16, 1.5 * lk(5, 16), head_steps=False)
    assert auto.cycle_ms(5, 16, head_steps=False) == pytest.approx(1.5 * lk(5, 16))


def test_the_odd_slow_cycle_does_not_set_the_price():
    """One K=0 cycle in five pays a repack or a pause (3x its price): the calibrated price stays
    at the typical cycle's (an average had put it 40% higher, and drafting beside it looked
    cheap), and a real shift in the typical cycle moves it within a window."""
    auto = AutoK(FLAT, 3)
    for i in range(60):
        auto.observe_cycle(0, 16, (3.0 if i % 5 == 4 else 1.0) * FLAT.cycle_ms(0, 16))
    assert auto.calib[(0, 16)] == pytest.approx(1.0)
    for _ in range(AutoK.CALIB_WINDOW):
        auto.observe_cycle(0, 16, 1.2 * FLAT.cycle_ms(0, 16))
    assert auto.calib[(0, 16)] == pytest.approx(1.2)


def test_a_catch_up_is_priced_at_what_catch_ups_took():
    """The curve's extends of 1..K+1 positions are nearly flat, so it prices a catch-up over 24
    skipped positions like one over 4; once catch-ups are seen at a batch class, they are priced
    per position at what they took, and a probe after a long K=0 run waits accordingly."""
    b16 = StepCosts({1: 85.0, 2: 135.0, 4: 144.0}, 0.5, 4.0)   # 16 rows on the AMX Xeon
    costs = StepCosts({1: 44.5, 2: 50.9, 4: 52.6}, 0.7, 2.0, by_batch={16: b16})
    auto = AutoK(costs, 3, probe_every=4)
    rows = [[0.3] * 3] * 16
    flat = auto.cycle_ms(1, 16, deferred=24)
    assert flat == pytest.approx(costs.cycle_ms(1, 16) + costs.extend_ms(24, 16))
    due_before = next(z for z in range(4, 10_000) if auto.probe_due(rows, zero_run=z, deferred=z))
    base = costs.extend_ms(1, 16)
    for z in (8, 16, 24):
        auto.observe_catch_up(16, z, base + 1.0 * (z - 1))  # 1 ms a position beyond the first
    assert auto.catch_up_ms(24, 16) == pytest.approx(base + 23.0)
    assert auto.cycle_ms(1, 16, deferred=24) == pytest.approx(flat - costs.extend_ms(24, 16) + base + 23.0, rel=0.01)
    auto.observe_catch_up(2, 1, 50.0)                    # one position says nothing of the slope
    assert auto.catch_up_ms(24, 2) == costs.extend_ms(24, 2)
    assert auto.catch_up_ms(24, 1) == costs.extend_ms(24, 1)  # another batch class: the curve
    due_after = next((z for z in range(4, 10_000) if auto.probe_due(rows, zero_run=z, deferred=z)), None)
    assert due_after is None or due_after > 1.2 * due_before


def test_a_catch_up_is_spread_over_the_cycles_left():
    """After a run of cycles without the head, its catch-up is paid once and buys the head back
    for the cycles the rows have left: spread over those, a head worth drafting is chosen again
    however long it sat out; charged whole to one cycle (``left`` = 1) it is not, and the longer
    the run the surer (auto then drafted almost only with prompt lookup at 2-4 clients while the
    head at K=1 was the best arm). A probe still pays the catch-up whole."""
    costs = StepCosts({1: 40.0, 2: 42.0, 4: 45.0}, draft_step=5.0, extend=2.0,
                      extend_by_n={1: 2.0, 4: 4.0})       # ~0.67 ms a further position
    auto = AutoK(costs, 3, calibrate=False)
    rows = [[0.45] * 3] * 2                               # the head's step-1 acceptance at 2 rows
    assert auto.choose(rows, 0) >= 1                      # caught up: the head pays
    z = 120                                               # ~80 ms of catch-up
    assert auto.choose(rows, 0, deferred=z) == 0          # charged whole (left = 1): K=0
    assert auto.choose(rows, 0, deferred=z, left=200) >= 1  # spread over 200 cycles: the head
    assert auto.choose(rows, 0, deferred=z, left=4) == 0  # a few tokens left: not worth it
    lookups = [([0.1] * 3, 1)] * 2                        # one-token, weak prompt-lookup proposals
    k, use, _ = auto.plan_hybrid(rows, lookups, 0, deferred=z)
    assert k == 0 or all(use)                             # whole: never the head
    k, use, _ = auto.plan_hybrid(rows, lookups, 0, deferred=z, left=200)
    assert k >= 1 and not any(use)                        # spread: the head for both rows
    # the share: the catch-up times the rows' tokens a cycle over the cycles left, at most whole
    whole = auto.catch_up_ms(z, 2)
    assert auto._head_share(0.0, z, 2, 200, 1.5) == pytest.approx(whole * 1.5 / 200)
    assert auto._head_share(0.0, z, 2, 1, 1.5) == pytest.approx(whole)
    assert auto._head_share(3.0, 0, 2, 200, 2.0) == pytest.approx(6.0)  # the prompts' share alone
    # a probe pays it whole: after z cycles at K=0 a head at 10% is not probed at once
    assert not auto.probe_due([[0.1] * 3] * 2, zero_run=8, deferred=z)


def test_a_catch_up_is_spread_only_over_the_head_cycles_that_followed_catch_ups():
    """Under load the head drafted a cycle or two after a catch-up and the batch went back to
    K=0, so a catch-up spread over the rows' whole budgets was paid by one or two cycles. Once
    runs are seen at a batch class the catch-up is spread over at most their median length
    there; where the head went on drafting (one row), over the cycles left as before. A cycle
    on prompt lookup alone neither counts nor ends a run; a run a probe started is not kept."""
    costs = StepCosts({1: 40.0, 2: 42.0, 4: 45.0}, draft_step=5.0, extend=2.0,
                      extend_by_n={1: 2.0, 4: 4.0})
    auto = AutoK(costs, 3)
    z = 120
    whole = auto.catch_up_ms(z, 8)
    assert auto._head_share(0.0, z, 8, 200, 1.5) == pytest.approx(whole * 1.5 / 200)  # nothing seen
    for _ in range(3):  # at 8 rows: K=0, a catch-up, a lookup-only cycle, one more head cycle, K=0
        auto.observe_cycle(0, 8, 40.0)
        auto.observe_cycle(1, 8, 60.0, deferred=z)
        auto.observe_cycle(2, 8, 45.0, head_steps=False)
        auto.observe_cycle(1, 8, 50.0, deferred=3)      # (the lookup cycle's small catch-up)
        auto.observe_cycle(0, 8, 40.0)
    assert list(auto._runs[batch_class(8)]) == [2, 2, 2]
    assert auto._head_share(0.0, z, 8, 200, 1.5) == pytest.approx(whole / 2)
    assert auto._head_share(0.0, z, 8, 3, 2.0) == pytest.approx(whole * 2 / 3)  # fewer left: as before
    rows = [[0.45] * 3] * 8
    assert auto.choose(rows, 0, deferred=z, left=200) == 0   # half of ~80 ms: not worth it
    # a probe's catch-up and the K=0 after it: not a run (probes pay their catch-up whole)
    assert auto.choose([[0.3] * 3] * 8, zero_run=10_000, deferred=z, left=200) == 1
    auto.observe_cycle(1, 8, 60.0, deferred=z)
    auto.observe_cycle(0, 8, 40.0)
    assert list(auto._runs[batch_class(8)]) == [2, 2, 2]
    # at one row the head went on drafting for 40 cycles after its catch-up
    auto.observe_cycle(1, 1, 20.0, deferred=z)
    for _ in range(39):
        auto.observe_cycle(1, 1, 18.0)
    assert batch_class(1) not in auto._runs          # still drafting: nothing kept yet
    auto.observe_cycle(0, 1, 15.0)
    assert list(auto._runs[batch_class(1)]) == [40]
    assert auto._head_share(0.0, z, 1, 200, 1.5) == pytest.approx(auto.catch_up_ms(z, 1) / 40)
    assert auto._head_share(0.0, z, 1, 1000, 1.5) == pytest.approx(auto.catch_up_ms(z, 1) / 40)
    fixed = AutoK(costs, 3, calibrate=False)          # a curve imposed: nothing learnt
    for _ in range(3):
        fixed.observe_cycle(1, 8, 60.0, deferred=z)
        fixed.observe_cycle(0, 8, 40.0)
    assert fixed._runs == {} and fixed._head_share(0.0, z, 8, 200, 1.5) == pytest.approx(whole * 1.5 / 200)


def test_the_engine_spreads_catch_ups_over_the_budget_left(llama):
    """The engine tells the controller the cycles its rows have left (the median of their
    remaining budgets), and the output stays the target's."""
    t, head, _ = llama
    eng = ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=False))
    seen = []
    choose = eng.auto.choose
    eng.auto.choose = lambda *a, **kw: seen.append(a[4] if len(a) > 4 else kw["left"]) or choose(*a, **kw)
    reqs = [Request([1, 5, 7, 9, 11], SamplingParams(max_new_tokens=12)),
            Request([3, 4], SamplingParams(max_new_tokens=20))]
    res = eng.generate(reqs)
    assert seen[0] == pytest.approx(((12 - 1) + (20 - 1)) / 2)  # after the prefill's token
    assert all(n >= 1 for n in seen)
    assert [r.output_ids for r in res] == [greedy_reference(t, r.input_ids, r.params.max_new_tokens)
                                          for r in reqs]


def test_an_estimate_left_unobserved_moves_back_towards_the_shared_one():
    """A row stops drafting with a source after a few misses; its estimate then no longer
    moves, so without relaxing it would stay low for the rest of the request (the rows' head
    estimates sat at 0.1-0.3 at 2 clients with a head at ~0.4). Each cycle that does not observe
    the source moves it ``relax`` of the way back to the shared one, so the row drafts again."""
    costs = StepCosts({1: 40.0, 2: 42.0, 4: 45.0}, draft_step=5.0, extend=2.0)
    auto = AutoK(costs, 3, calibrate=False, prior=0.45, shared_alpha=0.0)
    est = auto.new_estimate()
    for _ in range(3):
        auto.update(est, 1, 0)                            # three misses in a row
    assert est[0] == pytest.approx(0.45 * 0.8 ** 3) and auto.choose([est], 0) == 0
    n = next(n for n in range(1, 100) if auto.relax_estimate(est) or auto.choose([est], 0) > 0)
    assert 3 <= n <= 20 and est[0] < 0.45                 # back to drafting after some cycles
    auto.relax_estimate(est, "lookup4")                   # a source nobody measured: unchanged
    frozen = AutoK(costs, 3, calibrate=False, prior=0.45, shared_alpha=0.0, relax=0.0)
    low = frozen.new_estimate()
    frozen.update(low, 1, 0)
    for _ in range(100):
        frozen.relax_estimate(low)
    assert low[0] == pytest.approx(0.36)
    with pytest.raises(ValueError, match="relax"):
        AutoK(costs, 3, relax=1.5)


def test_the_engine_reports_its_catch_ups(llama):
    t, head, _ = llama
    eng = ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=True))
    plan = iter([0] * 6 + [2] * 100)
    eng._choose = lambda b: next(plan)
    eng.generate([Request([1, 5, 7, 9, 11], SamplingParams(max_new_tokens=12)),
                  Request([3, 4], SamplingParams(max_new_tokens=12))])
    assert list(eng.auto._catch_up) == [2] and len(eng.auto._catch_up[2]) == 1  # (6 positions)


def test_the_heads_first_reading_of_prompts_is_priced_over_the_budget_left():
    """The head reads a row's prompt when the row first drafts (ReferenceEngine._head_prompts):
    a one-time cost, spread over the cycles the rows have left. Unmeasured it is free (the first
    drafting cycle is not held back by a guess); measured, rows with a long budget left still
    draft, rows near the end of theirs stay at K=0, and a probe waits for it too."""
    auto = AutoK(FLAT, 3, calibrate=True)
    good, bad = [[0.6] * 3] * 2, [[0.05] * 3] * 2
    assert auto.once_ms(1600, 2) == 0.0
    auto.observe_prompts(400, 40.0)                                  # 0.1 ms a prompt token
    assert auto.once_ms(1600, 60) == pytest.approx(1600 * 0.1 / 60)
    assert auto.once_ms(1600, 0) == pytest.approx(160.0)             # (at least one cycle)
    assert auto.best(good) == 3
    assert auto.best(good, once=auto.once_ms(1600, 60)) == 3         # 2.7 ms a cycle: it pays
    assert auto.best(good, once=auto.once_ms(1600, 2)) == 0          # 80 ms a cycle: it does not
    assert auto.choose(good, 0) == 3 and auto.choose(good, 0, once=80.0) == 0
    assert auto.plan_hybrid(good, [None, None], 0, once=auto.once_ms(1600, 2))[0] == 0
    assert auto.cycle_ms(0, 2, once=5.0) == auto.cycle_ms(0, 2)      # K=0 reads no prompt
    assert auto.cycle_ms(2, 2, head_steps=False, once=5.0) == auto.cycle_ms(2, 2, head_steps=False)
    assert auto.cycle_ms(2, 2, once=5.0) == pytest.approx(auto.cycle_ms(2, 2) + 5.0)
    assert auto.probe_due(bad, zero_run=8) and not auto.probe_due(bad, zero_run=8, once=80.0)


def test_the_engine_measures_and_prices_the_heads_first_reading_of_prompts(llama):
    t, head, _ = llama
    eng = ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=True))
    once = []
    plan = iter([0] * 3 + [2] * 100)
    real = eng._prompts_once
    eng._choose = lambda b: once.append(real(b.rows)) or next(plan)
    reqs = [Request([1, 5, 7, 9, 11], SamplingParams(max_new_tokens=12)),
            Request([3, 4], SamplingParams(max_new_tokens=20))]
    eng.generate(reqs)
    assert once[:4] == [0.0] * 4 and once[-1] == 0.0   # unmeasured: free; all read: nothing left
    assert len(eng.auto._prompt_tok) == 1                # one reading of both prompts
    eng.auto._prompt_tok.clear()
    eng.auto._prompt_tok.append(0.5)                     # 0.5 ms a prompt token
    b = eng.start(reqs, [0, 1])                          # each has emitted its first token
    assert eng._prompts_once(b.rows) == pytest.approx(0.5 * 7 / 15)  # budgets left 11, 19
    b.rows[0].head_prompt = None
    assert eng._prompts_once(b.rows) == pytest.approx(0.5 * 2 / 19)
    b.rows[1].req = Request([3, 4], SamplingParams(max_new_tokens=1))  # no budget left (aborted)
    assert eng._prompts_once(b.rows) == 0.0


@pytest.mark.parametrize("hybrid", [False, True], ids=["head", "hybrid"])
@pytest.mark.parametrize("budget, drafts", [(200, True), (3, False)])
def test_rows_near_the_end_of_their_budget_do_not_pay_for_the_heads_first_reading(llama, hybrid, budget, drafts):
    """The engine's own choice (no forced plan): with the reading priced at 20 ms a prompt token
    (7 tokens: ~3 plain cycles of FLAT), rows with 199 tokens left draft in their first cycle,
    rows with 2 left decode at K=0."""
    t, head, _ = llama
    auto = AutoK(FLAT, 3, prior=0.9, calibrate=False)
    auto._prompt_tok.append(20.0)
    eng = ReferenceEngine(t, head, 3, auto=auto, drafter=NgramDrafter(max_ngram=4) if hybrid else None,
                          hybrid=hybrid)
    res = eng.generate([Request([1, 5, 7, 9, 11], SamplingParams(max_new_tokens=budget)),
                        Request([3, 4], SamplingParams(max_new_tokens=budget))])
    assert (res[0].metrics.cycles[0].drafted > 0) == drafts


def test_the_heads_first_reading_stays_out_of_the_cycles_calibration(llama, monkeypatch):
    """The reading is priced apart (once_ms), so the cycle that pays it reports its time without
    it to the calibration, and the reading's own time to observe_prompts. The engine's clock is
    the test's: it stands still except where the test moves it (the reading: 50 ms, every
    verify: 7 ms), so the times reported are exact whatever else runs on the machine."""
    t, head, _ = llama
    eng = ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=True))
    plan = iter([2] * 100)
    eng._choose = lambda b: next(plan)
    now = [0.0]
    eng.clock = lambda: now[0]
    real_cache, real_verify = head.new_cache, eng._verify

    def slow_cache(*a, **kw):  # the reading makes a cache of its own rows: 50 ms more
        now[0] += 0.050
        return real_cache(*a, **kw)

    def verify(*a, **kw):  # every cycle's verify: 7 ms
        now[0] += 0.007
        return real_verify(*a, **kw)
    eng._verify = verify
    cycles, prompts = [], []
    real_cycle, real_prompts = eng.auto.observe_cycle, eng.auto.observe_prompts
    monkeypatch.setattr(eng.auto, "observe_cycle", lambda k, b, ms, *a: cycles.append(ms) or real_cycle(k, b, ms, *a))
    monkeypatch.setattr(eng.auto, "observe_prompts", lambda n, ms: prompts.append(ms) or real_prompts(n, ms))
    b = eng.start([Request([1, 5, 7, 9, 11], SamplingParams(max_new_tokens=8))], [0])
    monkeypatch.setattr(head, "new_cache", slow_cache)
    while len(b):
        eng.step(b)
    assert prompts == [pytest.approx(50.0)]                 # read once, in the first cycle
    assert cycles == pytest.approx([7.0] * len(cycles)) and cycles  # the first one too: 57 - 50


def test_no_probes_where_the_batch_leaves_drafting_no_room():
    """Once drafting has been observed, a probe is made only at batch sizes where rows as good
    as the best shared estimate could make drafting pay: at 16 rows (K=1 at 1.6x a plain cycle)
    a head accepted 37% of the time never could, so K=0 runs without probes there, while one row
    still probes."""
    b16 = StepCosts({1: 85.0, 2: 135.0, 4: 144.0}, 0.5, 4.0)
    costs = StepCosts({1: 44.5, 2: 50.9, 4: 52.6}, 0.7, 2.0, by_batch={16: b16})
    auto = AutoK(costs, 3, probe_every=8, calibrate=False, shared_alpha=1.0)
    assert auto.room(16) and auto.room(1)  # nothing observed yet
    auto.update(auto.new_estimate(), 3, 1)   # accepted, rejected: shared = [1, 0, prior]
    auto.shared["head"] = [0.37] * 3
    rows = [[0.37] * 3] * 16
    assert not auto.room(16) and auto.room(1)
    assert all(auto.choose(rows, zero_run=z) == 0 for z in range(8, 5000, 7))
    assert auto.probe_due(rows[:1], zero_run=8)
    auto.shared["lookup4"] = [0.95] * 3  # a source that could pay at 16 reopens the room
    auto._seen["lookup4"] = 1
    assert auto.room(16)
    # ... for the hybrid's proposals, not for probes: a probe is a head cycle, and the head's
    # own estimate still could not pay at 16 rows (while one row probes as before)
    assert not auto.room(16, head_only=True) and auto.room(1, head_only=True)
    assert not any(auto.probe_due(rows, zero_run=z) for z in range(8, 5000, 7))
    assert all(auto.plan_hybrid(rows, [None] * 16, zero_run=z)[0] == 0 for z in range(8, 5000, 7))
    assert auto.probe_due(rows[:1], zero_run=8)
    auto.shared["head"] = [0.95] * 3  # a head that good could pay at 16: probes there again
    assert auto.room(16, head_only=True)


def test_room_counts_the_heads_leaves_as_its_price_does():
    """With leaves (width 3) a head cycle at K=1 verifies 4 tokens; where that costs more than
    one (AVX-512 without AMX: 18.4 against 14.4 ms, bench/results/avx512_vector_build/
    cost_curves/vec2_2) only the leaves' tokens make it pay. room()
    and the probe's price count them as the chooser does: after one early miss (shared step-1
    estimate 0.4) the chooser still drafts for a row at the shared estimate, so the room stays
    open and probes come (before, room() counted the chain alone and shut drafting off for the
    rest of the process)."""
    costs = StepCosts({1: 14.36, 4: 18.44, 8: 22.47}, draft_step=1.21, extend=0.45)
    auto = AutoK(costs, 3, width=3, calibrate=False)
    auto.update(auto.new_estimate(), 1, 0)          # one probe, missed: shared [0.4, 0.5, 0.5]
    row = auto.new_estimate()
    assert row[0] == pytest.approx(0.4)
    assert auto.head_curve(row)[1] / auto.cycle_ms(1, 1) > 1.03 / auto.cycle_ms(0, 1)  # pays with leaves
    assert auto.best([row]) >= 1
    assert auto.room(1) and auto.room(1, head_only=True)
    assert auto.probe_due([row], zero_run=8)
    auto.shared["head"] = [0.2] * 3                 # a head that bad: no room, no probes
    assert not auto.room(1) and not auto.probe_due([[0.2] * 3], zero_run=8)


def _forced_hybrid(eng, plan, prompts, ref):
    """Replace auto's choice by ``plan``: per cycle "head" (every row drafts with the head),
    "lookup" (every row takes a 3-token proposal whose first 0-3 tokens are the target's own
    continuation, varying by row and cycle, so rows accept different counts; any proposal is
    verified, so output stays the target's) or 0 (K=0)."""
    steps = iter(plan)
    cycle = [0]

    def choose(b):
        what = next(steps, "head")
        cycle[0] += 1
        b.plan, b.plan_head = [], what == "head"
        for r in b.rows:
            r.est_lookup.setdefault(1, eng.auto.new_estimate("lookup1"))
            i = prompts.index(list(r.req.input_ids))
            true = (ref[i] + [0] * 4)[len(r.out):len(r.out) + 3]
            right = (cycle[0] + i) % 4
            toks = true[:right] + [(x + 1) % V for x in true[right:]]
            if what == "free" and i % 2:  # no proposal: this row verifies nothing
                b.plan.append((True, 0, []))
            else:
                b.plan.append((what in ("lookup", "free"), 1, toks))
        return 0 if what == 0 else 3
    eng._choose = choose


def _spied_hybrid(t, head, plan, prompts, ref, eager: bool):
    """A hybrid engine forced through ``plan`` (_forced_hybrid) that records the head's drafts
    (one list per drafting cycle) and counts its forwards (``heads[0]``); ``eager``: lookup
    cycles extend the head at once instead of deferring. Returns (engine, drafts, heads)."""
    eng = ReferenceEngine(t, head, 3, drafter=NgramDrafter(max_ngram=3),
                          auto=AutoK(FLAT, 3, calibrate=False), hybrid=True)
    _forced_hybrid(eng, plan, prompts, ref)
    if eager:
        eng._head_idle = lambda b, drafted: drafted == 0
    drafts, heads, real, spy = [], [0], eng._head, eng._draft_head

    def draft_head(b, K, *splices):
        d, q = spy(b, K, *splices)
        drafts.append(d.tolist())
        return d, q

    def count(*a):
        heads[0] += 1
        return real(*a)
    eng._draft_head, eng._head = draft_head, count
    return eng, drafts, heads


def test_cycles_without_the_head_defer_its_extend_and_it_catches_up_exactly(llama, monkeypatch):
    """Cycles where every row took prompt lookup (as K=0 cycles) leave the head's extend for its
    next drafting cycle: no head forward runs in them, and the head's drafts after the catch-up
    are the drafts of an engine that extended the head at every cycle (live attention, rows
    accepting different counts). Past DEFER_MAX positions the oldest are forgotten, lookup
    cycles' too (the head drafts worse). Output stays the target's."""
    t, head, _ = llama
    prompts = [PROMPTS[0], PROMPTS[1] + PROMPTS[1], REPEATS[0]]
    ref = [greedy_reference(t, p, 20) for p in prompts]
    plan = ["head", "lookup", "lookup", 0, "lookup", "head", "lookup", 0, 0, "head"] * 3
    runs = []
    for mode in ("defer", "eager", "overflow"):
        # overflow: 5 positions (a lookup cycle adds 4): the oldest are forgotten
        monkeypatch.setattr(engine_mod, "DEFER_MAX", 5 if mode == "overflow" else 128)
        eng, drafts, heads = _spied_hybrid(t, head, plan, prompts, ref, eager=mode == "eager")
        res = eng.generate([Request(p, SamplingParams(max_new_tokens=20)) for p in prompts])
        assert [r.output_ids for r in res] == ref
        looked = {c.accepted for r in res for c in r.metrics.cycles if c.source == "lookup"}
        assert {0, 1, 2} <= looked  # rows accepted different counts in cycles without the head
        runs.append((drafts, heads[0]))
    (deferred, n_def), (eager, n_eager), (over, n_over) = runs
    assert deferred == eager and len(deferred) >= 3
    assert n_def == n_over < n_eager  # lookup cycles ran no head forward of their own


def test_a_cycle_without_the_head_leaves_rows_without_a_proposal_undrafted(llama):
    """Hybrid: when only some rows have a prompt-lookup proposal, a cycle may still skip the head;
    the rows without one verify nothing (one token, as at K=0) and the output stays the
    target's, batched with rows accepting lookup drafts."""
    t, head, _ = llama
    prompts = [PROMPTS[0], PROMPTS[1] + PROMPTS[1], REPEATS[0]]
    ref = [greedy_reference(t, p, 20) for p in prompts]
    eng = ReferenceEngine(t, head, 3, drafter=NgramDrafter(max_ngram=3),
                          auto=AutoK(FLAT, 3, calibrate=False), hybrid=True)
    _forced_hybrid(eng, ["free", "free", "head", "free", 0] * 8, prompts, ref)
    heads = [0]
    real = eng._draft_head

    def draft_head(b, K, *splices):
        heads[0] += 1
        return real(b, K, *splices)
    eng._draft_head = draft_head
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=20)) for p in prompts])
    assert [r.output_ids for r in res] == ref
    odd = [c for c in res[1].metrics.cycles]  # row 1: no proposal in "free" cycles
    assert sum(c.drafted == 0 for c in odd) > sum(c.drafted == 0 for c in res[0].metrics.cycles)
    assert {c.accepted for c in res[0].metrics.cycles if c.source == "lookup"} >= {0, 1, 2}
    assert heads[0] <= len(res[0].metrics.cycles) // 2  # "free" cycles ran no head step


def test_hybrid_may_go_without_the_head_when_one_row_has_a_good_proposal():
    """Two rows, one with a long prompt-lookup match (accepted 90%) and one with nothing; a head
    right 30% of the time whose steps are dear: the best cycle runs no head at all (the second
    row verifies nothing), where the head for the second row would have cost more than it brings."""
    costs = StepCosts({1: 16.6, 2: 19.0, 4: 21.0}, draft_step=3.0, extend=2.0)
    auto = AutoK(costs, 3, calibrate=False)
    k, use, _ = auto.plan_hybrid([[0.3] * 3, [0.3] * 3], [([0.9] * 3, 3), None], zero_run=0)
    assert k == 3 and use == [True, True]
    # with a proposal for neither row nothing changes: the head or K=0
    k, use, _ = auto.plan_hybrid([[0.3] * 3, [0.3] * 3], [None, None], zero_run=0)
    assert use == [False, False]


def test_rows_join_a_batch_holding_deferred_lookup_cycles(llama):
    """Rows join a batch whose prompt-lookup cycles left the head's extends deferred (parts of
    4 positions, each row's ending at its own last accepted one): the merge widens the joiners'
    entries to each part's width, and after the catch-up the head drafts exactly what an engine
    that extended the head every cycle drafts; every row gets the target's tokens (fp32)."""
    t, head, _ = llama
    prompts = [PROMPTS[0], PROMPTS[1] + PROMPTS[1], REPEATS[0], REPEATS[1]]
    ref = [greedy_reference(t, p, 20) for p in prompts]
    plan = ["lookup", "lookup", "lookup", "head", "lookup", 0, "lookup", "head"] * 6
    joins = {2: [2], 6: [3]}  # the cycle before which request i joins
    runs = []
    for mode in ("defer", "eager"):
        eng, drafts, heads = _spied_hybrid(t, head, plan, prompts, ref, eager=mode == "eager")
        reqs = [Request(list(p), SamplingParams(max_new_tokens=20)) for p in prompts]
        b = eng.start(reqs[:2], [0, 1])
        out, cycle = {}, 0
        while len(b) or len(out) + len(b) < len(reqs):
            cycle += 1
            if cycle in joins:
                if mode == "defer":  # the joiners meet lookup cycles' multi-position parts
                    assert any(d[1].shape[1] == 4 for d in b.deferred)
                eng.join(b, [reqs[i] for i in joins[cycle]], joins[cycle])
                if mode == "defer":
                    assert all(x.shape[0] == len(b) for d in b.deferred for x in d)
            out.update((k, r) for k, r in eng.step(b))
        assert [out[i].output_ids for i in range(len(reqs))] == ref
        looked = {c.accepted for r in out.values() for c in r.metrics.cycles if c.source == "lookup"}
        assert {0, 1, 2} <= looked
        runs.append((drafts, heads[0]))
    (deferred, n_def), (eager, n_eager) = runs
    assert deferred == eager and len(deferred) >= 3
    assert n_def < n_eager  # lookup cycles ran no head forward of their own


def test_a_short_proposal_is_spliced_with_the_head_where_the_estimates_say_it_pays():
    """A 1-token proposal at K=3: padded, its positions 2-3 are misses; spliced, the head's
    estimates price them. The splice is taken when lookup's first position is the likelier one,
    and kept off (the head's own chain) when lookup's estimate is low: the estimates are the gate."""
    auto = AutoK(FLAT, 3, calibrate=False)
    head = [0.5, 0.5, 0.5]
    k, use, runs_head = auto.plan_hybrid([head], [([0.9] * 3, 1)], zero_run=0, splice=True)
    assert k == 3 and use == [True] and runs_head  # E = 1 + .9 + .45 + .225 against the head's 1.875
    k, use, _ = auto.plan_hybrid([head], [([0.9] * 3, 1)], zero_run=0)  # padded: 1.9 at most
    assert (k, use) != (3, [True])
    k, use, runs_head = auto.plan_hybrid([head], [([0.1] * 3, 1)], zero_run=0, splice=True)
    assert use == [False] and runs_head and k >= 1  # lookup unlikely: the head's own chain
    # a proposal as long as K is not spliced: the cycle can go without the head
    k, use, runs_head = auto.plan_hybrid([[0.1] * 3], [([0.9] * 3, 3)], zero_run=0, splice=True)
    assert k == 3 and use == [True] and not runs_head


@pytest.mark.parametrize("splice", [True, False])
def test_spliced_chains_give_the_targets_greedy_output(monkeypatch, splice):
    """The successor world (target x -> x+1, a head that knows it) with prompt lookup proposing
    only the next token: spliced, the head continues the proposal past its end and whole chains
    are accepted (it read the proposal's token); the output is the target's either way."""
    t, head = successor_world()
    auto = AutoK(FLAT, 3, calibrate=False)
    auto.shared["lookup1"] = [0.95] * 3  # earlier requests found such proposals right
    eng = ReferenceEngine(t, head, 3, drafter=NgramDrafter(max_ngram=2), auto=auto, hybrid=True, splice=splice)
    monkeypatch.setattr(eng, "_lookup", lambda r, k: ([((r.out or r.req.input_ids)[-1] + 1) % V], 1))
    prompts = [[3, 4, 5], [20, 21], [7]]
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=16)) for p in prompts])
    assert [r.output_ids for r in res] == [[(p[-1] + 1 + i) % V for i in range(16)] for p in prompts]
    spliced = [c for r in res for c in r.metrics.cycles if c.source == "splice"]
    if splice:
        assert spliced and all(c.accepted == c.drafted == 3 for c in spliced)
    else:
        assert not spliced


def _token_marginal(t, prompt: list[int], v: int, n: int) -> torch.Tensor:
    """The target's distribution of its n-th generated token (n >= 1)."""
    seqs, probs = torch.tensor([prompt]), torch.ones(1)
    with torch.no_grad():
        for step in range(n):
            p = torch.softmax(t.model(seqs).logits[:, -1].float(), -1)              # [m, v]
            if step == n - 1:
                return (probs[:, None] * p).sum(0)
            probs = (probs[:, None] * p).reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(v, 0), torch.arange(v).repeat(len(seqs))[:, None]], 1)


def _sampled_splices(monkeypatch, shared: list[float], proposal: list[int] | None, n: int = 3000,
                     prompt: tuple[int, ...] = (4, 9, 2)):
    """``n`` sampled rows of ``prompt`` on a tiny target and random head, hybrid at K=3, prompt
    lookup proposing ``proposal`` every cycle (its match length: its length; None: lookup as it
    is, every match length estimated at ``shared``) with the shared estimate ``shared`` for it.
    Asserts the second and third tokens follow the target's marginals; returns the results."""
    v = 12
    t, head = peaky_world(v)
    prompt = list(prompt)
    auto = AutoK(FLAT, 3, calibrate=False, row_margin=0.0)  # (3000 rows that are to draft)
    for m in ([len(proposal)] if proposal else [1, 2]):
        auto.shared[f"lookup{m}"] = shared
    eng = ReferenceEngine(t, head, 3, max_context=24, drafter=NgramDrafter(), auto=auto, hybrid=True,
                          splice=True)
    if proposal:
        monkeypatch.setattr(eng, "_lookup", lambda r, k: (list(proposal), len(proposal)))
    res = eng.generate([Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=11 + i))
                        for i in range(n)])
    for i in (1, 2):
        want = _token_marginal(t, prompt, v, i + 1)
        emp = torch.bincount(torch.tensor([r.output_ids[i] for r in res]), minlength=v).float() / n
        tv = 0.5 * (emp - want).abs().sum().item()
        assert tv < 0.05, f"token {i + 1}: total variation {tv:.3f} between emitted and target marginals"
    return res


def test_spliced_chains_are_lossless_when_sampling(monkeypatch):
    """Sampled rows whose chain is a one-token proposal (q one-hot) continued by the head's
    sampled drafts (q its distribution after that token): the second and third tokens follow
    the target's marginals."""
    res = _sampled_splices(monkeypatch, [0.9] * 3, [5])
    assert any(c.source == "splice" and c.accepted >= 1 for r in res for c in r.metrics.cycles)


def test_a_proposal_found_after_the_heads_drafts_takes_over_where_lookup_is_likelier():
    auto = AutoK(FLAT, 3, calibrate=False)
    head = [0.5, 0.5, 0.5]
    assert auto.takes_over(head, [0.9, 0.9, 0.9], 1, 3)       # 1 + .9 + .81 against 1 + .5 + .25
    assert not auto.takes_over(head, [0.3, 0.3, 0.3], 1, 3)
    assert not auto.takes_over(head, [0.9, 0.9, 0.9], 3, 3)   # nothing left to take


def test_ngram_index_proposes_after_drafts_it_was_not_given():
    """``propose_after(extra)`` is the proposal for the sequence followed by ``extra``, from
    matches inside the sequence, without adding ``extra``."""
    d = NgramDrafter(max_ngram=3)
    idx = NgramIndex(d)
    seq = [10, 20, 21, 22, 3, 4, 5, 20, 9]
    idx.sync(seq, [])
    assert idx.propose_after([10], 2) == ([20, 21], 1)          # "10" at 0
    assert idx.propose_after([20], 2) == ([21, 22], 1)          # earliest "20"
    assert idx.propose_after([4], 3) == ([5, 20, 9], 1)
    assert idx.propose_after([3, 4], 2) == ([5, 20], 2)         # the longer match wins
    assert idx.propose_after([9, 10], 2) == ([20, 21], 1)       # "9 10" is nowhere: "10"
    assert idx.propose_after([77], 2) == ([], 0)
    assert idx.seq == seq                                        # nothing was added


def test_prompt_lookup_asked_again_after_the_heads_draft_takes_over(monkeypatch):
    """Successor world, head rows, a prompt that holds the head's first draft followed by wrong
    tokens: asked again after that draft, prompt lookup finds them and takes positions 2..3
    (one draft accepted where the head alone gets three; the estimates say lookup is likelier).
    With splices off, the head's chain stands. Output: the target's either way."""
    t, head = successor_world()
    for splice in (True, False):
        auto = AutoK(FLAT, 3, calibrate=False)
        auto.shared["lookup1"] = [0.95] * 3
        eng = ReferenceEngine(t, head, 3, drafter=NgramDrafter(max_ngram=2), auto=auto, hybrid=True,
                              splice=splice)
        # the target goes on 5, 6, ...; the second cycle's first draft is 10, after which the
        # prompt holds 50, 51
        prompt = [10, 50, 51, 3, 4]
        res = eng.generate([Request(prompt, SamplingParams(max_new_tokens=16))])[0]
        assert res.output_ids == [(5 + i) % V for i in range(16)]
        spliced = [c for c in res.metrics.cycles if c.source == "splice"]
        assert (len(spliced) >= 1 and all(c.accepted == 1 for c in spliced)) if splice else not spliced


def test_a_proposal_found_after_the_heads_sampled_draft_is_lossless(monkeypatch):
    """Sampled head rows whose later positions become prompt lookup's tokens (q one-hot) when
    lookup, asked again after the head's sampled first draft, finds a proposal, and stay the
    head's draws otherwise: the second and third tokens follow the target's marginals."""
    res = _sampled_splices(monkeypatch, [0.95] * 3, None, prompt=[4, 9, 2, 11, 4, 9, 2])
    assert sum(c.source == "splice" for r in res for c in r.metrics.cycles) > len(res) // 10


@pytest.mark.parametrize("rows", [2, 8])
def test_plans_back_off_under_load_after_a_run_of_k0(rows):
    """Hybrid auto where drafting does not pay at the batch's size (verification steep, rows
    many): from 4 rows, after probe_every cycles at K=0, only one cycle in PLAN_EVERY asks prompt
    lookup and plans; below 4 rows every cycle plans. The output is the target's either way."""
    t, head = successor_world()
    steep16 = StepCosts({1: 50.0, 2: 400.0, 4: 800.0}, draft_step=40.0, extend=30.0)
    costs = StepCosts(dict(STEEP.verify), STEEP.draft_step, STEEP.extend, by_batch={2: steep16, 16: steep16})
    auto = AutoK(costs, 3, calibrate=False, probe_every=8)
    eng = ReferenceEngine(t, head, 3, drafter=NgramDrafter(max_ngram=2), auto=auto, hybrid=True)
    plans = []
    real = auto.plan_hybrid
    auto.plan_hybrid = lambda *a, **k: (plans.append(1), real(*a, **k))[1]
    reqs = [Request([1 + i, 2 + i, 3 + i], SamplingParams(max_new_tokens=40)) for i in range(rows)]
    res = eng.generate(reqs)
    assert [r.output_ids for r in res] == [greedy_reference(t, r.input_ids, 40) for r in reqs]
    cycles = max(len(r.metrics.cycles) for r in res)
    assert all(c.drafted == 0 for r in res for c in r.metrics.cycles)  # K=0 throughout
    if rows < eng.PLAN_BACKOFF_ROWS:
        assert len(plans) == cycles
    else:  # the first probe_every cycles, then one in PLAN_EVERY
        assert len(plans) <= 8 + (cycles - 8) // eng.PLAN_EVERY + 1 and len(plans) < cycles


def test_conditional_acceptance_counts_only_cycles_that_drafted_that_position():
    """auto's cycles draft different K: a_2 is the share of cycles that drafted a second token,
    having accepted the first, that accepted it too; a K=1 cycle is no miss at position 2.
    A_k and tau keep their definitions (fractions of all cycles)."""
    from fastmtp_sglang.decode.metrics import summarize_cycles

    accepted = [1, 1, 1, 2, 0, 0, 2]
    drafted = [1, 1, 2, 2, 2, 0, 3]
    s = summarize_cycles(accepted, 3, drafted)
    # position 1: drafted by 6 cycles, accepted by 5; position 2: drafted after an accepted
    # first by cycles 3, 4 and 7, accepted by 4 and 7; position 3: only cycle 7, rejected
    assert s["a_k"] == pytest.approx([5 / 6, 2 / 3, 0.0])
    assert s["A_k"] == pytest.approx([5 / 7, 2 / 7, 0.0])
    assert s["tau"] == pytest.approx(1 + sum(accepted) / 7)
    plain = summarize_cycles(accepted, 3)  # without drafted: A_k / A_(k-1), as before
    assert plain["a_k"] == pytest.approx([5 / 7, 2 / 5, 0.0])
    with pytest.raises(ValueError):
        summarize_cycles(accepted, 3, drafted[:-1])
