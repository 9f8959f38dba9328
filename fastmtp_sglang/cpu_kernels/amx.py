"""bf16 linear layers at the few rows of a decode step on AMX tiles (``amx.c``; on AVX-512 dot
products where the CPU has no AMX), and the elementwise steps of a bf16 decoder layer.

A plain step multiplies one row by every weight of the model; a verify, K+1 rows; a batch of B
requests, B (K+1) rows. Through oneDNN's kernels on prepared weights (packed_linear.py) the
demo target's 120 projections of a step stream their 212 MB at 18-19 GB/s on the AMX Xeon, where
a plain read of memory reached 28.7 GB/s in the same run, at every row count from 1 to 16 (each product is a
short call with its own fixed cost). ``amx.c`` multiplies each 1 KB tile of a weight
against all rows before it reads the next, in one call with little around it: the same 120
products in 8.5-9.6 ms at 1-16 rows against oneDNN's 11.2-12.1, level at 64 rows, slower from 128
(``python bench/probes/cpu_kernels_probe.py``; bench/results/cpu_kernels_probe/).

- :func:`available`: the kernel is built with the system's C compiler on first use and cached
  (loader.py: a private folder, the sha256 checked before every load). Two builds of one
  source: on AMX tiles, and (``FASTMTP_VECTOR``) on AVX-512 bf16 dot products for CPUs without
  AMX (AMD EPYC Zen 4 and later, Intel Cooper Lake), also taken (and logged) where the OS
  refuses tile data or the tiles' build fails; :func:`tiles` says which runs. The vector
  build sums each output as one fp32 chain over its pairs in order (VDPBF16PS; not the tiles'
  bits: its last bit can differ from theirs), up to 8 rows sharing each weight row it reads;
  it has no tiles for a verify's attention (:func:`takes_multi` is False, PyTorch attends). On the AMX Xeon with AMX masked
  (bench/probes/without_amx.py) the draft step took 1.2 ms against 2.3-2.4 through oneDNN and
  the plain step 14 ms against 24-26 (bench/results/avx512_vector_build/). False, with
  :func:`unavailable_reason` (a build failure or a refused folder is also logged, once), on a
  CPU without AVX-512 bf16, where neither build can be made or loaded, or with
  ``FASTMTP_CPU_KERNELS=off``: callers then keep oneDNN (packed_linear.py).
- :func:`pack` lays a weight out once (:class:`Packed`); :func:`linear` computes ``x @ W.T + b``;
  :func:`linear_argmax` only each row's largest output's index (a greedy draft's table pick;
  :func:`linear_argmax_rows` with the table's token ids looked up in the call).
- :func:`add_rms_`, :func:`rope_`, :func:`silu_mul`: the elementwise steps of a bf16 decoder
  layer, one call each with transformers' roundings (decode/lean_forward.py, lean_head.py).
- :class:`HeadStep`: a head's whole draft step at one token per row in one call, from the
  same pieces (decode/lean_head.py).

Products run three column blocks' chains of tile products at once (``amx_products.h``); the
argmax at a single row takes AVX-512 dot products over the same tiles (faster there for the
table's pick). The sums are fp32 and rounded to bf16 once, like oneDNN's, but in another order,
so the last bit of an output can differ from ``F.linear``'s; a row's result never depends on the
other rows of the call, alone or among others, nor on the thread count (tests/test_cpu_amx.py:
float64 reference over odd shapes, row independence).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from fastmtp_sglang.cpu_kernels import loader
from fastmtp_sglang.cpu_kernels.loader import ENV, Once, load_for_cpu

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("amx.c")
VECTOR_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
NEEDS = ("amx_tile", "amx_bf16", *VECTOR_NEEDS)
TILE_K = 32                      # inputs per tile
BLOCK_N = 16                     # output columns per tile


def _load(build: str | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """``build``: "tiles" (AMX), "vector" (AVX-512 bf16 dot products, no AMX), or None: tiles
    where the CPU has AMX and the OS grants tile data, else the vector build."""
    if build is None:
        flags = loader.cpu_flags()
        if all(f in flags for f in NEEDS):
            lib, why = _load("tiles")
            if lib is not None or why == f"{ENV}=off":
                return lib, why
            vec, vwhy = _load("vector")  # (AMX refused or failed to build: the vector units)
            if vec is not None:
                log.warning("amx: %s; the AVX-512 build of the kernels runs instead", why)
                return vec, None
            return None, why if vwhy == why else f"{why}; {vwhy}"
        build = "vector"
    if build == "tiles":
        lib, why = load_for_cpu(SOURCE, "amx", NEEDS, instead="the AVX-512 build is tried next")
    else:
        lib, why = load_for_cpu(SOURCE, "amx_vector", VECTOR_NEEDS, ("FASTMTP_VECTOR",))
    if lib is None:
        return None, why
    lib.fastmtp_linear_bf16_amx.restype = None
    lib.fastmtp_linear_bf16_amx.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    P, I = ctypes.c_void_p, ctypes.c_int
    for name, args in (("fastmtp_add_rms_bf16", [P, P, P, P, I, I, ctypes.c_float]),
                       ("fastmtp_rope_bf16", [P, P, P, I, I, I, I]),
                       ("fastmtp_silu_mul_bf16", [P, P, I, I])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, args
    lib.fastmtp_linear_argmax_bf16_amx.restype = ctypes.c_int
    lib.fastmtp_linear_argmax_bf16_amx.argtypes = [P, P, I, I, I, P, I, P]
    lib.fastmtp_head_step_bf16.restype = ctypes.c_int
    lib.fastmtp_head_step_bf16.argtypes = [P, P, P, P, P, P, I, I, P, P, ctypes.c_long, ctypes.c_long,
                                           P, P, P, I]
    L = ctypes.c_long
    lib.fastmtp_multi_attn_amx.restype = ctypes.c_int
    lib.fastmtp_multi_attn_amx.argtypes = [P, L, L, L, P, P, P, P, I, I, I, I, I, I, L, L, L, L, L, L,
                                           ctypes.c_float, I]
    lib.fastmtp_amx_init.restype = ctypes.c_int
    lib.fastmtp_has_tiles.restype = ctypes.c_int
    if lib.fastmtp_amx_init() != 0:
        return None, "the OS refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)"
    lib.has_tiles = bool(lib.fastmtp_has_tiles())  # (read for every forward: takes_multi)
    return lib, None


_once = Once(lambda: _load())
_state = _once.state


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (then :func:`unavailable_reason` says why). Built once per
    source, compiler and flags, loaded once per process (a failure is logged once)."""
    return _once.get()


