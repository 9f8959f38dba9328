"""launch/serve_sglang.sh and launch/serve_vllm.sh read their command line through one parser
(launch/serve_args.sh): TARGET DRAFT [K] [-- extra flags]. Each script is run with PYTHON set to
a stub that prints the argv it would exec, so no engine is needed: the usage on too few
arguments (exit 2), K's default of 3, an explicit K, K = 0 without speculation, and extra
flags passed through unchanged (spaces kept).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.fixture
def echo_python(tmp_path):
    """A PYTHON that prints its arguments, one a line, instead of starting a server."""
    stub = tmp_path / "python"
    stub.write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n")
    stub.chmod(0o755)
    return stub


def run(script: str, *args: str, python: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PORT": "1234", "HOST": "127.0.0.9"}
    if python is not None:
        env["PYTHON"] = str(python)
    return subprocess.run(["bash", str(LAUNCH / script), *args], env=env, text=True,
                          capture_output=True, timeout=60)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("script", ["serve_sglang.sh", "serve_vllm.sh"])
def test_usage_on_too_few_arguments(script):
    res = run(script, "only-a-target")
    assert res.returncode == 2
    lines = res.stdout.splitlines()
    # the script's header comment, without its '# ' and up to the first line of code
    assert lines[0].startswith("Serve a target model with a FastMTP draft head")
    assert any(line.strip().startswith(f"launch/{script} TARGET DRAFT [K]") for line in lines)
    assert not any(line.startswith("#") or "set -euo" in line for line in lines)


def test_sglang_default_k_and_extra_flags(echo_python, tmp_path):
    res = run("serve_sglang.sh", "my-target", "my-draft", "--", "--mem-fraction-static", "0.5",
              "--x", "a b", python=echo_python)
    assert res.returncode == 0, res.stderr
    argv = res.stdout.splitlines()
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "my-target"
    assert flag(argv, "--host") == "127.0.0.9" and flag(argv, "--port") == "1234"
    assert flag(argv, "--speculative-draft-model-path") == "my-draft"
    assert flag(argv, "--speculative-num-steps") == "3"
    assert flag(argv, "--speculative-num-draft-tokens") == "4"
    assert argv[-4:] == ["--mem-fraction-static", "0.5", "--x", "a b"]


def test_sglang_explicit_k_and_k0(echo_python):
    argv = run("serve_sglang.sh", "t", "d", "5", python=echo_python).stdout.splitlines()
    assert flag(argv, "--speculative-num-steps") == "5"
    assert flag(argv, "--speculative-num-draft-tokens") == "6"
    plain = run("serve_sglang.sh", "t", "d", "0", "--", "--dtype", "bfloat16",
                python=echo_python).stdout.splitlines()
    assert not any(a.startswith("--speculative") for a in plain)
    assert plain[-2:] == ["--dtype", "bfloat16"]


def test_vllm_k_and_extra_flags(echo_python, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    argv = run("serve_vllm.sh", "t", str(draft), "2", "--", "--dtype", "float32",
               python=echo_python).stdout.splitlines()
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == "t"
    spec = flag(argv, "--speculative-config")
    assert f'"model": "{draft}"' in spec and '"num_speculative_tokens": 2' in spec
    assert argv[-2:] == ["--dtype", "float32"]
    default = run("serve_vllm.sh", "t", str(draft), python=echo_python).stdout.splitlines()
    assert '"num_speculative_tokens": 3' in flag(default, "--speculative-config")
    plain = run("serve_vllm.sh", "t", "no-such-draft", "0", python=echo_python).stdout.splitlines()
    assert "--speculative-config" not in plain and plain[-1] == "1073741824"
