"""Copy a trained draft directory into the package as a shipped head, with its own table.

    python bench/ship_head.py RUN_DIR TABLE.pt [--extra builtin:smollm2/zh-4096] \
        [--name smollm2-135m-fastmtp-k3]

Writes ``fastmtp_sglang/data/heads/NAME/`` (replacing what is there, through a temporary folder
and one rename): ``config.json`` (``fastmtp.vocab_tables`` = the copied table, then the
``--extra`` refs), ``model.safetensors``, ``train_log.jsonl`` and the table's ``.pt`` and
``.json``. The table must be the one the head was trained with (its name is in the training
record) unless ``--any-table``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="trained draft directory (config.json, model.safetensors)")
    ap.add_argument("table", help="the compressed table (.pt with its .json sidecar)")
    ap.add_argument("--extra", nargs="*", default=["builtin:smollm2/zh-4096"],
                    help="further vocab_tables entries (builtin refs), e.g. a Chinese table")
    ap.add_argument("--name", default="smollm2-135m-fastmtp-k3")
    ap.add_argument("--any-table", action="store_true", help="skip the trained-with check")
    args = ap.parse_args()

    run, table = Path(args.run), Path(args.table)
    cfg = json.loads((run / "config.json").read_text())
    trained = ((cfg.get("fastmtp") or {}).get("training") or {}).get("vocab") or {}
    side = json.loads(table.with_suffix(".json").read_text())
    if not args.any_table and (trained.get("size"), trained.get("name")) != (side.get("size"), table.stem):
        raise SystemExit(f"{run} was trained with {trained or 'the full vocabulary'}, not {table.name}")
    cfg["fastmtp"]["vocab_tables"] = [table.name] + list(args.extra)
    dst = REPO / "fastmtp_sglang" / "data" / "heads" / args.name
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("model.safetensors", "train_log.jsonl"):
        shutil.copy2(run / f, tmp / f)
    shutil.copy2(table, tmp / table.name)
    shutil.copy2(table.with_suffix(".json"), tmp / table.with_suffix(".json").name)
    old = dst.with_name(dst.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
    print(f"shipped {run} -> {dst} (tables: {cfg['fastmtp']['vocab_tables']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
