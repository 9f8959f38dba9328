"""bf16 linear layers at the few rows of a decode step on AMX tiles (``cpu_amx.c``).

A plain step multiplies one row by every weight of the model; a verify, K+1 rows; a batch of B
requests, B (K+1) rows. Through oneDNN's kernels on prepared weights (core/packed_linear.py) the
demo target's 120 projections of a step stream their 212 MB at 18-19 GB/s on the AMX Xeon, where
a plain read of memory reached 28.7 GB/s in the same run, at every row count from 1 to 16 (each product is a
short call with its own fixed cost). ``cpu_amx.c`` multiplies each 1 KB tile of a weight
against all rows before it reads the next, in one call with little around it: the same 120
products in 8.5-9.6 ms at 1-16 rows against oneDNN's 11.2-12.1, level at 64 rows, slower from 128
(``python bench/cpu_kernels_probe.py``; bench/results/cpu_kernels_probe/).

- :func:`available`: the kernel is built with the system's C compiler on first use
  (``gcc -O3 -fopenmp``, linked against the libgomp PyTorch loaded; about a second) and cached
  under ``<cache>/kernels/`` (``<cache>``: ``$FASTMTP_CACHE`` or ``~/.cache/fastmtp``) by the
  hash of the source, the compiler, its flags and that runtime. The folder is made with mode
  0700 and refused when another user owns it or group or others may write it; the library's
  sha256 is stored beside it and checked before every load (a mismatch is rebuilt, never
  loaded). False, with :func:`unavailable_reason` (a build failure or a refused folder is also
  logged, once), on a CPU without AMX (``amx_tile``, ``amx_bf16``), where the kernel cannot be
  built or the OS refuses tile data, or with ``FASTMTP_CPU_KERNELS=off``: callers then keep
  oneDNN (core/packed_linear.py).
- :func:`pack` lays a weight out once (:class:`Packed`); :func:`linear` computes ``x @ W.T + b``.
- :func:`add_rms_`, :func:`rope_`, :func:`silu_mul`: the elementwise steps of a bf16 decoder
  layer, one call each with transformers' roundings (decode/lean_forward.py, lean_head.py).

The sums are fp32 and rounded to bf16 once, like oneDNN's, but in another order, so the last bit
of an output can differ from ``F.linear``'s; a row's result never depends on the other rows of
the call (tests/test_cpu_amx.py: float64 reference over odd shapes, row independence).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from fastmtp_sglang.core.hardware import cpu_flags

SOURCE = Path(__file__).with_name("cpu_amx.c")
ENV = "FASTMTP_CPU_KERNELS"     # "auto" (default) or "off"
NEEDS = ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
TILE_K = 32                      # inputs per tile
BLOCK_N = 16                     # output columns per tile

log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    from fastmtp_sglang.core.demo_target import default_cache_dir

    return default_cache_dir() / "kernels"


class UnsafeCacheDir(RuntimeError):
    """The kernel cache is a folder another user could have put a library in."""


def private_dir(d: Path) -> Path:
    """``d``, created with mode 0700 when missing; UnsafeCacheDir when it is a symlink, not a
    folder, owned by another user, or writable by group or others: a library loaded from there
    runs with this process's rights, so only its owner may be able to write it."""
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheDir(f"the kernel cache {d} is not a folder (a symlink or a file); "
                             "remove it or set FASTMTP_CACHE")
    if st.st_uid != os.geteuid():
        raise UnsafeCacheDir(f"the kernel cache {d} is owned by uid {st.st_uid}, not this user "
                             f"({os.geteuid()}); remove it or set FASTMTP_CACHE")
    if st.st_mode & 0o022:
        raise UnsafeCacheDir(f"the kernel cache {d} is writable by group or others (mode "
                             f"{stat.S_IMODE(st.st_mode):o}); `chmod 700 {d}` or set FASTMTP_CACHE")
    return d


