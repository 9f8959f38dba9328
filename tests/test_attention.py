"""core/attention.py: folded grouped-query attention equals attention over repeated keys, over
odd shapes, mask forms and dtypes (it is the engine's attention on the target and the head)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastmtp_sglang.core.attention import grouped_attention


def _reference(q, k, v, mask, scale, causal):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(rep, 1),
                                          v.double().repeat_interleave(rep, 1),
                                          attn_mask=mask if mask is None or mask.dtype == torch.bool
                                          else mask.double(), scale=scale, is_causal=causal)


@pytest.mark.parametrize("B, nh, nkv, S, T", [
    (1, 9, 3, 1, 37), (3, 9, 3, 2, 300), (5, 8, 2, 3, 123), (2, 6, 6, 4, 17), (16, 9, 3, 1, 311),
    (4, 9, 3, 5, 1025), (2, 4, 1, 7, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "per_head", "none_causal"])
def test_folded_equals_repeated_keys(B, nh, nkv, S, T, dtype, mask_kind):
    g = torch.Generator().manual_seed(B * 100 + S * 10 + T)
    q = torch.randn(B, nh, S, 64, generator=g).to(dtype)
    k, v = (torch.randn(B, nkv, T, 64, generator=g).to(dtype) for _ in range(2))
    keep = torch.rand(B, 1, S, T, generator=g) > 0.3
    keep[..., -1] = True  # every query sees a key
    causal = False
    if mask_kind == "bool":
        mask = keep
    elif mask_kind == "additive":
        mask = torch.zeros(B, 1, S, T, dtype=dtype).masked_fill(~keep, float("-inf"))
    elif mask_kind == "per_head":
        mask = keep.expand(B, nh, S, T) & (torch.rand(B, nh, S, T, generator=g) > 0.1)
        mask[..., -1] = True
    else:
        if S > T:
            pytest.skip("causal needs S <= T")
        mask, causal, k, v = None, True, k[:, :, :S], v[:, :, :S]
    out = grouped_attention(q, k, v, mask, 0.125, causal)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _reference(q, k, v, mask, 0.125, causal)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} at {(out.double() - ref).abs().argmax().item()}"
