"""The vLLM launch command (fastmtp_sglang.serving.vllm_launch): pure, no vLLM needed.

The same command checked against vLLM's own argument parser: tests/test_vllm.py (marker vllm).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.serving.vllm_launch import DEFAULT_KV_CACHE_BYTES, build_vllm_command, cpu_preload, vocab_env

SHIPPED = str(Path(__file__).resolve().parents[1] / "fastmtp_sglang" / "data" / "heads"
              / "smollm2-135m-fastmtp-k3")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_command_with_draft():
    argv, env = build_vllm_command("/models/t", SHIPPED, 3, 8123, "127.0.0.1", ["--enforce-eager"],
                                   dtype="float32")
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/t"]
    spec = json.loads(_flag(argv, "--speculative-config"))
    assert spec["method"] == "eagle" and spec["num_speculative_tokens"] == 3
    assert spec["model"].endswith("smollm2-135m-fastmtp-k3") and spec["model"].startswith("/")
    assert _flag(argv, "--port") == "8123" and _flag(argv, "--dtype") == "float32"
    assert _flag(argv, "--kv-cache-memory-bytes") == str(DEFAULT_KV_CACHE_BYTES)
    assert argv[-1] == "--enforce-eager" and env == {}


def test_k0_has_no_speculation_and_needs_no_draft():
    argv, env = build_vllm_command("/models/t", None, 0, 8000, "0.0.0.0")
    assert "--speculative-config" not in argv and env == {}


def test_user_sized_kv_cache_is_kept():
    argv, _ = build_vllm_command("/m", SHIPPED, 2, 8000, "h", ["--gpu-memory-utilization", "0.3"])
    assert "--kv-cache-memory-bytes" not in argv


@pytest.mark.parametrize("extra", [["--port", "1"], ["--speculative-config={}"], ["-sc", "{}"],
                                   ["--dtype", "half"], ["--model", "x"]])
def test_owned_flags_refused(extra):
    with pytest.raises(FastMTPError, match="fastmtp sets"):
        build_vllm_command("/m", SHIPPED, 3, 8000, "h", extra)


def test_bad_steps_and_drafts(tmp_path):
    with pytest.raises(FastMTPError, match="--steps must be >= 0"):
        build_vllm_command("/m", SHIPPED, -1, 8000, "h")
    with pytest.raises(FastMTPError, match="needs --draft"):
        build_vllm_command("/m", None, 3, 8000, "h")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FastMTPError, match="not a FastMTP draft directory"):
        build_vllm_command("/m", tmp_path, 3, 8000, "h")
    with pytest.raises(FastMTPError):
        build_vllm_command("/m", tmp_path / "missing", 3, 8000, "h")


def test_vocab_one_global_table_or_refusal():
    assert vocab_env(None) is None and vocab_env("full") == "full"
    assert vocab_env("builtin:smollm2/en-16384") == "builtin:smollm2/en-16384"
    _, env = build_vllm_command("/m", SHIPPED, 3, 8000, "h", vocab="builtin:smollm2/en-16384")
    assert env == {"FASTMTP_VLLM_VOCAB": "builtin:smollm2/en-16384"}
    for per_request in ("auto", "builtin:smollm2/en-16384,builtin:smollm2/zh-4096"):
        with pytest.raises(FastMTPError, match="per request"):
            vocab_env(per_request)
    with pytest.raises(FastMTPError, match="needs a draft"):
        build_vllm_command("/m", None, 0, 8000, "h", vocab="builtin:smollm2/en-16384")


def test_cpu_build_preloads_intel_openmp_unless_ld_preload_is_set(tmp_path):
    (tmp_path / "lib").mkdir()
    lib = tmp_path / "lib" / "libiomp5.so"
    lib.write_bytes(b"\x7fELF")
    linux = dict(machine="x86_64", system="linux")
    assert cpu_preload({}, tmp_path, True, **linux) == {"LD_PRELOAD": str(lib)}
    assert cpu_preload({"LD_PRELOAD": ""}, tmp_path, True, **linux) == {}  # the user's, even empty
    assert cpu_preload({"LD_PRELOAD": "/x/libtcmalloc.so"}, tmp_path, True, **linux) == {}
    assert cpu_preload({}, tmp_path, False, **linux) == {}  # a GPU build: nothing
    assert cpu_preload({}, tmp_path, True, machine="aarch64", system="linux") == {}
    assert cpu_preload({}, tmp_path, True, machine="x86_64", system="darwin") == {}
    lib.unlink()
    assert cpu_preload({}, tmp_path, True, **linux) == {}  # no runtime to preload


def test_k0_mode_of_the_vllm_plugin(monkeypatch):
    """$FASTMTP_VLLM_K0 (vllm_models/k0.py): kv by default, full on request, anything else a
    clear error (raised at install, so vLLM stops at start with the message)."""
    from fastmtp_sglang.vllm_models import k0

    monkeypatch.delenv(k0.MODE_ENV, raising=False)
    assert k0.mode() == "kv"
    for value, want in (("full", "full"), (" KV ", "kv"), ("", "kv")):
        monkeypatch.setenv(k0.MODE_ENV, value)
        assert k0.mode() == want
    monkeypatch.setenv(k0.MODE_ENV, "skip")
    with pytest.raises(FastMTPError, match="use 'kv'.*or 'full'"):
        k0.mode()
