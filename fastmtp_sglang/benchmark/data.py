"""Where the shipped prompt files are, in a source checkout or an installed wheel.

``bench/data/*.jsonl`` (evaluation: Spec-Bench, 480 rows; a C-Eval sample, 51 rows; its README
gives provenance and licences) ships inside the wheel as ``fastmtp_sglang/eval_data/``
(setuptools ``package-dir`` in ``pyproject.toml``); the training prompts are
``fastmtp_sglang/data/train_prompts/`` in both. So the commands that point at them work without a
checkout::

    fastmtp bench ... --prompts "$(python -m fastmtp_sglang.benchmark.data spec_bench.jsonl)"
    fastmtp distill ... --prompts "$(python -m fastmtp_sglang.benchmark.data --train)"/*.jsonl \\
        --exclude "$(python -m fastmtp_sglang.benchmark.data)"/*.jsonl

The evaluation files are evaluation data only: never train, self-distil or build vocab tables on
them.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from fastmtp_sglang.core.errors import FastMTPError

__all__ = ["bench_data_dir", "bench_data_path", "train_prompts_dir"]


def bench_data_dir() -> Path:
    """The folder holding ``spec_bench.jsonl``, ``c_eval_zh.jsonl`` and their README.

    An installed wheel has it inside the package (``fastmtp_sglang/eval_data``); a source checkout
    (an editable install included) has it at ``bench/data`` beside the package. ``bench/data`` has
    no ``__init__.py``, so it is looked up as a folder, not imported.
    """
    here = Path(__file__).resolve().parents[1]  # the package root: fastmtp_sglang/
    for candidate in (here / "eval_data", here.parent / "bench" / "data"):
        if (candidate / "spec_bench.jsonl").is_file():
            return candidate
    raise FastMTPError(f"the evaluation prompts are missing: neither {here / 'eval_data'} (installed wheel) nor "
                       f"{here.parent / 'bench' / 'data'} (source checkout) holds spec_bench.jsonl; reinstall "
                       "fastmtp-sglang")


def bench_data_path(name: str) -> Path:
    """Path of one shipped evaluation file, e.g. ``bench_data_path("spec_bench.jsonl")``."""
    folder = bench_data_dir()
    path = folder / name
    if not path.is_file() or path.parent != folder:
        have = ", ".join(sorted(p.name for p in folder.glob("*.jsonl")))
        raise FastMTPError(f"no shipped evaluation file {name!r}; shipped: {have}")
    return path


def train_prompts_dir() -> Path:
    """The folder of the shipped training prompts (``fastmtp_sglang/data/train_prompts``)."""
    return Path(str(resources.files("fastmtp_sglang.data").joinpath("train_prompts")))


def main(argv: list[str] | None = None) -> int:
    """``python -m fastmtp_sglang.benchmark.data [NAME | --train]``: print the evaluation folder, one
    evaluation file's path, or (``--train``) the training-prompt folder."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if args == ["--train"]:
            print(train_prompts_dir())
        elif len(args) > 1 or (args and args[0].startswith("-")):
            print("usage: python -m fastmtp_sglang.benchmark.data [NAME | --train]", file=sys.stderr)
            return 2
        else:
            print(bench_data_path(args[0]) if args else bench_data_dir())
    except FastMTPError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
