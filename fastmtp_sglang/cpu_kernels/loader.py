"""Build and load the CPU kernels' C code: one loader for every C file of this folder.

A C file (``amx.c``, ``decode_attention.c``, with the headers beside them) is compiled with the
system's C compiler on first use (``gcc -O3 -fopenmp``, linked against the libgomp PyTorch
loaded, so no second thread pool competes for the cores; about a second) and cached under
``<cache>/kernels/`` (``<cache>``: ``$FASTMTP_CACHE`` or ``~/.cache/fastmtp``) by the hash of the
source, its headers, the compiler, its flags and that runtime.

Nothing another user could have written is ever loaded: the folder is made with mode 0700 and
refused (:class:`UnsafeCacheDir`) when another user owns it, it is a symlink, or group or others
may write it; the library's sha256 is stored beside it and checked before every load (a
mismatch is rebuilt, never loaded); a library is written beside its name and renamed into
place, so another process never loads half of one.

:func:`load_for_cpu` is the one entry point (a library, or why not: ``FASTMTP_CPU_KERNELS=off``,
a CPU without the flags a kernel needs, no compiler, a refused folder, a failed build; the last
two logged once); :class:`Once` keeps a kernel's library per process. Tested in
tests/test_cpu_kernels_loader.py.
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
from pathlib import Path

from fastmtp_sglang.core.hardware import cpu_flags

ENV = "FASTMTP_CPU_KERNELS"     # "auto" (default) or "off"

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


def _commands(cc: str, omp: str | None, defines: tuple[str, ...] = ()) -> list[list[str]]:
    """The compile and link command lines, with ``{src}``, ``{obj}`` and ``{out}`` for the
    files (``defines``: macros, ``-D<name>``, for a build of the source). Linked against the
    OpenMP runtime torch already has: a second libgomp in the process would keep its own
    spinning threads on the same cores."""
    return [[cc, *CFLAGS, *(f"-D{d}" for d in defines), "-c", "{src}", "-o", "{obj}"],
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


def _library_path(cc: str, source: Path, stem: str,
                  defines: tuple[str, ...] = ()) -> tuple[Path, list[list[str]]]:
    """Where the library built from ``source`` is cached (``<stem>-<key>.so``), and the commands
    that build it."""
    cmds = _commands(cc, _loaded_openmp(), defines)
    # (the headers beside it too: bf16.h, which both C files include, and amx_products.h)
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


def _build(cc: str, source: Path, stem: str, defines: tuple[str, ...] = ()) -> Path:
    """The kernel library for this source, compiler and flags: the cached one when its recorded
    sha256 matches, else built now (a mismatch is rebuilt, never loaded). ``stem``: the start of
    the library's file name."""
    out, cmds = _library_path(cc, source, stem, defines)
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


def open_library(cc: str, source: Path, stem: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or find in the cache) and load a C library; raises UnsafeCacheDir, OSError,
    RuntimeError or SubprocessError with the reason."""
    path = _build(cc, source, stem, defines)
    if not verified(path):  # replaced between the build and now
        raise RuntimeError(f"{path} does not match its recorded sha256; not loaded")
    return ctypes.CDLL(str(path))


def load_for_cpu(source: Path, stem: str, needs: tuple[str, ...], defines: tuple[str, ...] = (),
                 instead: str = "PyTorch's kernels are used instead",
                 ) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library built from ``source``, None) or (None, why not): ``FASTMTP_CPU_KERNELS=off``,
    a CPU without one of ``needs``, no C compiler, a refused cache folder or a failed build (the
    last two logged, with ``instead``: what runs in its place). Every kernel of this folder
    loads its C file through here; ``defines`` (macros) pick one build of a source (``stem``
    names it in the cache)."""
    if os.environ.get(ENV, "auto") == "off":
        return None, f"{ENV}=off"
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None, "no C compiler (gcc) on PATH"
    try:
        return open_library(cc, source, stem, defines), None
    except UnsafeCacheDir as e:
        why = f"refusing the kernel cache: {e}"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = f"building the kernel failed: {e}"
    log.warning("%s: %s; %s", stem, why, instead)
    return None, why


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
