"""`fastmtp serve --dtype`: auto by default (as `fastmtp demo` and `fastmtp bench`), resolved
before the engine starts, and said in a start line that names the dtype and that float32 is the
bit-exact choice. The CLI is parsed for real; the engines are replaced by stubs that record the
namespace they get (no model is loaded). The CPU's flags are injected, not read."""

from __future__ import annotations

import argparse

import pytest

from fastmtp_sglang.cli import build_parser, main
from fastmtp_sglang.cli import serve
from fastmtp_sglang.core import hardware

BF16_CPU = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2_CPU = frozenset({"avx2", "fma"})


@pytest.fixture
def engines(monkeypatch):
    """Stub engines: each records the namespace `fastmtp serve` hands it and returns 0."""
    from fastmtp_sglang.serving import vllm_launch

    got: dict[str, object] = {}

    def stub(name):
        def run(args, *rest):
            got[name] = args
            return 0
        return run

    def stub_vllm(target, draft, steps, port, host, extra, **kw):  # (explicit arguments)
        got["vllm"] = argparse.Namespace(target=target, draft=draft, steps=steps, port=port,
                                         host=host, extra=extra, **kw)
        return 0

    monkeypatch.setattr(serve, "cuda_available", lambda: False)
    monkeypatch.setattr(serve, "run_reference", stub("reference"))
    from fastmtp_sglang.serving import sglang_launch

    def stub_sglang(target, draft, steps, port, host, extra, **kw):  # (explicit arguments)
        got["sglang"] = argparse.Namespace(target=target, draft=draft, steps=steps, port=port,
                                           host=host, extra=extra, **kw)
        return 0

    monkeypatch.setattr(serve, "check_sglang_can_run", lambda: None)
    monkeypatch.setattr(sglang_launch, "run_sglang", stub_sglang)
    monkeypatch.setattr(vllm_launch, "run_vllm", stub_vllm)
    return got


def _cpu(monkeypatch, flags):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)


def test_default_is_auto_and_help_says_so():
    args = build_parser().parse_args(["serve", "--target", "T"])
    assert args.dtype == "auto"
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    help_text = next(a.help for a in sub._actions if a.dest == "dtype")
    assert "default auto" in help_text and "float32 = greedy output bit-equal" in help_text


@pytest.mark.parametrize("flags, picked, why", [
    (BF16_CPU, "bfloat16", "auto: this CPU has bf16 units"),
    (AVX2_CPU, "float32", "auto: no bf16 units on this CPU"),
])
def test_reference_start_line_names_the_auto_pick(monkeypatch, capsys, engines, flags, picked, why):
    _cpu(monkeypatch, flags)
    assert main(["serve", "--engine", "reference", "--target", "T", "--steps", "0"]) == 0
    assert engines["reference"].dtype == picked  # resolved before the engine sees it
    line = next(x for x in capsys.readouterr().out.splitlines() if "dtype" in x)
    assert line.startswith(f"fastmtp serve: dtype {picked} ({why}")
    if picked == "float32":
        assert "greedy output bit-equal to the target's own greedy decoding" in line
    else:
        assert "--dtype float32 gives output bit-equal to it" in line


def test_explicit_dtype_wins_over_the_cpu(monkeypatch, capsys, engines):
    _cpu(monkeypatch, BF16_CPU)
    assert main(["serve", "--engine", "reference", "--target", "T", "--steps", "0",
                 "--dtype", "float32"]) == 0
    assert engines["reference"].dtype == "float32"
    out = capsys.readouterr().out
    assert "dtype float32 (asked for with --dtype); greedy output bit-equal" in out


def test_cuda_device_is_bf16_whatever_the_cpu(monkeypatch, capsys, engines):
    _cpu(monkeypatch, AVX2_CPU)
    assert main(["serve", "--engine", "reference", "--target", "T", "--steps", "0",
                 "--device", "cuda"]) == 0
    assert engines["reference"].dtype == "bfloat16"
    assert "dtype bfloat16 (auto: CUDA)" in capsys.readouterr().out


def test_vllm_gets_the_resolved_dtype(monkeypatch, capsys, engines):
    """vLLM's own `--dtype auto` means the checkpoint's dtype; ours is resolved first, so vLLM
    gets a concrete name and the start line says it."""
    from fastmtp_sglang.serving.vllm_launch import build_vllm_command

    _cpu(monkeypatch, AVX2_CPU)
    assert main(["serve", "--engine", "vllm", "--target", "T", "--draft", "D", "--steps", "1"]) == 0
    args = engines["vllm"]
    assert args.dtype == "float32"
    assert "fastmtp serve: dtype float32 (auto: no bf16 units" in capsys.readouterr().out
    argv, _ = build_vllm_command(args.target, None, 0, args.port, args.host, dtype=args.dtype)
    assert argv[argv.index("--dtype") + 1] == "float32"


def test_sglang_is_not_told_a_dtype(monkeypatch, capsys, engines):
    """SGLang takes its own --dtype after `--`: serve neither resolves nor announces one."""
    _cpu(monkeypatch, BF16_CPU)
    assert main(["serve", "--engine", "sglang", "--target", "T", "--draft", "D"]) == 0
    assert "--dtype" not in engines["sglang"].extra and not hasattr(engines["sglang"], "dtype")
    assert "dtype" not in capsys.readouterr().out


def test_leaves_are_the_reference_engines_only(monkeypatch, capsys, engines):
    """--auto-width above 1 (leaves) on vLLM: refused with the flag named, before any launch."""
    _cpu(monkeypatch, AVX2_CPU)
    rc = main(["serve", "--engine", "vllm", "--target", "T", "--draft", "D", "--steps", "auto",
               "--auto-width", "3"])
    assert rc != 0 and "vllm" not in engines
    assert "--auto-width" in capsys.readouterr().err
