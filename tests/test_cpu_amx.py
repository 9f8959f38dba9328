"""The engine's bf16 CPU kernels (core/cpu_amx.py): the AMX small-rows linear against a
float64 reference over odd shapes, with a bound from bf16's rounding and fp32 accumulation; a
row's result independent of the other rows and of the thread count; the fused elementwise steps
against PyTorch's own ops (skipped, with the reason, on CPUs without AMX); and the build, on any
CPU: cached by source, compiler and flags, atomic, refused cleanly; a cache folder another user
could write is refused, and a library whose bytes do not match its recorded sha256 is never
loaded."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fastmtp_sglang.core import cpu_amx as ck

needs_kernels = pytest.mark.skipif(not ck.available(), reason=f"cpu kernels: {ck.unavailable_reason()}")
bf = torch.bfloat16


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Half a bf16 step of the result, plus fp32 accumulation over K terms of |x| |w|."""
    K = x.shape[-1]
    return ref.abs() * 2.0 ** -8 + K * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T) + 1e-30


@needs_kernels
@pytest.mark.parametrize("N,K", [(1, 32), (5, 7), (16, 64), (17, 33), (40, 100), (960, 576), (576, 1536)])
@pytest.mark.parametrize("M", [1, 3, 16, 17, 40])
def test_linear_matches_float64_within_rounding(N, K, M):
    g = torch.Generator().manual_seed(N * 1000 + K * 10 + M)
    w = torch.randn(N, K, generator=g).to(bf)
    b = torch.randn(N, generator=g).to(bf)
    x = torch.randn(M, K, generator=g).to(bf)
    p = ck.pack(w)
    for bias in (None, b):
        y = ck.linear(x, p, bias)
        assert y.shape == (M, N) and y.dtype == bf
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        err = (y.double() - ref).abs()
        assert bool((err <= _bound(x, w, ref)).all()), float((err / _bound(x, w, ref)).max())


@needs_kernels
def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 96, generator=g).to(bf)
    x = torch.randn(37, 96, generator=g).to(bf)
    p = ck.pack(w)
    full = ck.linear(x, p)
    for m in (0, 15, 16, 36):
        assert torch.equal(ck.linear(x[m:m + 1], p), full[m:m + 1])
    assert torch.equal(ck.linear(x[3:20], p), full[3:20])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ck.linear(x, p), full)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_inputs_of_any_layout_and_leading_shape():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=g).to(bf)
    p = ck.pack(w)
    x = torch.randn(2, 3, 128, generator=g).to(bf)[..., ::2]   # not contiguous
    y = ck.linear(x, p)
    assert y.shape == (2, 3, 48)
    assert torch.equal(y, ck.linear(x.contiguous(), p))
    assert ck.linear(torch.empty(0, 64, dtype=bf), p).shape == (0, 48)


@needs_kernels
def test_bad_input_is_refused_with_the_reason():
    p = ck.pack(torch.randn(8, 32).to(bf))
    with pytest.raises(ValueError, match="32 inputs"):
        ck.linear(torch.randn(2, 31).to(bf), p)
    with pytest.raises(ValueError, match="bf16"):
        ck.linear(torch.randn(2, 32), p)
    with pytest.raises(ValueError, match="2-D bf16"):
        ck.pack(torch.randn(8, 32))


@needs_kernels
def test_add_rms_equals_llamas_residual_add_and_rmsnorm():
    g = torch.Generator().manual_seed(3)
    for N, H in ((1, 576), (7, 64), (33, 100)):
        x = (torch.randn(N, H, generator=g) * 3).to(bf)
        d = torch.randn(N, H, generator=g).to(bf)
        w = torch.randn(H, generator=g).to(bf)
        for delta in (None, d):
            r = x + delta if delta is not None else x
            hf = r.float()
            ref = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf)
            xx, out = x.clone(), torch.empty_like(x)
            ck.add_rms_(xx, delta, w, 1e-5, out)
            assert torch.equal(xx, r)
            # fp32 statistics summed in another order: at most one bf16 step apart, rarely
            diff = (out.float() - ref.float()).abs()
            assert bool((diff <= ref.float().abs() * 2.0 ** -7 + 1e-6).all())
            assert (out == ref).float().mean() > 0.99


