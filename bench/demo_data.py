"""Data files for the demo-target bench scripts (curve_demo.sh, ablation.sh, head_demo.sh),
from one self-distilled file.

    python bench/demo_data.py prefix   SRC DST TOKENS HELD [--disjoint] [--from-row N]
                                       [--replay TOKENS --replay-from ROW]
    python bench/demo_data.py corpus   SRC DST HELD [--disjoint]
    python bench/demo_data.py prompts  DATA DST HELD
    python bench/demo_data.py heldout  SRC DST HELD
    python bench/demo_data.py mix      DATA GREEDY DST HELD
    python bench/demo_data.py usable   DATA HELD TARGET MAX_LEN

``prefix``: the first HELD rows of SRC are the held-out rows (moved to the end of DST, where
`fastmtp curve --heldout-rows HELD` takes them from); the training rows are read from row HELD on
until TOKENS response tokens (+5%: rows longer than --max-len are cut when training). The same
layout as bench/pipelines/curve_demo.sh, so a point here and a point there train on the same rows.
With ``--disjoint`` no training row shares a prompt with a held-out row (the held-out rows' other
samples are skipped: with 8 samples per prompt, 4 of a held-out prompt's came after row HELD, and
the held-out score read answers to prompts the head had trained on); without it, the rows the
shipped heads were trained on (101 such rows in their 7,872). ``--replay TOKENS --replay-from R``:
a warm restart on new rows that keeps seeing the old: about TOKENS response tokens of rows drawn
(seed 0) from rows R to --from-row, mixed with the new rows in one shuffled order (seed 0).
``corpus``: the responses of SRC's rows after the held-out ones, as jsonl text for
`fastmtp build-vocab --corpus` (a table from the target's own outputs, never the held-out rows).
``prompts``: one row per distinct prompt of DATA's training rows, for a greedy `fastmtp distill`.
``heldout``: one row per distinct prompt of SRC's first HELD rows (the held-out rows), with its
source (the prompt id without its number: alpaca_eval, seed, synth-rag, ...) as the category, for
`fastmtp bench --prompts DST`: served greedy tau on prompts no training row of a ``--disjoint``
prefix shares, drawn from the training sources rather than from the evaluation files, to choose
between heads without tuning on bench/data.
``mix``: DATA with the last sample of every prompt that has two or more replaced by that prompt's
greedy continuation from GREEDY (when it survived distill's filters): the same prompts and the
same number of rows, about a quarter of them greedy; held-out rows untouched.
``usable``: "TOKENS ROWS", the response tokens and rows before DATA's last HELD rows as training
reads them (TARGET's tokenizer, responses cut at MAX_LEN): the largest point `fastmtp curve
--tokens` can train, known before any feature is computed.
"""

from __future__ import annotations

import json
import random
import sys


