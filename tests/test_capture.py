"""A request that asks for features gets what `fastmtp features` would store for its sequence:
the target's states at positions 0 .. P + N - 2 and the top-k log-probabilities there, whatever
the batch, K, sampling, shared prompts or a stop cutting a cycle short."""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.generator import GenRequest, generate_all
from fastmtp_sglang.decode.sampling import SamplingParams
from test_engine import PROMPTS, llama, successor_world  # noqa: F401  (fixture)

K_TOP = 5


def _reference(t, prompt: list[int], out: list[int]):
    seq = torch.tensor(prompt + out)
    with torch.no_grad():
        h = t.model.model(input_ids=seq[None]).last_hidden_state[0][: len(seq) - 1]
        return h, torch.log_softmax(t.lm_head(h).float(), -1)


def _check(t, prompt, out, feats):
    states, ids, lp = feats
    h, logp = _reference(t, prompt, out)
    assert states.shape == h.shape  # P + N - 1 rows
    torch.testing.assert_close(states, h, rtol=1e-4, atol=1e-4)
    assert ids.dtype == torch.int32 and lp.dtype == torch.float16 and ids.shape == (len(h), K_TOP)
    # the stored columns are the target's top-k (compared by value: robust to near-ties)
    torch.testing.assert_close(lp.float(), logp.topk(K_TOP, -1).values, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lp.float(), logp.gather(1, ids.long()), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("steps", [0, 3])
def test_captured_features_equal_the_targets(llama, steps):
    t, head, _ = llama
    eng = ReferenceEngine(t, head if steps else None, steps)
    sampled = SamplingParams(temperature=0.9, max_new_tokens=20, seed=4)
    reqs = [Request(PROMPTS[0], sampled, features=K_TOP),           # two samples of one prompt:
            Request(PROMPTS[0], SamplingParams(temperature=0.9, max_new_tokens=20, seed=5),
                    features=K_TOP),                                # one prefill
            Request(PROMPTS[1], SamplingParams(max_new_tokens=17), features=K_TOP),
            Request(PROMPTS[2], SamplingParams(max_new_tokens=20), features=None)]
    res = eng.generate(reqs)
    for req, r in zip(reqs[:3], res[:3]):
        _check(t, req.input_ids, r.output_ids, r.features)
    assert res[3].features is None  # asked for nothing, kept nothing


def test_a_stop_inside_a_cycle_keeps_the_positions_of_the_kept_tokens():
    t, head = successor_world()  # the head drafts x+1, x+2, x+3: every cycle accepts all 3
    r = ReferenceEngine(t, head, 3).generate(
        [Request([1, 5, 7], SamplingParams(max_new_tokens=24, stop_token_ids=[14]), features=K_TOP)])[0]
    assert r.output_ids == [8, 9, 10, 11, 12, 13, 14]  # the second cycle's 4 tokens end at 14
    assert [c.accepted for c in r.metrics.cycles] == [3, 3]  # ... which fed past it
    _check(t, [1, 5, 7], r.output_ids, r.features)


def test_the_generator_hands_features_back(llama):
    t, _, _ = llama
    eng = ReferenceEngine(t, None, 0)
    reqs = [GenRequest(p, SamplingParams(max_new_tokens=9 + i), features=K_TOP) for i, p in enumerate(PROMPTS)]
    for req, r in zip(reqs, generate_all(eng, reqs, slots=2)):  # the third joins a running batch
        _check(t, req.input_ids, r.output_ids, r.features)


def test_the_server_answers_hidden_states_from_what_the_engine_kept(llama):
    """SGLang's return_hidden_states rows from Result.features, no second forward (model=None
    would fail if one ran), equal to the target's states."""
    from fastmtp_sglang.serving.hidden_states import sglang_hidden_states

    t, _, _ = llama
    r = ReferenceEngine(t, None, 0).generate(
        [Request(PROMPTS[2], SamplingParams(max_new_tokens=9), features=0)])[0]
    rows = sglang_hidden_states(None, PROMPTS[2], r.output_ids, r.features)
    assert len(rows[0]) == len(PROMPTS[2]) and len(rows) == 1 + len(r.output_ids) - 1
    got = torch.cat([torch.tensor(rows[0]), torch.tensor(rows[1:])])
    torch.testing.assert_close(got, _reference(t, PROMPTS[2], r.output_ids)[0], rtol=1e-4, atol=1e-4)
    assert r.features[1] is None and r.features[2] is None  # k = 0: states only
