"""The engine's lean target forward (decode/lean_forward.py): bit-identical to transformers'
forward in fp32 and in bf16 on PyTorch's kernels (hidden states, kept layers, the slot cache),
Llama and Qwen2 (q/k/v bias), rows with padding holes, prefills and verify steps; on the bf16
CPU kernels (AMX machines) within bf16 rounding and the same tokens; the engine's output with
and without it equal; models it does not cover are left to transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fastmtp_sglang.cpu_kernels import amx, decode_attention
from fastmtp_sglang.cpu_kernels.packed_linear import pack_for_inference
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.lean_forward import LeanForward, lean_forward_for, unsupported
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.decode.slot_cache import SlotCache, use_gqa_sdpa
from test_continuous import live_successor_world

VOCAB = 97


def _model(kind: str, dtype=torch.float32):
    torch.manual_seed(11)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    m = (Qwen2ForCausalLM(Qwen2Config(**kw)) if kind == "qwen2"
         else LlamaForCausalLM(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}, **kw)))
    with torch.no_grad():  # non-trivial norms and biases
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.normal_(1.0 if "norm" in n else 0.0, 0.3)
    m = m.eval().to(dtype)
    use_gqa_sdpa(m)
    return m


def _batches():
    """(ids, mask) of a prefill of 3 rows with holes, then verify steps of 1..4 new tokens."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0          # a short row (left holes)
    mask[2, 3:5] = 0         # rejected slots in the middle
    steps = [torch.randint(0, VOCAB, (3, n), generator=g) for n in (1, 4, 2, 1)]
    return ids, mask, steps


def _run(fwd, ids, mask, steps, keep=()):
    cache, outs, pos_end = SlotCache(), [], None
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    outs.append(fwd(ids, pos, mask, cache, keep))
    pos_end = pos[:, -1:]
    for new in steps:
        n = new.shape[1]
        mask = torch.cat([mask, torch.ones(3, n, dtype=torch.long)], 1)
        p = pos_end + torch.arange(1, n + 1)
        outs.append(fwd(new, p, mask, cache, keep))
        pos_end = p[:, -1:]
    return outs, cache


def _hf(model):
    def fwd(ids, pos, mask, cache, keep):
        o = model.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                        use_cache=True, output_hidden_states=bool(keep))
        return o.last_hidden_state, ({i: o.hidden_states[i] for i in keep} if keep else None)
    return fwd


