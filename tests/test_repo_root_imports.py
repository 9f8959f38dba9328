"""Python started from the repository root must import installed packages, not the repository's
top-level folders (STYLE habit 19): the top-level ``kernels/`` folder (installed as
``fastmtp_sglang.kernels``) shares its name with PyPI's ``kernels``, which transformers imports.
Each check runs a fresh interpreter with the repository root as its working directory, as
``python -c`` and ``python -m pytest`` there do. CI also runs this file against the newest
transformers pyproject.toml admits, with the newest ``kernels`` (Makefile: test-newest-transformers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_at_root(code: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def installed(name: str) -> bool:
    """Is a distribution ``name`` installed (asked from outside the repository)?"""
    r = run_at_root(f"import importlib.metadata as m; m.version({name!r})", cwd=Path("/"))
    return r.returncode == 0


def test_import_kernels_at_the_root_gets_the_installed_package():
    if not installed("kernels"):
        pytest.skip("PyPI's kernels is not installed here (the sglang extra and CI's newest-"
                    "transformers venv have it)")
    r = run_at_root("import kernels; print(kernels.__file__)")
    assert r.returncode == 0, r.stderr
    assert not Path(r.stdout.strip()).resolve().is_relative_to(REPO / "kernels"), r.stdout


def test_without_an_installed_kernels_the_folder_reads_as_not_installed():
    """No PyPI kernels on the path (site-packages hidden): ``import kernels`` gives an empty module
    without ``__file__``, which transformers' availability check (find_spec, then an import when
    there is no metadata) reads as "not installed" (an ImportError there would fail
    ``import transformers.activations``, as it did in vLLM's venv, which has no kernels)."""
    r = run_at_root("import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
                    "import kernels; print(getattr(kernels, '__file__', None), "
                    "[n for n in dir(kernels) if not n.startswith('_')])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None []", r.stdout


def test_transformers_imports_at_the_root():
    """transformers >= 5.25 imports ``kernels`` (CUDAProperties) while importing its activations."""
    r = run_at_root("from transformers.activations import ACT2FN; import fastmtp_sglang.core.target")
    assert r.returncode == 0, r.stderr[-2000:]


def test_our_kernels_still_import_under_the_package():
    r = run_at_root("import fastmtp_sglang.kernels.compressed_head as m; print(m.compressed_head.__name__)")
    assert r.returncode == 0 and r.stdout.strip() == "compressed_head", r.stderr


@pytest.mark.parametrize("folder", sorted(p.name for p in REPO.iterdir()
                                          if (p / "__init__.py").is_file() and p.name not in ("fastmtp_sglang", "kernels")))
def test_no_other_top_level_package_shares_an_installed_name(folder):
    """A top-level folder with an ``__init__.py`` shadows any installed package of its name."""
    r = run_at_root(f"import importlib.util; print(importlib.util.find_spec({folder!r}) is None)", cwd=Path("/"))
    assert r.stdout.strip() == "True", f"an installed package is also called {folder!r}: rename the folder"
