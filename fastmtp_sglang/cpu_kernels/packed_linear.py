"""Linear layers on weights oneDNN has laid out once, for bf16 inference on CPUs with native bf16.

``torch.nn.functional.linear`` in bf16 on CPU reaches oneDNN's matmul, but lays the weight out
for the kernel on every call; at the few rows a decode step or a verification has (1..K+1 per
request), that reorder costs as much as the matmul itself. ``torch.ops.mkldnn._reorder_linear_weight``
does it once, and ``torch.ops.mkldnn._linear_pointwise`` then reads the prepared weight (the ops
PyTorch's inductor uses when it freezes a CPU model; callable in eager mode, no compile). On the
AMX Xeon this project runs on, the demo target's projections ran 1.2-1.7x faster at 1-16 rows, with results
bit-identical to ``F.linear`` at every row count measured (bench/probes/packed_linear_probe.py).

:func:`pack_linears` swaps the ``forward`` of every ``nn.Linear`` in a module (state dicts and
parameters are untouched). The prepared copy is used only where it is exact and fresh: bf16
input and weight on CPU, no autograd (``inference_mode``/``no_grad``), and the weight unchanged
since it was prepared (its version counter and storage; a trained head repacks after an
optimizer step). Everything else takes ``F.linear``.

:func:`fuse_projections` goes one step further for the projections that read the same input:
q/k/v of an attention and gate/up of an MLP become one prepared matmul (three calls become one;
the bf16 plain step of the demo target: 53.5 ms unfused, 38.4 / 49.2 ms fused in the runs just
before and after it, bench/results/speculation_pays/costs/). The first of a group to be called (q_proj, gate_proj: the order
transformers' Llama/Qwen2 modules and our head call them in) computes every member's output
and leaves the others theirs, keyed by the input tensor itself; a member called with another
input computes its own. Only up to ``FUSED_MAX_ROWS`` rows, where the fused product is
bit-identical to the separate ones (it was not at 200 rows: prefills keep the separate path).

Where amx.py's kernels load (AMX tiles, or their vector build on AVX-512 bf16 CPUs without
AMX) the prepared copy is laid out in tiles for amx.py instead of oneDNN's layout
(``amx.available()`` says which): on AMX the same products 1.2-1.4x faster at 1-16 rows, level
at 64, slower from 128 rows (bench/results/cpu_kernels_probe/); the vector build 1.1-1.4x faster
than oneDNN's at 1-64 rows, 0.89x at 256 (bench/results/avx512_vector_build/). Its sums run in
another order than oneDNN's, so the last bit of an output may differ from ``F.linear``'s (the tests compare within bf16 rounding there); every row's result is
independent of the other rows, and a fused product equals the separate ones exactly.
"""

from __future__ import annotations

import functools
import os
import types

import torch
import torch.nn.functional as F

from fastmtp_sglang.core.hardware import cpu_flags, fast_bf16
from fastmtp_sglang.cpu_kernels import amx

_HINT = 16  # oneDNN's batch-size hint for the layout: exact at every row count we measured from 8 up
_ATTR = "_fastmtp_packed"
_GROUP = "_fastmtp_fused"
FUSED_MAX_ROWS = 64  # fused q/k/v was bit-identical to three products up to here, not at 200 rows
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


# oneDNN's bf16 weight reorder refuses other CPUs ("bf16 path needs the cpu support
# avx_ne_convert or avx512bw, avx512vl and avx512dq"): an AVX2-only EPYC raises
_BF16_REORDER_FLAGS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}),
                       frozenset({"amx_bf16"}))


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why prepared bf16 linears cannot run here (None: they can). Fixed for the process (the
    draft step asks on every call)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN linear ops"
    flags = cpu_flags()
    if not any(need <= flags for need in _BF16_REORDER_FLAGS):
        return "this CPU cannot run oneDNN's bf16 reorder (needs avx512bw+avx512vl+avx512dq, avx_ne_convert or AMX)"
    return None


def available() -> bool:
    return unavailable_reason() is None


