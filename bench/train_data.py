"""The committed self-distilled data of the demo target: pack it into the repository, restore it
into a pipeline's work directory.

    python bench/train_data.py pack runs/demo-pipeline-v2       # after a distillation: writes bench/train_data/
    python bench/train_data.py restore runs/demo-pipeline-v2    # what bench/pipelines/demo_pipeline.sh runs
    python bench/train_data.py check                            # the archive matches its manifest

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


def restore(work: Path) -> None:
    manifest = json.loads((DATA / "manifest.json").read_text())
    work.mkdir(parents=True, exist_ok=True)
    for name, entry in manifest["files"].items():
        dst = work / name
        if dst.exists():
            raise SystemExit(f"{dst} exists: not replaced (move it away to restore the committed data)")
        raw = _unpacked(name, entry)
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.write_bytes(raw)
        os.replace(tmp, dst)
        print(f"restored {dst} ({entry['rows']} rows, {entry['response_tokens']:,} response tokens, "
              f"sha256 {entry['sha256'][:12]}...)")


def check() -> None:
    manifest = json.loads((DATA / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        _unpacked(name, entry)
        print(f"ok {name}: {entry['rows']} rows, sha256 {entry['sha256']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="compress WORK/distill.jsonl (+ rejected) into bench/train_data/")
    a.add_argument("work")
    a.add_argument("--note", default="", help="what state the data is in (complete, or how far)")
    b = sub.add_parser("restore", help="decompress bench/train_data/ into WORK (checks sha256)")
    b.add_argument("work")
    sub.add_parser("check", help="check the archive against its manifest")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        m = pack(Path(args.work), args.note)
        for name, e in m["files"].items():
            print(f"{name}: {e['rows']} rows, {e['response_tokens']:,} response tokens, "
                  f"{e['bytes']:,} -> {e['xz_bytes']:,} bytes")
    elif args.cmd == "restore":
        restore(Path(args.work))
    else:
        check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
