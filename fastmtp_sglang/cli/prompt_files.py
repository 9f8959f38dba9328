"""``python -m fastmtp_sglang.cli.prompt_files [NAME | --train]``: print where the shipped prompt
files are (the evaluation folder, one evaluation file, or the training-prompt folder), so shell
commands can point at them from an installed wheel. The lookup is
:mod:`fastmtp_sglang.benchmark.data`."""

from __future__ import annotations

import sys

from fastmtp_sglang.benchmark.data import bench_data_dir, bench_data_path, train_prompts_dir
from fastmtp_sglang.core.errors import FastMTPError


def main(argv: list[str] | None = None) -> int:
    """``python -m fastmtp_sglang.cli.prompt_files [NAME | --train]``: print the evaluation folder, one
    evaluation file's path, or (``--train``) the training-prompt folder."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if args == ["--train"]:
            print(train_prompts_dir())
        elif len(args) > 1 or (args and args[0].startswith("-")):
            print("usage: python -m fastmtp_sglang.cli.prompt_files [NAME | --train]", file=sys.stderr)
            return 2
        else:
            print(bench_data_path(args[0]) if args else bench_data_dir())
    except FastMTPError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
