"""The committed self-distilled data of the demo target: pack it into the repository, restore it
into a pipeline's work directory.

    python bench/train_data.py pack runs/demo-pipeline-v2       # after a distillation: writes bench/train_data/
    python bench/train_data.py restore runs/demo-pipeline-v2    # what bench/pipelines/demo_pipeline.sh runs
    python bench/train_data.py check                            # the archive matches its manifest
    python bench/train_data.py pack-growth runs/data-v3 --note "..."   # rows added since: growth/
    python bench/train_data.py restore runs/data-v3 --with-growth      # base + growth

The base (``bench/train_data/*.xz``, 4 samples per prompt at T=0.6) stays byte-identical, so
everything that restores it (bench/pipelines/demo_pipeline.sh, the shipped head's recipe) keeps
working; ``bench/pipelines/grow_data.sh`` appends to a copy of it (8 samples per prompt, mixed
temperatures, more prompts), and ``pack-growth`` commits only the rows after the base's and the
growth's already committed, as a new part (``bench/train_data/growth/*.partNN.xz``: append-only,
so git stores each row once): a work file must start with those exact bytes.

`pack` compresses ``distill.jsonl`` and its ``distill.jsonl.rejected.jsonl`` (the samples the
filters dropped: with them a resumed distillation skips exactly what was already tried) with xz
into ``bench/train_data/``, and writes ``manifest.json`` (sha256 and size of each file before and
after compression, rows, response tokens, and the command that made the data). `restore`
decompresses into the work directory, checks every sha256, and writes each file atomically; it
refuses to replace a file that is there already (the pipeline only calls it when there is none).

Training data only: the rows are the target's own answers to the training prompts
(``bench/train_prompts/``, ``fastmtp_sglang/data/train_prompts/``), never to ``bench/data`` or
``../shared/eval``; ``fastmtp distill --exclude`` refused the evaluation prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "train_data"
FILES = ("distill.jsonl", "distill.jsonl.rejected.jsonl")
COMMAND = "STAGE=distill bash bench/pipelines/demo_pipeline.sh runs/demo-pipeline-v2"
GROWTH = DATA / "growth"
GROWTH_COMMAND = "bash bench/pipelines/grow_data.sh runs/data-v3"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stats(raw: bytes) -> dict:
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return {"rows": len(rows), "prompts": len({r.get("prompt_id") for r in rows}),
            "response_tokens": sum(len(r.get("response_ids") or []) for r in rows)}


def pack(work: Path, note: str) -> dict:
    DATA.mkdir(parents=True, exist_ok=True)
    manifest = {"command": COMMAND, "note": note, "files": {}}
    for name in FILES:
        raw = (work / name).read_bytes()
        packed = lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)
        dst = DATA / f"{name}.xz"
        tmp = dst.with_suffix(".xz.tmp")
        tmp.write_bytes(packed)
        os.replace(tmp, dst)
        manifest["files"][name] = {"sha256": sha256(raw), "bytes": len(raw),
                                   "xz_sha256": sha256(packed), "xz_bytes": len(packed), **stats(raw)}
    (DATA / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _unpacked(name: str, entry: dict) -> bytes:
    packed = (DATA / f"{name}.xz").read_bytes()
    if sha256(packed) != entry["xz_sha256"]:
        raise SystemExit(f"bench/train_data/{name}.xz does not match manifest.json (sha256): "
                         "check out the committed file again (git checkout -- bench/train_data)")
    raw = lzma.decompress(packed)
    if sha256(raw) != entry["sha256"]:
        raise SystemExit(f"bench/train_data/{name}.xz decompresses to the wrong bytes")
    return raw


def growth_parts(manifest: dict) -> list[dict]:
    """The growth's parts, oldest first: {"note", "files": {name: entry with its "file"}}. A
    manifest from before parts (one file per name, rewritten by each pack) is one part."""
    if "parts" in manifest:
        return manifest["parts"]
    return [{"note": manifest.get("note", ""),
             "files": {n: {**e, "file": f"{n}.xz"} for n, e in manifest["files"].items()}}]


def _growth_manifest() -> dict | None:
    path = GROWTH / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def pack_growth(work: Path, note: str) -> dict:
    """Compress the rows WORK's files hold past the base and the committed growth into a new part
    of growth/ (append-only: the parts already committed are checked, never rewritten, so the
    repository's history stores each row once). The base's and the parts' bytes must be the
    files' prefix: grow_data.sh only appends."""
    base = json.loads((DATA / "manifest.json").read_text())["files"]
    old = _growth_manifest()
    parts = growth_parts(old) if old else []
    idx = len(parts)
    GROWTH.mkdir(parents=True, exist_ok=True)
    raws, new_part = {}, {"note": note, "files": {}}
    for name in FILES:
        raw = (work / name).read_bytes()
        n = base[name]["bytes"]
        if sha256(raw[:n]) != base[name]["sha256"]:
            raise SystemExit(f"{work / name} does not start with the committed base's bytes: "
                             "growth is only what was appended to it (restore the base, then grow)")
        for i, part in enumerate(parts):
            e = part["files"][name]
            if sha256(raw[n:n + e["bytes"]]) != e["sha256"]:
                raise SystemExit(f"{work / name} does not continue the committed growth (part {i}): "
                                 "restore with --with-growth, then grow")
            n += e["bytes"]
        raws[name] = (raw, raw[n:])
    if not any(extra for _, extra in raws.values()):
        raise SystemExit(f"{work}: no rows past the committed growth: nothing to pack")
    for name, (raw, extra) in raws.items():
        packed = lzma.compress(extra, preset=9 | lzma.PRESET_EXTREME)
        dst = GROWTH / f"{name}.part{idx:02d}.xz"
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.write_bytes(packed)
        os.replace(tmp, dst)
        new_part["files"][name] = {"file": dst.name, "sha256": sha256(extra), "bytes": len(extra),
                                   "xz_sha256": sha256(packed), "xz_bytes": len(packed), **stats(extra)}
    manifest = {"command": GROWTH_COMMAND, "base": {n: e["sha256"] for n, e in base.items()},
                "parts": parts + [new_part],
                "total": {name: stats(raw) for name, (raw, _) in raws.items()}}
    tmp = GROWTH / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, GROWTH / "manifest.json")   # last: a pack stopped before it leaves the old state
    return manifest


