"""Prompt-lookup (n-gram) drafting in the reference engine: proposals by hand, greedy output
identical to plain decoding (fp32, batch 1 and 3, K=1..5), lossless sampling, and it pays on
text that repeats its prompt."""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.metrics import aggregate
from fastmtp_sglang.decode.ngram import NgramDrafter
from fastmtp_sglang.decode.sampling import SamplingParams
from test_engine import N_NEW, PROMPTS, greedy_reference, tiny_target


def test_proposals_by_hand():
    d = NgramDrafter(max_ngram=2, min_ngram=1)
    assert d.propose([5, 6, 7, 8, 9, 5, 6], 3) == [7, 8, 9]       # bigram (5, 6) seen earlier
    assert d.propose([5, 6, 7, 1, 6], 2) == [7, 1]                # unigram 6: earliest match
    assert d.propose([1, 2, 3], 2) == []                          # nothing repeats
    assert d.propose([4, 4], 3) == [4]                            # continuation cut by the end
    assert d.propose([1, 2, 9, 1, 2], 5) == [9, 1, 2]
    assert NgramDrafter(3, 3).propose([1, 2, 3, 7, 2, 3], 2) == []  # only trigrams count
    with pytest.raises(ValueError):
        NgramDrafter(1, 2)


@pytest.fixture(scope="module")
def llama():
    t = tiny_target("llama", seed=21)
    return t, [greedy_reference(t, p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_greedy_equals_plain_decoding(llama, steps):
    t, ref = llama
    eng = ReferenceEngine(t, None, steps, drafter=NgramDrafter())
    batched = eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS])
    assert [r.output_ids for r in batched] == ref
    for p, want in zip(PROMPTS, ref):
        assert eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW))])[0].output_ids == want


def test_copying_text_is_accepted():
    """A target that continues a repeating prompt by repeating it: prompt lookup drafts the
    repetition, so tau is well above 1 (a target that never repeats itself would give ~1)."""
    t = tiny_target("llama", seed=22)
    prompt = [7, 3, 11, 5, 2] * 6
    ref = greedy_reference(t, prompt, 24)
    eng = ReferenceEngine(t, None, 4, drafter=NgramDrafter(max_ngram=3))
    r = eng.generate([Request(prompt, SamplingParams(max_new_tokens=24))])[0]
    assert r.output_ids == ref
    assert aggregate([r.metrics])["tau"] > 2.0  # (this seed's target does continue the pattern)


def test_sampled_tokens_follow_the_target():
    """Lossless: the first verified token follows the target's marginal although the proposal is
    a fixed (one-hot) guess."""
    v = 12
    t = tiny_target("llama", seed=5, vocab=v)
    prompt = [4, 9, 2, 4, 9]                  # "4 9" repeats: the drafter proposes 2 after it
    with torch.no_grad():
        ids = torch.tensor([prompt])
        p1 = torch.softmax(t.model(ids).logits[0, -1].float(), -1)
        both = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], dim=1)
        p2 = torch.softmax(t.model(both).logits[:, -1].float(), -1)
        want = p1 @ p2
    n = 3000
    eng = ReferenceEngine(t, None, 2, max_context=16, drafter=NgramDrafter())
    res = eng.generate([Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=i))
                        for i in range(n)])
    second = torch.tensor([r.output_ids[1] for r in res])
    emp = torch.bincount(second, minlength=v).float() / n
    tv = 0.5 * (emp - want).abs().sum().item()
    assert tv < 0.05, f"total variation {tv:.3f}"


@pytest.mark.parametrize("min_n,max_n", [(1, 2), (1, 4), (2, 3), (3, 3)])
def test_index_proposes_what_the_scan_proposes_as_the_sequence_grows(min_n, max_n):
    """NgramIndex (what the engine uses: one per request, fed the new tokens) returns the scan's
    proposal and match length after every append, over small vocabularies where n-grams recur."""
    import random

    from fastmtp_sglang.decode.ngram import NgramIndex

    d = NgramDrafter(max_n, min_n)
    rng = random.Random(min_n * 10 + max_n)
    for vocab in (2, 3, 6):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        idx, out = NgramIndex(d), []
        for _ in range(40):
            idx.sync(prompt, out)
            for k in (1, 3, 5):
                assert idx.propose_match(k) == d.propose_match(prompt + out, k)
            out.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
    idx.sync([9, 9, 9], [])  # another sequence: rebuilt, not mixed with the old one
    assert idx.propose_match(2) == d.propose_match([9, 9, 9], 2)


def test_index_grows_from_an_empty_prompt():
    """A sequence that is all output (the hybrid-aware weighting's drafter may see a row whose
    prompt is empty): the index grows with it and proposes what the scan proposes."""
    from fastmtp_sglang.decode.ngram import NgramIndex

    d = NgramDrafter(3, 1)
    idx, seq = NgramIndex(d), [1, 2, 3, 1, 2, 3, 1, 2]
    for n in range(len(seq) + 1):
        idx.sync([], seq[:n])
        assert idx.propose_match(2) == d.propose_match(seq[:n], 2)
    idx.sync([], [7, 7])  # another sequence: rebuilt
    assert idx.propose_match(1) == d.propose_match([7, 7], 1)
