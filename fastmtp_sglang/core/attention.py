"""Attention over grouped key/value heads for the CPU decoding paths (the target's lean forward,
its transformers attention function, the head's cached forward).

The one function here folds the query heads that share a key/value head into that head's
query rows, so PyTorch's ``scaled_dot_product_attention`` runs without its GQA path; see
:func:`grouped_attention` for why and what it costs in exactness.
"""

from __future__ import annotations

import torch

__all__ = ["fold_mask", "grouped_attention"]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None = None, causal: bool = False, folded: bool = False) -> torch.Tensor:
    """Attention of grouped key/value heads, each key read once: the query heads that share a
    key/value head become that head's query rows ([B, n_heads, S, D] -> [B, n_kv, rep * S, D],
    the mask repeated along them), so ``scaled_dot_product_attention`` runs without GQA.

    q [B, n_heads, S, D]; k, v [B, n_kv, T, D]; mask bool or additive, broadcastable to
    [B, 1, S, T], or None. Returns [B, n_heads, S, D].

    Why: PyTorch's CPU kernel with ``enable_gqa=True`` and a mask is slow in bf16 on a CPU with
    avx512_bf16 and no AMX (AMD EPYC, ``bench/results/attention_probe/``): one query per row
    took 262 us per layer at 1 row and 311 slots (52 folded), 2.2-6.1 ms at 16 rows and 311-800
    slots (0.35-0.83 folded), which made a plain decoding step at 16 rows (84 ms, a throwaway
    probe) slower than a verify of 2 tokens (60 ms); several queries per row gain 1.1-1.8x. In fp32 folding gains up
    to 1.4x from 4 rows and costs ~5 us per layer at 1 row. The same maths: per query row the
    same scores and the same sum, but a kernel blocks rows differently, so outputs may differ
    from the GQA call in the last bit (fp32: up to 2.5e-7). Causal attention without a mask (a
    prefill) keeps the GQA call: folding would need the mask built.

    ``folded``: ``mask`` is already [B, 1, rep * S, T] in the folded rows' order
    (:func:`fold_mask`): a caller that runs many layers with one mask folds it once."""
    nh, nkv = q.shape[1], k.shape[1]
    if folded:
        B, _, S, D = q.shape
        out = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(B, nkv, (nh // nkv) * S, D), k, v, attn_mask=mask, scale=scale)
        return out.view(B, nh, S, D)
    if nh == nkv or (causal and mask is None):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=nh != nkv)
    B, _, S, D = q.shape
    rep = nh // nkv
    qg = q.reshape(B, nkv, rep * S, D)
    if mask is not None and mask.dim() == 4 and mask.shape[1] == nh:  # a mask per query head
        mask = mask.expand(B, nh, S, mask.shape[-1]).reshape(B, nkv, rep * S, mask.shape[-1])
    elif mask is not None and S > 1 and mask.shape[-2] > 1:  # per query: once per folded head
        mask = mask.repeat(1, 1, rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.view(B, nh, S, D)


def fold_mask(mask: torch.Tensor, n_heads: int, n_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask [B, 1, S, T] as :func:`grouped_attention` reads it with ``folded=True``:
    repeated once per query head sharing a key/value head ([B, 1, rep * S, T]) and made
    additive in ``dtype`` (0 where seen, -inf elsewhere: what ``scaled_dot_product_attention``
    makes of a bool mask at every call). The same numbers as passing the bool mask each layer,
    without a repeat and a conversion per layer (~1.2 ms of a 30-layer verify forward)."""
    rep = n_heads // n_kv
    m = mask.repeat(1, 1, rep, 1) if rep > 1 else mask
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
