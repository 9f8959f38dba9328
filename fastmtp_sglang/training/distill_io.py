"""The files of a `fastmtp distill` run: ``<out>`` (the kept samples) and
``<out>.rejected.jsonl`` (those a filter dropped), repaired when a crash cut a line and checked
before a rerun appends to them, and ``<out>.stats.json``, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from fastmtp_sglang.core.errors import FastMTPError

# settings that must match between runs writing one file (the seed differs per sample)
RESUME_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")


def stats_path(out: Path) -> Path:
    return out.with_name(out.name + ".stats.json")


def rejected_path(out: Path) -> Path:
    return out.with_name(out.name + ".rejected.jsonl")


def atomic_write(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it: a crash leaves the old file or the
    new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_jsonl_repair(path: Path, required: tuple[str, ...] = ("id",)) -> tuple[list[dict], list[str]]:
    """Records of a JSONL file we append to, repairing it in place when damaged.

    A line that is not a JSON object with the ``required`` keys, a line without its newline
    (the last one, cut by a crash), and a repeated ``id`` are dropped; if any was, the file is
    rewritten (atomically) with the good lines only. Returns (records, "line N: reason" for each
    dropped line). A missing file is empty.
    """
    if not path.exists():
        return [], []
    raw = path.read_bytes()
    records: list[dict] = []
    good: list[bytes] = []
    dropped: list[str] = []
    ids: set[str] = set()
    lines = raw.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else the cut-off last line
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            dropped.append(f"line {lineno}: not JSON ({getattr(exc, 'msg', exc)})")
            continue
        if not isinstance(rec, dict) or any(k not in rec for k in required):
            dropped.append(f"line {lineno}: not an object with {list(required)}")
            continue
        if rec["id"] in ids:
            dropped.append(f"line {lineno}: id {rec['id']!r} repeated")
            continue
        ids.add(rec["id"])
        records.append(rec)
        good.append(line)
    if tail.strip():
        dropped.append(f"line {len(lines) + 1}: cut off (no newline; a crash mid-write)")
    if dropped:
        atomic_write(path, "".join(g.decode("utf-8") + "\n" for g in good))
    return records, dropped


def check_resume(records: list[dict], sampling: dict[str, Any] | Callable[[dict], dict[str, Any]],
                 target: str, out: Path, render: Callable[[str], str] | None = None) -> None:
    """Refuse to append to a file written with other settings or for another target.

    ``sampling``: the settings every record should have, or ``sampling(record)`` -> the settings
    that record's sample should have (a temperature per sample index).

    ``render(prompt) -> templated text``: this run's chat template and system message; a record
    whose ``prompt_text`` differs was written with another ``--system`` (or template)."""
    for rec in records[:1] + records[-1:]:
        if render is not None and "prompt" in rec and "prompt_text" in rec:
            if render(str(rec["prompt"])) != rec["prompt_text"]:
                raise FastMTPError(
                    f"{out} was written with another system message or chat template (its prompt "
                    f"{rec.get('prompt_id')!r} was rendered differently): use another --out, or "
                    "the same --system to resume")
        sp = rec.get("sampling_params") or {}
        want = sampling(rec) if callable(sampling) else sampling
        diff = {k: (sp.get(k), want[k]) for k in RESUME_KEYS if sp.get(k) != want[k]}
        if diff:
            what = ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in diff.items())
            raise FastMTPError(f"{out} was written with other sampling settings ({what}); "
                               "use another --out, or the same settings to resume")
        if rec.get("target") != target:
            raise FastMTPError(f"{out} holds samples of target {rec.get('target')!r}, this run's "
                               f"is {target!r}; use another --out (or --target-name to name it)")
