"""The reference server's options live in one object (``ServerOptions``): the CLI's flags take
their defaults and help from it, its checks name the flag, and the server holds its worker
(no subclassing, no reach into the worker's private names). No model is loaded here."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from fastmtp_sglang.cli import build_parser
from fastmtp_sglang.serving.options import OptionError, ServerOptions

SERVING = Path(__file__).resolve().parents[1] / "fastmtp_sglang" / "serving"


def _serve_action(dest: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    return next(a for a in sub._actions if a.dest == dest)


def test_serve_flags_take_default_and_help_from_the_options():
    args = build_parser().parse_args(["serve", "--target", "T"])
    assert ServerOptions.from_cli_args(args) == ServerOptions()
    for f in dataclasses.fields(ServerOptions):
        flag = f.metadata["flag"]
        if flag is None:
            continue
        action = _serve_action(flag.lstrip("-").replace("-", "_"))
        assert f.metadata["help"] in action.help, flag
        if isinstance(f.default, str):
            assert action.default == f.default and f"(default {f.default})" in action.help
        elif not isinstance(f.default, bool):
            shown = f.default / f.metadata["scale"]
            assert action.default == shown and f"(default {shown:g})" in action.help, flag


def test_flags_in_other_units_are_converted():
    args = build_parser().parse_args(["serve", "--target", "T", "--batch-window-ms", "250",
                                      "--max-body-mb", "0.5", "--port", "0", "--log-requests"])
    opts = ServerOptions.from_cli_args(args)
    assert opts.batch_window_s == 0.25 and opts.max_body_bytes == 1 << 19
    assert opts.port == 0 and opts.log_requests is True


@pytest.mark.parametrize("argv, message", [
    (["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    (["--max-body-mb", "0"], "--max-body-mb must be > 0, got 0.0"),
    (["--batch-window-ms", "-1"], "--batch-window-ms must be >= 0, got -1.0"),
    (["--read-timeout", "0"], "--read-timeout must be > 0, got 0.0"),
    (["--port", "70000"], "--port must be <= 65535, got 70000"),
])
def test_a_bad_flag_is_named_with_the_value_given(argv, message):
    args = build_parser().parse_args(["serve", "--target", "T", *argv])
    with pytest.raises(OptionError) as err:
        ServerOptions.from_cli_args(args)
    assert str(err.value) == message


def test_the_object_checks_itself_and_is_immutable():
    with pytest.raises(OptionError, match="max_batch must be >= 1, got 0"):
        ServerOptions(max_batch=0)
    with pytest.raises(OptionError, match="write_timeout_s must be > 0"):
        dataclasses.replace(ServerOptions(), write_timeout_s=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerOptions().max_batch = 3  # type: ignore[misc]


def test_distill_flags_take_their_defaults_from_distill_config():
    from fastmtp_sglang.training.distill_config import DistillConfig

    args = build_parser().parse_args(["distill", "--url", "http://x", "--prompts", "p",
                                      "--out", "o"])
    for f in dataclasses.fields(DistillConfig):
        if f.default is not dataclasses.MISSING and hasattr(args, f.name) \
                and f.name not in ("url", "target", "progress"):
            assert getattr(args, f.name) == f.default, f.name


def test_the_server_holds_its_worker_and_uses_its_public_face_only():
    """ReferenceServer is no EngineWorker; the HTTP modules touch no underscored name of the
    worker (``worker._x`` / ``srv.worker._x``) and the constructors take the options object."""
    from fastmtp_sglang.serving.app import ReferenceServer
    from fastmtp_sglang.serving.worker import EngineWorker

    assert not issubclass(ReferenceServer, EngineWorker)
    for name in ("app.py", "http_transport.py", "reference.py", "jobs.py"):
        tree = ast.parse((SERVING / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                base = node.value
                owner = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                assert owner != "worker", f"{name}:{node.lineno}: worker.{node.attr}"
    for cls in (ReferenceServer, EngineWorker):
        params = inspect.signature(cls).parameters
        assert "options" in params and "max_batch" not in params and "max_queue" not in params
