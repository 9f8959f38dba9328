"""Sampling and verification: hand-built cases, invariants, statistics (CPU, a few seconds).

Run: .venv/bin/pytest tests/test_sampling.py
"""

import pytest
import torch

from fastmtp_sglang.decode.sampling import (
    SamplingParams,
    draw_distinct,
    logits_to_probs,
    plain_temperature,
    sample,
    sample_each,
    verify_greedy,
    verify_sampling,
)

V = 6


def logits_with_argmax(argmax: list[list[int]], vocab: int = V) -> torch.Tensor:
    """[B, K+1, V] logits whose argmax at [b, k] is argmax[b][k], with noise elsewhere."""
    g = torch.Generator().manual_seed(123)
    a = torch.tensor(argmax)
    logits = torch.rand(*a.shape, vocab, generator=g)
    return logits.scatter(-1, a[..., None], 5.0)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tv(ids: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance between the empirical distribution of ids and p [V]."""
    freq = torch.bincount(ids, minlength=p.numel()).double() / ids.numel()
    return 0.5 * (freq - p.double()).abs().sum().item()


# --- greedy, hand-built -----------------------------------------------------------------------


def test_verify_greedy_k3_mixed_batch():
    target = logits_with_argmax([[1, 2, 3, 4], [5, 0, 0, 0], [2, 2, 1, 0]])
    drafts = torch.tensor([[1, 2, 3], [4, 0, 0], [2, 2, 5]])
    n, emitted = verify_greedy(drafts, target)
    assert n.tolist() == [3, 0, 2]
    assert emitted.dtype == torch.int64
    assert emitted.tolist() == [[1, 2, 3, 4], [5, -1, -1, -1], [2, 2, 1, -1]]


def test_verify_greedy_k1():
    target = logits_with_argmax([[3, 1], [3, 1], [0, 4]])
    drafts = torch.tensor([[3], [2], [0]])
    n, emitted = verify_greedy(drafts, target)
    assert n.tolist() == [1, 0, 1]
    assert emitted.tolist() == [[3, 1], [3, -1], [0, 4]]


def test_verify_greedy_k0_is_plain_decoding():
    target = logits_with_argmax([[4], [0], [2]])
    n, emitted = verify_greedy(torch.empty(3, 0, dtype=torch.long), target)
    assert n.tolist() == [0, 0, 0]
    assert emitted.tolist() == [[4], [0], [2]]


def test_verify_greedy_rejects_after_first_mismatch():
    # Step 2 matches but step 1 did not: acceptance stops at the first rejection.
    target = logits_with_argmax([[1, 2, 3]])
    n, emitted = verify_greedy(torch.tensor([[0, 2]]), target)
    assert n.tolist() == [0]
    assert emitted.tolist() == [[1, -1, -1]]


def test_verify_shape_errors():
    with pytest.raises(ValueError, match="K\\+1"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, V))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampling(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, V + 1),
                        torch.zeros(2, 4, V))


# --- invariants -------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("b,v", [(1, 7), (99, 111), (13, 1000)])
def test_emitted_count_is_accepted_plus_one(b, k, v):
    g = gen(k * 1000 + b)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, dim=-1)
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 2, dim=-1)
    drafts = sample(q.reshape(-1, v), g).reshape(b, k)
    for n, emitted in [verify_sampling(drafts, q, p, g), verify_greedy(drafts, p.log())]:
        valid = emitted >= 0
        assert (valid.sum(dim=1) == n + 1).all()
        # Valid entries form a prefix, and accepted entries are the drafts.
        assert (valid == (torch.arange(k + 1)[None, :] <= n[:, None])).all()
        pos = torch.arange(k)[None, :] < n[:, None]
        assert (emitted[:, :k][pos] == drafts[pos]).all()
        assert ((emitted < v) & (emitted >= -1)).all()


def test_one_hot_target_reproduces_argmax_and_matches_greedy():
    b, k, v = 64, 3, 50
    g = gen(1)
    logits = torch.randn(b, k + 1, v, generator=g)
    argmax = logits.argmax(-1)
    # Drafts agree with the target ~70% of the time, so outcomes vary per row.
    wrong = torch.randint(0, v, (b, k), generator=g)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.7, argmax[:, :k], wrong)
    p = logits_to_probs(logits.reshape(-1, v), 0.0, 1.0, -1).reshape(b, k + 1, v)
    q_onehot = torch.nn.functional.one_hot(drafts, v).float()
    q_soft = torch.softmax(torch.randn(b, k, v, generator=g), -1)  # greedy p ignores q's shape
    n_ref, e_ref = verify_greedy(drafts, logits)
    assert n_ref.unique().numel() > 1
    for q in (q_onehot, q_soft):
        n, emitted = verify_sampling(drafts, q, p, gen(2))
        assert torch.equal(n, n_ref) and torch.equal(emitted, e_ref)
        valid = emitted >= 0
        assert (emitted[valid] == argmax[valid]).all()


def test_q_equal_p_accepts_everything():
    b, k, v = 500, 4, 32
    g = gen(3)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    q = p[:, :k].clone()
    drafts = sample(q.reshape(-1, v), g).reshape(b, k)
    n, emitted = verify_sampling(drafts, q, p, g)
    assert (n == k).all()
    assert (emitted[:, :k] == drafts).all() and (emitted[:, k] >= 0).all()


def test_verify_sampling_is_reproducible():
    b, k, v = 200, 3, 40
    g = gen(4)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    q = torch.softmax(torch.randn(b, k, v, generator=g), -1)
    drafts = sample(q.reshape(-1, v), g).reshape(b, k)
    out1 = verify_sampling(drafts, q, p, gen(7))
    out2 = verify_sampling(drafts, q, p, gen(7))
    assert all(torch.equal(a, c) for a, c in zip(out1, out2))


# --- statistics -------------------------------------------------------------------------------

# With 200k draws over 8 tokens the expected TV noise is ~0.003, so 0.01 is a >3x margin; the
# seed is fixed, so the test is deterministic.
N_ROWS = 200_000
TV_TOL = 0.01

P1 = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
P2 = torch.tensor([0.05, 0.05, 0.40, 0.20, 0.00, 0.10, 0.10, 0.10])
P3 = torch.tensor([0.125] * 8)
Q_CASES = {
    "close": torch.tensor([0.25, 0.25, 0.15, 0.10, 0.10, 0.05, 0.05, 0.05]),
    # Compressed vocabulary: the draft only knows tokens 0-3.
    "subset_support": torch.tensor([0.40, 0.30, 0.20, 0.10, 0.0, 0.0, 0.0, 0.0]),
    # Mass where p is small, and on token 4 where P2 is zero.
    "wild": torch.tensor([0.01, 0.01, 0.01, 0.02, 0.05, 0.10, 0.30, 0.50]),
}


@pytest.mark.parametrize("q_name", list(Q_CASES))
@pytest.mark.parametrize("k", [1, 2])
def test_emitted_distribution_matches_target(q_name, k):
    q_step = Q_CASES[q_name]
    p_steps = torch.stack([P1, P2, P3][: k + 1])  # [K+1, V]
    q_steps = torch.stack([q_step, q_step][:k])  # [K, V]
    g = gen(10 + k)
    p = p_steps.expand(N_ROWS, -1, -1)
    q = q_steps.expand(N_ROWS, -1, -1)
    drafts = torch.stack([torch.multinomial(q_steps[i], N_ROWS, True, generator=g)
                          for i in range(k)], dim=1)
    n, emitted = verify_sampling(drafts, q, p, g)

    assert tv(emitted[:, 0], P1) < TV_TOL
    # Acceptance rate of step 1 is sum(min(p, q)) = 1 - TV(p, q).
    expected_accept = torch.minimum(P1, q_step).sum().item()
    assert abs((n >= 1).double().mean().item() - expected_accept) < TV_TOL
    # Here p does not depend on the prefix, so token 2 (when emitted) follows P2, and the
    # bonus token after K=2 accepted drafts follows P3.
    assert tv(emitted[n >= 1, 1], P2) < TV_TOL
    if k == 2:
        assert tv(emitted[n == 2, 2], P3) < 2 * TV_TOL  # fewer rows reach here
    # Tokens outside p's support are never emitted.
    assert not (emitted[:, 1] == 4).any()


# --- sample -----------------------------------------------------------------------------------


def test_sample_distribution_and_zero_probability():
    p = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    ids = sample(p.expand(N_ROWS, -1), gen(5))
    assert ids.shape == (N_ROWS,) and ids.dtype == torch.int64
    assert (p[ids] > 0).all()
    assert tv(ids, p) < TV_TOL
    # Unnormalised rows, and a near-one-hot row, still never pick a zero.
    q = torch.tensor([[0.0, 2.0, 0.0], [1e-30, 0.0, 0.0]]).repeat(1000, 1)
    ids = sample(q, gen(6))
    assert (q.gather(1, ids[:, None]) > 0).all()


def test_sample_at_the_top_of_the_uniform_takes_the_last_token_with_mass(monkeypatch):
    """The inverse-CDF draw: a uniform that rounds up to the row's total mass (u * total ==
    total) still lands on a token with probability, not past the end or on a trailing zero."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(*a[:2] if len(a) > 1 else a[0]))
    p = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0, 1.0]])
    assert sample(p).tolist() == [2, 4]


