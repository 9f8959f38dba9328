"""bench/train_data.py: the committed data checks against its manifest, and the growth is
append-only (each pack adds a part, the parts committed before stay byte-identical; restore gives
back base + every part byte for byte; a work file that does not continue them is refused)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("train_data_tool", REPO / "bench" / "train_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def td(tmp_path, monkeypatch):
    """The tool with its archive in tmp_path/archive, and a base packed from 3 rows."""
    mod = _load()
    monkeypatch.setattr(mod, "DATA", tmp_path / "archive")
    monkeypatch.setattr(mod, "GROWTH", tmp_path / "archive" / "growth")
    work = tmp_path / "work"
    work.mkdir()
    _append(work, 0, 3)
    mod.pack(work, "base")
    return mod, work


def _append(work: Path, start: int, stop: int) -> None:
    with open(work / "distill.jsonl", "a") as f:
        for i in range(start, stop):
            f.write(json.dumps({"id": f"p{i}#0", "prompt_id": f"p{i}", "response_ids": list(range(i + 1))}) + "\n")
    with open(work / "distill.jsonl.rejected.jsonl", "a") as f:
        if stop % 2:
            f.write(json.dumps({"id": f"r{stop}", "prompt_id": f"p{stop}"}) + "\n")


def test_the_committed_archive_matches_its_manifest():
    _load().check()  # raises SystemExit on any sha256 mismatch


def test_growth_packs_append_parts_and_restore_round_trips(td, tmp_path):
    mod, work = td
    _append(work, 3, 6)
    m = mod.pack_growth(work, "first")
    assert [p["note"] for p in m["parts"]] == ["first"]
    part0 = (mod.GROWTH / "distill.jsonl.part00.xz").read_bytes()
    assert m["parts"][0]["files"]["distill.jsonl"]["rows"] == 3
    _append(work, 6, 10)
    m = mod.pack_growth(work, "second")
    assert (mod.GROWTH / "distill.jsonl.part00.xz").read_bytes() == part0  # never rewritten
    assert m["parts"][1]["files"]["distill.jsonl"]["rows"] == 4
    assert m["total"]["distill.jsonl"] == {"rows": 10, "prompts": 10, "response_tokens": sum(range(1, 11))}
    out = tmp_path / "restored"
    mod.restore(out, with_growth=True)
    for name in mod.FILES:
        assert (out / name).read_bytes() == (work / name).read_bytes()
    with pytest.raises(SystemExit, match="nothing to pack"):
        mod.pack_growth(work, "again")
    # a work file that rewrote a committed row is refused, and the archive is unchanged
    before = (mod.GROWTH / "manifest.json").read_text()
    text = (work / "distill.jsonl").read_text().replace('"p4"', '"px"')
    (work / "distill.jsonl").write_text(text + json.dumps({"id": "extra"}) + "\n")
    with pytest.raises(SystemExit, match="does not continue the committed growth"):
        mod.pack_growth(work, "bad")
    assert (mod.GROWTH / "manifest.json").read_text() == before


def test_a_growth_from_before_parts_reads_as_part_zero(td, tmp_path):
    mod, work = td
    _append(work, 3, 5)
    m = mod.pack_growth(work, "old")
    # rewrite it the way the tool stored growth before parts: one {name}.xz per file, no "parts"
    legacy = {"command": m["command"], "note": "old", "base": m["base"], "files": {}}
    for name, e in m["parts"][0]["files"].items():
        (mod.GROWTH / e.pop("file")).rename(mod.GROWTH / f"{name}.xz")
        legacy["files"][name] = {**e, "total": m["total"][name]}
    (mod.GROWTH / "manifest.json").write_text(json.dumps(legacy))
    _append(work, 5, 7)
    m = mod.pack_growth(work, "new")
    assert [p["files"]["distill.jsonl"]["file"] for p in m["parts"]] == ["distill.jsonl.xz", "distill.jsonl.part01.xz"]
    out = tmp_path / "restored"
    mod.restore(out, with_growth=True)
    assert (out / "distill.jsonl").read_bytes() == (work / "distill.jsonl").read_bytes()