def available() -> bool:
    return library() is not None


def tiles() -> bool:
    """Whether the loaded build runs on AMX tiles (False: the AVX-512 vector build, or none)."""
    lib = library()
    return lib is not None and lib.has_tiles


def unavailable_reason() -> str | None:
    return _once.why()


@dataclass
class Packed:
    """A bf16 weight [n, k] in tiles ([N/16][K/2][16][2], zero-padded: N to 16, K to 32)."""
    data: torch.Tensor
    n: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k


def pack(w: torch.Tensor) -> Packed:
    """Lay a bf16 weight ``w`` [N, K] out in tiles for :func:`linear`."""
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        raise ValueError(f"pack takes a 2-D bf16 weight, got {tuple(w.shape)} {w.dtype}")
    N, K = w.shape
    nb, kp = -(-N // BLOCK_N), -(-K // TILE_K) * TILE_K // 2
    with torch.no_grad():
        pad = w.new_zeros(nb * BLOCK_N, kp * 2, device="cpu")
        pad[:N, :K] = w.detach()
        data = pad.view(nb, BLOCK_N, kp, 2).permute(0, 2, 1, 3).contiguous()
    return Packed(data, N, K)


def linear_rows(x: torch.Tensor, p: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear` for a contiguous bf16 ``x`` [M, K] with K a multiple of 32 and an fp32
    ``bias`` or None, without the checks (the engine's hot path; callers guarantee them)."""
    M = x.shape[0]
    y = torch.empty(M, p.n, dtype=torch.bfloat16)
    _once.state["lib"].fastmtp_linear_bf16_amx(x.data_ptr(), p.data.data_ptr(),
                                          bias.data_ptr() if bias is not None else None,
                                          y.data_ptr(), M, p.n, p.k, torch.get_num_threads())
    return y


def linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a bf16 ``x`` [..., K] on the CPU (``bias`` [N], any float dtype)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the AMX kernel is unavailable: {unavailable_reason()}")
    if x.dtype != torch.bfloat16 or x.shape[-1] != p.k or x.device.type != "cpu":
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} {x.device} does not fit a packed bf16 "
                         f"weight of {p.k} inputs on the CPU")
    shape = x.shape
    x2 = x.reshape(-1, p.k)
    M, K = x2.shape[0], p.k
    y = torch.empty(M, p.n, dtype=torch.bfloat16)
    if M:
        if K % TILE_K:  # tiles read whole 32-input pieces: pad the rows with zeros
            K = -(-K // TILE_K) * TILE_K
            x2 = torch.nn.functional.pad(x2, (0, K - p.k))
        elif not x2.is_contiguous():
            x2 = x2.contiguous()
        b = None
        if bias is not None:
            b = bias.detach()
            if b.dtype != torch.float32 or not b.is_contiguous():
                b = b.float().contiguous()
        lib.fastmtp_linear_bf16_amx(x2.data_ptr(), p.data.data_ptr(),
                                    b.data_ptr() if b is not None else None, y.data_ptr(),
                                    M, p.n, K, torch.get_num_threads())
    return y.reshape(*shape[:-1], p.n)


def linear_argmax(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """``(x @ W.T).max(-1).indices`` for a bf16 ``x`` [M, K] (M <= 16) without writing the
    products: each row's largest bf16 output, the first on ties, a NaN winning (as torch.max).
    Returns int64 [M]. What a greedy draft step asks of its vocabulary table. From two rows the
    sums are :func:`linear`'s; one row sums on vector units, which may round a near-tie apart."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the AMX kernel is unavailable: {unavailable_reason()}")
    if (x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[-1] != p.k or x.device.type != "cpu"
            or not 1 <= x.shape[0] <= 16 or p.k % TILE_K):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} {x.device} does not fit a packed bf16 "
                         f"weight of {p.k} inputs at 1-16 rows (inputs a multiple of {TILE_K})")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if lib.fastmtp_linear_argmax_bf16_amx(x.data_ptr(), p.data.data_ptr(), x.shape[0], p.n, p.k,
                                          out.data_ptr(), torch.get_num_threads(), None):
        raise ValueError("linear_argmax: rows or threads out of range")
    return out


def linear_argmax_rows(x: torch.Tensor, p: Packed, ids: torch.Tensor) -> torch.Tensor:
    """``ids[linear_argmax(x, p)]`` for a contiguous bf16 ``x`` [M, p.k] (1 <= M <= 16, p.k a
    multiple of 32) and contiguous int64 ``ids`` [>= p.n], without the checks: a greedy draft
    step's hot path (its table's token ids looked up in the call); callers guarantee them."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _once.state["lib"].fastmtp_linear_argmax_bf16_amx(x.data_ptr(), p.data.data_ptr(), x.shape[0], p.n, p.k,
                                                      out.data_ptr(), torch.get_num_threads(), ids.data_ptr())
    return out


# -- the elementwise steps of a bf16 decoder layer (one call each; transformers' roundings) ----

def check_rows(t: torch.Tensor, name: str) -> None:
    """ValueError unless ``t`` is a contiguous bf16 CPU tensor (what the elementwise kernels take)."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous bf16 CPU tensor, got {t.dtype} {t.device}")


def add_rms_(x: torch.Tensor, d: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out: torch.Tensor) -> torch.Tensor:
    """``x += d`` in place (when ``d``), then ``out = weight * bf16(x * rsqrt(mean(x^2) + eps))``
    (Llama's residual add and RMSNorm). x, d, out [N, H]; returns ``out``."""
    for t, n in ((x, "x"), (out, "out"), (weight, "weight")) + (((d, "d"),) if d is not None else ()):
        check_rows(t, n)
    N, H = x.shape
    library().fastmtp_add_rms_bf16(x.data_ptr(), d.data_ptr() if d is not None else None,
                                   weight.data_ptr(), out.data_ptr(), N, H, float(eps))
    return out


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotary embedding of the first ``heads`` heads of every row of ``qkv`` [N, W], in place;
    ``cos``, ``sin`` [N, head_dim]."""
    for t, n in ((qkv, "qkv"), (cos, "cos"), (sin, "sin")):
        check_rows(t, n)
    if head_dim > 512 or heads * head_dim > qkv.shape[1]:
        raise ValueError(f"{heads} heads of {head_dim} do not fit rows of {qkv.shape[1]}")
    library().fastmtp_rope_bf16(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[0],
                                heads, head_dim, qkv.shape[1])


def add_rms_rows(x: torch.Tensor, d: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    """:func:`add_rms_` without the checks (the engine's hot path: 61 calls a forward of the
    demo target, where the checks cost more than the kernel; callers guarantee contiguous bf16
    CPU tensors of matching shapes)."""
    _once.state["lib"].fastmtp_add_rms_bf16(x.data_ptr(), d.data_ptr() if d is not None else None,
                                            weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)


def rope_rows(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """:func:`rope_` without the checks (the engine's hot path; callers guarantee them)."""
    _once.state["lib"].fastmtp_rope_bf16(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[0],
                                         heads, head_dim, qkv.shape[1])


def silu_mul_rows(gu: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` without the checks (the engine's hot path; callers guarantee them)."""
    N, I2 = gu.shape
    out = torch.empty(N, I2 // 2, dtype=torch.bfloat16)
    _once.state["lib"].fastmtp_silu_mul_bf16(gu.data_ptr(), out.data_ptr(), N, I2 // 2)
    return out


class HeadStep:
    """One draft step of a Llama-block head at one new token per row in one call of ``amx.c``
    (``fastmtp_head_step_bf16``): the same functions and roundings as the calls of
    decode/lean_head.py's LeanHead, which builds one from the head's tiles and norms.

    ``weights``: the 18 tensors or None in the order amx.c lists (embedding, norms, tiles'
    data, fp32 biases); ``dims``: (H, layout, query heads, key/value heads, head_dim,
    intermediate size, the embedding's rows); ``eps``: the five norms' epsilons. The object keeps them alive."""

    def __init__(self, weights: list, dims: tuple, eps: tuple):
        self._keep = weights
        ptrs = [0 if t is None else t.data_ptr() for t in weights]
        self._w = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._dims = (ctypes.c_long * len(dims))(*dims)
        self._eps = (ctypes.c_float * len(eps))(*eps)
        self.H = dims[0]

    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, per_row: int = 1,
                 shape: tuple | None = None) -> torch.Tensor:
        """ids, pos [N] int64 (or any shape of N elements: [B, S]); hidden [N, H] bf16 (or [B, S,
        H]); k, v the cache buffers [R >= N / per_row, n_kv, cap, D]; cos, sin [> max(pos), D]
        bf16. All contiguous. ``per_row``: positions per batch row (1: a draft step; more: a
        draft extend): inputs b * per_row .. (b + 1) * per_row - 1 are batch row b's (every key
        written at its pos before any input attends keys 0..pos). Returns the head's output
        after its final norm, [N, H] or ``shape``."""
        N = ids.numel()
        out = torch.empty(shape or (N, self.H), dtype=torch.bfloat16)
        rc = _once.state["lib"].fastmtp_head_step_bf16(
            self._w, self._dims, self._eps, ids.data_ptr(), hidden.data_ptr(), pos.data_ptr(), N,
            per_row, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), cos.data_ptr(),
            sin.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"a token id outside the embedding's {self._dims[6]} rows, or a "
                             "negative position, reached the head step")
        if rc == -3:
            raise ValueError(f"the head step's {N} inputs are not a whole number of rows of "
                             f"{per_row}, or {torch.get_num_threads()} threads are outside 1..256")
        if rc:
            raise MemoryError("the head step could not allocate its scratch memory")
        return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``bf16(silu(g)) * u`` for ``gu`` = [g | u] [N, 2I] -> [N, I]."""
    check_rows(gu, "gu")
    N, I2 = gu.shape
    out = torch.empty(N, I2 // 2, dtype=torch.bfloat16)
    library().fastmtp_silu_mul_bf16(gu.data_ptr(), out.data_ptr(), N, I2 // 2)
    return out


MULTI_MAX_S = 32  # new tokens per row up to which a verify's attention runs on tiles (multi_query_attention)


def takes_multi(tokens: int, head_dim: int) -> bool:
    """Whether :func:`multi_query_attention` takes ``tokens`` new tokens a row at this head
    size: 2 to ``MULTI_MAX_S`` tokens, head size a multiple of 32 up to 256, on AMX tiles (the
    vector build has none: :func:`tiles`) (what a forward can decide before it has the tensors,
    :func:`fits_multi`)."""
    return 1 < tokens <= MULTI_MAX_S and head_dim % 32 == 0 and head_dim <= 256 and tiles()


def fits_multi(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`multi_query_attention` takes these tensors: bf16, :func:`takes_multi`'s
    shapes, query heads a multiple of the key/value heads, last dimensions contiguous."""
    B, nh, S, D = q.shape
    return (q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and takes_multi(S, D)
            and nh % k.shape[1] == 0 and k.stride(-1) == 1 and q.stride(-1) == 1
            and 32 * k.stride(2) < 2 ** 31)


def multi_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """softmax(scale q k^T) v for a verify's few new tokens per row, each seeing the slots its
    row of ``valid`` marks, on AMX tiles (``fastmtp_multi_attn_amx``: fp32 scores and softmax,
    the weights rounded to bf16 before the product with the values, as PyTorch's CPU flash
    attention does).

    q [B, n_heads, S, D] bf16, last dimension contiguous (a view of the q/k/v product is fine);
    k, v [B, n_kv, T, D] bf16, last dimension contiguous; valid [B, S, T] bool. Returns
    [B, n_heads, S, D] bf16, a view of a [B, S, n_heads, D] buffer (so ``.transpose(1, 2)`` is
    contiguous). A token that sees no slot gets zeros."""
    B, nh, S, D = q.shape
    nkv, T = k.shape[1], k.shape[2]
    if library() is None:
        raise RuntimeError(f"the AMX kernels are unavailable: {unavailable_reason()}")
    if not tiles():
        raise RuntimeError("multi_query_attention runs on AMX tiles; this CPU has the AVX-512 "
                           "build of the kernels (a verify's attention stays with PyTorch there)")
    if not fits_multi(q, k) or v.shape != k.shape or v.stride(-1) != 1 or v.dtype != k.dtype:
        raise ValueError(f"multi_query_attention takes bf16 q [B, H, S, D] with 1 < S <= {MULTI_MAX_S}, "
                         f"D % 32 == 0, D <= 256 and k, v [B, n_kv, T, D]; got q {tuple(q.shape)} "
                         f"{q.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if valid.shape != (B, S, T) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool [B, S, T] = [{B}, {S}, {T}], got {tuple(valid.shape)} {valid.dtype}")
    return multi_query_attention_rows(q, k, v, valid.contiguous(), scale)


def multi_query_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """:func:`multi_query_attention` without the checks (the verify's hot path: a call a layer
    with the shapes of the forward's first, which was checked; ``valid`` contiguous)."""
    B, nh, S, D = q.shape
    nkv, T = k.shape[1], k.shape[2]
    out = torch.empty(B, S, nh, D, dtype=torch.bfloat16)
    rc = _once.state["lib"].fastmtp_multi_attn_amx(
        q.data_ptr(), *q.stride()[:3], k.data_ptr(), v.data_ptr(), valid.data_ptr(), out.data_ptr(),
        B, nkv, nh // nkv, S, T, D, *k.stride()[:3], *v.stride()[:3], float(scale),
        torch.get_num_threads())
    if rc == -1:
        raise MemoryError("the multi-query attention kernel could not allocate its scratch memory")
    if rc:
        raise ValueError(f"the multi-query attention kernel does not take q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out.transpose(1, 2)
