"""The wheel, not the editable install: what it holds, and that an installed copy finds its data.

Builds the wheel from a copy of the source tree (``pip wheel --no-deps --no-build-isolation``,
setuptools from the environment, no network), installs it with ``pip install --target`` into a
temporary folder, and runs Python there with ``PYTHONPATH`` pointing at that folder, so every
resource lookup (shipped head, demo prompts, vocab tables, training and evaluation prompts) must
resolve inside the installed copy, not in this checkout. About 20 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IGNORED = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", "out", "runs"}


def _copy_source(dst: Path) -> Path:
    """The files a fresh clone would have (git's view when there is one), copied to ``dst``."""
    src = dst / "src"
    listed = None
    if (REPO / ".git").exists() and shutil.which("git"):
        run = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                             capture_output=True, check=False)
        if run.returncode == 0:
            listed = [p for p in run.stdout.decode().split("\0") if p]
    if listed is None:
        shutil.copytree(REPO, src, ignore=lambda d, names: [n for n in names if n in IGNORED
                                                            or n.endswith(".egg-info")])
        return src
    for rel in listed:
        f = REPO / rel
        if f.is_file():  # a file deleted but not yet committed is still listed
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, src / rel)
    return src


def _expected_files(root: Path) -> set[str]:
    """Wheel paths the package must ship, from the source tree ``root``: every module, every data file."""
    def files(root: Path, patterns=("*",)) -> list[Path]:
        out = []
        for pattern in patterns:
            out += [p for p in root.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts
                    and p.suffix != ".pyc"]
        return out

    want = {f"fastmtp_sglang/{p.relative_to(root / 'fastmtp_sglang').as_posix()}"
            for p in files(root / "fastmtp_sglang")}
    want |= {f"fastmtp_sglang/kernels/{p.relative_to(root / 'kernels').as_posix()}"
             for p in files(root / "kernels", ("*.py",))}
    want |= {f"fastmtp_sglang/vocab_tables/{p.relative_to(root / 'vocab_tables').as_posix()}"
             for p in files(root / "vocab_tables", ("*.py", "*.pt", "*.json", "*.md"))}
    want |= {f"fastmtp_sglang/eval_data/{p.name}" for p in files(root / "bench" / "data", ("*.jsonl", "*.md"))
             if p.name not in NON_COMMERCIAL and not p.name.endswith(".LICENSE.md")}
    return want


