"""Compressed draft head: the draft's lm_head restricted to a per-request vocabulary table.

The draft step of a speculative decoder is memory-bound and dominated by the lm_head ([V, H]
read once per step; docs/design.md section 1.4). FR-Spec (arXiv 2502.14856) showed that drafting over
the most frequent 16-32K tokens of a 152K vocabulary keeps most of the acceptance length, and
verification over the full vocabulary keeps the output unchanged. Here every row of the batch has
its own table (its request's language), and may add its own extra ids (for example the prompt's
tokens, for copy-heavy tasks).

Ladder (Liger-Kernel style):

- ``_compressed_head_kernel`` / ``_compressed_head_extra_kernel`` / ``_compressed_head_combine_kernel``
  (``@triton.jit``): gathered projection fused with a running max / argmax and an online
  log-sum-exp, one program per (table tile, row block), then a per-row combine of the partials.
- ``compressed_head_triton``: launcher; validates shapes, dtypes, devices and contiguity.
- ``compressed_head_torch``: pure-torch reference with the same signature (the CPU path).
- ``compressed_head``: dispatcher (Triton on CUDA tensors, torch otherwise;
  ``FASTMTP_COMPRESSED_HEAD=torch|triton`` overrides).

The candidate set of row ``b`` is ``tables[table_idx[b], :table_lens[table_idx[b]]]`` followed by
``extra_ids[b]``; extra ids that are padding (``-1``), out of range, already in the row's table, or
repeated earlier in ``extra_ids[b]`` are masked (logit ``-inf``), so the compressed distribution is
a softmax over a set, each id once. Slot ``s < S_max`` of a row's logits is table position ``s``;
slot ``S_max + e`` is ``extra_ids[b, e]`` (see :func:`slot_ids`). Ties in the argmax go to the
lowest slot.

Everything is CUDA-graph capturable: no host syncs, no data-dependent shapes (the CPU torch path
groups rows by table on the host, where a sync costs nothing).

Why one file: the three kernels, their launcher and the pure-torch reference share one signature
and one set of input checks, and are tested against each other (tests/test_compressed_head.py);
keeping the reference beside the kernel is the point (docs/design.md section 10). The slot layout
both paths share (which id each slot holds, the extra ids' masking, the spread back to the full
vocabulary: ``slot_ids``, ``mask_extra_ids``, ``scatter_to_full``) is compressed_slots.py, and
is imported from here too.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastmtp_sglang.kernels.compressed_slots import mask_extra_ids, scatter_to_full, slot_ids

__all__ = [
    "compressed_head",
    "compressed_head_torch",
    "compressed_head_triton",
    "mask_extra_ids",
    "scatter_to_full",
    "slot_ids",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKEND_ENV = "FASTMTP_COMPRESSED_HEAD"  # "torch" | "triton" | unset (auto)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _compressed_head_kernel(
    hidden_ptr,  # [B, H]
    weight_ptr,  # [V, H] (row stride stride_w) or, with PREGATHERED, [L, S_max, H]
    tables_ptr,  # [L, S_max] int64
    table_lens_ptr,  # [L] int64
    table_idx_ptr,  # [B] int64
    part_max_ptr,  # [B, n_cols] float32: max logit of the tile for the row
    part_sum_ptr,  # [B, n_cols] float32: sum exp(logit - max) over the tile
    part_slot_ptr,  # [B, n_cols] int64: slot of the tile's argmax
    logits_ptr,  # [B, logits_stride] float32 (only with WRITE_LOGITS)
    B,
    H,
    S_max,
    n_cols,
    logits_stride,
    stride_w,
    PREGATHERED: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program = one tile of BLOCK_S table positions of table l, for a block of BLOCK_B rows.
    # The tile's weight rows are read once for every row of the block that uses table l; rows on
    # another table are masked out (their partials stay neutral). Reading each table once per row
    # block, instead of once per row, is what keeps large batches memory-bound on the weights.
    pid_s = tl.program_id(0)
    l = tl.program_id(1)
    pid_b = tl.program_id(2)
    n_s_tiles = tl.cdiv(S_max, BLOCK_S)
    col = l * n_s_tiles + pid_s

    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    row_table = tl.load(table_idx_ptr + rows, mask=row_ok, other=-1)
    use = row_ok & (row_table == l)
    n_use = tl.sum(use.to(tl.int32), axis=0)

    table_len = tl.load(table_lens_ptr + l)
    s_start = pid_s * BLOCK_S
    s = s_start + tl.arange(0, BLOCK_S)
    s_ok = s < table_len

    out_off = rows.to(tl.int64) * n_cols + col
    if (n_use > 0) & (s_start < table_len):
        ids = tl.load(tables_ptr + l * S_max + s, mask=s_ok, other=0)
        if PREGATHERED:
            w_rows = (l * S_max + s).to(tl.int64) * H
        else:
            w_rows = ids.to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_B, BLOCK_S], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < H
            h = tl.load(
                hidden_ptr + rows.to(tl.int64)[:, None] * H + k[None, :],
                mask=use[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                weight_ptr + w_rows[:, None] + k[None, :],
                mask=s_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            # fp32 operands: the interpreter's bf16 tl.dot is wrong (docs/design.md section 6.1). On GPU,
            # tf32 represents fp16/bf16 values exactly, so 16-bit inputs lose nothing; fp32
            # inputs get a true fp32 product.
            if IEEE_DOT:
                acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="tf32")
        valid = use[:, None] & s_ok[None, :]
        acc = tl.where(valid, acc, float("-inf"))
        m = tl.max(acc, axis=1)  # [BLOCK_B]
        arg = tl.argmax(acc, axis=1)  # first maximum within the tile
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        ssum = tl.sum(tl.exp(acc - m_safe[:, None]), axis=1)
        tl.store(part_max_ptr + out_off, m, mask=row_ok)
        tl.store(part_sum_ptr + out_off, ssum, mask=row_ok)
        tl.store(part_slot_ptr + out_off, (s_start + arg).to(tl.int64), mask=row_ok)
        if WRITE_LOGITS:
            tl.store(
                logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + s[None, :],
                acc,
                mask=valid,
            )
    else:
        # skipped tile (no row of this block uses table l, or past the table's end): no weight
        # traffic, neutral partials.
        tl.store(part_max_ptr + out_off, tl.full([BLOCK_B], float("-inf"), tl.float32), mask=row_ok)
        tl.store(part_sum_ptr + out_off, tl.zeros([BLOCK_B], tl.float32), mask=row_ok)
        tl.store(part_slot_ptr + out_off, tl.zeros([BLOCK_B], tl.int64), mask=row_ok)


@triton.jit
def _compressed_head_extra_kernel(
    hidden_ptr,  # [B, H]
    weight_ptr,  # [V, H]
    extra_ptr,  # [B, E] int64, -1 = masked (padding, out of range, duplicate)
    part_max_ptr,
    part_sum_ptr,
    part_slot_ptr,
    logits_ptr,
    H,
    E,
    S_max,
    n_cols,
    col0,
    logits_stride,
    stride_w,
    WRITE_LOGITS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Extra ids are per row, so there is no weight reuse across rows: one program per
    # (extra tile, row), a matrix-vector product.
    pid_e = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    ids = tl.load(extra_ptr + b * E + e, mask=e_ok, other=-1)
    ok = ids >= 0
    w_rows = tl.where(ok, ids, 0).to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        h = tl.load(hidden_ptr + b * H + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + w_rows[:, None] + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
    acc = tl.where(ok, acc, float("-inf"))
    m = tl.max(acc, axis=0)
    arg = tl.argmax(acc, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    ssum = tl.sum(tl.exp(acc - m_safe), axis=0)
    out_off = b * n_cols + col0 + pid_e
    tl.store(part_max_ptr + out_off, m)
    tl.store(part_sum_ptr + out_off, ssum)
    tl.store(part_slot_ptr + out_off, (S_max + pid_e * BLOCK_E + arg).to(tl.int64))
    if WRITE_LOGITS:
        tl.store(logits_ptr + b * logits_stride + S_max + e, acc, mask=e_ok)


@triton.jit
def _compressed_head_combine_kernel(
    part_max_ptr,  # [B, n_cols]
    part_sum_ptr,
    part_slot_ptr,
    tables_ptr,  # [L, S_max]
    table_idx_ptr,  # [B]
    extra_ptr,  # [B, E] (unused without HAS_EXTRA)
    top_id_ptr,  # [B] int64
    top_logprob_ptr,  # [B] float32
    n_cols,
    S_max,
    E,
    HAS_EXTRA: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Online softmax across the tiles of a row: per lane a running (max, sum, slot); strict '>'
    # keeps the earliest column on ties, and columns are in slot order.
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    run_m = tl.full([BLOCK_C], float("-inf"), tl.float32)
    run_s = tl.zeros([BLOCK_C], tl.float32)
    run_slot = tl.zeros([BLOCK_C], tl.int64)
    for c0 in range(0, n_cols, BLOCK_C):
        cc = c0 + c
        c_ok = cc < n_cols
        m = tl.load(part_max_ptr + b * n_cols + cc, mask=c_ok, other=float("-inf"))
        sm = tl.load(part_sum_ptr + b * n_cols + cc, mask=c_ok, other=0.0)
        slot = tl.load(part_slot_ptr + b * n_cols + cc, mask=c_ok, other=0)
        new_m = tl.maximum(run_m, m)
        new_safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        run_s = run_s * tl.exp(run_m - new_safe) + sm * tl.exp(m - new_safe)
        run_slot = tl.where(m > run_m, slot, run_slot)
        run_m = new_m
    top_m = tl.max(run_m, axis=0)
    top_safe = tl.where(top_m == float("-inf"), 0.0, top_m)
    total = tl.sum(run_s * tl.exp(run_m - top_safe), axis=0)
    big = S_max + E + 1
    top_slot = tl.min(tl.where(run_m == top_m, run_slot, big), axis=0)
    found = top_m != float("-inf")
    # log p(top) = top_m - (top_m + log total) = -log(total)
    logprob = tl.where(found, -tl.log(total), float("-inf"))
    table = tl.load(table_idx_ptr + b)
    in_table = top_slot < S_max
    tid = tl.load(tables_ptr + table * S_max + top_slot, mask=found & in_table, other=-1)
    if HAS_EXTRA:
        xid = tl.load(extra_ptr + b * E + (top_slot - S_max), mask=found & (top_slot >= S_max), other=-1)
        tid = tl.where(in_table, tid, xid)
    tid = tl.where(found, tid, -1)
    tl.store(top_id_ptr + b, tid)
    tl.store(top_logprob_ptr + b, logprob)


# ----------------------------------------------------------------------------------------------
# Helpers shared by both paths
# ----------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_inputs(hidden, weight, tables, table_lens, table_idx, extra_ids, table_weight) -> None:
    """Validate shapes, dtypes and devices (no host sync). Raises ValueError naming the values."""
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be [B, H]; got shape {tuple(hidden.shape)}")
    if weight.ndim != 2:
        raise ValueError(f"weight must be [V, H]; got shape {tuple(weight.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden dtype must be one of {_FLOAT_DTYPES}; got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != hidden dtype {hidden.dtype}")
    B, H = hidden.shape
    if weight.shape[1] != H:
        raise ValueError(f"weight is {tuple(weight.shape)}, expected [V, {H}] to match hidden {tuple(hidden.shape)}")
    if tables.ndim != 2 or tables.dtype != torch.int64:
        raise ValueError(f"tables must be int64 [L, S_max]; got {tables.dtype} {tuple(tables.shape)}")
    L, S = tables.shape
    if L == 0 or S == 0:
        raise ValueError(f"tables must be non-empty; got shape {tuple(tables.shape)}")
    if table_lens.dtype != torch.int64 or tuple(table_lens.shape) != (L,):
        raise ValueError(f"table_lens must be int64 [{L}]; got {table_lens.dtype} {tuple(table_lens.shape)}")
    if table_idx.dtype != torch.int64 or tuple(table_idx.shape) != (B,):
        raise ValueError(f"table_idx must be int64 [{B}]; got {table_idx.dtype} {tuple(table_idx.shape)}")
    named = {"weight": weight, "tables": tables, "table_lens": table_lens, "table_idx": table_idx}
    if extra_ids is not None:
        if extra_ids.dtype != torch.int64 or extra_ids.ndim != 2 or extra_ids.shape[0] != B:
            raise ValueError(
                f"extra_ids must be int64 [{B}, E]; got {extra_ids.dtype} {tuple(extra_ids.shape)}"
            )
        named["extra_ids"] = extra_ids
    if table_weight is not None:
        if tuple(table_weight.shape) != (L, S, H) or table_weight.dtype != hidden.dtype:
            raise ValueError(
                f"table_weight must be {hidden.dtype} [{L}, {S}, {H}] (weight[tables]); "
                f"got {table_weight.dtype} {tuple(table_weight.shape)}"
            )
        named["table_weight"] = table_weight
    for name, t in named.items():
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")


# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------


def _table_logits(
    hidden: torch.Tensor,  # [B, H]
    weight: torch.Tensor,  # [V, H]
    tables: torch.Tensor,  # [L, S]
    table_lens: torch.Tensor,  # [L]
    table_idx: torch.Tensor,  # [B]
    table_weight: torch.Tensor | None,  # [L, S, H]
    group_on_host: bool,
) -> torch.Tensor:  # [B, S] float32, padded slots unmasked (zero or garbage)
    B = hidden.shape[0]
    L, S = tables.shape
    V = weight.shape[0]

    def table_rows(l: int, n: int = S) -> torch.Tensor:  # [n, H]
        if table_weight is not None:
            return table_weight[l, :n]
        return weight.index_select(0, tables[l, :n].clamp(0, V - 1))

    if group_on_host:
        # only the rows' own tables, and only up to each table's length (a 4K table padded to
        # 32K costs 4K rows here)
        out = torch.zeros(B, S, dtype=torch.float32, device=hidden.device)
        lens = table_lens.tolist()
        for l in torch.unique(table_idx).tolist():
            if not 0 <= l < L:
                raise ValueError(f"table_idx holds {l}, outside [0, {L})")
            n = max(0, min(int(lens[l]), S))
            rows = (table_idx == l).nonzero().squeeze(1)
            out[rows, :n] = (hidden.index_select(0, rows) @ table_rows(l, n).T).float()
        return out
    # No host sync: every row against every table, then pick (L x B x S floats).
    per_table = torch.stack([(hidden @ table_rows(l).T).float() for l in range(L)])  # [L, B, S]
    return per_table[table_idx, torch.arange(B, device=hidden.device)]



def compressed_head_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tables: torch.Tensor,
    table_lens: torch.Tensor,
    table_idx: torch.Tensor,
    extra_ids: torch.Tensor | None = None,
    return_logits: bool = False,
    *,
    table_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Top-1 draft token over each row's compressed vocabulary (pure torch).

    Parameters
    ----------
    hidden : Tensor, float32/float16/bfloat16, shape [B, H]
        The draft's final hidden states.
    weight : Tensor, same dtype, shape [V, H]
        The full (shared) lm_head weight.
    tables : Tensor, int64, shape [L, S_max]
        Full-vocabulary ids of each table, padded past its length (padding is never read).
    table_lens : Tensor, int64, shape [L]
        Length of each table (``>= 1``).
    table_idx : Tensor, int64, shape [B]
        Table of each row, in ``[0, L)``.
    extra_ids : Tensor, int64, shape [B, E], optional
        Additional full-vocabulary ids per row, ``-1`` padded; ids already in the row's table or
        repeated are masked (see :func:`mask_extra_ids`).
    return_logits : bool
        Also return the compressed logits.
    table_weight : Tensor, same dtype, shape [L, S_max, H], optional
        ``weight[tables]`` gathered once (``TableSet.gather_weight``); saves re-gathering the
        table's rows every step, which on CPU costs as much as the matmul.

    Returns
    -------
    top_id : Tensor, int64, shape [B]
        Full-vocabulary id of the argmax (``-1`` if a row has no candidate).
    top_logprob : Tensor, float32, shape [B]
        Its log-probability under the softmax over the row's compressed set.
    logits : Tensor, float32, shape [B, S_max + E], or None
        Compressed logits, ``-inf`` at padded and masked slots; ids from :func:`slot_ids`.
    """
    _check_inputs(hidden, weight, tables, table_lens, table_idx, extra_ids, table_weight)
    B, H = hidden.shape
    S = tables.shape[1]
    V = weight.shape[0]
    dev = hidden.device

    # Host syncs are free on CPU: there each row is computed against its own table only.
    logits_t = _table_logits(hidden, weight, tables, table_lens, table_idx, table_weight,
                             group_on_host=dev.type == "cpu")
    in_len = torch.arange(S, device=dev)[None, :] < table_lens.index_select(0, table_idx)[:, None]
    logits_t = logits_t.masked_fill(~in_len, float("-inf"))

    ids = slot_ids(tables, table_lens, table_idx)
    logits = logits_t
    if extra_ids is not None and extra_ids.shape[1] > 0:
        ex = mask_extra_ids(tables, table_lens, table_idx, extra_ids, V)
        w_ex = weight.index_select(0, ex.clamp(0, V - 1).reshape(-1)).view(B, -1, H)  # [B, E, H]
        logits_e = torch.bmm(w_ex, hidden.unsqueeze(2)).squeeze(2).float()  # [B, E]
        logits_e = logits_e.masked_fill(ex < 0, float("-inf"))
        logits = torch.cat([logits_t, logits_e], dim=1)
        ids = torch.cat([ids, ex], dim=1)
    elif extra_ids is not None:  # E == 0
        ids = torch.cat([ids, extra_ids], dim=1)

    top_slot = logits.argmax(dim=1)  # first maximum (torch.max's index is not guaranteed first)
    top_logit = logits.gather(1, top_slot[:, None]).squeeze(1)
    lse = torch.logsumexp(logits, dim=1)
    found = top_logit != float("-inf")
    top_logprob = torch.where(found, top_logit - lse, torch.full_like(lse, float("-inf")))
    top_id = torch.where(found, ids.gather(1, top_slot[:, None]).squeeze(1), torch.full_like(top_slot, -1))
    return top_id, top_logprob, (logits if return_logits else None)


