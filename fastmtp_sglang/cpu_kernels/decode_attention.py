"""Attention of a decode step (one new token per row) over a bf16 key/value cache in one pass
(``decode_attention.c``), on CPUs with AVX-512.

Why: at one query per row PyTorch's CPU ``scaled_dot_product_attention`` is far from the cost
of reading the cache. Profiled in self-distillation on an AMD EPYC with avx512_bf16 and no AMX
(64 rows, ~350 slots, the demo target's 3 key/value heads of 3 query heads each): 2.1 ms a
layer, 36 % of a decode step, where that layer's keys and values are ~17 MB (~0.5 ms of memory
traffic on 2 cores). The kernel streams each row's keys and values once for the query heads
that share them, with the running-maximum softmax of flash attention, fp32 sums, and one
rounding to bf16.

- :func:`available` / :func:`unavailable_reason`: built with gcc on first use and cached by
  loader.py, as amx.py's library is (same private cache folder, sha256 checked before every
  load, flags in the key); off with ``FASTMTP_CPU_KERNELS=off`` or on a CPU without ``avx512f``.
- :func:`decode_attention` runs it; :func:`decode_attention_ref` is the same maths in torch
  (fp32), the reference the tests hold it to (tests/test_decode_attention.py).

The sums are fp32 in another order than PyTorch's kernel, so an output can differ from it in the
last bf16 bit; a row's result does not depend on the other rows or on the thread count.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from fastmtp_sglang.cpu_kernels.loader import Once, load_for_cpu

SOURCE = Path(__file__).with_name("decode_attention.c")
NEEDS = ("avx512f",)
MAX_D, MAX_G = 256, 16


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    lib, why = load_for_cpu(SOURCE, "decode_attention", NEEDS)
    if lib is not None:
        P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        fn = lib.fastmtp_decode_attn_bf16
        fn.restype = None
        fn.argtypes = [P, P, P, P, P, I, I, I, I, I, L, L, L, L, L, L, ctypes.c_float, I]
    return lib, why


_once = Once(lambda: _load())
_state = _once.state


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (then :func:`unavailable_reason` says why); loaded once."""
    return _once.get()


def available() -> bool:
    return library() is not None


def unavailable_reason() -> str | None:
    return _once.why()


def fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these shapes: bf16 on the CPU, one query per row,
    head size a multiple of 16 up to 256, at most 16 query heads per key/value head, keys and
    values with a contiguous last dimension."""
    B, nh, S, D = q.shape
    return (q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and q.device.type == "cpu"
            and S == 1 and D % 16 == 0 and D <= MAX_D and nh % k.shape[1] == 0
            and nh // k.shape[1] <= MAX_G and k.stride(-1) == 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """softmax(scale q k^T) v for one new token per row.

    Parameters
    ----------
    q : [B, n_heads, 1, D] bf16 (any strides)
    k, v : [B, n_kv, T, D] bf16, last dimension contiguous (views of a cache are fine)
    valid : [B, T] bool, the slots each row attends to, or None (all)
    scale : the softmax scale

    Returns
    -------
    [B, n_heads, 1, D] bf16. A row with no valid slot gets zeros.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"the decode-attention kernel is unavailable: {unavailable_reason()}")
    if not fits(q, k) or v.shape != k.shape or v.stride(-1) != 1 or v.dtype != k.dtype:
        raise ValueError(f"decode_attention takes bf16 q [B, H, 1, D] and k, v [B, n_kv, T, D] with "
                         f"D % 16 == 0, D <= {MAX_D}; got q {tuple(q.shape)} {q.dtype}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, nh, _, D = q.shape
    nkv, T = k.shape[1], k.shape[2]
    if valid is not None:
        if valid.shape != (B, T):
            raise ValueError(f"valid must be [B, T] = [{B}, {T}], got {tuple(valid.shape)}")
        valid = valid.to(torch.bool).contiguous()
    qc = q.reshape(B, nh, D).contiguous()
    out = torch.empty(B, nh, 1, D, dtype=torch.bfloat16)
    lib.fastmtp_decode_attn_bf16(qc.data_ptr(), k.data_ptr(), v.data_ptr(),
                                 valid.data_ptr() if valid is not None else None, out.data_ptr(),
                                 B, nkv, nh // nkv, T, D, *k.stride()[:3], *v.stride()[:3],
                                 float(scale), torch.get_num_threads())
    return out


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """:func:`decode_attention` in torch, fp32 throughout, rounded to q's dtype at the end."""
    B, nh, _, D = q.shape
    nkv = k.shape[1]
    qf = q.float().reshape(B, nkv, nh // nkv, D)
    s = torch.einsum("bhgd,bhtd->bhgt", qf, k.float()) * scale
    if valid is not None:
        s = s.masked_fill(~valid.bool()[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgt,bhtd->bhgd", p, v.float()).reshape(B, nh, 1, D).to(q.dtype)