def test_row_distribution_does_not_depend_on_other_rows_filters():
    """An unfiltered row gets the same probabilities (bit for bit) alone or beside a top-p and a
    greedy row, so a seeded row draws the same token whatever else is batched."""
    logits = torch.randn(3, 200, generator=gen(4))
    alone = logits_to_probs(logits[:1], 1.0, 1.0, -1)
    mixed = logits_to_probs(logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0.9, 1.0]),
                            torch.tensor([-1, -1, -1]))
    assert torch.equal(alone[0], mixed[0])
    assert (mixed[1] > 0).sum() < 200 and mixed[2].max() == 1.0


def test_sample_honours_generator():
    p = torch.softmax(torch.randn(1000, 50, generator=gen(0)), -1)
    assert torch.equal(sample(p, gen(9)), sample(p, gen(9)))
    assert not torch.equal(sample(p, gen(9)), sample(p, gen(10)))


def test_sample_each_draws_what_a_call_per_row_draws():
    """One running sum for every row, each row's uniform from its own generator: the same tokens
    as sample() called row by row with those generators (rows with zeros, one near one-hot)."""
    p = torch.softmax(torch.randn(5, 3000, generator=gen(2)) * 2, -1)
    p[1, ::2] = 0.0
    p[2] = 0.0
    p[2, 17] = 1e-30
    for seed in range(60):
        gens = [gen(seed * 5 + i) for i in range(5)]
        alone = [int(sample(p[i:i + 1], gen(seed * 5 + i))[0]) for i in range(5)]
        assert sample_each(p, gens).tolist() == alone
    with pytest.raises(ValueError, match="generators"):
        sample_each(p, [gen(0)])


