"""Leaves (decode/leaves.py): the chain's drafts plus W - 1 candidates beside each, verified in one
forward. Greedy output equals plain decoding (float32); acceptance among candidates keeps the
target's distribution (recursive rejection sampling, frequencies checked); a leaf is accepted where
the chain's draft is not; the attention layout is the tree it claims."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from fastmtp_sglang.decode import leaves
from fastmtp_sglang.decode.batch import Batch
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.sampling import SamplingParams
from test_engine import N_NEW, PROMPTS, greedy_reference, random_head, tiny_target


@pytest.fixture(scope="module")
def llama():
    t = tiny_target("llama")
    return t, random_head(t, "mimo"), [greedy_reference(t, p, N_NEW) for p in PROMPTS]


def test_tree_mask_and_positions():
    K, W = 3, 3
    m = leaves.tree_mask(K, W)
    assert m.shape == (1 + K * W, 1 + K * W)
    assert torch.equal(m[: K + 1, : K + 1], torch.ones(K + 1, K + 1, dtype=torch.bool).tril())
    assert not m[: K + 1, K + 1:].any()  # the chain never sees a leaf
    for k in range(1, K + 1):
        for j in range(W - 1):
            n = leaves.leaf_node(K, W, k, j)
            assert m[n].nonzero().flatten().tolist() == list(range(k)) + [n]
    pos = leaves.positions(torch.tensor([10, 20]), K, W)
    assert pos[0].tolist() == [10, 11, 12, 13, 11, 11, 12, 12, 13, 13]
    assert pos[1, 0] == 20


@pytest.mark.parametrize("steps,width", [(1, 2), (3, 2), (3, 4), (5, 3)])
def test_greedy_equals_plain_decoding_batched(llama, steps, width):
    t, head, ref = llama
    eng = ReferenceEngine(t, head, steps, width=width)
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS])
    assert [r.output_ids for r in res] == ref


def test_greedy_leaves_are_accepted_and_raise_acceptance(llama):
    """Same head, same prompts: with leaves some cycles end on a leaf, and tau does not fall."""
    t, head, ref = llama
    prompts = [[i, i + 3, 2 * i % 97] for i in range(1, 13)]
    run = lambda w: ReferenceEngine(t, head, 3, width=w).generate(  # noqa: E731
        [Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in prompts])
    one, four = run(1), run(4)
    assert [r.output_ids for r in one] == [r.output_ids for r in four]
    cyc1 = [c for r in one for c in r.metrics.cycles]
    cyc4 = [c for r in four for c in r.metrics.cycles]
    assert not any(c.leaf for c in cyc1)
    assert sum(c.leaf for c in cyc4) > 0
    tau = lambda cs: sum(c.accepted + 1 for c in cs) / len(cs)  # noqa: E731
    assert tau(cyc4) > tau(cyc1)


def test_context_limit_with_leaves(llama):
    t, head, _ = llama
    eng = ReferenceEngine(t, head, 3, max_context=16, width=3)
    prompt = list(range(1, 11))  # (no token 0: the reference's generate takes it for padding)
    r = eng.generate([Request(prompt, SamplingParams(max_new_tokens=50))])[0]
    assert r.finish_reason["type"] == "length" and 10 + len(r.output_ids) <= 16
    assert r.output_ids == greedy_reference(t, prompt, len(r.output_ids))


def _row(V: int, seed: int):
    """A one-row sampled batch as the walk reads it; its distributions come through
    ``Batch.probs`` (the per-row tensors' path)."""
    b = SimpleNamespace(greedy=False, plain_temp=None, temp=torch.ones(1), top_p=torch.ones(1),
                        top_k=torch.zeros(1, dtype=torch.long), gens=[torch.Generator().manual_seed(seed)])
    b.dist_params = functools.partial(Batch.dist_params, b)
    b.probs = functools.partial(Batch.probs, b)
    return b


@pytest.mark.parametrize("W", [1, 3])
def test_one_position_keeps_the_target_distribution(W):
    """K=1: candidates drawn without replacement from q, the emitted first token must follow p
    (total variation within sampling noise); three candidates accept more often than one."""
    V, n = 8, 6000
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(V, generator=g) * 1.5
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    p = torch.softmax(p_logits, -1)
    counts = torch.zeros(V)
    accepted = 0
    tl = torch.stack([p_logits, p_logits, torch.zeros(V), torch.zeros(V)])[None, : 1 + W]  # [1, 1 + W, V]
    for s in range(n):
        b = _row(V, s)
        cand = torch.multinomial(q, W, replacement=False, generator=b.gens[0])
        chain = cand[:1][None]
        lv = cand[1:][None, None] if W > 1 else torch.empty(1, 1, 0, dtype=torch.long)
        acc, em, path, _, _ = leaves.verify(chain, lv, [q[None]], tl.expand(1, 1 + W, V), b, [1])
        counts[em[0, 0]] += 1
        accepted += int(acc[0])
    emp = counts / n
    assert 0.5 * (emp - p).abs().sum() < 0.03, (emp, p)
    rate = accepted / n
    single = torch.minimum(p, q).sum().item()
    if W == 1:
        assert abs(rate - single) < 0.03
    else:
        assert rate > single + 0.08, (rate, single)


def test_a_leaf_ends_the_walk_with_the_target_token_after_it():
    """Greedy, K=2, W=2: chain [5, 6], leaves [[7], [8]]; the target's argmax after the pending
    token is 7 (a leaf) and after that leaf 9: the cycle emits 7, 9 and its path is the leaf's node."""
    V = 12
    K, W = 2, 2
    tl = torch.zeros(1, 1 + K * W, V)
    tl[0, 0, 7] = 5.0                              # after pending: 7 (not the chain's 5)
    tl[0, leaves.leaf_node(K, W, 1, 0), 9] = 5.0   # after the leaf 7: 9
    b = SimpleNamespace(greedy=True)
    acc, em, path, took, _ = leaves.verify(torch.tensor([[5, 6]]), torch.tensor([[[7], [8]]]), [], tl, b, [2])
    assert acc.tolist() == [1] and em[0, :2].tolist() == [7, 9] and took == [True]
    assert path[0, :2].tolist() == [0, leaves.leaf_node(K, W, 1, 0)]


def test_sampled_engine_with_leaves_follows_the_target():
    """As tests/test_engine.py's lossless check, through the engine with width 3: the second
    token (the first a cycle emits) follows the target's marginal."""
    from test_auto import peaky_world, second_token_marginal

    v = 12
    t, head = peaky_world(v)
    prompt = [4, 9, 2]
    want = second_token_marginal(t, prompt, v)
    n = 3000
    res = ReferenceEngine(t, head, 2, max_context=16, width=3).generate(
        [Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=11 + i)) for i in range(n)])
    emp = torch.bincount(torch.tensor([r.output_ids[1] for r in res]), minlength=v).float() / n
    assert 0.5 * (emp - want).abs().sum().item() < 0.05
    assert any(c.leaf for r in res for c in r.metrics.cycles)


