"""The queue generator (distill's in-process path: the serving engine at K=0 fed from a queue)
against the target itself: greedy tokens equal ``generate`` with rows refilled mid-run, sampling
follows the filtered target distribution, a seed reproduces its tokens whatever the batch, n
copies of a prompt share one prefill and change nothing, refused requests fail alone and an
engine fault fails everything (fp32)."""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.decode.engine import ReferenceEngine, RequestError
from fastmtp_sglang.decode.generator import GenRequest, QueueGenerator, generate_all
from fastmtp_sglang.decode.sampling import SamplingParams, logits_to_probs, sample_rows
from test_engine import tiny_target

PROMPTS = [[1, 5, 7, 9, 11], [3, 4], [8, 8, 8, 8, 8, 8, 8, 8, 2, 40, 41], [17], [60, 61, 62, 63],
           [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43], [9, 9]]


def hf_greedy(target, ids, n):
    # (the mask given: inferred from pad_token_id, it would hide a prompt's token 0)
    x = torch.tensor([ids])
    out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                do_sample=False, min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def engine(t, **kw):
    return ReferenceEngine(t, None, 0, **kw)


@pytest.mark.parametrize("family,slots,join_min", [("llama", 1, None), ("llama", 3, 1),
                                                   ("llama", 3, 2), ("qwen2", 2, None)])
def test_greedy_equals_generate_with_refill(family, slots, join_min):
    """More prompts than slots: finished rows are refilled mid-run (one at a time or in groups);
    every output is the target's own greedy continuation."""
    t = tiny_target(family, seed=12)
    n_new = [9, 20, 5, 14, 11, 3, 17]
    reqs = [GenRequest(p, SamplingParams(max_new_tokens=n, ignore_eos=True), tag=i)
            for i, (p, n) in enumerate(zip(PROMPTS, n_new))]
    res = generate_all(engine(t), reqs, slots=slots, join_min=join_min)
    for i, r in enumerate(res):
        assert r.tag == i and r.prompt_tokens == len(PROMPTS[i])
        assert r.output_ids == hf_greedy(t, PROMPTS[i], n_new[i]), f"prompt {i}"
        assert r.finish_reason == {"type": "length", "length": n_new[i]}


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    """n samples of one prompt (sharing one prefill): a seed gives the same tokens alone or
    batched beside other requests; different seeds differ; greedy rows stay the target's."""
    t = tiny_target("llama", seed=13)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=16,
                             ignore_eos=True, seed=100 + s) for s in range(4)]
    reqs = [GenRequest(PROMPTS[2], p, tag=s) for s, p in enumerate(params)]
    reqs.insert(2, GenRequest(PROMPTS[0], SamplingParams(max_new_tokens=7, ignore_eos=True), tag="g"))
    res = generate_all(engine(t), reqs, slots=3)
    for r in res:
        if r.tag == "g":
            assert r.output_ids == hf_greedy(t, PROMPTS[0], 7)
            continue
        alone = generate_all(engine(t), [GenRequest(PROMPTS[2], params[r.tag])], slots=1)[0]
        assert r.output_ids == alone.output_ids, f"sample {r.tag}"
    outs = [tuple(r.output_ids) for r in res if r.tag != "g"]
    assert len(set(outs)) > 1  # different seeds really differ