# --- draw_distinct ----------------------------------------------------------------------------


def zero_and_resample(p: torch.Tensor, w: int, g: torch.Generator) -> list[int]:
    """The law draw_distinct keeps, the slow way: draw, zero what was drawn, draw again."""
    left, out = p[None].clone(), []
    for _ in range(w):
        if not float(left.sum()) > 0:
            break
        out.append(int(sample(left, generator=g)[0]))
        left[0, out[-1]] = 0.0
    return out + [-1] * (w - len(out))


def test_draw_distinct_draws_what_zero_and_resample_draws():
    """Seed for seed the same entries as zeroing each draw and sampling again: one uniform per
    draw, mapped to the same entry (over 400 seeds and rows with zeros and a dominant entry)."""
    rows = [torch.softmax(torch.randn(300, generator=gen(1)) * 2, -1),
            torch.tensor([0.0, 0.9, 0.0, 0.05, 0.03, 0.02, 0.0]),
            torch.tensor([0.25, 0.25, 0.25, 0.25])]
    for p in rows:
        for seed in range(400 if p.numel() < 100 else 100):
            got = draw_distinct(p[None], 3, [gen(seed)])[0].tolist()
            assert got == zero_and_resample(p, 3, gen(seed)), (p, seed)
            assert len(set(got)) == 3 and all(p[t] > 0 for t in got)


def test_draw_distinct_law_of_ordered_pairs():
    """The first two draws of [0.5, 0.3, 0.2] follow P(i, j) = p_i p_j / (1 - p_i)."""
    p = torch.tensor([0.5, 0.3, 0.2])
    n = 6000
    g = gen(11)
    pairs = draw_distinct(p.expand(n, -1), 2, [g] * n)
    code = pairs[:, 0] * 3 + pairs[:, 1]
    want = torch.zeros(9)
    for i in range(3):
        for j in range(3):
            if i != j:
                want[i * 3 + j] = p[i] * p[j] / (1 - p[i])
    assert tv(code, want) < 0.03


def test_draw_distinct_rows_with_fewer_entries_than_draws():
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.2, 0.0, 0.8, 0.0]])
    got = draw_distinct(p, 3, [gen(0), gen(1), gen(2)])
    assert got[0].tolist() == [1, -1, -1]
    assert got[1].tolist() == [-1, -1, -1]
    assert sorted(got[2, :2].tolist()) == [0, 2] and got[2, 2] == -1
    with pytest.raises(ValueError, match="generators"):
        draw_distinct(p, 3, [gen(0)])


