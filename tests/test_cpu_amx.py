"""The AMX kernel (cpu_kernels/amx.py): the small-rows linear against a float64 reference over
odd shapes, with a bound from bf16's rounding and fp32 accumulation; a row's result independent
of the other rows and of the thread count; the fused elementwise steps against PyTorch's own ops
(skipped, with the reason, on CPUs without AMX or AVX-512 bf16). Every test runs under each build
this CPU loads: AMX tiles, and the AVX-512 vector build (conftest.amx_build). Its build and
cache: test_cpu_kernels_loader.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastmtp_sglang.cpu_kernels import amx as ck

# every test under each build of the kernels this CPU loads (conftest.amx_build)
pytestmark = pytest.mark.usefixtures("amx_build")
needs_kernels = pytest.mark.skipif(not ck.available(), reason=f"cpu kernels: {ck.unavailable_reason()}")
bf = torch.bfloat16


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Half a bf16 step of the result, plus fp32 accumulation over K terms of |x| |w|."""
    K = x.shape[-1]
    return ref.abs() * 2.0 ** -8 + K * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T) + 1e-30


@needs_kernels
@pytest.mark.parametrize("N,K", [(1, 32), (5, 7), (16, 64), (17, 33), (40, 100), (960, 576), (576, 1536)])
@pytest.mark.parametrize("M", [1, 3, 16, 17, 40])
def test_linear_matches_float64_within_rounding(N, K, M):
    g = torch.Generator().manual_seed(N * 1000 + K * 10 + M)
    w = torch.randn(N, K, generator=g).to(bf)
    b = torch.randn(N, generator=g).to(bf)
    x = torch.randn(M, K, generator=g).to(bf)
    p = ck.pack(w)
    for bias in (None, b):
        y = ck.linear(x, p, bias)
        assert y.shape == (M, N) and y.dtype == bf
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        err = (y.double() - ref).abs()
        assert bool((err <= _bound(x, w, ref)).all()), float((err / _bound(x, w, ref)).max())