def test_copies_of_a_prompt_are_prefilled_once_and_equal_separate_prefills():
    """Four copies of a prompt admitted together: the target reads the prompt once (one row in
    the prefill forward), and every copy's greedy output is the target's."""
    t = tiny_target("llama", seed=16)
    e = engine(t)
    rows_seen = []
    real = e._target

    def spy(ids, *a, **k):
        rows_seen.append(ids.shape[0])
        return real(ids, *a, **k)

    e._target = spy
    reqs = [GenRequest(PROMPTS[5], SamplingParams(max_new_tokens=6, ignore_eos=True), tag=i)
            for i in range(4)] + [GenRequest(PROMPTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True))]
    res = generate_all(e, reqs, slots=5)
    want = {len(PROMPTS[5]): hf_greedy(t, PROMPTS[5], 6), len(PROMPTS[0]): hf_greedy(t, PROMPTS[0], 6)}
    for r in res:
        assert r.output_ids == want[r.prompt_tokens]
    # the prefill forwards held 2 distinct prompts in all (not 5 rows); decode steps hold 5
    assert sum(n for n in rows_seen if n != 5) == 2, rows_seen


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (8, 0.7), (-1, 0.8)])
def test_sampled_first_token_follows_the_filtered_target(top_k, top_p):
    """The top-k draw (top_k > 0) and the full path (top_k = -1) both sample the first token
    from logits_to_probs's distribution (statistical: 3000 seeds, total variation < 0.05)."""
    v = 16
    t = tiny_target("llama", seed=15, vocab=v)
    with torch.no_grad():
        t.model.lm_head.weight.mul_(20.0)  # a peaked distribution, so top-k / top-p bite
        logits = t.model(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    want = logits_to_probs(logits[None], 0.9, top_p, top_k)[0]
    n = 3000
    reqs = [GenRequest(PROMPTS[0], SamplingParams(temperature=0.9, top_p=top_p, top_k=top_k,
                                                  max_new_tokens=1, ignore_eos=True, seed=i))
            for i in range(n)]
    res = generate_all(engine(t), reqs, slots=64)
    emp = torch.bincount(torch.tensor([r.output_ids[0] for r in res]), minlength=v).float() / n
    assert (emp[want == 0] == 0).all()  # never a token the filters removed
    assert 0.5 * (emp - want).abs().sum() < 0.05


def test_sample_rows_matches_logits_to_probs_per_row():
    """sample_rows over a mixed batch (greedy, top-k, top-k + top-p, no top-k): each row's
    empirical distribution over 4000 seeded draws is logits_to_probs's (total variation < 0.04),
    and a row's draw depends only on its own generator, not on its neighbours."""
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=4),
              SamplingParams(temperature=1.3, top_k=6, top_p=0.6), SamplingParams(temperature=0.9, top_p=0.9)]
    n = 4000
    counts = torch.zeros(4, 12)
    for s in range(n):
        gens = [torch.Generator().manual_seed(s * 4 + i) for i in range(4)]
        counts[torch.arange(4), sample_rows(logits, params, gens)] += 1
    for i, p in enumerate(params):
        want = logits_to_probs(logits[i:i + 1], p.temperature, p.top_p, p.top_k)[0]
        assert (counts[i][want == 0] == 0).all()
        assert 0.5 * (counts[i] / n - want).abs().sum() < 0.04, i
    # row 1 alone, with the same generator seed, draws what it drew in the batch
    for s in range(50):
        batch = sample_rows(logits, params, [torch.Generator().manual_seed(s * 4 + i) for i in range(4)])
        alone = sample_rows(logits[1:2], params[1:2], [torch.Generator().manual_seed(s * 4 + 1)])
        assert int(batch[1]) == int(alone[0])


def test_eos_context_limit_and_a_refused_request():
    t = tiny_target("llama", seed=14)
    greedy = hf_greedy(t, PROMPTS[1], 12)
    capped_ref = hf_greedy(t, PROMPTS[5], 7)  # before EOS is set (generate would suppress it)
    eos = greedy[5]
    t.model.generation_config.eos_token_id = eos
    t.config["eos_token_id"] = eos
    w = QueueGenerator(engine(t, max_context=20), slots=2).start()
    ok = w.submit(GenRequest(PROMPTS[1], SamplingParams(max_new_tokens=12)))
    long = w.submit(GenRequest(list(range(1, 21)), SamplingParams(max_new_tokens=4)))
    capped = w.submit(GenRequest(PROMPTS[5], SamplingParams(max_new_tokens=50, ignore_eos=True)))
    w.close()
    r = ok.result()
    assert r.output_ids == greedy[: greedy.index(eos) + 1]
    assert r.finish_reason["type"] == "stop"
    with pytest.raises(RequestError, match="context"):
        long.result()
    c = capped.result()  # the context (20 positions) ends the row
    assert c.finish_reason["type"] == "length"
    assert len(PROMPTS[5]) + len(c.output_ids) == 20
    assert c.output_ids == capped_ref[: len(c.output_ids)]


def test_worker_on_calling_thread_fails_every_request_when_the_engine_dies():
    """run() on the caller's thread (the fast place on CPU, see GenWorker): an engine fault
    mid-generation fails the rows in flight and the queued requests, then propagates."""
    t = tiny_target("llama", seed=15)
    e = engine(t)
    w = QueueGenerator(e, slots=2).worker()
    futs = [w.submit(GenRequest(p, SamplingParams(max_new_tokens=8))) for p in PROMPTS[:5]]
    w.close()
    calls = {"n": 0}
    real = e.step

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated engine fault")
        return real(*a, **k)

    e.step = flaky
    with pytest.raises(RuntimeError, match="simulated"):
        w.run()
    for f in futs:
        with pytest.raises(RuntimeError, match="simulated"):
            f.result(timeout=1)
    with pytest.raises(RuntimeError, match="stopped"):
        w.submit(GenRequest(PROMPTS[0], SamplingParams(max_new_tokens=2)))


def test_cancel_fails_unfinished_requests_and_returns():
    from fastmtp_sglang.decode.generator import GenerationCancelled

    t = tiny_target("llama", seed=17)
    e = engine(t)
    w = QueueGenerator(e, slots=2).worker()
    futs = [w.submit(GenRequest(p, SamplingParams(max_new_tokens=30, ignore_eos=True))) for p in PROMPTS[:4]]
    real = e.step
    calls = {"n": 0}

    def step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            w.cancel()
        return real(*a, **k)

    e.step = step
    w.run()  # returns quietly
    for f in futs:
        with pytest.raises(GenerationCancelled):
            f.result(timeout=1)
