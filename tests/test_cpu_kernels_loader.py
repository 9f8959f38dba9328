"""The one loader of the CPU kernels' C code (cpu_kernels/loader.py), through the AMX kernel's
load path, on any CPU: the build is cached by source, compiler and flags, atomic, and refused
cleanly; a cache folder another user could write is refused, and a library whose bytes do not
match its recorded sha256 is never loaded."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from types import SimpleNamespace

import pytest

from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.cpu_kernels import loader

LOGGER = "fastmtp_sglang.cpu_kernels.loader"
has_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on PATH")


@pytest.fixture
def amx_cpu(tmp_path, monkeypatch):
    """A cache under tmp_path and a CPU that reports every flag the kernel needs (so the build
    path runs on any machine); returns the kernel folder."""
    monkeypatch.setenv("FASTMTP_CACHE", str(tmp_path))
    monkeypatch.setenv(loader.ENV, "auto")
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset(amx.NEEDS))
    return tmp_path / "kernels"


class FakeLib:
    """What ctypes.CDLL returns, for the load path without a real AMX library."""

    def __init__(self):
        self.fastmtp_amx_init = lambda: 0
        self.fastmtp_has_tiles = lambda: 1

    def __getattr__(self, name):
        return SimpleNamespace()


@pytest.fixture
def loads(monkeypatch):
    """Every path ctypes.CDLL is asked to load, in order (a FakeLib comes back)."""
    seen: list[str] = []

    def cdll(path, *a, **kw):
        seen.append(str(path))
        return FakeLib()

    monkeypatch.setattr(loader.ctypes, "CDLL", cdll)
    return seen


def test_build_is_cached_refused_cleanly_and_never_half_written(amx_cpu, monkeypatch):
    monkeypatch.setenv(loader.ENV, "off")
    assert amx._load() == (None, f"{loader.ENV}=off")
    monkeypatch.setenv(loader.ENV, "auto")
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx2"}))
    lib, why = amx._load()
    assert lib is None and why.startswith("the CPU lacks")
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset(amx.NEEDS))
    monkeypatch.setenv("CC", "/bin/false")   # a compiler that fails
    lib, why = amx._load()
    assert lib is None and why.startswith("building the kernel failed")
    assert not list(amx_cpu.glob("*")), "a failed build left a file behind"


def test_cache_dir_is_created_private(amx_cpu):
    loader.private_dir(amx_cpu)
    assert stat.S_IMODE(os.lstat(amx_cpu).st_mode) & 0o077 == 0   # 0700 (less under a umask)


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o777], ids=lambda m: f"{m:o}")
def test_a_dir_others_can_write_is_refused(amx_cpu, monkeypatch, loads, mode):
    amx_cpu.mkdir()
    os.chmod(amx_cpu, mode)
    with pytest.raises(loader.UnsafeCacheDir, match="writable by group or others"):
        loader.private_dir(amx_cpu)
    monkeypatch.setenv("CC", "/bin/false")
    lib, why = amx._load()
    assert lib is None and why.startswith("refusing the kernel cache") and "chmod 700" in why
    assert loads == [] and not list(amx_cpu.glob("*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_dir_owned_by_another_user_is_refused(amx_cpu, monkeypatch, loads):
    amx_cpu.mkdir(mode=0o700)
    os.chown(amx_cpu, 12345, 12345)
    with pytest.raises(loader.UnsafeCacheDir, match="owned by uid 12345"):
        loader.private_dir(amx_cpu)
    monkeypatch.setenv("CC", "/bin/false")
    lib, why = amx._load()
    assert lib is None and "owned by uid 12345" in why and loads == []


def test_a_symlinked_dir_is_refused(amx_cpu, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    amx_cpu.symlink_to(elsewhere)
    with pytest.raises(loader.UnsafeCacheDir, match="not a folder"):
        loader.private_dir(amx_cpu)


@pytest.mark.parametrize("sidecar", ["wrong sha", "no sha", "right sha"])
def test_a_planted_library_loads_only_with_its_sha(amx_cpu, monkeypatch, loads, sidecar):
    """A file under the right name is loaded only when its bytes match the sha256 beside it
    (the compiler fails, so nothing would replace it)."""
    monkeypatch.setenv("CC", "/bin/false")
    path, _ = loader._library_path("/bin/false", amx.SOURCE, "amx")
    loader.private_dir(path.parent)
    path.write_bytes(b"\x7fELF planted")
    if sidecar != "no sha":
        body = b"\x7fELF planted" if sidecar == "right sha" else b"something else"
        loader._sha_file(path).write_text(hashlib.sha256(body).hexdigest() + "\n")
    lib, why = amx._load()
    if sidecar == "right sha":   # the control: the load path is reached and takes this file
        assert isinstance(lib, FakeLib) and why is None and loads == [str(path)]
    else:
        assert lib is None and why.startswith("building the kernel failed") and loads == []


@pytest.mark.parametrize("flags,stem,defines", [
    (amx.NEEDS, "amx", ()),
    (amx.VECTOR_NEEDS, "amx_vector", ("FASTMTP_VECTOR",)),
], ids=["amx", "avx512-bf16-only"])
def test_the_build_follows_the_cpu(amx_cpu, monkeypatch, loads, flags, stem, defines):
    """A CPU with AMX loads the tiles' build; one with AVX-512 bf16 and no AMX the vector build
    (compiled with -DFASTMTP_VECTOR, cached under its own name); the compile command carries
    the define."""
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv("CC", "/bin/false")
    path, cmds = loader._library_path("/bin/false", amx.SOURCE, stem, defines)
    assert path.name.startswith(stem + "-")
    assert ("-DFASTMTP_VECTOR" in cmds[0]) == bool(defines)
    loader.private_dir(path.parent)
    path.write_bytes(b"\x7fELF planted")
    loader._sha_file(path).write_text(hashlib.sha256(b"\x7fELF planted").hexdigest() + "\n")
    lib, why = amx._load()
    assert isinstance(lib, FakeLib) and why is None and loads == [str(path)]


def test_refused_tiles_fall_back_to_the_vector_build(amx_cpu, monkeypatch, loads):
    """An AMX CPU whose OS refuses tile data (or whose tiles' build fails) loads the vector build."""
    monkeypatch.setenv("CC", "/bin/false")
    path, _ = loader._library_path("/bin/false", amx.SOURCE, "amx_vector", ("FASTMTP_VECTOR",))
    loader.private_dir(path.parent)
    path.write_bytes(b"\x7fELF vector")
    loader._sha_file(path).write_text(hashlib.sha256(b"\x7fELF vector").hexdigest() + "\n")
    lib, why = amx._load()   # the tiles' build fails (no compiler), the vector one is cached
    assert isinstance(lib, FakeLib) and why is None and loads == [str(path)]


def test_tiles_the_os_refuses_fall_back_to_the_vector_build(amx_cpu, monkeypatch, caplog):
    """The OS refuses AMX tile data (arch_prctl fails: the tiles' library says so at init): the
    vector build loads, says it has no tiles, and the refusal is logged."""
    monkeypatch.setenv("CC", "/bin/false")
    paths = {}
    for stem, defines in (("amx", ()), ("amx_vector", ("FASTMTP_VECTOR",))):
        path, _ = loader._library_path("/bin/false", amx.SOURCE, stem, defines)
        loader.private_dir(path.parent)
        path.write_bytes(stem.encode())
        loader._sha_file(path).write_text(hashlib.sha256(stem.encode()).hexdigest() + "\n")
        paths[stem] = str(path)
    seen = []

    def cdll(path, *a, **kw):
        seen.append(str(path))
        lib = FakeLib()
        tiles = str(path) == paths["amx"]
        lib.fastmtp_amx_init = lambda: -1 if tiles else 0
        lib.fastmtp_has_tiles = lambda: int(tiles)
        return lib

    monkeypatch.setattr(loader.ctypes, "CDLL", cdll)
    with caplog.at_level(logging.WARNING, logger="fastmtp_sglang.cpu_kernels.amx"):
        lib, why = amx._load()
    assert seen == [paths["amx"], paths["amx_vector"]] and why is None
    assert isinstance(lib, FakeLib) and lib.has_tiles is False
    assert any("refused AMX tile data" in r.getMessage() and "AVX-512 build" in r.getMessage()
               for r in caplog.records)


def test_flags_compiler_and_source_are_in_the_key(amx_cpu, monkeypatch):
    monkeypatch.setattr(loader, "_compiler_id", lambda cc: "/usr/bin/gcc\ngcc 12.2.0")
    base, _ = loader._library_path("gcc", amx.SOURCE, "amx")
    assert loader._library_path("gcc", amx.SOURCE, "amx")[0] == base   # stable
    monkeypatch.setattr(loader, "CFLAGS", ("-O2", "-fPIC", "-fopenmp"))
    assert loader._library_path("gcc", amx.SOURCE, "amx")[0] != base
    cmds = loader._commands("gcc", None)
    key = loader.cache_key(b"src", "gcc 12", cmds)
    assert loader.cache_key(b"src", "gcc 13", cmds) != key
    assert loader.cache_key(b"src2", "gcc 12", cmds) != key
    assert loader.cache_key(b"src", "gcc 12", loader._commands("gcc", "/lib/libgomp.so.1")) != key


def test_a_failed_build_is_logged_once(amx_cpu, monkeypatch, caplog):
    monkeypatch.setattr(amx._once, "state", {})
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert amx.library() is None and amx.library() is None and not amx.available()
    why = amx.unavailable_reason()
    assert why.startswith("building the kernel failed")
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # once per build tried: the tiles', then the vector build it falls back to
    assert [m.split(":")[0] for m in msgs] == ["amx", "amx_vector"], msgs
    assert msgs[0].endswith("the AVX-512 build is tried next") and msgs[1].endswith("used instead")
    assert all(part in m for part, m in zip(why.split("; "), msgs)), (why, msgs)


@has_gcc
def test_real_build_is_cached_and_a_mismatch_is_rebuilt(amx_cpu):
    first = loader._build("gcc", amx.SOURCE, "amx")
    assert loader.verified(first) and stat.S_IMODE(os.lstat(first.parent).st_mode) & 0o077 == 0
    ino = os.lstat(first).st_ino
    assert loader._build("gcc", amx.SOURCE, "amx") == first and os.lstat(first).st_ino == ino   # the cached file
    good = first.read_bytes()
    first.write_bytes(b"\x7fELF planted")         # right name, wrong bytes: rebuilt
    assert not loader.verified(first)
    assert loader._build("gcc", amx.SOURCE, "amx") == first and loader.verified(first) and first.read_bytes() == good
    assert sorted(p.name for p in amx_cpu.iterdir()) == [first.name, first.name + ".sha256"]