@pytest.mark.parametrize("kw,match", [
    (dict(width=0), "width must be an integer"),
    (dict(width=2, lean="off"), "lean forward"),
])
def test_bad_width(llama, kw, match):
    t, head, _ = llama
    with pytest.raises(ValueError, match=match):
        ReferenceEngine(t, head, 3, **kw)


def test_width_needs_the_head(llama):
    t, _, _ = llama
    with pytest.raises(ValueError, match="give a head"):
        ReferenceEngine(t, None, 0, width=2)


# -- with auto -----------------------------------------------------------------------------------

def test_auto_hybrid_with_leaves_equals_plain_decoding(llama):
    """auto + hybrid with leaves: head rows with leaves, prompt-lookup rows (no leaves beside
    their tokens) and K=0 cycles in one batch: still the target's greedy output."""
    from test_auto import FLAT, REPEATS

    from fastmtp_sglang.decode.auto import AutoK
    from fastmtp_sglang.decode.ngram import NgramDrafter

    t, head, _ = llama
    prompts = PROMPTS + REPEATS
    ref = [greedy_reference(t, p, N_NEW) for p in prompts]
    auto = AutoK(FLAT, 3, probe_every=3, width=3)
    eng = ReferenceEngine(t, head, 3, drafter=NgramDrafter(max_ngram=3), auto=auto, hybrid=True, width=3)
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in prompts])
    assert [r.output_ids for r in res] == ref
    assert any(c.leaf for r in res for c in r.metrics.cycles)
    assert auto.leaf != [AutoK.LEAF_PRIOR] * 3  # the leaves' rate was observed


def test_auto_sampled_with_leaves_follows_the_target():
    from test_auto import FLAT, peaky_world, second_token_marginal

    from fastmtp_sglang.decode.auto import AutoK

    v = 12
    t, head = peaky_world(v)
    prompt = [4, 9, 2]
    want = second_token_marginal(t, prompt, v)
    n = 3000
    eng = ReferenceEngine(t, head, 2, max_context=16, width=3,
                          auto=AutoK(FLAT, 2, calibrate=False, row_margin=0.0, width=3))
    res = eng.generate([Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=11 + i))
                        for i in range(n)])
    emp = torch.bincount(torch.tensor([r.output_ids[1] for r in res]), minlength=v).float() / n
    assert 0.5 * (emp - want).abs().sum().item() < 0.05
    assert any(c.leaf for r in res for c in r.metrics.cycles)


def test_auto_prices_leaves():
    """A head cycle at K with width W verifies 1 + K W tokens; a leaf taken where the chain's
    draft is rejected adds to the expected tokens; a width that differs from the engine's is
    refused."""
    from test_auto import FLAT

    from fastmtp_sglang.decode.auto import AutoK, expected_curve, expected_curve_leaves

    one, three = AutoK(FLAT, 3, calibrate=False), AutoK(FLAT, 3, calibrate=False, width=3)
    assert three.cycle_ms(2, 1) - one.cycle_ms(2, 1) == pytest.approx(FLAT.verify_ms(7) - FLAT.verify_ms(3))
    assert three.cycle_ms(0, 1) == one.cycle_ms(0, 1)
    est = [0.5, 0.4, 0.3]
    assert expected_curve_leaves(est, [0.0] * 3, 3) == pytest.approx(expected_curve(est, 3))
    # E(1) = 1 + a1 + (1 - a1) l1; E(2) adds a1 (a2 + (1 - a2) l2)
    e = expected_curve_leaves(est, [0.5, 0.5, 0.5], 3)
    assert e[1] == pytest.approx(1 + 0.5 + 0.25) and e[2] == pytest.approx(1.75 + 0.5 * (0.4 + 0.3))
    three.observe_leaf(0, True)
    assert three.leaf[0] > AutoK.LEAF_PRIOR


def test_engine_refuses_auto_at_another_width(llama):
    from test_auto import FLAT

    from fastmtp_sglang.decode.auto import AutoK

    t, head, _ = llama
    with pytest.raises(ValueError, match="same"):
        ReferenceEngine(t, head, 3, auto=AutoK(FLAT, 3, calibrate=False), width=3)