@needs_kernels
def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads():
    """A row's result is the same bits whatever the other rows of the call are, alone or among
    37 (three 16-row passes), at any thread count (which regroups the column blocks whose
    chains run together): a greedy request decodes the same tokens alone or in a batch."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 96, generator=g).to(bf)
    x = torch.randn(37, 96, generator=g).to(bf)
    p = ck.pack(w)
    full = ck.linear(x, p)
    for m in (0, 15, 16, 36):
        other = (m + 7) % 37
        assert torch.equal(ck.linear(x[[m, other]], p), full[[m, other]])
    assert torch.equal(ck.linear(x[3:20], p), full[3:20])
    alone = torch.cat([ck.linear(x[m:m + 1], p) for m in range(37)])
    assert torch.equal(alone, full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ck.linear(x, p), full)
        assert torch.equal(torch.cat([ck.linear(x[m:m + 1], p) for m in range(37)]), alone)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_inputs_of_any_layout_and_leading_shape():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=g).to(bf)
    p = ck.pack(w)
    x = torch.randn(2, 3, 128, generator=g).to(bf)[..., ::2]   # not contiguous
    y = ck.linear(x, p)
    assert y.shape == (2, 3, 48)
    assert torch.equal(y, ck.linear(x.contiguous(), p))
    assert ck.linear(torch.empty(0, 64, dtype=bf), p).shape == (0, 48)


@needs_kernels
def test_bad_input_is_refused_with_the_reason():
    p = ck.pack(torch.randn(8, 32).to(bf))
    with pytest.raises(ValueError, match="32 inputs"):
        ck.linear(torch.randn(2, 31).to(bf), p)
    with pytest.raises(ValueError, match="bf16"):
        ck.linear(torch.randn(2, 32), p)
    with pytest.raises(ValueError, match="2-D bf16"):
        ck.pack(torch.randn(8, 32))


@needs_kernels
def test_add_rms_equals_llamas_residual_add_and_rmsnorm():
    g = torch.Generator().manual_seed(3)
    for N, H in ((1, 576), (7, 64), (33, 100)):
        x = (torch.randn(N, H, generator=g) * 3).to(bf)
        d = torch.randn(N, H, generator=g).to(bf)
        w = torch.randn(H, generator=g).to(bf)
        for delta in (None, d):
            r = x + delta if delta is not None else x
            hf = r.float()
            ref = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf)
            xx, out = x.clone(), torch.empty_like(x)
            ck.add_rms_(xx, delta, w, 1e-5, out)
            assert torch.equal(xx, r)
            # fp32 statistics summed in another order: at most one bf16 step apart, rarely
            diff = (out.float() - ref.float()).abs()
            assert bool((diff <= ref.float().abs() * 2.0 ** -7 + 1e-6).all())
            assert (out == ref).float().mean() > 0.99
            xr, out_r = x.clone(), torch.empty_like(x)   # the unchecked entry: the same call
            ck.add_rms_rows(xr, delta, w, 1e-5, out_r)
            assert torch.equal(xr, xx) and torch.equal(out_r, out)


@needs_kernels
@pytest.mark.parametrize("D", [64, 40, 8])  # halves of 32, 20 (a masked tail) and 4 values
def test_rope_and_silu_mul_equal_pytorchs_ops(D):
    g = torch.Generator().manual_seed(4)
    N, nh, nkv = 5, 9, 3
    qkv = torch.randn(N, (nh + 2 * nkv) * D, generator=g).to(bf)
    cos, sin = torch.randn(N, D, generator=g).to(bf), torch.randn(N, D, generator=g).to(bf)
    qk = qkv[:, : (nh + nkv) * D].view(N, nh + nkv, D)
    rot = torch.cat((-qk[..., D // 2:], qk[..., : D // 2]), -1)
    ref = qk * cos[:, None] + rot * sin[:, None]
    for rope in (ck.rope_, ck.rope_rows):
        got = qkv.clone()
        rope(got, cos, sin, nh + nkv, D)
        assert torch.equal(got[:, : (nh + nkv) * D].view(N, nh + nkv, D), ref)
        assert torch.equal(got[:, (nh + nkv) * D:], qkv[:, (nh + nkv) * D:])   # v untouched
    gu = (torch.randn(N, 2 * 80, generator=g) * 4).to(bf)
    ref = F.silu(gu[:, :80]) * gu[:, 80:]
    out = ck.silu_mul(gu)
    assert torch.equal(ck.silu_mul_rows(gu), out)
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2.0 ** -7 + 1e-6).all()) and (out == ref).float().mean() > 0.99
    with pytest.raises(ValueError, match="contiguous bf16"):
        ck.silu_mul(gu.float())


@needs_kernels
@pytest.mark.parametrize("N,K", [(1, 32), (17, 64), (1000, 96), (16384, 64)])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_argmax_is_the_first_maximum_of_the_products(N, K, M, threads):
    """The index of each row's largest bf16 output, as ``linear(...).max(-1).indices`` (the
    first of tied maxima), with rows tied on purpose (duplicated weight rows), at any thread
    count. One row sums on vector units (amx_products.h), which may round a near-tie apart from
    the tiles: there the pick must be within a bf16 step of linear()'s maximum and of the exact
    one, and the first of the duplicated rows' tie."""
    g = torch.Generator().manual_seed(N + K + M)
    w = torch.randn(N, K, generator=g).to(bf)
    if N > 20:
        w[N - 3] = w[5]     # a tie far from its twin (another thread's share)
        w[7] = w[5]
    x = torch.randn(M, K, generator=g).to(bf)
    if N > 20:
        x[0] = w[5] * 4     # row 0's maximum is the tie
    p = ck.pack(w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ck.linear_argmax(x, p)
    finally:
        torch.set_num_threads(old)
    y = ck.linear(x, p)
    want = y.max(-1).indices
    assert got.dtype == torch.int64
    if M > 1:
        assert torch.equal(got, want)
    else:
        top = y[0, want[0]].float()
        assert float((top - y[0, got[0]].float()).abs()) <= float(top.abs()) * 2.0 ** -7
        exact = (x[0].double() @ w.double().T)
        assert float(exact[got[0]]) >= float(exact.max()) - float(exact.abs().max()) * 2.0 ** -6
    if N > 20:
        assert int(got[0]) == 5


@needs_kernels
def test_linear_argmax_refuses_what_it_cannot_take():
    p = ck.pack(torch.randn(40, 64).to(bf))
    for x in (torch.randn(17, 64).to(bf), torch.randn(2, 32).to(bf), torch.randn(2, 64)):
        with pytest.raises(ValueError):
            ck.linear_argmax(x, p)
    assert ck.linear_argmax(torch.randn(2, 64).to(bf), p).shape == (2,)


@needs_kernels
def test_a_verify_attention_stays_off_the_vector_build(amx_build):
    """The vector build (no AMX) has no tiles: a verify's attention is not offered to it
    (takes_multi), and a direct call says why; on tiles the same call runs."""
    q = torch.randn(1, 3, 4, 64).to(bf)
    k = v = torch.randn(1, 3, 10, 64).to(bf)
    valid = torch.ones(1, 4, 10, dtype=torch.bool)
    if amx_build == "vector":
        assert not ck.tiles()
    assert ck.takes_multi(4, 64) == ck.tiles()
    if ck.tiles():
        assert ck.multi_query_attention(q, k, v, valid, 0.125).shape == (1, 3, 4, 64)
    else:
        with pytest.raises(RuntimeError, match="AVX-512 build"):
            ck.multi_query_attention(q, k, v, valid, 0.125)
