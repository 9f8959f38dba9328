"""The head's lean forward (decode/lean_head.py) on the bf16 CPU kernels: within bf16 rounding of
the module over prefills, draft steps and extends, at batch 1 and 2, for every layout, with the
same head cache contents; never used in fp32, under autograd or for heads with aux layers (the
module runs there); the engine's output the same with it as without in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.cpu_kernels.packed_linear import pack_for_inference
from fastmtp_sglang.decode.lean_head import LeanHead
from test_engine import random_head, tiny_target

# every test under each build of the kernels this CPU loads (conftest.amx_build)
pytestmark = pytest.mark.usefixtures("amx_build")
needs_kernels = pytest.mark.skipif(not amx.available(),
                                   reason=f"cpu kernels: {amx.unavailable_reason()}")


def _world(layout: str, dtype=torch.bfloat16):
    t = tiny_target("llama", seed=5)
    head = random_head(t, layout, seed=6)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.3)
    t.model.to(dtype)
    head.to(dtype)
    return t, head


def _calls(B: int):
    """(hidden-from, ids, positions) of a prefill over 7 positions, then 3 draft steps and an
    extend over 3 positions, per row at its own offset."""
    g = torch.Generator().manual_seed(B)
    off = torch.arange(B)[:, None] * 2
    out = [(torch.randn(B, 7, 64, generator=g), torch.randint(0, 50, (B, 7), generator=g), off + torch.arange(7))]
    for k in range(3):
        out.append((None, torch.randint(0, 50, (B, 1), generator=g), off + 7 + k))
    out.append((torch.randn(B, 3, 64, generator=g), torch.randint(0, 50, (B, 3), generator=g), off + torch.arange(7, 10)))
    return out


def _run(fn, head, B: int):
    cache = head.new_cache(B, 64)
    outs, g = [], None
    for hidden, ids, pos in _calls(B):
        h = (hidden.to(torch.bfloat16) if hidden is not None else g)
        g = fn(h, ids, pos, cache)
        outs.append(g)
        g = g[:, -1:]
    return outs, cache


@needs_kernels
@pytest.mark.parametrize("layout", ["split", "mimo", "deepseek"])
@pytest.mark.parametrize("B", [1, 2])
def test_lean_head_within_rounding_of_the_module(layout, B):
    t, head = _world(layout)
    pack_for_inference(t.model, head, "on")
    lean = LeanHead(head)
    with torch.inference_mode():
        a, ca = _run(lambda h, i, p, c: head(h, i, p, c, return_logits=False)[0], head, B)
        b, cb = _run(lean, head, B)
        for x, y in zip(a, b):
            assert y is not None and y.shape == x.shape
            torch.testing.assert_close(y.float(), x.float(), rtol=3e-2, atol=3e-2)
            agree = (head.project(x).argmax(-1) == head.project(y).argmax(-1)).float().mean()
            assert agree > 0.8
        torch.testing.assert_close(cb.k.float(), ca.k.float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(cb.v.float(), ca.v.float(), rtol=3e-2, atol=3e-2)


def test_lean_head_steps_aside_where_it_does_not_apply():
    t, head = _world("split", torch.float32)
    lean = LeanHead(head)
    cache = head.new_cache(1, 16)
    x, ids, pos = torch.randn(1, 1, 64), torch.tensor([[3]]), torch.tensor([[0]])
    with torch.inference_mode():
        assert lean(x, ids, pos, cache) is None            # fp32: PyTorch's kernels, the module
    t, head = _world("split")
    pack_for_inference(t.model, head, "on")
    lean = LeanHead(head)
    cache = head.new_cache(1, 16)
    xb = x.to(torch.bfloat16)
    assert lean(xb, ids, pos, cache) is None               # autograd on: training calls the module
    with torch.inference_mode():
        assert lean(torch.randn(1, 1, 128).to(torch.bfloat16), ids, pos, cache) is None  # aux-width input
        assert (lean(xb, ids, pos, cache) is not None) == amx.available()


def test_engine_output_unchanged_in_fp32():
    """fp32 never takes the lean head: the engine's tokens with and without the lean paths."""
    from fastmtp_sglang.decode.engine import ReferenceEngine, Request
    from fastmtp_sglang.decode.sampling import SamplingParams

    t, head = _world("mimo", torch.float32)
    t2, head2 = copy.deepcopy((t, head))
    on, off = ReferenceEngine(t, head, 3), ReferenceEngine(t2, head2, 3, lean="off")
    assert on.lean_head is not None and off.lean_head is None
    reqs = lambda: [Request([1, 2, 3, 4], SamplingParams(max_new_tokens=12)), Request([9, 8], SamplingParams(max_new_tokens=12))]
    assert [r.output_ids for r in on.generate(reqs())] == [r.output_ids for r in off.generate(reqs())]


