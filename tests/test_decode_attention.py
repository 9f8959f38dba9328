"""The decode-attention kernel (cpu_kernels/decode_attention.py) against its fp32 torch reference over odd
shapes, masks with holes, strided cache views and thread counts; a row's output does not depend
on the other rows; bad shapes are refused. Skipped with the reason on CPUs without AVX-512."""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.cpu_kernels import decode_attention as ca

needs = pytest.mark.skipif(not ca.available(), reason=f"cpu attention: {ca.unavailable_reason()}")


def case(B, nh, nkv, T, D, slack=7, seed=0, holes=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, nh, D, generator=g).bfloat16().transpose(1, 2)        # a strided view
    buf_k = torch.randn(B + 2, nkv, T + slack, D, generator=g).mul(2).bfloat16()
    buf_v = torch.randn(B + 2, nkv, T + slack, D, generator=g).bfloat16()
    k, v = buf_k[:B, :, :T], buf_v[:B, :, :T]                                     # cache views
    valid = torch.rand(B, T, generator=g) < 0.7 if holes else None
    if valid is not None:
        valid[:, -1] = True     # the new token's own slot
        valid[0] = False        # a row that sees nothing (gets zeros)
    return q, k, v, valid


@needs
@pytest.mark.parametrize("B,nh,nkv,T,D", [(1, 9, 3, 1, 64), (5, 9, 3, 123, 64), (3, 8, 8, 65, 32),
                                          (2, 12, 2, 300, 128), (7, 16, 1, 64, 16), (4, 6, 3, 129, 256)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_fp32_reference(B, nh, nkv, T, D, threads):
    q, k, v, valid = case(B, nh, nkv, T, D)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ca.decode_attention(q, k, v, valid, 0.125)
    finally:
        torch.set_num_threads(old)
    ref = ca.decode_attention_ref(q, k, v, valid, 0.125)
    assert out.shape == (B, nh, 1, D) and out.dtype == torch.bfloat16
    diff = (out.float() - ref.float()).abs()
    tol = ref.float().abs() * 2 ** -7 + 1e-3                      # one bf16 step (rounding apart)
    bad = (diff > tol).nonzero()
    assert not len(bad), f"first mismatch at {bad[0].tolist()}: {out.float()[tuple(bad[0])]} vs {ref.float()[tuple(bad[0])]}"
    assert (out[0] == 0).all()                                     # the row that sees nothing
    # no mask at all
    full = ca.decode_attention(q, k, v, None, 0.2)
    assert ((full.float() - ca.decode_attention_ref(q, k, v, None, 0.2).float()).abs()
            <= ref.float().abs().max() * 2 ** -7 + 1e-3).all()


@needs
def test_a_rows_output_does_not_depend_on_the_others():
    q, k, v, valid = case(6, 9, 3, 200, 64, seed=3)
    whole = ca.decode_attention(q, k, v, valid, 0.1)
    for b in (1, 4):
        alone = ca.decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], valid[b:b + 1], 0.1)
        assert torch.equal(alone[0], whole[b])


@needs
def test_the_same_as_pytorchs_attention_within_rounding():
    """Against scaled_dot_product_attention with the grouped heads repeated (what the engine ran
    before): within one bf16 step."""
    q, k, v, valid = case(4, 9, 3, 150, 64, seed=5)
    valid[0, :3] = True
    rep = 3
    sd = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=valid[:, None, None, :], scale=0.125)
    out = ca.decode_attention(q, k, v, valid, 0.125)
    assert ((out.float() - sd.float()).abs() <= sd.float().abs() * 2 ** -7 + 2e-3).all()


def test_bad_shapes_are_refused():
    q = torch.zeros(2, 4, 2, 64, dtype=torch.bfloat16)               # two queries per row
    k = torch.zeros(2, 2, 10, 64, dtype=torch.bfloat16)
    assert not ca.fits(q, k)
    assert not ca.fits(q[:, :, :1].float(), k)
    assert not ca.fits(torch.zeros(2, 4, 1, 40, dtype=torch.bfloat16), torch.zeros(2, 2, 10, 40, dtype=torch.bfloat16))
    if ca.available():
        with pytest.raises(ValueError, match="decode_attention takes"):
            ca.decode_attention(q, k, k, None, 1.0)
        with pytest.raises(ValueError, match="valid must be"):
            ca.decode_attention(q[:, :, :1], k, k, torch.ones(2, 9, dtype=torch.bool), 1.0)