# files of the repository under non-commercial licences: kept for the pipelines and for measuring,
# never in the Apache-2.0 wheel
NON_COMMERCIAL = {"c_eval_zh.jsonl", "alpaca_eval_instructions.jsonl"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_source(tmp)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    wheels = list((tmp / "dist").glob("fastmtp_sglang-*.whl"))
    assert len(wheels) == 1, wheels
    return tmp, wheels[0], run.stdout + run.stderr, src


def test_wheel_builds_without_packaging_warnings(wheel):
    log = wheel[2]
    # setuptools' warning classes (BuildBackendWarning, SetuptoolsDeprecationWarning, ...): the
    # "absent from the `packages` configuration" and "`project.license` as a TOML table" ones
    # were printed by every install before; distutils' lower-case "warning: ... byte-compiling is
    # disabled" is pip's doing and harmless
    found = sorted(set(re.findall(r"\b\w*Warning: [^\n]{0,120}", log)))
    assert not found, "\n".join(found)


def test_wheel_holds_the_package_and_its_data(wheel):
    _, whl, _, src = wheel
    names = set(zipfile.ZipFile(whl).namelist())
    missing = sorted(_expected_files(src) - names)
    assert not missing, f"not in the wheel: {missing}"
    non_commercial = sorted(n for n in names if Path(n).name in NON_COMMERCIAL)
    assert not non_commercial, f"non-commercial files in the Apache-2.0 wheel: {non_commercial}"
    for name in NON_COMMERCIAL:  # still in the repository, each with its licence beside it
        [kept] = [p for p in src.rglob(name) if p.is_file()]
        assert "non-commercial" in (kept.parent / kept.name.replace(".jsonl", ".LICENSE.md")).read_text()
    # only our namespace: no top-level `kernels` (PyPI has one that sglang needs) or `vocab_tables`
    top = {n.split("/")[0] for n in names} - {"fastmtp_sglang"}
    assert len(top) == 1 and top.pop().endswith(".dist-info"), sorted({n.split("/")[0] for n in names})
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    entry = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "fastmtp = fastmtp_sglang.cli:main" in entry


PROBE = r"""
import json
from pathlib import Path

import fastmtp_sglang, fastmtp_sglang.kernels
from fastmtp_sglang.benchmark import data as bench_data
from fastmtp_sglang.cli import demo
from fastmtp_sglang.vocab import tables as vocab

head = demo.shipped_head()
draft, what = demo.demo_draft(Path("no-target-needed"), Path("no-cache-needed"))
refs = json.loads((head / "config.json").read_text())["fastmtp"]["vocab_tables"]
tables = vocab.TableSet.from_draft_dir(head)
train = bench_data.train_prompts_dir()


def _error(fn):
    try:
        fn()
    except Exception as exc:
        return str(exc)
    return None
print(json.dumps({
    "package": fastmtp_sglang.__file__,
    "kernels": fastmtp_sglang.kernels.__file__,
    "head": str(head / "model.safetensors"),
    "demo_draft": str(draft / "config.json"),
    "demo_draft_what": what,
    "demo_prompts": str(demo.demo_prompts_path()),
    "tables": [str(p) for p in vocab.shipped_tables()],
    "head_tables": [str(vocab.resolve_table_ref(r, head)) for r in refs],
    "head_table_names": tables.names,
    "train_prompts": [str(p) for p in sorted(train.glob("*.jsonl"))],
    "bench_data": [str(bench_data.bench_data_path(n)) for n in ("spec_bench.jsonl",)],
    "c_eval_error": _error(lambda: bench_data.bench_data_path("c_eval_zh.jsonl")),
}))
"""


def test_installed_wheel_finds_its_own_data(wheel):
    tmp, whl, _, src = wheel
    target = tmp / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                          "--target", str(target), str(whl)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(target))
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp, env=env, capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    inside = target.resolve()

    def installed(path: str) -> bool:
        p = Path(path).resolve()
        return p.is_file() and p.is_relative_to(inside)

    assert got["demo_draft_what"].startswith("trained FastMTP head"), got["demo_draft_what"]
    for key in ("package", "kernels", "head", "demo_draft", "demo_prompts"):
        assert installed(got[key]), f"{key}: {got[key]} is not a file of the installed copy {inside}"
    shipped = sorted(p.relative_to(src / "vocab_tables").as_posix() for p in (src / "vocab_tables").glob("*/*.pt"))
    assert sorted(Path(p).relative_to(inside / "fastmtp_sglang" / "vocab_tables").as_posix()
                  for p in got["tables"]) == shipped
    for key in ("tables", "head_tables", "train_prompts", "bench_data"):
        assert got[key] and all(installed(p) for p in got[key]), f"{key}: {got[key]}"
    assert got["head_table_names"] == ["en-16384", "zh-4096"]
    assert [Path(p).name for p in got["train_prompts"]] == sorted(
        p.name for p in (src / "fastmtp_sglang" / "data" / "train_prompts").glob("*.jsonl"))
    # the non-commercial evaluation file is not installed, and asking for it says where it is
    assert "not shipped in the wheel" in got["c_eval_error"] and "bench/data/c_eval_zh.jsonl" in got["c_eval_error"]
    printed = subprocess.run([sys.executable, "-m", "fastmtp_sglang.cli.prompt_files", "spec_bench.jsonl"], cwd=tmp,
                             env=env, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0 and installed(printed.stdout.strip()), printed.stdout + printed.stderr
    # the console script of the wheel runs the installed copy too
    script = target / "bin" / "fastmtp"
    helped = subprocess.run([str(script), "demo", "--help"], cwd=tmp, env=env, capture_output=True, text=True,
                            timeout=300)
    assert helped.returncode == 0 and "--max-new-tokens" in helped.stdout, helped.stderr[-2000:]


def test_bench_data_in_a_checkout():
    from fastmtp_sglang.benchmark import data as bench_data
    from fastmtp_sglang.core.errors import FastMTPError

    assert bench_data.bench_data_path("spec_bench.jsonl") == REPO / "bench" / "data" / "spec_bench.jsonl"
    assert bench_data.train_prompts_dir() == REPO / "fastmtp_sglang" / "data" / "train_prompts"
    with pytest.raises(FastMTPError, match=r"no shipped evaluation file '../README.md'; shipped: c_eval_zh.jsonl"):
        bench_data.bench_data_path("../README.md")
