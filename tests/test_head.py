"""FastMTPHead against an independent hand-written forward (conftest.ref_mtp): every layout, both
dense blocks, rope scalings, GQA; fp32 tight and bf16 loose; the KV cache path against the
full-sequence forward; rollback; sharing of the target's embedding and lm_head.

Run: .venv/bin/pytest tests/test_head.py
"""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.core.draft_dir import expected_shapes
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig

from conftest import H, HD, I, NH, NKV  # noqa: E402  (pytest puts tests/ on sys.path)

V = 101  # odd on purpose
ROPES = {
    "default": {"rope_theta": 10000.0},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}},
}


def make_cfg(layout: str, block: str, rope: str = "linear", **kw) -> HeadConfig:
    hf = {"hidden_size": H, "num_attention_heads": NH, "max_position_embeddings": 256, **ROPES[rope]}
    return HeadConfig(hidden_size=H, intermediate_size=I, num_attention_heads=NH,
                      num_key_value_heads=NKV, vocab_size=V, layout=layout, block=block,
                      head_dim=HD, rms_norm_eps=1e-5, max_position_embeddings=256,
                      hf_config=hf, **kw)


def ref_rope(ref, rope: str):
    spec = ROPES[rope]
    if rope == "default":
        return lambda p: ref.rope_by_hand(p, HD, spec["rope_theta"])
    if rope == "linear":
        return lambda p: ref.rope_by_hand(p, HD, spec["rope_theta"], spec["rope_scaling"]["factor"])
    return ref.rope_from_hf({"rope_theta": spec["rope_theta"], **spec["rope_scaling"]}, 256)