# --- logits_to_probs --------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1.0, 0.7, 1.3])
def test_plain_path_gives_the_per_row_paths_probabilities(t):
    """Scalars (the softmax alone) and per-row tensors give the same probabilities bit for bit,
    -inf logits included: a seeded row draws the same whichever path its batch takes."""
    logits = torch.randn(4, 1000, generator=gen(3)) * 3
    logits[:, ::7] = float("-inf")
    plain = logits_to_probs(logits, t, 1.0, -1)
    rows = logits_to_probs(logits, torch.full((4,), t), torch.ones(4), torch.full((4,), -1))
    assert torch.equal(plain, rows)
    assert (plain[:, ::7] == 0).all()


@pytest.mark.parametrize("scale", [8.0, 0.5])  # peaked (the top entries hold the nucleus), flat (they do not)
def test_top_p_and_top_k_from_the_largest_entries_equal_the_full_sort(scale, monkeypatch):
    """The kept set looked for among each row's largest entries (topk) gives the very same
    probabilities as sorting the whole row, for top-p alone, top-k alone (inside and beyond the
    partial width), both, and rows that keep everything beside them."""
    import fastmtp_sglang.decode.nucleus as nucleus

    logits = torch.randn(7, 6000, generator=gen(8)) * scale
    t = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.9, 1.0])
    top_p = torch.tensor([0.95, 0.9, 1.0, 0.8, 1.0, 0.99, 1.0])
    top_k = torch.tensor([-1, -1, 50, 300, 5000, 5000, -1])
    fast = logits_to_probs(logits, t, top_p, top_k)
    monkeypatch.setattr(nucleus, "PARTIAL_TOP_K", 10**9)  # the first width only, then the sort
    one = logits_to_probs(logits, t, top_p, top_k)
    monkeypatch.setattr(nucleus, "PARTIAL_TOP", 10**9)  # every row sorted whole
    full = logits_to_probs(logits, t, top_p, top_k)
    assert torch.equal(fast, full) and torch.equal(one, full)
    assert ((fast > 0).sum(-1)[2] == 50) and ((fast > 0).sum(-1)[6] == 6000)


@pytest.mark.parametrize("scale", [8.0, 2.0, 0.5])
def test_top_p_alone_from_the_largest_entries_equals_the_full_sort(scale, monkeypatch):
    """Every row filtering by top-p alone (the common request) skips the top-k bookkeeping: the
    same probabilities as sorting the whole row (peaked rows found among the first 256 entries,
    middling ones among 4096, flat ones sorted)."""
    import fastmtp_sglang.decode.nucleus as nucleus

    logits = torch.randn(5, 6000, generator=gen(9)) * scale
    t = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.9])
    top_p = torch.tensor([0.95, 0.9, 0.5, 0.8, 0.99])
    fast = logits_to_probs(logits, t, top_p, torch.full((5,), -1))
    monkeypatch.setattr(nucleus, "PARTIAL_TOP", 10**9)
    monkeypatch.setattr(nucleus, "PARTIAL_TOP_K", 10**9)
    full = logits_to_probs(logits, t, top_p, torch.full((5,), -1))
    assert torch.equal(fast, full)


def test_plain_temperature():
    sp = lambda **k: SamplingParams(**k)  # noqa: E731
    assert plain_temperature([sp(temperature=0.7), sp(temperature=0.7, seed=3)]) == 0.7
    assert plain_temperature([sp(temperature=0.7), sp(temperature=1.0)]) is None
    assert plain_temperature([sp(temperature=1.0), sp()]) is None  # a greedy row
    assert plain_temperature([sp(temperature=1.0, top_p=0.9)]) is None
    assert plain_temperature([sp(temperature=1.0, top_k=50)]) is None


# --- logits_to_probs --------------------------------------------------------------------------


def test_temperature_zero_is_one_hot():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [float("-inf"), -5.0, -4.0, float("-inf")]])
    probs = logits_to_probs(logits, torch.zeros(2), torch.ones(2), torch.full((2,), -1))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


def test_plain_softmax_with_temperature():
    logits = torch.randn(5, 30, generator=gen(0))
    t = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.3])
    probs = logits_to_probs(logits, t, 1.0, -1)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / t[:, None], -1))


def test_top_k_keeps_exactly_k():
    logits = torch.randn(4, 100, generator=gen(1))
    logits[3, :] = 0.0  # all tied: still exactly k kept
    k = torch.tensor([1, 5, 37, 10])
    probs = logits_to_probs(logits, torch.ones(4), torch.ones(4), k)
    assert (probs > 0).sum(-1).tolist() == k.tolist()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    for row in range(3):
        top = logits[row].topk(int(k[row])).indices
        assert (probs[row, top] > 0).all()


