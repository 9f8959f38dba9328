"""Linear layers on weights oneDNN has laid out once, for bf16 inference on CPUs with native bf16.

``torch.nn.functional.linear`` in bf16 on CPU reaches oneDNN's matmul, but lays the weight out
for the kernel on every call; at the few rows a decode step or a verification has (1..K+1 per
request), that reorder costs as much as the matmul itself. ``torch.ops.mkldnn._reorder_linear_weight``
does it once, and ``torch.ops.mkldnn._linear_pointwise`` then reads the prepared weight (the ops
PyTorch's inductor uses when it freezes a CPU model; callable in eager mode, no compile). On the
AMX Xeon this project runs on, the demo target's projections ran ~1.5-2x faster, with results
bit-identical to ``F.linear`` at every row count measured (bench/packed_linear_probe.py).

:func:`pack_linears` swaps the ``forward`` of every ``nn.Linear`` in a module (state dicts and
parameters are untouched). The prepared copy is used only where it is exact and fresh: bf16
input and weight on CPU, no autograd (``inference_mode``/``no_grad``), and the weight unchanged
since it was prepared (its version counter and storage; a trained head repacks after an
optimizer step). Everything else takes ``F.linear``.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F

from fastmtp_sglang.core.hardware import fast_bf16

_HINT = 16  # oneDNN's batch-size hint for the layout: exact at every row count we measured from 8 up
_ATTR = "_fastmtp_packed"


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _version(w: torch.Tensor) -> tuple[int, int]:
    try:
        v = w._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot be changed in place)
        v = -1
    return v, w.data_ptr()


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu"
            or w.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w, self.bias)
    state = self.__dict__.get(_ATTR)
    key = _version(w)
    if state is None or state[0] != key:
        with torch.no_grad():
            state = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), _HINT))
        self.__dict__[_ATTR] = state
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), state[1], self.bias, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])


def prepared_linear(x: torch.Tensor, w: torch.Tensor, store: dict, key) -> torch.Tensor:
    """``F.linear(x, w)`` through a prepared copy of ``w`` kept in ``store[key]`` (made on first
    use, remade when ``w`` changes) where the engine would pack an ``nn.Linear`` (bf16 on a CPU
    with bf16 units, no autograd); plain ``F.linear`` elsewhere. For weights that are slices of
    a bigger tensor rather than layers (the draft vocabulary's table rows)."""
    if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu"
            or not available() or not fast_bf16() or (torch.is_grad_enabled() and x.requires_grad)):
        return F.linear(x, w)
    state = store.get(key)
    ver = _version(w)
    if state is None or state[0] != ver:
        with torch.no_grad():
            state = (ver, torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _HINT))
        store[key] = state
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), state[1], None, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])


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
        if isinstance(m, torch.nn.Linear) and getattr(m.__dict__.get("forward"), "__func__", None) is _packed_forward:
            del m.forward
            m.__dict__.pop(_ATTR, None)
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
    return mode == "on" or (p.dtype == torch.bfloat16 and fast_bf16())


def pack_for_inference(model: torch.nn.Module, head: torch.nn.Module | None = None,
                       mode: str | None = None) -> bool:
    """Pack ``model``'s (and ``head``'s) linear layers when :func:`wanted` says so; ``mode`` None
    reads the ``FASTMTP_PACKED_LINEAR`` environment variable (default "auto"). Returns whether the
    layers run packed."""
    mode = mode if mode is not None else os.environ.get("FASTMTP_PACKED_LINEAR", "auto")
    if not wanted(model, mode):
        return False
    n = pack_linears(model)
    if head is not None:
        n += pack_linears(head)
    return n > 0


def is_packed(module: torch.nn.Module) -> bool:
    return any(getattr(m.__dict__.get("forward"), "__func__", None) is _packed_forward
               for m in module.modules() if isinstance(m, torch.nn.Linear))
