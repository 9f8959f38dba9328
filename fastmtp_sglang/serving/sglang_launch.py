"""The SGLang launch command for a target with a FastMTP draft head (``fastmtp serve --engine sglang``).

    argv, env = build_launch_command("HuggingFaceTB/SmolLM2-135M-Instruct", "drafts/smollm2",
                                     steps=3, port=30000, host="127.0.0.1", extra_args=[])
    subprocess.Popen(argv, env={**os.environ, **env})
    wait_for_health("http://127.0.0.1:30000", timeout=600)

The command is ``python -m sglang.launch_server`` with SGLang 0.5.23's own flags (checked against
its ``ServerArgs`` parser in tests/test_sglang_model.py), one EAGLE chain of K drafts::

    --speculative-algorithm EAGLE --speculative-draft-model-path D
    --speculative-num-steps K --speculative-eagle-topk 1 --speculative-num-draft-tokens K+1

and ``SGLANG_EXTERNAL_MODEL_PACKAGE=fastmtp_sglang.models`` in the environment, so that every
process SGLang spawns (the schedulers load the draft) registers ``FastMTPForCausalLM``. ``--vocab``
reaches the draft model class the same way, as ``FASTMTP_SGLANG_VOCAB``.
``launch/serve_sglang.sh`` is the same command as a script to read and adapt.
"""

from __future__ import annotations

import os
import sys

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.serving.launch import (
    FULL_VOCAB, flag_name, format_command, local_or_id, preflight, print_command, read_fastmtp_config,
    refuse_owned_flags, require_draft, require_steps, run_child, table_env_ref, wait_for_health,
    wants_tables)

__all__ = ["MODEL_PACKAGE", "build_launch_command", "format_command", "run_sglang",
           "wait_for_health"]

MODEL_PACKAGE = "fastmtp_sglang.models"
PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
VOCAB_ENV = "FASTMTP_SGLANG_VOCAB"  # read by fastmtp_sglang.models.compressed_projection

# flags this command sets; passing them again in extra_args would silently fight ours
_OWNED_FLAGS = (
    "--model-path", "--host", "--port",
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens",
)
# a FastMTP head is one module reused K times by the stock worker (docs/design.md section 5.4)
_REFUSED_FLAGS = {"--enable-multi-layer-eagle": "FastMTP reuses one head for every step"}


def build_launch_command(
    target: str | os.PathLike,
    draft: str | os.PathLike | None,
    steps: int,
    port: int,
    host: str,
    extra_args: list[str] | tuple[str, ...] = (),
    vocab: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions that launch SGLang with a FastMTP draft.

    Parameters
    ----------
    target : the target model (directory or hub id), SGLang's ``--model-path``
    draft : a FastMTP draft directory; ignored when ``steps`` is 0
    steps : K, the draft tokens per cycle; 0 = a plain server without speculation (the K=0
        baseline of ``fastmtp bench``)
    port, host : where the HTTP server listens
    extra_args : further SGLang flags, passed through unchanged (say ``--mem-fraction-static
        0.8``); must not repeat a flag this function sets
    vocab : the draft vocabulary, picked per request inside SGLang (FASTMTP_SGLANG_VOCAB for the
        draft model class). None: the draft directory's own tables (``fastmtp.vocab_tables``)
        if it lists any, else the full vocabulary; ``"full"`` / ``"none"``: the full
        vocabulary; ``"auto"``: the draft's tables, else the shipped tables for the target's
        tokenizer; otherwise comma-separated table files or ``builtin:`` refs. SGLang's global
        ``--speculative-token-map`` can be passed in ``extra_args`` (it replaces the tables).

    Returns
    -------
    argv : list[str], starting with this Python interpreter
    env : dict[str, str], variables to add to the current environment (not a full environment)

    Raises
    ------
    FastMTPError
        Bad K, a missing or foreign draft directory, a conflicting flag or environment variable.
    """
    require_steps(steps)
    if steps == 0 and wants_tables(vocab):
        raise FastMTPError(f"--vocab {vocab}: a compressed draft vocabulary needs a draft "
                           "(--steps > 0 and --draft DIR)")
    vocab_env = _vocab_env(vocab) if steps > 0 else None
    extra = [str(a) for a in extra_args]
    refuse_owned_flags(extra, _OWNED_FLAGS, "SGLang")
    for arg in extra:
        if flag_name(arg) in _REFUSED_FLAGS:
            raise FastMTPError(f"{flag_name(arg)} is not for FastMTP heads: {_REFUSED_FLAGS[flag_name(arg)]}")

    argv = [sys.executable, "-m", "sglang.launch_server",
            "--model-path", local_or_id(target), "--host", str(host), "--port", str(int(port))]
    env: dict[str, str] = {}
    if steps > 0:
        require_draft(draft)
        read_fastmtp_config(draft)
        argv += [
            "--speculative-algorithm", "EAGLE",
            "--speculative-draft-model-path", local_or_id(draft),
            "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", "1",  # a chain: one head, K steps, no tree
            "--speculative-num-draft-tokens", str(steps + 1),
        ]
        current = os.environ.get(PACKAGE_ENV)
        if current not in (None, "", MODEL_PACKAGE):
            raise FastMTPError(
                f"{PACKAGE_ENV} is already set to {current!r}; SGLang takes one external package. "
                f"Unset it, or install fastmtp-sglang so its sglang.srt.plugins entry point "
                "registers FastMTPForCausalLM")
        env[PACKAGE_ENV] = MODEL_PACKAGE
        if vocab_env is not None:
            env[VOCAB_ENV] = vocab_env
    return argv + extra, env


def _vocab_env(vocab: str | None) -> str | None:
    """``--vocab`` as the value of FASTMTP_SGLANG_VOCAB (None: leave the draft's default)."""
    if vocab is None:
        return None
    spec = str(vocab).strip()
    if spec.lower() in FULL_VOCAB:
        return "full"
    if spec.lower() == "auto":
        return "auto"
    refs = [table_env_ref(ref, " (give table files or builtin:<tokenizer>/<lang>-<N> refs, full, "
                          "or auto)")
            for ref in (r.strip() for r in spec.split(",")) if ref]
    if not refs:
        raise FastMTPError(f"--vocab {vocab!r}: no table given")
    return ",".join(refs)


def run_sglang(target: str, draft: str | None, steps: int, port: int, host: str, extra: list[str],
               vocab: str | None = None) -> int:
    """``fastmtp serve --engine sglang``: print the command, run SGLang's server as a child
    (Ctrl-C stops it) and return its exit code (parameters as :func:`build_launch_command`)."""
    preflight(target, host, port)  # before SGLang loads anything
    cmd, env = build_launch_command(target, draft, steps, port, host, extra, vocab=vocab)
    print_command(cmd, env, "SGLang", host, port)
    return run_child(cmd, env)
