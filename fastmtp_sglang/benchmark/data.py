"""Where the shipped prompt files are, in a source checkout or an installed wheel.

``bench/data/`` holds the evaluation prompts (Spec-Bench, 480 rows, Apache-2.0; a C-Eval sample,
51 rows, CC BY-NC-SA 4.0; its README gives provenance and licences). Spec-Bench ships inside the
wheel as ``fastmtp_sglang/eval_data/`` (setuptools ``package-dir`` in ``pyproject.toml``); the
C-Eval sample is non-commercial and stays in the source repository only. The training prompts
that ship are ``fastmtp_sglang/data/train_prompts/`` (self-instruct seeds, Apache-2.0, and our
synthesised tasks); AlpacaEval's instructions (CC BY-NC 4.0) stay in the repository at
``bench/train_prompts/``. So the commands that point at the shipped files work without a
checkout::

    fastmtp bench ... --prompts "$(python -m fastmtp_sglang.cli.prompt_files spec_bench.jsonl)"
    fastmtp distill ... --prompts "$(python -m fastmtp_sglang.cli.prompt_files --train)"/*.jsonl \\
        --exclude "$(python -m fastmtp_sglang.cli.prompt_files)"/*.jsonl

The evaluation files are evaluation data only: never train, self-distil or build vocab tables on
them.
"""

from __future__ import annotations

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


# Files of the source repository that are not in the wheel (non-commercial licences): name ->
# (licence, where they are in the repository).
NOT_IN_WHEEL = {
    "c_eval_zh.jsonl": ("CC BY-NC-SA 4.0", "bench/data/c_eval_zh.jsonl"),
    "alpaca_eval_instructions.jsonl": ("CC BY-NC 4.0", "bench/train_prompts/alpaca_eval_instructions.jsonl"),
}


def bench_data_path(name: str) -> Path:
    """Path of one shipped evaluation file, e.g. ``bench_data_path("spec_bench.jsonl")``."""
    folder = bench_data_dir()
    path = folder / name
    if not path.is_file() and name in NOT_IN_WHEEL:
        licence, where = NOT_IN_WHEEL[name]
        raise FastMTPError(f"{name} ({licence}, non-commercial) is not shipped in the wheel: it is in "
                           f"the source repository at {where}; clone the repository and pass that path")
    if not path.is_file() or path.parent != folder:
        have = ", ".join(sorted(p.name for p in folder.glob("*.jsonl")))
        raise FastMTPError(f"no shipped evaluation file {name!r}; shipped: {have}")
    return path


def train_prompts_dir() -> Path:
    """The folder of the shipped training prompts (``fastmtp_sglang/data/train_prompts``)."""
    return Path(str(resources.files("fastmtp_sglang.data").joinpath("train_prompts")))