def test_top_p_keeps_minimal_nucleus():
    p = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = p.log().expand(4, -1)
    top_p = torch.tensor([0.4, 0.75, 0.81, 1.0])
    probs = logits_to_probs(logits, torch.ones(4), top_p, torch.full((4,), -1))
    kept = [set(torch.nonzero(r).flatten().tolist()) for r in probs]
    assert kept == [{1}, {1, 3}, {1, 3, 2}, {0, 1, 2, 3}]
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.625, 0.0, 0.375]))
    # A tiny top_p keeps at least the most likely token.
    probs = logits_to_probs(p.log()[None], 1.0, 1e-9, -1)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_p_applies_to_top_k_survivors():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top-k 2 leaves {0.4, 0.3} -> renormalised {0.571, 0.429}; top_p 0.5 then keeps one token.
    probs = logits_to_probs(p.log()[None], 1.0, 0.5, 2)
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_neg_inf_logits_get_exactly_zero():
    v = 50
    logits = torch.randn(3, v, generator=gen(2))
    logits[:, 20:] = float("-inf")  # compressed draft: support is tokens 0-19
    top_k = torch.tensor([-1, 40, 5])  # k larger than the support must not revive -inf tokens
    top_p = torch.tensor([1.0, 0.99, 1.0])
    probs = logits_to_probs(logits, torch.tensor([1.0, 0.3, 5.0]), top_p, top_k)
    assert (probs[:, 20:] == 0).all()
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_mixed_batch_and_bf16_input():
    logits = torch.randn(3, 64, generator=gen(3)).to(torch.bfloat16)
    probs = logits_to_probs(logits, torch.tensor([0.0, 1.0, 0.8]), torch.tensor([1.0, 0.9, 1.0]),
                            torch.tensor([-1, -1, 3]))
    assert probs.dtype == torch.float32
    assert probs[0].max() == 1.0 and probs[0].argmax() == logits[0].float().argmax()
    assert (probs[2] > 0).sum() == 3


def test_per_row_shape_checked():
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(torch.zeros(3, 5), torch.ones(2), 1.0, -1)


# --- SamplingParams ---------------------------------------------------------------------------


def test_sampling_params_defaults():
    sp = SamplingParams()
    assert sp.is_greedy and sp.stop == [] and sp.seed is None
    assert not SamplingParams(temperature=0.7).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy


@pytest.mark.parametrize("kwargs,name", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"seed": -1}, "seed"),
])
def test_sampling_params_rejects_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_from_dict_sglang_shape():
    sp = SamplingParams.from_dict({
        "max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "stop": "</s>", "stop_token_ids": [2], "ignore_eos": True, "sampling_seed": 42,
    })
    assert sp == SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=64,
                                stop=["</s>"], stop_token_ids=[2], ignore_eos=True, seed=42)
    assert SamplingParams.from_dict({"temperature": 1, "stop": None}).temperature == 1.0
    assert SamplingParams.from_dict({}) == SamplingParams()


@pytest.mark.parametrize("d,name", [
    ({"temprature": 0.5}, "temprature"),
    ({"min_p": 0.1}, "min_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_new_tokens": 10.5}, "max_new_tokens"),
    ({"stop": [1]}, "stop"),
    ({"top_k": True}, "top_k"),
    ({"seed": 1, "sampling_seed": 2}, "sampling_seed"),
])
def test_from_dict_rejects_with_key_named(d, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict(d)


# --- GPU (skipped without CUDA) ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_greedy_and_target_distribution():
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    b, k, v = 4096, 3, 32000
    logits = torch.randn(b, k + 1, v, device=dev, generator=g)
    drafts = torch.randint(0, v, (b, k), device=dev, generator=g)
    drafts[: b // 2] = logits[: b // 2, :k].argmax(-1)
    p = logits_to_probs(logits.reshape(-1, v), 0.0, 1.0, -1).reshape(b, k + 1, v)
    q = torch.nn.functional.one_hot(drafts, v).float()
    assert all(torch.equal(a, c) for a, c in
               zip(verify_sampling(drafts, q, p, g), verify_greedy(drafts, logits)))
    n, emitted = verify_sampling(
        torch.multinomial(Q_CASES["wild"].to(dev), N_ROWS, True, generator=g)[:, None],
        Q_CASES["wild"].to(dev).expand(N_ROWS, 1, -1),
        torch.stack([P1, P2]).to(dev).expand(N_ROWS, -1, -1), g)
    assert tv(emitted[:, 0].cpu(), P1) < TV_TOL
