"""The verify's attention on AMX tiles (cpu_kernels/amx.py ``multi_query_attention``): against a
float64 reference that rounds the softmax weights to bf16 as the kernel (and PyTorch's CPU flash
attention) does, over odd shapes: slots not a multiple of 16 or 32, one to 16 tokens a row,
grouped heads, several rows, a tree mask with holes, a token that sees nothing, strided queries;
a row's result independent of the other rows and of the thread count; bad shapes refused
(skipped, with the reason, on CPUs without AMX)."""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.core.attention import fold_mask, grouped_attention
from fastmtp_sglang.cpu_kernels import amx

needs_kernels = pytest.mark.skipif(not amx.tiles(), reason="AMX tiles: "
                                   + (amx.unavailable_reason() or "the AVX-512 build has none"))
bf = torch.bfloat16


def _case(B, nkv, G, S, T, D, seed, p_seen=0.85):
    """q as a strided view of a q/k/v product (as the forward hands it over), k and v as views
    of a longer cache, a random mask, one token of row 0 seeing nothing."""
    g = torch.Generator().manual_seed(seed)
    nh = nkv * G
    prod = torch.randn(B, S, (nh + 2 * nkv) * D, generator=g).to(bf)
    q = prod[:, :, : nh * D].view(B, S, nh, D).transpose(1, 2)
    k = torch.randn(B, nkv, T + 7, D, generator=g).to(bf)[:, :, :T]
    v = torch.randn(B, nkv, T + 7, D, generator=g).to(bf)[:, :, :T]
    valid = torch.rand(B, S, T, generator=g) < p_seen
    valid[0, S - 1] = False
    return q, k, v, valid


def _reference(q, k, v, valid, scale):
    """float64 scores and softmax; the weights rounded to bf16 before the product with the
    values, their unrounded sum as the divisor (the kernel's roundings); then one rounding."""
    B, nh, S, D = q.shape
    nkv, T = k.shape[1], k.shape[2]
    s = torch.einsum("bhgsd,bhtd->bhgst", q.double().reshape(B, nkv, nh // nkv, S, D), k.double()) * scale
    s = s.masked_fill(~valid.reshape(B, 1, 1, S, T), float("-inf"))
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    e = (s - m).exp()
    l_ = e.sum(-1, keepdim=True)
    w = e.float().to(bf).double()
    o = torch.einsum("bhgst,bhtd->bhgsd", w, v.double()) / l_.clamp(min=1e-300)
    o = torch.where(l_ > 0, o, torch.zeros_like(o))
    return o.reshape(B, nh, S, D)


@needs_kernels
@pytest.mark.parametrize("B,nkv,G,S,T,D", [(1, 3, 3, 7, 400, 64), (1, 3, 3, 10, 33, 64), (2, 2, 4, 2, 17, 32),
                                           (1, 1, 1, 2, 1, 32), (3, 4, 2, 13, 301, 128), (2, 1, 5, 16, 64, 64),
                                           (1, 2, 3, 3, 31, 256)])
def test_matches_the_reference_within_rounding(B, nkv, G, S, T, D):
    q, k, v, valid = _case(B, nkv, G, S, T, D, seed=B * 100 + S * 10 + T)
    scale = D ** -0.5
    out = amx.multi_query_attention(q, k, v, valid, scale)
    ref = _reference(q, k, v, valid, scale)
    assert out.shape == (B, nkv * G, S, D) and out.transpose(1, 2).is_contiguous()
    # fp32 sums in another order than float64's: within a bf16 step of the reference, plus the
    # fp32 accumulation over T terms of |w| |v|
    bound = ref.abs() * 2.0 ** -8 + T * 2.0 ** -22 * v.double().abs().amax() + 1e-6
    assert bool(((out.double() - ref).abs() <= bound).all())
    assert bool((out[0, :, S - 1] == 0).all())  # the token that sees nothing
    # PyTorch's attention (the path it replaces) is as close to the same reference
    sdpa = grouped_attention(q, k, v, fold_mask(valid[:, None], q.shape[1], nkv, bf), scale, folded=True)
    seen = valid.any(-1)[:, None, :, None].expand_as(ref)
    assert (out.double() - ref).abs()[seen].max() <= 2 * (sdpa.double() - ref).abs()[seen].max() + 1e-6


@needs_kernels
def test_a_row_does_not_depend_on_the_others_or_the_threads():
    q, k, v, valid = _case(3, 3, 3, 7, 150, 64, seed=7)
    scale = 0.125
    whole = amx.multi_query_attention(q, k, v, valid, scale)
    alone = amx.multi_query_attention(q[1:2], k[1:2], v[1:2], valid[1:2], scale)
    assert torch.equal(whole[1:2], alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx.multi_query_attention(q, k, v, valid, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, one)


@needs_kernels
def test_shapes_it_does_not_take_are_refused():
    q, k, v, valid = _case(1, 2, 2, 3, 20, 64, seed=3)
    with pytest.raises(ValueError, match="valid"):
        amx.multi_query_attention(q, k, v, valid[:, :2], 0.1)
    with pytest.raises(ValueError, match="D % 32"):
        amx.multi_query_attention(q[..., :16], k[..., :16], v[..., :16], valid, 0.1)
    assert not amx.fits_multi(q[:, :, :1], k)                      # one token: the decode kernel's
    assert not amx.fits_multi(q.float(), k)
    assert not amx.fits_multi(torch.zeros(1, 4, amx.MULTI_MAX_S + 1, 64, dtype=bf), k)