def weight_stamp(w: torch.Tensor) -> tuple[int, int]:
    """(version counter, address) of ``w``: another value once ``w`` is changed in place or given
    new storage (what a prepared copy of it is checked against)."""
    try:
        v = w._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot be changed in place)
        v = -1
    return v, w.data_ptr()


def _prepare(w: torch.Tensor):
    """``w`` laid out for the backend: AMX tiles (amx.py) where available, oneDNN's
    layout otherwise."""
    if amx.available():
        return amx.pack(w)
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _HINT)


def _apply(x: torch.Tensor, prepared, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(prepared, amx.Packed):
        return amx.linear(x, prepared, bias)
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), prepared, bias, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])


def _cached(store: dict, key, w: torch.Tensor) -> torch.Tensor:
    """``w`` prepared, from ``store[key]`` while ``w`` is unchanged (version and storage)."""
    state, ver = store.get(key), weight_stamp(w)
    if state is None or state[0] != ver:
        state = store[key] = (ver, _prepare(w))
    return state[1]


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu"
            or w.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w, self.bias)
    return _apply(x, _cached(self.__dict__, _ATTR, w), self.bias)


def prepared_linear(x: torch.Tensor, w: torch.Tensor, store: dict, key) -> torch.Tensor:
    """``F.linear(x, w)`` through a prepared copy of ``w`` kept in ``store[key]`` (made on first
    use, remade when ``w`` changes) where the engine would pack an ``nn.Linear`` (bf16 on a CPU
    with bf16 units, no autograd); plain ``F.linear`` elsewhere. For weights that are slices of
    a bigger tensor rather than layers (the draft vocabulary's table rows)."""
    if not _prepares(x, w):
        return F.linear(x, w)
    return _apply(x, _cached(store, key, w), None)


