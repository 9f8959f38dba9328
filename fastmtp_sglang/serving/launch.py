"""What the SGLang and vLLM launch commands share (``fastmtp serve --engine sglang|vllm``).

The engine modules (fastmtp_sglang.serving.sglang_launch, fastmtp_sglang.serving.vllm_launch)
build their own argv from these pieces: paths made absolute when they exist here (the server
may start elsewhere), the checks on K, the draft directory and the extra arguments, one
``--vocab`` table ref as the engine processes read it from the environment, the command as one
shell line, and the two ways of running it (a child whose Ctrl-C is forwarded, or ``exec``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from fastmtp_sglang.serving.client import wait_for_health  # re-exported: one implementation of the poll
from fastmtp_sglang.core.errors import FastMTPError

__all__ = ["FULL_VOCAB", "exec_child", "flag_name", "format_command", "local_or_id",
           "print_command", "read_fastmtp_config", "refuse_owned_flags", "require_draft",
           "require_free_port", "require_steps", "require_target", "run_child", "table_env_ref",
           "wants_tables", "wait_for_health"]

FULL_VOCAB = ("none", "full")  # --vocab values meaning the full vocabulary


def flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def local_or_id(path: str | os.PathLike) -> str:
    """Absolute path when it exists here (the server may start elsewhere), else as given (a hub id)."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else str(path)


def require_target(target: str | os.PathLike) -> None:
    """Refuse, before anything starts, a ``--target`` written as a local path (absolute, ``.``,
    ``~``, or more than one ``/``) that does not exist; ``org/name`` and ``name`` may be hub ids,
    which SGLang and vLLM fetch themselves."""
    text = str(target)
    p = Path(text).expanduser()
    if p.exists():
        if not p.is_dir():
            raise FastMTPError(f"--target {text} is a file; give the model's directory (its "
                               "config.json, weights and tokenizer)")
        return
    if p.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1:
        raise FastMTPError(f"--target {text}: no such directory; give a local model directory "
                           "or a hub id (org/name)")


def require_free_port(host: str, port: int) -> None:
    """Refuse, before a server loads anything, a port something here already listens on (the
    engine would otherwise find out after minutes of loading weights)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise FastMTPError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; stop what "
                               "holds it, or pick another --port") from None


def preflight(target: str | os.PathLike, host: str, port: int) -> None:
    """What SGLang and vLLM would find out only after loading: a local ``--target`` that does not
    exist, a port out of range or already taken (0 = any free port)."""
    require_target(target)
    if not 0 <= port <= 65535:
        raise FastMTPError(f"--port must be in 0..65535, got {port}")
    if port:
        require_free_port(host, port)


def require_steps(steps: int) -> None:
    if steps < 0:
        raise FastMTPError(f"--steps must be >= 0 (0 = no speculation), got {steps}")


def refuse_owned_flags(extra: list[str], owned: tuple[str, ...], engine: str,
                       sources: str = "--target/--draft/--steps/--port/--host") -> None:
    """Refuse extra arguments that repeat a flag the command sets (they would silently fight
    ours); ``engine`` names the server in the message, ``sources`` the fastmtp flags."""
    clashes = sorted({flag_name(a) for a in extra if flag_name(a) in owned})
    if clashes:
        raise FastMTPError(
            f"{', '.join(clashes)} in the extra {engine} arguments: fastmtp sets "
            f"{'this' if len(clashes) == 1 else 'these'} from {sources}")


def wants_tables(vocab: str | None) -> bool:
    """True when ``--vocab`` asks for draft vocabulary tables (not None, ``full`` or ``none``)."""
    return vocab is not None and str(vocab).strip().lower() not in FULL_VOCAB


def require_draft(draft: str | os.PathLike | None) -> None:
    if draft is None:
        raise FastMTPError("--steps > 0 needs --draft DIR (or --steps 0 to serve without drafts)")


def read_fastmtp_config(draft: str | os.PathLike) -> dict:
    """The draft directory's config.json; FastMTPError unless it has a ``fastmtp`` block."""
    from fastmtp_sglang.core.draft_dir import read_config

    cfg = read_config(draft)  # raises DraftFormatError naming what is wrong
    if "fastmtp" not in cfg:
        raise FastMTPError(f"{draft} is not a FastMTP draft directory (its config.json has no "
                           "'fastmtp' block); make one with `fastmtp convert` or `fastmtp init-head`")
    aux = cfg["fastmtp"].get("aux_hidden_states")
    if aux:  # the SGLang and vLLM model classes read the last hidden state only
        raise FastMTPError(f"{draft} reads the target's middle layers {aux} (aux_hidden_states): "
                           "serving such a head in SGLang or vLLM is not built yet; serve it with "
                           "the reference engine (`fastmtp serve --engine reference`)")
    return cfg


def table_env_ref(ref: str, hint: str = "") -> str:
    """One ``--vocab`` table ref as the engine processes read it from the environment: a
    ``builtin:`` ref as given, a file as its absolute path (they may start elsewhere).
    ``hint`` ends the message for a missing file."""
    from fastmtp_sglang.vocab.tables import resolve_table_ref

    path = resolve_table_ref(ref)  # raises for an unknown builtin: ref
    if ref.startswith("builtin:"):
        return ref
    if not path.is_file():
        raise FastMTPError(f"--vocab: vocab table {ref} does not exist{hint}")
    return str(path.resolve())  # the engine processes may start elsewhere


def format_command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """One shell line: ``VAR=value python -m sglang.launch_server ...``, quoted for copy-paste."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(prefix + [shlex.quote(a) for a in argv])


def print_command(cmd: list[str], env: dict[str, str], engine: str, host: str, port: int,
                  note: str = "") -> None:
    """`fastmtp serve`'s two lines before it starts a server: the command, and where it listens."""
    print("fastmtp serve: " + format_command(cmd, env), flush=True)
    print(f"fastmtp serve: {engine} will listen on http://{host}:{port}{note}", flush=True)


def run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run the server as a child process and wait; Ctrl-C terminates it (killed after 30 s).
    Returns its exit code."""
    proc = subprocess.Popen(cmd, env={**os.environ, **env})
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def exec_child(cmd: list[str], env: dict[str, str]) -> int:
    """Become the server (``os.execve``, after flushing stdout); returns 1 only if the exec
    itself fails."""
    sys.stdout.flush()
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 1