def _loaded_openmp() -> str | None:
    """The OpenMP runtime PyTorch loaded into this process (its own libgomp, whatever its file
    name), so the kernel links that very library and shares its threads."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/libgomp" in path and ".so" in path and os.path.exists(path):
            return path
    return None


CFLAGS = ("-O3", "-fPIC", "-fopenmp")


def _commands(cc: str, omp: str | None) -> list[list[str]]:
    """The compile and link command lines, with ``{src}``, ``{obj}`` and ``{out}`` for the
    files. Linked against the OpenMP runtime torch already has: a second libgomp in the process
    would keep its own spinning threads on the same cores."""
    return [[cc, *CFLAGS, "-c", "{src}", "-o", "{obj}"],
            [cc, "-shared", "{obj}", "-o", "{out}", *([omp] if omp else ["-fopenmp"]), "-lm"]]


def _compiler_id(cc: str) -> str:
    """Which compiler ``cc`` is: its resolved path and its ``--version``."""
    path = shutil.which(cc) or cc
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    return f"{os.path.realpath(path)}\n{ver}"


def cache_key(source: bytes, compiler_id: str, commands: list[list[str]]) -> str:
    """The library's name in the cache: a hash of the source, the compiler and every flag of the
    commands that build it (the OpenMP runtime it links included)."""
    h = hashlib.sha256()
    for part in (source, compiler_id.encode(), json.dumps(commands).encode()):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:16]


def _library_path(cc: str, source: Path = SOURCE, stem: str = "cpu_amx") -> tuple[Path, list[list[str]]]:
    cmds = _commands(cc, _loaded_openmp())
    # (the headers beside it too: cpu_bf16.h, which both C files include)
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    tag = cache_key(text, _compiler_id(cc), cmds)
    return _cache_dir() / f"{stem}-{tag}.so", cmds


def _sha_file(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def verified(lib: Path) -> bool:
    """Whether ``lib`` is a regular file (not a symlink) whose bytes hash to the sha256 recorded
    beside it (``<lib>.sha256``). Checked right before every load: a library that does not match
    is rebuilt, never loaded."""
    try:
        if not stat.S_ISREG(os.lstat(lib).st_mode):
            return False
        want = _sha_file(lib).read_text().strip()
        return hashlib.sha256(lib.read_bytes()).hexdigest() == want
    except OSError:
        return False


def _write_beside(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _build(cc: str, source: Path = SOURCE, stem: str = "cpu_amx") -> Path:
    """The kernel library for this source, compiler and flags: the cached one when its recorded
    sha256 matches, else built now (a mismatch is rebuilt, never loaded). ``source`` / ``stem``:
    another C file built the same way (core/cpu_attention.py)."""
    out, cmds = _library_path(cc, source, stem)
    private_dir(out.parent)
    if verified(out):
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    obj = tmp + ".o"
    files = {"{src}": str(source), "{obj}": obj, "{out}": tmp}
    try:  # written beside, renamed into place: another process never loads half a library
        for cmd in cmds:
            cmd = [files.get(a, a) for a in cmd]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                err = r.stderr.strip()[-2000:]
                raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode})"
                                   + (f":\n{err}" if err else ""))
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        _write_beside(_sha_file(out), (digest + "\n").encode())
        os.replace(tmp, out)
    finally:
        for f in (tmp, obj):
            if os.path.exists(f):
                os.unlink(f)
    return out


def open_library(cc: str, source: Path = SOURCE, stem: str = "cpu_amx") -> ctypes.CDLL:
    """Build (or find in the cache) and load a C library; raises UnsafeCacheDir, OSError,
    RuntimeError or SubprocessError with the reason."""
    path = _build(cc, source, stem)
    if not verified(path):  # replaced between the build and now
        raise RuntimeError(f"{path} does not match its recorded sha256; not loaded")
    return ctypes.CDLL(str(path))


def load_for_cpu(source: Path, stem: str, needs: tuple[str, ...]) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library built from ``source``, None) or (None, why not): ``FASTMTP_CPU_KERNELS=off``,
    a CPU without one of ``needs``, no C compiler, a refused cache folder or a failed build (the
    last two logged). Shared by this module and core/cpu_attention.py."""
    if os.environ.get(ENV, "auto") == "off":
        return None, f"{ENV}=off"
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None, "no C compiler (gcc) on PATH"
    try:
        return open_library(cc, source, stem), None
    except UnsafeCacheDir as e:
        why = f"refusing the kernel cache: {e}"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = f"building the kernel failed: {e}"
    log.warning("%s: %s; PyTorch's kernels are used instead", stem, why)
    return None, why


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    lib, why = load_for_cpu(SOURCE, "cpu_amx", NEEDS)
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
    lib.fastmtp_amx_init.restype = ctypes.c_int
    if lib.fastmtp_amx_init() != 0:
        return None, "the OS refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return lib, None


class Once:
    """A library loaded on first use, once per process: ``get()`` is it or None, ``why()`` the
    reason it is not there; ``state`` ({"lib", "why"} once loaded) is what tests replace."""

    def __init__(self, load):
        self.load, self.state, self.lock = load, {}, threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if "lib" in self.state:
            return self.state["lib"]
        with self.lock:
            if "lib" not in self.state:
                self.state["lib"], self.state["why"] = self.load()
            return self.state["lib"]

    def why(self) -> str | None:
        self.get()
        return self.state.get("why")


_once = Once(lambda: _load())
_state = _once.state


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (then :func:`unavailable_reason` says why). Built once per
    source, compiler and flags, loaded once per process (a failure is logged once)."""
    return _once.get()


def available() -> bool:
    return library() is not None


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
        raise RuntimeError(f"cpu_amx is unavailable: {unavailable_reason()}")
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


# -- the elementwise steps of a bf16 decoder layer (one call each; transformers' roundings) ----

def _rows(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous bf16 CPU tensor, got {t.dtype} {t.device}")


def add_rms_(x: torch.Tensor, d: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out: torch.Tensor) -> torch.Tensor:
    """``x += d`` in place (when ``d``), then ``out = weight * bf16(x * rsqrt(mean(x^2) + eps))``
    (Llama's residual add and RMSNorm). x, d, out [N, H]; returns ``out``."""
    for t, n in ((x, "x"), (out, "out"), (weight, "weight")) + (((d, "d"),) if d is not None else ()):
        _rows(t, n)
    N, H = x.shape
    library().fastmtp_add_rms_bf16(x.data_ptr(), d.data_ptr() if d is not None else None,
                                   weight.data_ptr(), out.data_ptr(), N, H, float(eps))
    return out


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotary embedding of the first ``heads`` heads of every row of ``qkv`` [N, W], in place;
    ``cos``, ``sin`` [N, head_dim]."""
    for t, n in ((qkv, "qkv"), (cos, "cos"), (sin, "sin")):
        _rows(t, n)
    if head_dim > 512 or heads * head_dim > qkv.shape[1]:
        raise ValueError(f"{heads} heads of {head_dim} do not fit rows of {qkv.shape[1]}")
    library().fastmtp_rope_bf16(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[0],
                                heads, head_dim, qkv.shape[1])


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``bf16(silu(g)) * u`` for ``gu`` = [g | u] [N, 2I] -> [N, I]."""
    _rows(gu, "gu")
    N, I2 = gu.shape
    out = torch.empty(N, I2 // 2, dtype=torch.bfloat16)
    library().fastmtp_silu_mul_bf16(gu.data_ptr(), out.data_ptr(), N, I2 // 2)
    return out