def _rows(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.readlines()


def _write(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)


def prefix(src: str, dst: str, tokens: int, held: int, disjoint: bool = False,
           from_row: int | None = None, replay: int = 0, replay_from: int | None = None) -> None:
    rows = _rows(src)
    start = held if from_row is None else from_row
    if len(rows) <= max(held, start):
        sys.exit(f"{src} has {len(rows)} rows; {held} are held out and training starts at row {start}")
    if start < held:
        sys.exit(f"--from-row {start} is inside the {held} held-out rows")
    held_prompts = {json.loads(x)["prompt_id"] for x in rows[:held]} if disjoint else set()
    take, n, skipped = [], 0, 0
    for line in rows[start:]:
        if n >= tokens * 1.05:
            break
        r = json.loads(line)
        if r["prompt_id"] in held_prompts:
            skipped += 1
            continue
        take.append(line)
        n += len(r["response_ids"])
    n_replay = m_replay = 0
    if replay:
        lo = held if replay_from is None else replay_from
        if not held <= lo < start:
            sys.exit(f"--replay-from {lo} must lie between the held-out rows ({held}) and --from-row ({start})")
        pool = [x for x in rows[lo:start] if json.loads(x)["prompt_id"] not in held_prompts]
        random.Random(0).shuffle(pool)
        old, m = [], 0
        for line in pool:
            if m >= replay:
                break
            old.append(line)
            m += len(json.loads(line)["response_ids"])
        print(f"prefix: + {len(old)} replayed rows ({m} response tokens) of rows {lo}-{start - 1}",
              file=sys.stderr)
        take += old
        random.Random(0).shuffle(take)
        n_replay, m_replay = len(old), m
    if skipped:
        print(f"prefix: {skipped} rows skipped (their prompts are held out)", file=sys.stderr)
    if n < tokens:
        print(f"prefix: only {n} response tokens from row {start}; larger points are "
              "skipped by fastmtp curve", file=sys.stderr)
    _write(dst, take + rows[:held])
    print(f"prefix: {len(take)} training rows ({n + m_replay} response tokens"
          f"{f', {n_replay} rows replayed' if n_replay else ''}) + {held} held-out rows -> {dst}")


def corpus(src: str, dst: str, held: int, disjoint: bool = False) -> None:
    rows = _rows(src)
    held_prompts = {json.loads(x)["prompt_id"] for x in rows[:held]} if disjoint else set()
    out = [json.dumps({"text": r["response"]}, ensure_ascii=False) + "\n"
           for r in map(json.loads, rows[held:]) if r["prompt_id"] not in held_prompts]
    _write(dst, out)
    print(f"corpus: {len(out)} responses -> {dst}")


def _distinct(lines: list[str]) -> dict[str, str]:
    """prompt_id -> prompt, first occurrence, in order."""
    seen: dict[str, str] = {}
    for line in lines:
        r = json.loads(line)
        seen.setdefault(r["prompt_id"], r["prompt"])
    return seen


def prompts(data: str, dst: str, held: int = 0) -> None:
    rows = _rows(data)
    seen = _distinct(rows[: len(rows) - held] if held else rows)
    _write(dst, [json.dumps({"id": k, "prompt": v}, ensure_ascii=False) + "\n" for k, v in seen.items()])
    print(f"prompts: {len(seen)} distinct prompts -> {dst}")


def heldout(src: str, dst: str, held: int) -> None:
    seen = _distinct(_rows(src)[:held])
    _write(dst, [json.dumps({"id": k, "source": k.rsplit("-", 1)[0], "prompt": v}, ensure_ascii=False)
                 + "\n" for k, v in seen.items()])
    print(f"heldout: {len(seen)} distinct prompts of the first {held} rows -> {dst}")


def mix(data: str, greedy: str, dst: str, held: int) -> None:
    rows = _rows(data)
    train, tail = rows[: len(rows) - held], rows[len(rows) - held:]
    by_prompt = {json.loads(x)["prompt_id"]: x for x in _rows(greedy)}
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, line in enumerate(train):
        pid = json.loads(line)["prompt_id"]
        last[pid] = i
        count[pid] = count.get(pid, 0) + 1
    swapped = 0
    for pid, i in last.items():
        if count[pid] >= 2 and pid in by_prompt:
            train[i] = by_prompt[pid]
            swapped += 1
    _write(dst, train + tail)
    print(f"mix: {swapped} of {len(train)} training rows replaced by greedy continuations -> {dst}")


def usable(data: str, held: int, target: str, max_len: int) -> tuple[int, int]:
    from transformers import AutoTokenizer

    from fastmtp_sglang.training.data import load_examples

    tok = AutoTokenizer.from_pretrained(target)
    ex, _ = load_examples(data, tok, len(tok), max_len)
    pool = ex[: max(len(ex) - held, 0)]
    return sum(len(e.ids) - e.prompt_len for e in pool), len(pool)


if __name__ == "__main__":
    cmd, *a = sys.argv[1:] or [""]
    if cmd == "prefix":
        def opt(name):
            return int(float(a[a.index(name) + 1])) if name in a else None
        prefix(a[0], a[1], int(float(a[2])), int(a[3]), "--disjoint" in a[4:], opt("--from-row"),
               opt("--replay") or 0, opt("--replay-from"))
    elif cmd == "corpus":
        corpus(a[0], a[1], int(a[2]), "--disjoint" in a[3:])
    elif cmd == "prompts":
        prompts(a[0], a[1], int(a[2]) if len(a) > 2 else 0)
    elif cmd == "heldout":
        heldout(a[0], a[1], int(a[2]))
    elif cmd == "mix":
        mix(a[0], a[1], a[2], int(a[3]))
    elif cmd == "usable":
        print(*usable(a[0], int(a[1]), a[2], int(a[3])))
    else:
        sys.exit(__doc__)
