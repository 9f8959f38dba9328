"""Reference engine: greedy speculative output == plain greedy (transformers generate), for
K = 1..5, batch 1 and a batch of prompts of different lengths; accounting invariants; sampling
keeps the target's distribution; a perfect drafter reaches tau = K + 1."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fastmtp_sglang.core.draft_dir import make_draft_config
from fastmtp_sglang.decode.engine import ReferenceEngine, Request, RequestError
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig
from fastmtp_sglang.decode.metrics import aggregate
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.core.target import Target

V = 97
PROMPTS = [[1, 5, 7, 9, 11], [3, 4], [8, 8, 8, 8, 8, 8, 8, 8, 2, 40, 41]]
N_NEW = 24


def tiny_target(family: str = "llama", seed: int = 0, vocab: int = V) -> Target:
    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}, **kw))
    model.eval()
    return Target(model, None, model.config.to_dict(), family)


def random_head(target: Target, layout: str = "deepseek", seed: int = 1) -> FastMTPHead:
    torch.manual_seed(seed)
    cfg = HeadConfig.from_dict(make_draft_config(target.config, layout))
    return FastMTPHead(cfg, target.embed, target.lm_head).eval()


def successor_world() -> tuple[Target, FastMTPHead]:
    """A target that always predicts token x+1 after x, and a head that knows it (a perfect
    drafter): every layer's output projections are zeroed, so the residual stream is the token's
    embedding, and lm_head row y is the embedding of y-1."""
    t = tiny_target("llama", seed=3)
    with torch.no_grad():
        for layer in t.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = t.model.model.embed_tokens.weight
        emb.copy_(torch.nn.functional.normalize(torch.randn_like(emb), dim=-1) * 8)
        t.model.model.norm.weight.fill_(1.0)
        t.model.config.tie_word_embeddings = False
        t.model.lm_head.weight = torch.nn.Parameter(torch.roll(emb.clone(), 1, dims=0))
    head = random_head(t, "split")
    with torch.no_grad():
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
        head.e_proj.weight.copy_(torch.eye(64))
        head.h_proj.weight.zero_()
        head.enorm.weight.fill_(1.0)
        head.final_norm.weight.fill_(1.0)
    return t, head


def greedy_reference(target: Target, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding of ``prompt``. The attention mask is given: without
    it ``generate`` would infer one from ``pad_token_id`` and hide a prompt's token 0."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llama():
    t = tiny_target("llama")
    return t, random_head(t, "mimo"), [greedy_reference(t, p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 4, 5])
def test_greedy_equals_plain_decoding_batched(llama, steps):
    t, head, ref = llama
    eng = ReferenceEngine(t, head if steps else None, steps)
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS])
    for r, want in zip(res, ref):
        assert r.output_ids == want
        assert r.finish_reason["type"] == "length"


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_greedy_equals_plain_decoding_batch1(llama, steps):
    t, head, ref = llama
    eng = ReferenceEngine(t, head, steps)
    for p, want in zip(PROMPTS, ref):
        assert eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW))])[0].output_ids == want


@pytest.mark.parametrize("layout", ["deepseek", "split"])
def test_greedy_equals_plain_decoding_qwen2(layout):
    t = tiny_target("qwen2")
    head = random_head(t, layout)
    eng = ReferenceEngine(t, head, 3)
    res = eng.generate([Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS])
    assert [r.output_ids for r in res] == [greedy_reference(t, p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_perfect_drafter_accepts_everything(steps):
    t, head = successor_world()
    prompts = [[5], [10, 11, 12], [30, 31]]
    res = ReferenceEngine(t, head, steps).generate(
        [Request(p, SamplingParams(max_new_tokens=3 * (steps + 1) + 1)) for p in prompts])
    for p, r in zip(prompts, res):
        assert r.output_ids == [(p[-1] + 1 + i) % V for i in range(len(r.output_ids))]
        s = r.metrics.summary()
        # every cycle accepts all K drafts: tau = K + 1, A_k = 1
        assert s["tau"] == steps + 1 and s["A_k"] == [1.0] * steps
        assert s["accept_hist"][-1] == s["cycles"]


def test_accounting_invariants(llama):
    t, head, _ = llama
    head2 = random_head(t, "deepseek", seed=7)
    res = ReferenceEngine(t, head2, 3).generate(
        [Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS])
    for r in res:
        s = r.metrics.summary()
        assert s["emitted"] == sum(c.accepted + 1 for c in r.metrics.cycles)  # accepted + 1 each
        assert s["tau"] == pytest.approx(1 + sum(s["A_k"]))
        assert s["cycles"] == r.metrics.verify_ct == sum(s["accept_hist"])
        # the first token comes from prefill; cycles emit the rest (the last may be cut short)
        assert s["emitted"] >= r.metrics.completion_tokens - 1
    agg = aggregate([r.metrics for r in res])
    assert agg["tau"] == pytest.approx(1 + sum(agg["A_k"]))


def test_stop_conditions(llama):
    t, head, ref = llama
    eng = ReferenceEngine(t, head, 3)
    stop_tok = ref[0][5]
    r = eng.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=N_NEW, stop_token_ids=[stop_tok]))])[0]
    assert r.output_ids == ref[0][: ref[0].index(stop_tok) + 1]
    assert r.finish_reason == {"type": "stop", "matched": stop_tok}
    r = eng.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=7))])[0]
    assert r.output_ids == ref[0][:7] and r.finish_reason["type"] == "length"
    eng.eos_ids = {stop_tok}
    r = eng.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=N_NEW))])[0]
    assert r.output_ids[-1] == stop_tok and len(r.output_ids) <= ref[0].index(stop_tok) + 1
    r = eng.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))])[0]
    assert r.output_ids == ref[0]


def test_streaming_callback_concatenates_to_output(llama):
    t, head, ref = llama
    got: dict[int, list[int]] = {}
    res = ReferenceEngine(t, head, 2).generate(
        [Request(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS],
        on_tokens=lambda i, ids: got.setdefault(i, []).extend(ids))
    assert [got[i] for i in range(len(PROMPTS))] == [r.output_ids for r in res]


def test_bad_requests(llama):
    t, head, _ = llama
    eng = ReferenceEngine(t, head, 2, max_context=16)
    with pytest.raises(RequestError, match="context"):
        eng.generate([Request(list(range(20)), SamplingParams())])
    with pytest.raises(RequestError, match="empty"):
        eng.generate([Request([], SamplingParams())])
    with pytest.raises(RequestError, match="input_ids"):
        eng.generate([Request([V + 3], SamplingParams())])
    # near the context limit generation stops with "length" instead of failing
    r = eng.generate([Request(list(range(10)), SamplingParams(max_new_tokens=50))])[0]
    assert r.finish_reason["type"] == "length" and 10 + len(r.output_ids) <= 16


@pytest.mark.parametrize("steps", [1, 3])
def test_sampled_tokens_follow_the_target(steps):
    """Lossless sampling: the second token (the first one a verification cycle emits) must follow
    the target's marginal sum_x p(x | prompt) p(y | prompt, x), whatever the draft proposes.
    Small vocabulary so the check has power; the draft's own marginal is far from the target's."""
    v = 12
    t = tiny_target("llama", seed=5, vocab=v)
    head = random_head(t, "deepseek", seed=9)
    with torch.no_grad():  # a confident, mostly wrong draft
        head.final_norm.weight.mul_(4.0)
    prompt = [4, 9, 2]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        p1 = torch.softmax(t.model(ids).logits[0, -1].float(), -1)                  # [v]
        both = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], dim=1)     # [v, 4]
        p2 = torch.softmax(t.model(both).logits[:, -1].float(), -1)                  # [v, v]
        want = p1 @ p2                                                               # [v]
        hb = t.model.model(both).last_hidden_state
        q = torch.softmax(head(hb[:, -2:-1], both[:, -1:], torch.full((v, 1), 3))[1][:, 0].float(), -1)
        draft_marginal = p1 @ q
    n = 4000
    eng = ReferenceEngine(t, head, steps, max_context=16)
    res = eng.generate([Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=7 + i))
                        for i in range(n)])  # one seed per request: each row has its own generator
    second = torch.tensor([r.output_ids[1] for r in res])
    emp = torch.bincount(second, minlength=v).float() / n
    tv = 0.5 * (emp - want).abs().sum().item()
    gap = 0.5 * (draft_marginal - want).abs().sum().item()
    assert gap > 0.15, f"test has no power: draft marginal is only {gap:.3f} from the target's"
    # 4000 samples over 12 tokens: sampling noise in TV is about 0.02-0.03
    assert tv < 0.05, f"total variation {tv:.3f} between emitted and target marginals"
    assert sum(r.metrics.verify_ct for r in res) >= n  # every row ran a verification cycle


def test_seeded_sampling_does_not_depend_on_the_batch(llama):
    """Each request has its own generator: the same seed gives the same tokens alone or batched."""
    t, head, _ = llama
    eng = ReferenceEngine(t, head, 2)
    mk = lambda p, s: Request(p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=s))  # noqa: E731
    alone = eng.generate([mk(PROMPTS[1], 7)])[0].output_ids
    batched = eng.generate([mk(PROMPTS[0], 5), mk(PROMPTS[1], 7), mk(PROMPTS[2], 9)])[1].output_ids
    assert alone == batched
    other = eng.generate([mk(PROMPTS[1], 8)])[0].output_ids
    assert other != alone  # the seed matters (12 sampled tokens over 97: a tie is ~impossible)
