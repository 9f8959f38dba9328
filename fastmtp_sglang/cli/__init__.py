"""The `fastmtp` console script: thin argparse front ends over importable functions.

Each command lives in its own module, which exposes ``register(subparsers)``; the parser it adds
sets ``func`` to a callable taking the parsed namespace and returning an exit code.

Owns: one module per command (``convert``, ``export``, ``init_head``, ``inspect_draft``,
``serve``, ``bench``, ``bench_concurrency``, ``demo``, ``synth_prompts``, ``distill``,
``features``, ``train``, ``curve``, ``build_vocab``; ``--steps`` and the ``--auto-*`` flags are
parsed once, in decode/auto_setup.py), and two ``python -m`` entry points (``prompt_files``,
``vllm_proxy``).

May import: anything of this package below it (docs/design.md section 10.1).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fastmtp_sglang.core.errors import FastMTPError

# one module per command, in help order
COMMAND_MODULES = [
    "fastmtp_sglang.cli.convert",
    "fastmtp_sglang.cli.export",
    "fastmtp_sglang.cli.init_head",
    "fastmtp_sglang.cli.inspect_draft",
    "fastmtp_sglang.cli.serve",
    "fastmtp_sglang.cli.bench",
    "fastmtp_sglang.cli.demo",
    "fastmtp_sglang.cli.synth_prompts",
    "fastmtp_sglang.cli.distill",
    "fastmtp_sglang.cli.features",
    "fastmtp_sglang.cli.train",
    "fastmtp_sglang.cli.curve",
    "fastmtp_sglang.cli.build_vocab",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastmtp",
        description="Train, package and serve FastMTP draft heads for SGLang.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command not built yet; anything else is a real error
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except FastMTPError as exc:
        print(f"fastmtp {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