def _prepares(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`prepared_linear` takes a prepared copy of ``w`` for ``x``."""
    return (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu"
            and available() and fast_bf16() and not (torch.is_grad_enabled() and x.requires_grad))


def prepared_argmax(x: torch.Tensor, w: torch.Tensor, store: dict, key) -> torch.Tensor:
    """``F.linear(x, w).max(-1).indices`` (as :func:`prepared_linear`'s product): on AMX tiles
    without writing the products where the prepared copy is tiled and ``x`` has 1-16 rows
    (amx.linear_argmax: the first maximum of the same bf16 outputs from two rows; at one row of
    vector sums that may round a near-tie apart); the product and a max
    otherwise."""
    if x.dim() == 2 and 1 <= x.shape[0] <= 16 and _prepares(x, w):
        prepared = _cached(store, key, w)
        if isinstance(prepared, amx.Packed) and prepared.k % amx.TILE_K == 0:
            return amx.linear_argmax(x, prepared)
    return prepared_linear(x, w, store, key).max(-1).indices


class _Fused:
    """One group of projections over the same input: the members, their prepared concatenated
    weight (with the members' weight versions it was made from) and the outputs left for the
    members the leader computed for."""

    def __init__(self, members: list[torch.nn.Linear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.prepared = None   # (versions, prepared weight, concatenated bias or None)
        self.x = None          # the input the waiting outputs belong to
        self.outs: list[torch.Tensor | None] = []

    def weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prepared concatenated weight and bias (remade if a member's weight changed)."""
        key = tuple(weight_stamp(m.weight) for m in self.members)
        if self.prepared is None or self.prepared[0] != key:
            with torch.no_grad():
                b = (torch.cat([m.bias.detach() for m in self.members])
                     if self.members[0].bias is not None else None)
                self.prepared = (key, _prepare(torch.cat([m.weight.detach() for m in self.members])), b)
        return self.prepared[1], self.prepared[2]

    def run(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(_apply(x, *self.weight()).split(self.sizes, -1))


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    group, i = self.__dict__[_GROUP]  # (the group, this layer's place in it)
    if i > 0 and group.x is x and group.outs[i] is not None:
        out, group.outs[i] = group.outs[i], None
        if all(o is None for o in group.outs):
            group.x = None
        return out
    w = self.weight
    if (i == 0 and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu"
            and w.device.type == "cpu" and not torch.is_grad_enabled()
            and x.numel() // max(x.shape[-1], 1) <= FUSED_MAX_ROWS):
        outs = group.run(x)
        group.x, group.outs = x, [None] + outs[1:]
        return outs[0]
    if i == 0:
        group.x, group.outs = None, []
    return _packed_forward(self, x)


def fused_group(members: list[torch.nn.Linear]) -> _Fused | None:
    """The fused group made of exactly ``members`` in this order, or None."""
    g = members[0].__dict__.get(_GROUP)
    if g is None or g[0].members != members:
        return None
    return g[0]


def packed_weight(m: torch.nn.Linear) -> torch.Tensor:
    """``m``'s prepared weight, the copy its packed forward uses (made on first use)."""
    return _cached(m.__dict__, _ATTR, m.weight)


def runs_packed(m: torch.nn.Linear, x: torch.Tensor) -> bool:
    """Whether ``m``'s packed forward would use its prepared weight for ``x``."""
    w = m.weight
    return ("forward" in m.__dict__ and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.device.type == "cpu" and w.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def fuse_projections(module: torch.nn.Module) -> int:
    """Fuse q/k/v and gate/up under ``module`` (see the module docstring) where every member is
    an ``nn.Linear`` over the same input width, dtype and bias choice. Returns how many groups it
    fused. Members keep their parameters (state dicts unchanged)."""
    if not available():
        return 0
    n = 0
    for m in module.modules():
        for names in GROUPS:
            members = [getattr(m, a, None) for a in names]
            if not all(isinstance(x, torch.nn.Linear) for x in members):
                continue
            if any(_GROUP in x.__dict__ for x in members):
                continue
            if (len({x.in_features for x in members}) != 1 or len({x.weight.dtype for x in members}) != 1
                    or len({x.bias is None for x in members}) != 1):
                continue
            group = _Fused(members)
            for i, x in enumerate(members):
                x.__dict__[_GROUP] = (group, i)
                x.forward = types.MethodType(_fused_forward, x)
            n += 1
    return n


def pack_linears(module: torch.nn.Module) -> int:
    """Give every ``nn.Linear`` under ``module`` the prepared-weight forward. Returns how many
    layers it switched (0 where oneDNN's ops are missing). Idempotent."""
    if not available():
        return 0
    n = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and "forward" not in m.__dict__:
            m.forward = types.MethodType(_packed_forward, m)
            n += 1
    return n


def unpack_linears(module: torch.nn.Module) -> int:
    """Undo :func:`pack_linears` (for side-by-side timing). Returns how many layers it restored."""
    n = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and getattr(m.__dict__.get("forward"), "__func__", None) in (
                _packed_forward, _fused_forward):
            del m.forward
            m.__dict__.pop(_ATTR, None)
            m.__dict__.pop(_GROUP, None)
            n += 1
    return n


def wanted(model: torch.nn.Module, mode: str = "auto") -> bool:
    """``mode``: "on", "off" or "auto" (bf16 weights on a CPU with native bf16)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"packed linear mode must be auto, on or off, not {mode!r}")
    if mode == "off":
        return False
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return False
    return available() and (mode == "on" or (p.dtype == torch.bfloat16 and fast_bf16()))


def pack_for_inference(model: torch.nn.Module, head: torch.nn.Module | None = None,
                       mode: str | None = None, fuse: bool = True) -> bool:
    """Pack ``model``'s (and ``head``'s) linear layers when :func:`wanted` says so, fusing q/k/v
    and gate/up unless ``fuse`` is False; ``mode`` None reads the ``FASTMTP_PACKED_LINEAR``
    environment variable (default "auto"). Returns whether the layers run packed."""
    mode = mode if mode is not None else os.environ.get("FASTMTP_PACKED_LINEAR", "auto")
    if not wanted(model, mode):
        return False
    n = 0
    for m in (model, head):
        if m is not None:
            if fuse:
                fuse_projections(m)   # q/k/v and gate/up first: the rest get the single-layer forward
            n += pack_linears(m)
    return n > 0 or is_packed(model)


def is_packed(module: torch.nn.Module) -> bool:
    return any(getattr(m.__dict__.get("forward"), "__func__", None) in (_packed_forward, _fused_forward)
               for m in module.modules() if isinstance(m, torch.nn.Linear))
