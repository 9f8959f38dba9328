"""The slots of the compressed draft logits: which full-vocabulary id each slot holds, which
extra ids get a slot of their own, and the compressed logits spread back over the full vocabulary.

Row ``b``'s slot ``s < S_max`` is position ``s`` of its table (``tables[table_idx[b]]``, padding
past ``table_lens``), slot ``S_max + e`` is ``extra_ids[b, e]``; an extra id that is padding, out
of range, already in the row's table or repeated gets no slot (``-1``, its logit ``-inf``). Torch
ops only, no host sync: the projection onto these slots (compressed_head.py, Triton and torch)
and every caller that reads its logits share them (tested in tests/test_compressed_head.py).
"""

from __future__ import annotations

import torch

__all__ = ["mask_extra_ids", "scatter_to_full", "slot_ids"]


def mask_extra_ids(
    tables: torch.Tensor,
    table_lens: torch.Tensor,
    table_idx: torch.Tensor,
    extra_ids: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Extra ids with every id that must not get its own slot replaced by ``-1``.

    Masked: padding (``< 0``), out of range (``>= vocab_size``), already in the row's table, or
    equal to an earlier extra id of the same row. Torch ops only, no host sync.

    Parameters
    ----------
    tables : Tensor, int64, shape [L, S_max]
    table_lens : Tensor, int64, shape [L]
    table_idx : Tensor, int64, shape [B]
    extra_ids : Tensor, int64, shape [B, E]
    vocab_size : int

    Returns
    -------
    Tensor, int64, shape [B, E]
    """
    B, E = extra_ids.shape
    S = tables.shape[1]
    dev = extra_ids.device
    # first[b, v] = -1 if v is in row b's table, else the first extra position holding v (E if
    # none). Column vocab_size is a sink for invalid ids. scatter of one constant and amin are
    # deterministic under duplicate indices. Cost: B x (V+1) int32 (39 MB at B=64, V=152K).
    first = torch.full((B, vocab_size + 1), E, dtype=torch.int32, device=dev)
    rows = tables.index_select(0, table_idx)  # [B, S]
    in_len = torch.arange(S, device=dev)[None, :] < table_lens.index_select(0, table_idx)[:, None]
    first.scatter_(1, torch.where(in_len, rows.clamp(0, vocab_size), vocab_size), -1)
    ok = (extra_ids >= 0) & (extra_ids < vocab_size)
    cols = torch.where(ok, extra_ids, vocab_size)
    pos = torch.arange(E, dtype=torch.int32, device=dev).expand(B, E)
    first.scatter_reduce_(1, cols, pos, reduce="amin")
    keep = ok & (first.gather(1, cols) == pos)
    return torch.where(keep, extra_ids, torch.full_like(extra_ids, -1))


def slot_ids(
    tables: torch.Tensor,
    table_lens: torch.Tensor,
    table_idx: torch.Tensor,
    extra_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-vocabulary id of every slot of the compressed logits (``-1`` for padded slots).

    Parameters
    ----------
    tables : Tensor, int64, shape [L, S_max]
    table_lens : Tensor, int64, shape [L]
    table_idx : Tensor, int64, shape [B]
    extra_ids : Tensor, int64, shape [B, E], optional

    Returns
    -------
    Tensor, int64, shape [B, S_max + E]
        Column ``s < S_max`` is table position ``s`` of the row's table; column ``S_max + e`` is
        ``extra_ids[:, e]``. Duplicate extras keep their id here; their logit is ``-inf``.
    """
    S = tables.shape[1]
    rows = tables.index_select(0, table_idx)
    in_len = torch.arange(S, device=tables.device)[None, :] < table_lens.index_select(0, table_idx)[:, None]
    rows = torch.where(in_len, rows, torch.full_like(rows, -1))
    if extra_ids is None:
        return rows
    return torch.cat([rows, extra_ids], dim=1)


def scatter_to_full(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Spread compressed logits into a full-vocabulary row, ``-inf`` outside the slots.

    softmax of the result is the draft distribution q over the full vocabulary, supported on the
    row's compressed set, which is what lossless rejection sampling needs (min(1, p/q) and the
    residual max(p - q, 0) over the full vocabulary).

    Parameters
    ----------
    logits : Tensor, float, shape [B, S]
        ``-inf`` at padded or duplicate slots.
    ids : Tensor, int64, shape [B, S]
        Full-vocabulary id per slot (:func:`slot_ids`); negative for padding.
    vocab_size : int

    Returns
    -------
    Tensor, same dtype as ``logits``, shape [B, vocab_size]
    """
    if logits.shape != ids.shape or logits.ndim != 2:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)} must both be [B, S]")
    valid = (ids >= 0) & (ids < vocab_size)
    vals = torch.where(valid, logits, torch.full_like(logits, float("-inf")))
    full = torch.full((logits.shape[0], vocab_size), float("-inf"), dtype=logits.dtype, device=logits.device)
    # amax: an id held by a real slot and a masked duplicate (-inf) keeps the real logit;
    # invalid slots land on id 0 with -inf and change nothing. Deterministic under duplicates.
    return full.scatter_reduce_(1, ids.clamp(0, vocab_size - 1), vals, reduce="amax")