@needs_kernels
def test_rope_and_silu_mul_equal_pytorchs_ops():
    g = torch.Generator().manual_seed(4)
    N, D, nh, nkv = 5, 64, 9, 3
    qkv = torch.randn(N, (nh + 2 * nkv) * D, generator=g).to(bf)
    cos, sin = torch.randn(N, D, generator=g).to(bf), torch.randn(N, D, generator=g).to(bf)
    qk = qkv[:, : (nh + nkv) * D].view(N, nh + nkv, D)
    rot = torch.cat((-qk[..., D // 2:], qk[..., : D // 2]), -1)
    ref = qk * cos[:, None] + rot * sin[:, None]
    got = qkv.clone()
    ck.rope_(got, cos, sin, nh + nkv, D)
    assert torch.equal(got[:, : (nh + nkv) * D].view(N, nh + nkv, D), ref)
    assert torch.equal(got[:, (nh + nkv) * D:], qkv[:, (nh + nkv) * D:])   # v untouched
    gu = (torch.randn(N, 2 * 80, generator=g) * 4).to(bf)
    ref = F.silu(gu[:, :80]) * gu[:, 80:]
    out = ck.silu_mul(gu)
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2.0 ** -7 + 1e-6).all()) and (out == ref).float().mean() > 0.99
    with pytest.raises(ValueError, match="contiguous bf16"):
        ck.silu_mul(gu.float())


# -- the build and its cache: nothing another user could have written is ever loaded ----------

LOGGER = "fastmtp_sglang.core.cpu_amx"
has_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on PATH")


@pytest.fixture
def amx_cpu(tmp_path, monkeypatch):
    """A cache under tmp_path and a CPU that reports every flag the kernel needs (so the build
    path runs on any machine); returns the kernel folder."""
    monkeypatch.setenv("FASTMTP_CACHE", str(tmp_path))
    monkeypatch.setenv(ck.ENV, "auto")
    monkeypatch.setattr(ck, "cpu_flags", lambda: frozenset(ck.NEEDS))
    return tmp_path / "kernels"


class FakeLib:
    """What ctypes.CDLL returns, for the load path without a real AMX library."""

    def __init__(self):
        self.fastmtp_amx_init = lambda: 0

    def __getattr__(self, name):
        return SimpleNamespace()


@pytest.fixture
def loads(monkeypatch):
    """Every path ctypes.CDLL is asked to load, in order (a FakeLib comes back)."""
    seen: list[str] = []

    def cdll(path, *a, **kw):
        seen.append(str(path))
        return FakeLib()

    monkeypatch.setattr(ck.ctypes, "CDLL", cdll)
    return seen


def test_build_is_cached_refused_cleanly_and_never_half_written(amx_cpu, monkeypatch):
    monkeypatch.setenv(ck.ENV, "off")
    assert ck._load() == (None, f"{ck.ENV}=off")
    monkeypatch.setenv(ck.ENV, "auto")
    monkeypatch.setattr(ck, "cpu_flags", lambda: frozenset({"avx2"}))
    lib, why = ck._load()
    assert lib is None and why.startswith("the CPU lacks")
    monkeypatch.setattr(ck, "cpu_flags", lambda: frozenset(ck.NEEDS))
    monkeypatch.setenv("CC", "/bin/false")   # a compiler that fails
    lib, why = ck._load()
    assert lib is None and why.startswith("building the kernel failed")
    assert not list(amx_cpu.glob("*")), "a failed build left a file behind"


def test_cache_dir_is_created_private(amx_cpu):
    ck.private_dir(amx_cpu)
    assert stat.S_IMODE(os.lstat(amx_cpu).st_mode) & 0o077 == 0   # 0700 (less under a umask)


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o777], ids=lambda m: f"{m:o}")
def test_a_dir_others_can_write_is_refused(amx_cpu, monkeypatch, loads, mode):
    amx_cpu.mkdir()
    os.chmod(amx_cpu, mode)
    with pytest.raises(ck.UnsafeCacheDir, match="writable by group or others"):
        ck.private_dir(amx_cpu)
    monkeypatch.setenv("CC", "/bin/false")
    lib, why = ck._load()
    assert lib is None and why.startswith("refusing the kernel cache") and "chmod 700" in why
    assert loads == [] and not list(amx_cpu.glob("*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_dir_owned_by_another_user_is_refused(amx_cpu, monkeypatch, loads):
    amx_cpu.mkdir(mode=0o700)
    os.chown(amx_cpu, 12345, 12345)
    with pytest.raises(ck.UnsafeCacheDir, match="owned by uid 12345"):
        ck.private_dir(amx_cpu)
    monkeypatch.setenv("CC", "/bin/false")
    lib, why = ck._load()
    assert lib is None and "owned by uid 12345" in why and loads == []


def test_a_symlinked_dir_is_refused(amx_cpu, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    amx_cpu.symlink_to(elsewhere)
    with pytest.raises(ck.UnsafeCacheDir, match="not a folder"):
        ck.private_dir(amx_cpu)


@pytest.mark.parametrize("sidecar", ["wrong sha", "no sha", "right sha"])
def test_a_planted_library_loads_only_with_its_sha(amx_cpu, monkeypatch, loads, sidecar):
    """A file under the right name is loaded only when its bytes match the sha256 beside it
    (the compiler fails, so nothing would replace it)."""
    monkeypatch.setenv("CC", "/bin/false")
    path, _ = ck._library_path("/bin/false")
    ck.private_dir(path.parent)
    path.write_bytes(b"\x7fELF planted")
    if sidecar != "no sha":
        body = b"\x7fELF planted" if sidecar == "right sha" else b"something else"
        ck._sha_file(path).write_text(hashlib.sha256(body).hexdigest() + "\n")
    lib, why = ck._load()
    if sidecar == "right sha":   # the control: the load path is reached and takes this file
        assert isinstance(lib, FakeLib) and why is None and loads == [str(path)]
    else:
        assert lib is None and why.startswith("building the kernel failed") and loads == []


def test_flags_compiler_and_source_are_in_the_key(amx_cpu, monkeypatch):
    monkeypatch.setattr(ck, "_compiler_id", lambda cc: "/usr/bin/gcc\ngcc 12.2.0")
    base, _ = ck._library_path("gcc")
    assert ck._library_path("gcc")[0] == base   # stable
    monkeypatch.setattr(ck, "CFLAGS", ("-O2", "-fPIC", "-fopenmp"))
    assert ck._library_path("gcc")[0] != base
    cmds = ck._commands("gcc", None)
    key = ck.cache_key(b"src", "gcc 12", cmds)
    assert ck.cache_key(b"src", "gcc 13", cmds) != key
    assert ck.cache_key(b"src2", "gcc 12", cmds) != key
    assert ck.cache_key(b"src", "gcc 12", ck._commands("gcc", "/lib/libgomp.so.1")) != key


def test_a_failed_build_is_logged_once(amx_cpu, monkeypatch, caplog):
    monkeypatch.setattr(ck._once, "state", {})
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ck.library() is None and ck.library() is None and not ck.available()
    why = ck.unavailable_reason()
    assert why.startswith("building the kernel failed")
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(msgs) == 1 and why in msgs[0], msgs


@has_gcc
def test_real_build_is_cached_and_a_mismatch_is_rebuilt(amx_cpu):
    first = ck._build("gcc")
    assert ck.verified(first) and stat.S_IMODE(os.lstat(first.parent).st_mode) & 0o077 == 0
    ino = os.lstat(first).st_ino
    assert ck._build("gcc") == first and os.lstat(first).st_ino == ino   # the cached file
    good = first.read_bytes()
    first.write_bytes(b"\x7fELF planted")         # right name, wrong bytes: rebuilt
    assert not ck.verified(first)
    assert ck._build("gcc") == first and ck.verified(first) and first.read_bytes() == good
    assert sorted(p.name for p in amx_cpu.iterdir()) == [first.name, first.name + ".sha256"]
