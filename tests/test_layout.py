"""The package map stays true: every module of the package (``fastmtp_sglang/**/*.py`` and the
top-level ``kernels/*.py``, installed as ``fastmtp_sglang.kernels``; ``__init__.py`` excepted)
is named in its folder's ``__init__`` docstring ("Owns:") and in its folder's row of the map in
docs/design.md section 10.1, and no module is over MAX_LINES lines (the rule section 10 states).

The checks read the files as text (nothing is imported); the last test runs them on a made-up
package to show that each one fails where it should.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 650
MAP_HEADER = "| subpackage |"  # the first row of section 10.1's table of subpackages


def module_files(root: Path) -> dict[Path, list[str]]:
    """{folder: [module names]} of every module under ``root/fastmtp_sglang`` and ``root/kernels``
    (``__init__.py`` and caches excepted)."""
    found: dict[Path, list[str]] = {}
    paths = [*(root / "fastmtp_sglang").rglob("*.py"), *(root / "kernels").glob("*.py")]
    for p in sorted(paths):
        if p.name != "__init__.py" and "__pycache__" not in p.parts:
            found.setdefault(p.parent, []).append(p.stem)
    return found


def owns(init: Path) -> set[str]:
    """The names in double backticks in the "Owns:" paragraph of ``init``'s docstring (up to the
    next blank line); empty when there is no such paragraph."""
    doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
    m = re.search(r"^Owns:(.*?)(?:\n\s*\n|\Z)", doc or "", re.S | re.M)
    return set(re.findall(r"``([^`]+)``", m.group(1))) if m else set()


def section_10(design: str) -> str:
    start = design.index('<a id="s10"></a>')
    return design[start:design.index('<a id="s11"></a>', start)]


def map_rows(section: str) -> dict[str, set[str]]:
    """{folder as ``x/``: the names in single backticks of its row} from the table of
    subpackages (the one whose header starts with MAP_HEADER); a row may name several folders
    in its first cell."""
    rows: dict[str, set[str]] = {}
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(MAP_HEADER))
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first, rest = line.strip("|").split("|", 1)
        names = set(re.findall(r"`([^`]+)`", rest))
        for folder in re.findall(r"`([^`]+/)`", first):
            rows.setdefault(folder, set()).update(names)
    return rows


def missing_from_owns(root: Path) -> list[str]:
    return [f"{folder.relative_to(root) / name}.py: not in the Owns list of {folder.relative_to(root)}/__init__.py"
            for folder, names in module_files(root).items()
            for name in names if name not in owns(folder / "__init__.py")]


def missing_from_map(root: Path) -> list[str]:
    rows = map_rows(section_10((root / "docs" / "design.md").read_text()))
    return [f"{folder.relative_to(root) / name}.py: not in the `{folder.name}/` row of docs/design.md 10.1"
            for folder, names in module_files(root).items()
            for name in names if name not in rows.get(folder.name + "/", set())]


def too_long(root: Path, limit: int = MAX_LINES) -> list[str]:
    paths = [*(root / "fastmtp_sglang").rglob("*.py"), *(root / "kernels").glob("*.py")]
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted(paths)
            if (n := len(p.read_text().splitlines())) > limit]


def test_every_module_is_in_its_folders_owns_list():
    assert not missing_from_owns(REPO), "\n".join(missing_from_owns(REPO))


def test_every_module_is_in_the_design_map():
    assert not missing_from_map(REPO), "\n".join(missing_from_map(REPO))


def test_no_module_is_over_the_limit():
    assert not too_long(REPO), "\n".join(too_long(REPO))


def test_the_design_states_the_limit_the_test_enforces():
    assert f"No module is over {MAX_LINES} lines" in section_10((REPO / "docs" / "design.md").read_text())


def test_each_check_fails_on_a_made_up_package(tmp_path):
    """A package whose __init__ owns one of its two modules, whose map row names the other
    only, and whose second module is one line too long: each check names what is wrong."""
    pkg = tmp_path / "fastmtp_sglang" / "part"
    pkg.mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (pkg / "__init__.py").write_text('"""A part.\n\nOwns: ``a`` (the first).\n\nMay import: nothing."""\n')
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "b.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text(
        '## <a id="s10"></a>10. Layout\n\n| subpackage | owns | imports |\n|---|---|---|\n'
        "| `part/` | `b` (the second) | nothing |\n\n## <a id=\"s11\"></a>11. Next\n")
    assert missing_from_owns(tmp_path) == [
        "fastmtp_sglang/part/b.py: not in the Owns list of fastmtp_sglang/part/__init__.py"]
    assert missing_from_map(tmp_path) == [
        "fastmtp_sglang/part/a.py: not in the `part/` row of docs/design.md 10.1"]
    assert too_long(tmp_path) == [f"fastmtp_sglang/part/b.py: {MAX_LINES + 1} lines"]
    (pkg / "b.py").write_text("x = 1\n" * MAX_LINES)
    assert too_long(tmp_path) == []
