"""The reference server's options: every limit ``fastmtp serve --engine reference`` exposes, with
its default and its check, in one object (as uvicorn's ``Config`` and SGLang's ``ServerArgs``).

``ServerOptions`` is what ``EngineWorker`` and ``ReferenceServer`` take; the CLI only maps its
flags onto it (``add_cli_args`` makes the flags, their defaults and help from the fields below;
``from_cli_args`` builds the object back, and a bad value is reported under the flag's name).
A flag in other units than its field (milliseconds, MiB) says so with ``scale``: field value =
flag value * scale.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any


class OptionError(ValueError):
    """A server option outside its range; ``name`` is the field, ``rule`` what it must be."""

    def __init__(self, name: str, rule: str, value: Any):
        super().__init__(f"{name} {rule}, got {value!r}")
        self.name, self.rule, self.value = name, rule, value


def _opt(default: Any, flag: str | None, help: str, *, low: float | None = None,
         strict: bool = False, scale: float = 1.0, kind: type | None = None) -> Any:
    """A field with its default, its lower bound (``strict``: > low, else >= low) and its flag.
    ``help`` is the flag's help without the default, which is appended from ``default``. A flag
    in other units (``scale`` != 1) has the bound 0, which reads the same in both units."""
    assert scale == 1 or not low, "a scaled option's bound is 0"
    return field(default=default, metadata={"flag": flag, "help": help, "low": low,
                                            "strict": strict, "scale": scale, "kind": kind})


@dataclass(frozen=True)
class ServerOptions:
    """Every option of the reference server, with its default. Invalid values raise
    ``OptionError`` at construction (``dataclasses.replace`` checks again)."""

    host: str = _opt("127.0.0.1", "--host", "address to listen on")
    port: int = _opt(30000, "--port", "port (30000 is SGLang's); reference engine: 0 = any "
                     "free port", low=0)
    max_batch: int = _opt(8, "--max-batch", "reference engine: most requests decoded together as "
                          "one batch (rows)", low=1)
    batch_window_s: float = _opt(0.0, "--batch-window-ms", "reference engine: after a batch's "
                                 "first request, wait this many ms for more before running it "
                                 "(0 = run at once)", low=0, scale=1e-3)
    max_queue: int = _opt(128, "--max-queue", "reference engine: requests that may wait for a "
                          "batch; more get 503 with Retry-After", low=1)
    # a 128K-token prompt is ~1 MB as input_ids, ~3 MB as escaped CJK text
    max_body_bytes: int = _opt(8 << 20, "--max-body-mb", "reference engine: largest request body "
                               "in MiB; larger ones get 413 before they are read", low=0,
                               strict=True, scale=1 << 20, kind=int)
    read_timeout_s: float = _opt(30.0, "--read-timeout", "reference engine: seconds each "
                                 "request's headers, and its body, may take to arrive", low=0,
                                 strict=True)
    write_timeout_s: float = _opt(30.0, "--write-timeout", "reference engine: seconds a client "
                                  "may leave what was sent unread before its connection is cut "
                                  "and its request aborted", low=0, strict=True)
    max_connections: int = _opt(512, "--max-connections", "reference engine: connections open at "
                                "once; more are answered 503 with Retry-After", low=1)
    shutdown_timeout_s: float = _opt(30.0, "--shutdown-timeout", "reference engine: on SIGTERM / "
                                     "Ctrl-C, seconds requests in flight get to finish before "
                                     "they are aborted", low=0)
    log_requests: bool = _opt(False, "--log-requests", "reference engine: print one line per "
                              "finished request to stderr")
    enable_return_hidden_states: bool = _opt(
        False, "--enable-return-hidden-states", "reference engine: answer requests with "
        "return_hidden_states true (the target's post-norm hidden states in "
        "meta_info.hidden_states, as SGLang's flag of this name; `fastmtp distill "
        "--with-features` asks for them); with --engine sglang it is passed to SGLang")
    # listen backlog (uvicorn's default; Python's http.server had 5): no flag
    backlog: int = _opt(2048, None, "", low=1)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, low = getattr(self, f.name), f.metadata["low"]
            if low is None:
                continue
            if f.metadata["strict"] and not value > low:
                raise OptionError(f.name, f"must be > {low:g}", value)
            if not f.metadata["strict"] and not value >= low:
                raise OptionError(f.name, f"must be >= {low:g}", value)
        if self.port > 65535:
            raise OptionError("port", "must be <= 65535", self.port)
        if not self.host:
            raise OptionError("host", "must be an address (127.0.0.1, 0.0.0.0, ::1)", self.host)

    # -- the CLI's side -------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per option; its default and help come from the field."""
        for f in dataclasses.fields(cls):
            flag, scale = f.metadata["flag"], f.metadata["scale"]
            if flag is None:
                continue
            if isinstance(f.default, bool):
                parser.add_argument(flag, action="store_true", help=f.metadata["help"])
                continue
            default = f.default / scale if scale != 1 else f.default
            kind = float if scale != 1 or isinstance(f.default, float) else type(f.default)
            parser.add_argument(flag, type=kind, default=default,
                                help=f"{f.metadata['help']} (default {default:g})"
                                if not isinstance(default, str) else
                                f"{f.metadata['help']} (default {default})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerOptions":
        """The options the flags of ``add_cli_args`` give. Raises OptionError whose message names
        the flag and the value given (``--max-queue must be >= 1, got 0``)."""
        values = {}
        for f in dataclasses.fields(cls):
            flag = f.metadata["flag"]
            if flag is None:
                continue
            raw = getattr(args, _dest(flag))
            value = raw * f.metadata["scale"] if f.metadata["scale"] != 1 else raw
            values[f.name] = f.metadata["kind"](value) if f.metadata["kind"] else value
        try:
            return cls(**values)
        except OptionError as exc:  # (a scaled field's bound is 0: the same in the flag's unit)
            flag = next(f for f in dataclasses.fields(cls) if f.name == exc.name).metadata["flag"]
            raise OptionError(flag, exc.rule, getattr(args, _dest(flag))) from None


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