def _growth(name: str) -> bytes:
    """The committed growth of file ``name``: its parts' rows in order, each checked."""
    out = []
    for i, part in enumerate(growth_parts(_growth_manifest())):
        entry = part["files"][name]
        packed = (GROWTH / entry["file"]).read_bytes()
        if sha256(packed) != entry["xz_sha256"]:
            raise SystemExit(f"bench/train_data/growth/{entry['file']} does not match its manifest (sha256)")
        raw = lzma.decompress(packed)
        if sha256(raw) != entry["sha256"]:
            raise SystemExit(f"bench/train_data/growth/{entry['file']} decompresses to the wrong bytes")
        out.append(raw)
    return b"".join(out)


def restore(work: Path, with_growth: bool = False) -> None:
    manifest = json.loads((DATA / "manifest.json").read_text())
    work.mkdir(parents=True, exist_ok=True)
    if with_growth and not (GROWTH / "manifest.json").exists():
        raise SystemExit("no growth is committed (bench/train_data/growth/manifest.json): restore without --with-growth")
    for name, entry in manifest["files"].items():
        dst = work / name
        if dst.exists():
            raise SystemExit(f"{dst} exists: not replaced (move it away to restore the committed data)")
        raw = _unpacked(name, entry) + (_growth(name) if with_growth else b"")
        entry = {**entry, **stats(raw)} if with_growth else entry
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.write_bytes(raw)
        os.replace(tmp, dst)
        print(f"restored {dst} ({entry['rows']} rows, {entry['response_tokens']:,} response tokens, "
              f"sha256 {sha256(raw)[:12]}...)")


def check() -> None:
    manifest = json.loads((DATA / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        _unpacked(name, entry)
        print(f"ok {name}: {entry['rows']} rows, sha256 {entry['sha256']}")
        if (GROWTH / "manifest.json").exists():
            _growth(name)
            print(f"ok growth/{name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="compress WORK/distill.jsonl (+ rejected) into bench/train_data/")
    a.add_argument("work")
    a.add_argument("--note", default="", help="what state the data is in (complete, or how far)")
    g = sub.add_parser("pack-growth", help="compress the rows WORK's files hold past the base into "
                       "bench/train_data/growth/")
    g.add_argument("work")
    g.add_argument("--note", default="", help="how far the growth is")
    b = sub.add_parser("restore", help="decompress bench/train_data/ into WORK (checks sha256)")
    b.add_argument("work")
    b.add_argument("--with-growth", action="store_true", help="append the committed growth/ rows")
    sub.add_parser("check", help="check the archive against its manifest")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        m = pack(Path(args.work), args.note)
        for name, e in m["files"].items():
            print(f"{name}: {e['rows']} rows, {e['response_tokens']:,} response tokens, "
                  f"{e['bytes']:,} -> {e['xz_bytes']:,} bytes")
    elif args.cmd == "pack-growth":
        m = pack_growth(Path(args.work), args.note)
        for name, e in m["parts"][-1]["files"].items():
            t = m["total"][name]
            print(f"{name}: part {len(m['parts']) - 1}, +{e['rows']} rows, +{e['response_tokens']:,} "
                  f"response tokens ({t['rows']} rows, {t['response_tokens']:,} in all), "
                  f"{e['bytes']:,} -> {e['xz_bytes']:,} bytes")
    elif args.cmd == "restore":
        restore(Path(args.work), args.with_growth)
    else:
        check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