def _lean(model):
    lean = LeanForward(model)
    return lambda ids, pos, mask, cache, keep: lean(ids, pos, mask, cache, keep=keep)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_identical_to_transformers_on_pytorchs_kernels(kind, dtype, monkeypatch):
    monkeypatch.setitem(amx._state, "lib", None)   # PyTorch's own kernels only
    monkeypatch.setitem(decode_attention._state, "lib", None)
    model = _model(kind, dtype)
    ids, mask, steps = _batches()
    keep = (0, 2, 3)
    with torch.inference_mode():
        a, ca = _run(_hf(model), ids, mask, steps, keep)
        b, cb = _run(_lean(model), ids, mask, steps, keep)
    for (ha, ka), (hb, kb) in zip(a, b):
        assert torch.equal(ha, hb)
        assert ka.keys() == kb.keys() and all(torch.equal(ka[i], kb[i]) for i in keep)
    for la, lb in zip(ca.layers, cb.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.skipif(not amx.available(), reason=f"cpu kernels: {amx.unavailable_reason()}")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.usefixtures("amx_build")
def test_bf16_cpu_kernels_within_rounding_of_transformers(kind):
    model = _model(kind, torch.bfloat16)
    pack_for_inference(model, None, "on")
    ids, mask, steps = _batches()
    with torch.inference_mode():
        a, _ = _run(_hf(model), ids, mask, steps, (2,))
        b, _ = _run(_lean(model), ids, mask, steps, (2,))
        for (ha, ka), (hb, kb) in zip(a, b):
            torch.testing.assert_close(hb.float(), ha.float(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(kb[2].float(), ka[2].float(), rtol=3e-2, atol=3e-2)
            top = (model.lm_head(ha).argmax(-1) == model.lm_head(hb).argmax(-1)).float().mean()
            assert top > 0.9


def _counted(monkeypatch, module, name: str) -> dict:
    """``module.name`` replaced by itself counting its calls: {"n": calls so far}."""
    calls, real = {"n": 0}, getattr(module, name)

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.skipif(not decode_attention.available(), reason=f"cpu attention: {decode_attention.unavailable_reason()}")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_decode_attention_kernel_within_rounding_of_transformers(kind, monkeypatch):
    """One-token steps through the one-pass attention kernel (prefill and multi-token verify
    steps keep PyTorch's): within bf16 rounding of transformers, the same argmax, and the
    kernel really ran."""
    monkeypatch.setitem(amx._state, "lib", None)
    calls = _counted(monkeypatch, decode_attention, "decode_attention")
    model = _model(kind, torch.bfloat16)
    ids, mask, steps = _batches()
    with torch.inference_mode():
        a, ca = _run(_hf(model), ids, mask, steps, ())
        b, cb = _run(_lean(model), ids, mask, steps, ())
    assert calls["n"] == 2 * len(model.model.layers)   # the two one-token steps, every layer
    with torch.inference_mode():
        for (ha, _), (hb, _) in zip(a, b):
            torch.testing.assert_close(hb.float(), ha.float(), rtol=3e-2, atol=3e-2)
            assert (model.lm_head(ha).argmax(-1) == model.lm_head(hb).argmax(-1)).float().mean() > 0.9


@pytest.mark.skipif(not amx.tiles(), reason="AMX tiles: "
                                   + (amx.unavailable_reason() or "the AVX-512 build has none"))
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_verify_attention_on_tiles_within_rounding(kind, monkeypatch):
    """Verifies of several tokens a row (a chain, then a chain with leaves under a tree mask) at
    a head size the tiles take (32): the attention runs on tiles in every layer, within bf16
    rounding of transformers, and of the same forward with the verify's attention left to
    PyTorch (``TILE_ATTENTION`` off)."""
    from fastmtp_sglang.decode import leaves
    torch.manual_seed(12)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = (Qwen2ForCausalLM(Qwen2Config(**kw)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**kw)))
    model = model.eval().to(torch.bfloat16)
    use_gqa_sdpa(model)
    pack_for_inference(model, None, "on")
    calls = _counted(monkeypatch, amx, "multi_query_attention_rows")
    ids, mask, steps = _batches()
    with torch.inference_mode():
        a, _ = _run(_hf(model), ids, mask, steps, ())
        b, _ = _run(_lean(model), ids, mask, steps, ())
        L = len(model.model.layers)
        assert calls["n"] == 3 * L  # the prefill of 9 (rows with holes), the steps of 4 and 2 tokens
        off = LeanForward(model)
        off.TILE_ATTENTION = False
        c, _ = _run(lambda i, p, m, ca, k: off(i, p, m, ca, keep=k), ids, mask, steps, ())
        assert calls["n"] == 3 * L
        for (ha, _), (hb, _), (hc, _) in zip(a, b, c):
            torch.testing.assert_close(hb.float(), ha.float(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(hb.float(), hc.float(), rtol=3e-2, atol=3e-2)
            assert (model.lm_head(ha).argmax(-1) == model.lm_head(hb).argmax(-1)).float().mean() > 0.9
        # a verify with leaves: K=2, width 3 (7 tokens a row under the tree mask)
        K, W = 2, 3
        tree = leaves.tree_mask(K, W)
        n = tree.shape[0]
        for fwd in (LeanForward(model), off):
            cache = SlotCache()
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            fwd(ids, pos, mask, cache)
            new = torch.randint(0, VOCAB, (3, n), generator=torch.Generator().manual_seed(3))
            p = pos[:, -1:] + leaves.positions(torch.zeros(3, dtype=torch.long), K, W)[:, :] + 1
            m2 = torch.cat([mask, torch.ones(3, n, dtype=torch.long)], 1)
            out = fwd(new, p, m2, cache, tree=tree)[0]
            if fwd is off:
                torch.testing.assert_close(out.float(), first.float(), rtol=3e-2, atol=3e-2)
            else:
                first = out
        assert calls["n"] == 5 * L


def test_engine_tokens_equal_with_and_without_the_lean_forward():
    """fp32, a head that gets drafts accepted (live attention): the same tokens and the same
    acceptance per cycle through transformers' forward and the lean one."""
    t, head = live_successor_world()
    t2, head2 = copy.deepcopy((t, head))
    on = ReferenceEngine(t, head, 3, lean="auto")
    off = ReferenceEngine(t2, head2, 3, lean="off")
    assert on.lean is not None and off.lean is None
    prompts = [[1, 5, 7, 9, 11], [3, 4], [8, 8, 8, 8, 2, 40, 41], [60, 61, 62]]

    def run(eng):
        return eng.generate([Request(list(p), SamplingParams(max_new_tokens=24)) for p in prompts])

    a, b = run(on), run(off)
    assert sum(c.accepted for r in a for c in r.metrics.cycles) > 0
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [[c.accepted for c in r.metrics.cycles] for r in a] == [[c.accepted for c in r.metrics.cycles] for r in b]


def test_models_it_does_not_cover_go_to_transformers():
    m = _model("llama")
    assert unsupported(m) is None and isinstance(lean_forward_for(m), LeanForward)
    assert lean_forward_for(m, "off") is None
    m.config.hidden_act = "gelu"
    assert "hidden_act" in unsupported(m)
    assert lean_forward_for(m, "auto") is None
    with pytest.raises(ValueError, match="does not cover"):
        lean_forward_for(m, "on")
    with pytest.raises(ValueError, match="auto, on or off"):
        lean_forward_for(m, "fast")
    m2 = _model("qwen2")
    m2.config.model_type = "gpt2"
    assert "model type" in unsupported(m2)