def _fused_and_calls(layout: str):
    """(target, packed head, a LeanHead that takes the one kernel call, one held to its calls)."""
    t, head = _world(layout)
    pack_for_inference(t.model, head, "on")
    fused, calls = LeanHead(head), LeanHead(head)
    calls._one_call = lambda tiles: None
    return t, head, fused, calls


@needs_kernels
@pytest.mark.parametrize("layout", ["split", "mimo", "deepseek"])
@pytest.mark.parametrize("B", [1, 3])
def test_one_call_step_matches_the_calls_it_replaces(layout, B):
    """A draft step in one call of the kernel (amx.HeadStep) against LeanHead's own calls of the
    same functions: bit for bit where attention has one key (its output is that value, whatever
    the order of the sums); after a prefill the same key and value written and the output
    within bf16 rounding (attention's fp32 sums run in another order than PyTorch's, and a
    last-bit difference there travels through the rest of the block)."""
    t, head, fused, calls = _fused_and_calls(layout)
    g = torch.Generator().manual_seed(B + 10)
    off = torch.arange(B)[:, None] * 3
    with torch.inference_mode():
        first = [head.new_cache(B, 64), head.new_cache(B, 64)]
        x = torch.randn(B, 1, 64, generator=g).to(torch.bfloat16)
        tok, zero = torch.randint(0, 50, (B, 1), generator=g), torch.zeros(B, 1, dtype=torch.long)
        a, b = fused(x, tok, zero, first[0]), calls(x, tok, zero, first[1])
        assert torch.equal(a, b) and torch.equal(first[0].k, first[1].k) and torch.equal(first[0].v, first[1].v)
        caches = [head.new_cache(B, 64), head.new_cache(B, 64)]
        n = LeanHead.ONE_CALL_POSITIONS + 2
        hid = torch.randn(B, n, 64, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 50, (B, n), generator=g)
        for c in caches:
            fused(hid, ids, off + torch.arange(n), c)  # (a prefill: the calls' path for both)
        x = torch.randn(B, 1, 64, generator=g).to(torch.bfloat16)
        tok, pos = torch.randint(0, 50, (B, 1), generator=g), off + n
        a = fused(x, tok, pos, caches[0])
        assert fused._step is not None and fused._step[1] is not None  # the one call ran
        b = calls(x, tok, pos, caches[1])
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        for buf in ("k", "v"):  # the new key and value (before attention): bit for bit
            torch.testing.assert_close(getattr(caches[0], buf), getattr(caches[1], buf), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("layout", ["split", "deepseek"])
@pytest.mark.parametrize("B", [1, 3])
def test_one_call_extend_matches_the_calls_it_replaces(layout, B):
    """A draft extend (several positions a row) in one call of the kernel against LeanHead's own
    calls: the same keys and values written bit for bit, the outputs within bf16 rounding; with
    the engine's shapes: a row that accepted fewer drafts repeats its last position (the same
    input again), and a catch-up's positions run on across parts."""
    t, head, fused, calls = _fused_and_calls(layout)
    g = torch.Generator().manual_seed(B + 20)
    off = torch.arange(B)[:, None] * 3
    n = LeanHead.ONE_CALL_POSITIONS + 4
    with torch.inference_mode():
        caches = [head.new_cache(B, 64), head.new_cache(B, 64)]
        hid = torch.randn(B, n, 64, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 50, (B, n), generator=g)
        for c in caches:
            fused(hid, ids, off + torch.arange(n), c)  # a prefill (the calls, for both)
        for S in (3, 2, 5):
            x = torch.randn(B, S, 64, generator=g).to(torch.bfloat16)
            tok = torch.randint(0, 50, (B, S), generator=g)
            pos = off + n + torch.arange(S)
            if B > 1:  # row 1 accepted one draft fewer: its last position, input and token again
                x[1, -1], tok[1, -1], pos[1, -1] = x[1, -2], tok[1, -2], pos[1, -2]
            fused._step = None
            a = fused(x, tok, pos, caches[0])
            assert fused._step is not None and fused._step[1] is not None  # the one call ran
            b = calls(x, tok, pos, caches[1])
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
            for buf in ("k", "v"):
                torch.testing.assert_close(getattr(caches[0], buf), getattr(caches[1], buf), rtol=0, atol=0)
            n += S


@needs_kernels
def test_one_call_extend_leaves_long_reads_to_the_calls():
    """Past ``ONE_CALL_POSITIONS`` positions a row (a prompt) the calls run: their attention is
    batched, the kernel's per query."""
    t, head = _world("deepseek")
    pack_for_inference(t.model, head, "on")
    lean = LeanHead(head)
    used = []
    lean._one_call = lambda tiles: used.append(tiles) or None
    n = LeanHead.ONE_CALL_POSITIONS
    with torch.inference_mode():
        lean(torch.randn(1, n + 1, 64).to(torch.bfloat16), torch.zeros(1, n + 1, dtype=torch.long),
             torch.arange(n + 1)[None], head.new_cache(1, 64))
        assert not used
        lean(torch.randn(1, n, 64).to(torch.bfloat16), torch.zeros(1, n, dtype=torch.long),
             torch.arange(n)[None], head.new_cache(1, 64))
        assert used


@needs_kernels
def test_one_call_step_grows_the_cache_and_the_rotary_table():
    """A step past the cache's capacity and the rotary table's end: both grow first."""
    t, head = _world("deepseek")
    pack_for_inference(t.model, head, "on")
    lean = LeanHead(head)
    with torch.inference_mode():
        cache = head.new_cache(1, 2048)
        assert cache.capacity == 0
        x = torch.randn(1, 1, 64).to(torch.bfloat16)
        out = lean(x, torch.tensor([[5]]), torch.tensor([[1500]]), cache)
        assert out is not None and lean._step[1] is not None
        assert cache.capacity > 1500 and head._rope_table[0].shape[0] > 1500
        assert bool(cache.k[0, :, 1500].abs().sum() > 0)


def _one_step_both(fused: LeanHead, calls: LeanHead) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step of one fixed input, on fresh caches: (the one-call step's output, the calls')."""
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    tok, pos = torch.tensor([[4]]), torch.tensor([[0]])
    with torch.inference_mode():
        return fused(x, tok, pos, fused.head.new_cache(1, 8)), calls(x, tok, pos, calls.head.new_cache(1, 8))


@needs_kernels
def test_one_call_step_follows_a_norm_moved_to_new_storage():
    """The kernel reads the norms and the embedding by address: a parameter given new storage
    (as ``.to()`` or a replacing load does) rebuilds the step, which then reads the new values."""
    _, head, fused, calls = _fused_and_calls("deepseek")
    before, _ = _one_step_both(fused, calls)
    with torch.no_grad():
        head.final_norm.weight.data = head.final_norm.weight.data * 2  # new storage, new values
    after, ref = _one_step_both(fused, calls)
    assert torch.equal(after, ref) and not torch.equal(after, before)
    # a norm replaced by another parameter (the old one kept alive elsewhere, so its storage
    # stays valid and only the watch on the module's weight can tell)
    old = head.hnorm.weight
    head.hnorm.weight = torch.nn.Parameter(old.detach() * 3, requires_grad=False)
    again, ref = _one_step_both(fused, calls)
    assert torch.equal(again, ref) and not torch.equal(again, after)
    assert old.data_ptr() != head.hnorm.weight.data_ptr()


@needs_kernels
def test_one_call_step_follows_a_swapped_embedding():
    """The embedding is the target's, which ``set_embed_and_head`` may swap for another module,
    or whose weight may be replaced: the step reads the embedding it is given now."""
    _, head, fused, calls = _fused_and_calls("deepseek")
    before, _ = _one_step_both(fused, calls)
    other = torch.nn.Embedding(*head.embed_tokens.weight.shape).to(torch.bfloat16)
    head.set_embed_and_head(other, head.lm_head)
    after, ref = _one_step_both(fused, calls)
    assert torch.equal(after, ref) and not torch.equal(after, before)
    kept = other.weight
    other.weight = torch.nn.Parameter(kept.detach() * 3, requires_grad=False)
    again, ref = _one_step_both(fused, calls)
    assert torch.equal(again, ref) and not torch.equal(again, after)


@needs_kernels
def test_one_call_step_refuses_a_token_outside_the_embedding():
    """A token id past the embedding's rows is refused by the kernel before it writes anything
    (it reads the embedding row by address)."""
    t, head = _world("deepseek")
    pack_for_inference(t.model, head, "on")
    lean = LeanHead(head)
    V = head.embed_tokens.weight.shape[0]
    with torch.inference_mode():
        cache = head.new_cache(1, 8)
        x = torch.randn(1, 1, 64).to(torch.bfloat16)
        lean(x, torch.tensor([[1]]), torch.tensor([[0]]), cache)
        before = cache.k.clone()
        with pytest.raises(ValueError, match="embedding"):
            lean(x, torch.tensor([[V]]), torch.tensor([[1]]), cache)
        assert torch.equal(cache.k, before)
