"""The continuous-batching slot generator (distill's in-process path) against the target itself:
logits equal transformers' forward, greedy tokens equal ``generate``, sampling follows the
filtered target distribution and a seed reproduces its tokens whatever the batch, and refilled /
shared-prefill slots change nothing (fp32)."""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.decode.batch_gen import GenRequest, PromptTooLong, SlotGenerator, generate_all
from fastmtp_sglang.decode.sampling import SamplingParams
from test_engine import tiny_target

PROMPTS = [[1, 5, 7, 9, 11], [3, 4], [8, 8, 8, 8, 8, 8, 8, 8, 2, 40, 41], [17], [60, 61, 62, 63],
           [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43], [9, 9]]


def hf_greedy(target, ids, n):
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_match_transformers(family):
    t = tiny_target(family, seed=11)
    g = SlotGenerator(t, slots=3, max_len=64)
    ids = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    first = [g.prefill(i, p) for i, p in enumerate(ids)]
    nxt = torch.tensor([5, 6, 7])
    dec = g.decode(nxt)
    with torch.no_grad():
        for i, p in enumerate(ids):
            ref = t.model(torch.tensor([p + [int(nxt[i])]])).logits[0].float()
            torch.testing.assert_close(first[i], ref[-2], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dec[i], ref[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,slots", [("llama", 1), ("llama", 3), ("qwen2", 2)])
def test_greedy_equals_generate_with_refill(family, slots):
    """More prompts than slots: finished rows are refilled mid-run; every output is the target's."""
    t = tiny_target(family, seed=12)
    n_new = [9, 20, 5, 14, 11, 3, 17]
    reqs = [GenRequest(p, SamplingParams(max_new_tokens=n, ignore_eos=True), tag=i)
            for i, (p, n) in enumerate(zip(PROMPTS, n_new))]
    res = generate_all(t, reqs, slots=slots, max_len=64)
    for i, r in enumerate(res):
        assert r.tag == i
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
    res = generate_all(t, reqs, slots=3, max_len=64)
    for r in res:
        if r.tag == "g":
            assert r.output_ids == hf_greedy(t, PROMPTS[0], 7)
            continue
        alone = generate_all(t, [GenRequest(PROMPTS[2], params[r.tag])], slots=1, max_len=64)[0]
        assert r.output_ids == alone.output_ids, f"sample {r.tag}"
    outs = [tuple(r.output_ids) for r in res if r.tag != "g"]
    assert len(set(outs)) > 1  # different seeds really differ


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (8, 0.7), (-1, 0.8)])
def test_sampled_first_token_follows_the_filtered_target(top_k, top_p):
    """The fast top-k draw (top_k > 0) and the full path (top_k = -1) both sample the first token
    from logits_to_probs's distribution (statistical: 3000 seeds, total variation < 0.05)."""
    from fastmtp_sglang.decode.sampling import logits_to_probs

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
    res = generate_all(t, reqs, slots=64, max_len=16)
    emp = torch.bincount(torch.tensor([r.output_ids[0] for r in res]), minlength=v).float() / n
    assert (emp[want == 0] == 0).all()  # never a token the filters removed
    assert 0.5 * (emp - want).abs().sum() < 0.05


def test_eos_and_length_limits_and_bad_requests():
    t = tiny_target("llama", seed=14)
    greedy = hf_greedy(t, PROMPTS[1], 12)
    capped_ref = hf_greedy(t, PROMPTS[5], 7)  # before EOS is set (generate would suppress it)
    eos = greedy[5]
    t.model.generation_config.eos_token_id = eos
    t.config["eos_token_id"] = eos
    w = SlotGenerator(t, slots=2, max_len=20).start()
    ok = w.submit(GenRequest(PROMPTS[1], SamplingParams(max_new_tokens=12)))
    long = w.submit(GenRequest(list(range(1, 21)), SamplingParams(max_new_tokens=4)))
    capped = w.submit(GenRequest(PROMPTS[5], SamplingParams(max_new_tokens=50, ignore_eos=True)))
    w.close()
    r = ok.result()
    assert r.output_ids == greedy[: greedy.index(eos) + 1]
    assert r.finish_reason["type"] == "stop"
    with pytest.raises(PromptTooLong):
        long.result()
    c = capped.result()  # 14 prompt tokens fill positions 0..13; new tokens are cached at 14..19,
    assert c.finish_reason["type"] == "length"  # and the last one, never cached, ends the row
    assert len(c.output_ids) == 20 - len(PROMPTS[5]) + 1
    assert c.output_ids == capped_ref


def test_worker_on_calling_thread_fails_every_request_when_the_engine_dies():
    """run() on the caller's thread (the fast place on CPU, see GenWorker): an engine fault
    mid-generation fails the rows in flight and the queued requests, then propagates."""
    t = tiny_target("llama", seed=15)
    gen = SlotGenerator(t, slots=2, max_len=64)
    w = gen.worker()
    futs = [w.submit(GenRequest(p, SamplingParams(max_new_tokens=8))) for p in PROMPTS[:5]]
    w.close()
    calls = {"n": 0}
    real = gen.decode

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated engine fault")
        return real(*a, **k)

    gen.decode = flaky
    with pytest.raises(RuntimeError, match="simulated"):
        w.run()
    for f in futs:
        with pytest.raises(RuntimeError, match="simulated"):
            f.result(timeout=1)
    with pytest.raises(RuntimeError, match="stopped"):
        w.submit(GenRequest(PROMPTS[0], SamplingParams(max_new_tokens=2)))