def randomise(head: FastMTPHead, seed: int = 0) -> FastMTPHead:
    """Random weights everywhere, norms and biases included (defaults would hide mix-ups)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return head


def target_parts(seed: int = 1) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Embedding(V, H)
    lm = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(V, H, generator=g))
        lm.weight.copy_(torch.randn(V, H, generator=g) / H ** 0.5)
    return emb.requires_grad_(False), lm.requires_grad_(False)


def inputs(b: int = 2, s: int = 9, seed: int = 2, start: tuple[int, ...] = (0, 5)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, H, generator=g) * 2.0
    ids = torch.randint(0, V, (b, s), generator=g)
    positions = torch.stack([torch.arange(s) + start[i % len(start)] for i in range(b)])
    return hidden, ids, positions


def build(layout, block, rope="linear", dtype=torch.float32, seed=0, **kw):
    emb, lm = target_parts()
    head = randomise(FastMTPHead(make_cfg(layout, block, rope, **kw), emb, lm), seed).eval()
    return head.to(dtype), emb, lm


DIMS = {"n_heads": NH, "n_kv": NKV, "head_dim": HD}


def reference(ref, head, rope, hidden, ids, positions, emb, lm, compute_dtype=torch.float32):
    sd = {k: v.to(compute_dtype) for k, v in head.state_dict().items()}
    w = ref.weights_head(sd, head.cfg.layout)
    return ref.mtp(w, hidden.to(compute_dtype), ids, positions, emb.weight.to(compute_dtype),
                   lm.weight.to(compute_dtype), ref_rope(ref, rope), DIMS, head.cfg.rms_norm_eps)


@pytest.mark.parametrize("layout", ["mimo", "deepseek", "split"])
@pytest.mark.parametrize("block", ["llama", "qwen2"])
def test_forward_matches_reference_fp32(ref, layout, block):
    head, emb, lm = build(layout, block)
    hidden, ids, positions = inputs()
    with torch.no_grad():
        out, logits = head(hidden, ids, positions)
        want_out, want_logits = reference(ref, head, "linear", hidden, ids, positions, emb, lm)
    assert out.shape == (2, 9, H) and logits.shape == (2, 9, V)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
def test_rope_scaling_matches_reference(ref, rope):
    head, emb, lm = build("deepseek", "llama", rope)
    # positions well past original_max_position_embeddings, where the scalings differ
    hidden, ids, positions = inputs(s=7, start=(40, 130))
    with torch.no_grad():
        out, logits = head(hidden, ids, positions)
        want_out, want_logits = reference(ref, head, rope, hidden, ids, positions, emb, lm)
        # and the check can tell scalings apart: the default rope gives other numbers
        other = reference(ref, head, "default" if rope != "default" else "linear",
                          hidden, ids, positions, emb, lm)[0]
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)
    assert (other - want_out).abs().max() > 1e-3


def test_llama_attention_and_mlp_bias(ref):
    head, emb, lm = build("split", "llama", attention_bias=True, mlp_bias=True)
    assert head.layer.self_attn.o_proj.bias is not None and head.layer.mlp.down_proj.bias is not None
    hidden, ids, positions = inputs()
    with torch.no_grad():
        out, logits = head(hidden, ids, positions)
        want_out, want_logits = reference(ref, head, "linear", hidden, ids, positions, emb, lm)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("layout", ["mimo", "deepseek", "split"])
@pytest.mark.parametrize("block", ["llama", "qwen2"])
def test_forward_bf16_close_to_fp32_reference(ref, layout, block):
    head, emb, lm = build(layout, block, dtype=torch.bfloat16)
    emb.to(torch.bfloat16), lm.to(torch.bfloat16)  # a bf16 target
    assert head.enorm.weight.dtype == torch.bfloat16
    hidden, ids, positions = inputs()
    with torch.no_grad():
        out, logits = head(hidden.bfloat16(), ids, positions)
        # the same bf16 weights, maths in fp32
        want_out, want_logits = reference(ref, head, "linear", hidden.bfloat16(), ids, positions,
                                          emb, lm, torch.float32)
    assert out.dtype == torch.bfloat16
    assert _rel(out, want_out) < 3e-2, _rel(out, want_out)
    assert _rel(logits, want_logits) < 3e-2, _rel(logits, want_logits)
    assert (logits.float().argmax(-1) == want_logits.argmax(-1)).float().mean() > 0.8


def test_bf16_head_on_fp32_target():
    """Mixed dtypes: the embedding is cast into the head's dtype, the hidden into lm_head's."""
    head, emb, lm = build("deepseek", "llama", dtype=torch.bfloat16)
    hidden, ids, positions = inputs()
    with torch.no_grad():
        out, logits = head(hidden, ids, positions)
    assert out.dtype == torch.bfloat16 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, lm(out.float()))


def test_expected_shapes_match_the_module():
    for layout in ("mimo", "deepseek", "split"):
        for block, kw in (("llama", {}), ("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True})):
            head = FastMTPHead(make_cfg(layout, block, **kw))
            got = {k: tuple(v.shape) for k, v in head.state_dict().items()}
            assert got == expected_shapes(head.cfg), (layout, block, kw)


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,block", [("mimo", "qwen2"), ("deepseek", "llama"), ("split", "llama")])
def test_cache_prefill_then_decode_equals_full_forward(layout, block):
    head, _, _ = build(layout, block)
    total, prefill = 13, 5
    hidden, ids, positions = inputs(b=3, s=total, start=(0,))
    with torch.no_grad():
        full_out, full_logits = head(hidden, ids, positions)
        cache = head.new_cache(3, 32)
        outs = [head(hidden[:, :prefill], ids[:, :prefill], positions[:, :prefill], cache)]
        t = prefill
        for step in (1, 1, 2, 1, 3):  # single tokens and small verify-like chunks
            outs.append(head(hidden[:, t:t + step], ids[:, t:t + step], positions[:, t:t + step], cache))
            t += step
        assert t == total
    out = torch.cat([o for o, _ in outs], dim=1)
    logits = torch.cat([lg for _, lg in outs], dim=1)
    torch.testing.assert_close(out, full_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, full_logits, atol=2e-5, rtol=1e-5)


def test_cache_bf16_decode_close_to_full():
    head, _, _ = build("deepseek", "qwen2", dtype=torch.bfloat16)
    hidden, ids, positions = inputs(b=2, s=8, start=(0,))
    hidden = hidden.bfloat16()
    with torch.no_grad():
        full_out, _ = head(hidden, ids, positions)
        cache = head.new_cache(2, 16)
        assert cache.k.dtype == torch.bfloat16
        outs = [head(hidden[:, :4], ids[:, :4], positions[:, :4], cache)[0]]
        for t in range(4, 8):
            outs.append(head(hidden[:, t:t + 1], ids[:, t:t + 1], positions[:, t:t + 1], cache)[0])
    assert _rel(torch.cat(outs, 1), full_out) < 2e-2


def test_stale_cache_entries_do_not_matter():
    """Rollback is free: after drafting ahead, re-running from an earlier position overwrites the
    stale slots, and garbage beyond the current position is never read."""
    head, _, _ = build("mimo", "qwen2")
    hidden, ids, positions = inputs(b=2, s=10, start=(0,))
    g = torch.Generator().manual_seed(9)
    new_h = torch.randn(2, 1, H, generator=g)
    new_id = torch.randint(0, V, (2, 1), generator=g)
    with torch.no_grad():
        cache = head.new_cache(2, 32)
        head(hidden, ids, positions, cache)  # 10 positions, 0..9
        # roll back to position 6: rows continue from there with other inputs
        cache.k[:, :, 7:] = 1e3 * torch.randn_like(cache.k[:, :, 7:])
        cache.v[:, :, 7:] = float("nan")
        pos = torch.full((2, 1), 6)
        got_out, got_logits = head(new_h, new_id, pos, cache)
        # the same sequence, no cache: positions 0..5 from before, then the new token at 6
        want_out, want_logits = head(torch.cat([hidden[:, :6], new_h], 1),
                                     torch.cat([ids[:, :6], new_id], 1),
                                     torch.arange(7).expand(2, 7))
    torch.testing.assert_close(got_out, want_out[:, -1:], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits, want_logits[:, -1:], atol=2e-5, rtol=1e-5)


def test_rows_at_different_positions_share_one_cache():
    """Rows of a batch advance independently (different accept lengths): row 1 rolls back two
    positions while row 0 moves on; each row equals its own no-cache forward."""
    head, _, _ = build("split", "qwen2")
    hidden, ids, positions = inputs(b=2, s=8, start=(0,))
    g = torch.Generator().manual_seed(4)
    new_h = torch.randn(2, 2, H, generator=g)
    new_id = torch.randint(0, V, (2, 2), generator=g)
    pos = torch.tensor([[8, 9], [6, 7]])
    with torch.no_grad():
        cache = head.new_cache(2, 16)
        head(hidden, ids, positions, cache)
        got, _ = head(new_h, new_id, pos, cache)
        for row, keep in ((0, 8), (1, 6)):
            h = torch.cat([hidden[row:row + 1, :keep], new_h[row:row + 1]], 1)
            i = torch.cat([ids[row:row + 1, :keep], new_id[row:row + 1]], 1)
            want, _ = head(h, i, torch.arange(keep + 2)[None])
            torch.testing.assert_close(got[row], want[0, -2:], atol=2e-5, rtol=1e-5)


def test_cache_select_keeps_rows():
    head, _, _ = build("deepseek", "llama")
    hidden, ids, positions = inputs(b=3, s=6, start=(0,))
    with torch.no_grad():
        full, _ = head(hidden, ids, positions)
        cache = head.new_cache(3, 8)
        head(hidden[:, :5], ids[:, :5], positions[:, :5], cache)
        cache.select(torch.tensor([2, 0]))
        last, _ = head(hidden[[2, 0], 5:], ids[[2, 0], 5:], positions[[2, 0], 5:], cache)
    torch.testing.assert_close(last, full[[2, 0], 5:], atol=2e-5, rtol=1e-5)


def test_cache_holds_what_was_written_and_grows():
    """The buffers grow with the positions written (not max_len up front); caches of different
    capacities join (into free rows of the first one's buffers), a row leaves by moving another
    into its place, and every row still equals its no-cache forward."""
    head, _, _ = build("mimo", "llama")
    hidden, ids, positions = inputs(b=2, s=12, start=(0,))
    with torch.no_grad():
        full, _ = head(hidden, ids, positions)
        a = head.new_cache(1, 8192)
        assert a.capacity == 0 and a.max_len == 8192
        head(hidden[:1, :3], ids[:1, :3], positions[:1, :3], a)
        assert a.capacity == a.GROW  # one growth step, not 8,192 positions
        b = head.new_cache(1, 8192, capacity=4)
        head(hidden[1:, :4], ids[1:, :4], positions[1:, :4], b)
        assert b.capacity == 4
        head(hidden[1:, 4:9], ids[1:, 4:9], positions[1:, 4:9], b)  # grows past its 4
        assert 9 <= b.capacity < a.GROW + 1
        # row 0 catches up to position 8, then both rows run on as one batch
        head(hidden[:1, 3:9], ids[:1, 3:9], positions[:1, 3:9], a)
        cap_b = b.capacity
        a.prepare_append(b, rows=4)  # free rows for later joins
        assert a.k.shape[0] == 1 and a._k.shape[0] == 4  # (nothing of the batch changed yet)
        a.append_rows(b)
        assert a.k.shape[0] == 2 and a.capacity >= cap_b and a._k.shape[0] == 4
        last, _ = head(hidden[:, 9:11], ids[:, 9:11], positions[:, 9:11], a)
        # row 0 leaves: row 1 moves into its place, in the same buffers
        buf = a._k.data_ptr()
        a.move_rows([0], [1], 1)
        assert a.k.shape[0] == 1 and a._k.data_ptr() == buf
        alone, _ = head(hidden[1:, 11:], ids[1:, 11:], positions[1:, 11:], a)
        with pytest.raises(IndexError, match="beyond the head cache"):
            head.new_cache(1, 4).reserve(5)
    torch.testing.assert_close(last, full[:, 9:11], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(alone, full[1:, 11:], atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# the target's parts are shared, never copied
# ----------------------------------------------------------------------------------------------

def test_embedding_and_lm_head_are_shared_by_reference():
    emb, lm = target_parts()
    head = FastMTPHead(make_cfg("mimo", "qwen2"), emb, lm)
    assert head.embed_tokens is emb and head.lm_head is lm
    assert head.embed_tokens.weight.data_ptr() == emb.weight.data_ptr()
    names = set(head.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names), names
    params = {id(p) for p in head.parameters()}
    assert id(emb.weight) not in params and id(lm.weight) not in params
    assert set(dict(head.named_parameters())) == names
    # casting / moving the head leaves the target's tensors alone
    head.to(torch.bfloat16)
    assert emb.weight.dtype == torch.float32 and lm.weight.dtype == torch.float32
    assert head.embed_tokens.weight.data_ptr() == emb.weight.data_ptr()


def test_changes_to_the_target_show_through():
    head, emb, lm = build("deepseek", "llama")
    hidden, ids, positions = inputs()
    with torch.no_grad():
        before = head(hidden, ids, positions)[1].clone()
        lm.weight.mul_(2.0)  # in place: the head sees it
        after = head(hidden, ids, positions)[1]
    torch.testing.assert_close(after, 2 * before, atol=1e-5, rtol=1e-5)


def test_set_embed_and_head_and_missing_parts():
    head = randomise(FastMTPHead(make_cfg("split", "llama"))).eval()
    hidden, ids, positions = inputs()
    with pytest.raises(RuntimeError, match="set_embed_and_head"):
        head(hidden, ids, positions)
    emb, lm = target_parts()
    head.set_embed_and_head(emb, lm)
    assert head.embed_tokens is emb and head.lm_head is lm
    with torch.no_grad():
        _, logits = head(hidden, ids, positions)
    assert logits.shape == (2, 9, V)


def test_projection_replaces_lm_head():
    """The compressed-vocabulary seam: a callable over the output hidden state, any width."""
    head, emb, _ = build("mimo", "qwen2")

    class Exploding(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("the full lm_head must not run when a projection is set")

    head.set_embed_and_head(emb, Exploding())
    keep = torch.tensor([3, 7, 11, 50, 99])
    rows = torch.randn(V, H)[keep]
    head.projection = lambda h: h @ rows.T  # [..., 5]
    hidden, ids, positions = inputs()
    with torch.no_grad():
        out, logits = head(hidden, ids, positions)
        no_logits = head(hidden, ids, positions, return_logits=False)[1]
    assert logits.shape == (2, 9, 5) and no_logits is None
    torch.testing.assert_close(logits, out @ rows.T)