# ----------------------------------------------------------------------------------------------
# Triton launcher
# ----------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def compressed_head_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tables: torch.Tensor,
    table_lens: torch.Tensor,
    table_idx: torch.Tensor,
    extra_ids: torch.Tensor | None = None,
    return_logits: bool = False,
    *,
    table_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`compressed_head_torch` (same parameters and returns).

    Needs CUDA tensors, or ``TRITON_INTERPRET=1`` (set before ``triton`` is imported) for CPU
    tensors. Inputs must be contiguous (``weight`` may have a row stride, its last dimension must
    be contiguous). Launches three kernels (two without ``extra_ids``) plus, with ``extra_ids``,
    the torch ops of :func:`mask_extra_ids`; no host sync.
    """
    _check_inputs(hidden, weight, tables, table_lens, table_idx, extra_ids, table_weight)
    interp = _interpreting()
    if hidden.device.type != "cuda" and not interp:
        raise ValueError(
            f"compressed_head_triton needs CUDA tensors (got {hidden.device}); use "
            f"compressed_head_torch, or set TRITON_INTERPRET=1 before importing triton"
        )
    for name, t in (("hidden", hidden), ("tables", tables), ("table_lens", table_lens), ("table_idx", table_idx)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; got strides {t.stride()} for shape {tuple(t.shape)}")
    if weight.stride(1) != 1:
        raise ValueError(f"weight's last dimension must be contiguous; got strides {weight.stride()}")
    if table_weight is not None and not table_weight.is_contiguous():
        raise ValueError(f"table_weight must be contiguous; got strides {table_weight.stride()}")
    B, H = hidden.shape
    L, S = tables.shape
    V = weight.shape[0]
    E = 0 if extra_ids is None else extra_ids.shape[1]
    dev = hidden.device

    if interp:
        # The interpreter pays per op, not per element: few, large tiles.
        block_s = min(_next_pow2(S), 512)
        block_k = min(_next_pow2(H), 256)
        block_b = max(16, min(_next_pow2(B), 32))
        block_e = min(max(16, _next_pow2(E)), 256)
        num_warps = 4
    else:
        # The gathered weight tile is the traffic; BLOCK_B rows share it. 64 x 128 fp32 operand
        # tiles per program keep register use moderate at BLOCK_B <= 64.
        block_b = max(16, min(_next_pow2(B), 64))
        block_s = 64
        block_k = 128 if block_b <= 32 else 64
        block_e = 64
        num_warps = 4 if block_b <= 32 else 8
    n_s_tiles = triton.cdiv(S, block_s)
    n_e_tiles = triton.cdiv(E, block_e) if E > 0 else 0
    n_cols = L * n_s_tiles + n_e_tiles

    part_max = torch.empty(B, n_cols, dtype=torch.float32, device=dev)
    part_sum = torch.empty(B, n_cols, dtype=torch.float32, device=dev)
    part_slot = torch.empty(B, n_cols, dtype=torch.int64, device=dev)
    top_id = torch.empty(B, dtype=torch.int64, device=dev)
    top_logprob = torch.empty(B, dtype=torch.float32, device=dev)
    logits = None
    if return_logits:
        # padded table slots are never written by the kernel: pre-fill
        logits = torch.full((B, S + E), float("-inf"), dtype=torch.float32, device=dev)
    logits_arg = logits if logits is not None else part_max  # dummy pointer when unused

    pregathered = table_weight is not None
    _compressed_head_kernel[(n_s_tiles, L, triton.cdiv(B, block_b))](
        hidden,
        table_weight if pregathered else weight,
        tables,
        table_lens,
        table_idx,
        part_max,
        part_sum,
        part_slot,
        logits_arg,
        B,
        H,
        S,
        n_cols,
        S + E,
        weight.stride(0),
        PREGATHERED=pregathered,
        WRITE_LOGITS=return_logits,
        IEEE_DOT=hidden.dtype == torch.float32,
        BLOCK_B=block_b,
        BLOCK_S=block_s,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    extra = None
    if E > 0:
        extra = mask_extra_ids(tables, table_lens, table_idx, extra_ids, V).contiguous()
        _compressed_head_extra_kernel[(n_e_tiles, B)](
            hidden,
            weight,
            extra,
            part_max,
            part_sum,
            part_slot,
            logits_arg,
            H,
            E,
            S,
            n_cols,
            L * n_s_tiles,
            S + E,
            weight.stride(0),
            WRITE_LOGITS=return_logits,
            BLOCK_E=block_e,
            BLOCK_K=block_k,
            num_warps=4,
        )
    block_c = min(_next_pow2(n_cols), 1024)
    _compressed_head_combine_kernel[(B,)](
        part_max,
        part_sum,
        part_slot,
        tables,
        table_idx,
        extra if extra is not None else tables,
        top_id,
        top_logprob,
        n_cols,
        S,
        E,
        HAS_EXTRA=extra is not None,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return top_id, top_logprob, logits


# ----------------------------------------------------------------------------------------------
# Dispatcher
# ----------------------------------------------------------------------------------------------


def compressed_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tables: torch.Tensor,
    table_lens: torch.Tensor,
    table_idx: torch.Tensor,
    extra_ids: torch.Tensor | None = None,
    return_logits: bool = False,
    *,
    table_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Compressed draft head; Triton on CUDA tensors, torch elsewhere.

    ``FASTMTP_COMPRESSED_HEAD=torch`` or ``=triton`` forces a path. Parameters and returns as in
    :func:`compressed_head_torch`.
    """
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if choice not in ("", "torch", "triton"):
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected 'torch', 'triton' or unset")
    use_triton = choice == "triton" or (choice == "" and hidden.is_cuda)
    fn = compressed_head_triton if use_triton else compressed_head_torch
    return fn(hidden, weight, tables, table_lens, table_idx, extra_ids, return_logits, table_weight=table_weight)
