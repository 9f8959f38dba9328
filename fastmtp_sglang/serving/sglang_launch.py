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
import shlex
import sys
from pathlib import Path

from fastmtp_sglang.serving.client import wait_for_health  # re-exported: one implementation of the poll
from fastmtp_sglang.core.errors import FastMTPError

__all__ = ["MODEL_PACKAGE", "build_launch_command", "format_command", "wait_for_health"]

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
_FULL_VOCAB = ("none", "full")


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _local_or_id(path: str | os.PathLike) -> str:
    """Absolute path when it exists here (the server may start elsewhere), else as given (a hub id)."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else str(path)


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
    if steps < 0:
        raise FastMTPError(f"--steps must be >= 0 (0 = no speculation), got {steps}")
    if steps == 0 and vocab is not None and str(vocab).strip().lower() not in _FULL_VOCAB:
        raise FastMTPError(f"--vocab {vocab}: a compressed draft vocabulary needs a draft "
                           "(--steps > 0 and --draft DIR)")
    vocab_env = _vocab_env(vocab) if steps > 0 else None
    extra = [str(a) for a in extra_args]
    clashes = sorted({_flag_name(a) for a in extra if _flag_name(a) in _OWNED_FLAGS})
    if clashes:
        raise FastMTPError(
            f"{', '.join(clashes)} in the extra SGLang arguments: fastmtp sets "
            f"{'this' if len(clashes) == 1 else 'these'} from --target/--draft/--steps/--port/--host")
    for arg in extra:
        if _flag_name(arg) in _REFUSED_FLAGS:
            raise FastMTPError(f"{_flag_name(arg)} is not for FastMTP heads: {_REFUSED_FLAGS[_flag_name(arg)]}")

    argv = [sys.executable, "-m", "sglang.launch_server",
            "--model-path", _local_or_id(target), "--host", str(host), "--port", str(int(port))]
    env: dict[str, str] = {}
    if steps > 0:
        if draft is None:
            raise FastMTPError("--steps > 0 needs --draft DIR (or --steps 0 to serve without drafts)")
        from fastmtp_sglang.core.draft_dir import read_config

        cfg = read_config(draft)  # raises DraftFormatError naming what is wrong
        if "fastmtp" not in cfg:
            raise FastMTPError(f"{draft} is not a FastMTP draft directory (its config.json has no "
                               "'fastmtp' block); make one with `fastmtp convert` or `fastmtp init-head`")
        argv += [
            "--speculative-algorithm", "EAGLE",
            "--speculative-draft-model-path", _local_or_id(draft),
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
    if spec.lower() in _FULL_VOCAB:
        return "full"
    if spec.lower() == "auto":
        return "auto"
    from fastmtp_sglang.vocab.tables import resolve_table_ref

    refs = []
    for ref in (r.strip() for r in spec.split(",")):
        if not ref:
            continue
        path = resolve_table_ref(ref)  # raises for an unknown builtin: ref
        if not ref.startswith("builtin:"):
            if not path.is_file():
                raise FastMTPError(f"--vocab: vocab table {ref} does not exist (give table files "
                                   "or builtin:<tokenizer>/<lang>-<N> refs, full, or auto)")
            ref = str(path.resolve())  # the scheduler processes may start elsewhere
        refs.append(ref)
    if not refs:
        raise FastMTPError(f"--vocab {vocab!r}: no table given")
    return ",".join(refs)


def format_command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """One shell line: ``VAR=value python -m sglang.launch_server ...``, quoted for copy-paste."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(prefix + [shlex.quote(a) for a in argv])
