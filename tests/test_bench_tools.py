"""The bench scripts that choose training rows and draw a head's lineage: bench/demo_data.py prefix
(--from-row, --disjoint), bench/head_lineage.py (steps counted across warm restarts) and
bench/copy_share.py (offline prompt-lookup tau of distilled answers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)


@pytest.fixture
def distill(tmp_path):
    """12 rows, 3 samples of 4 prompts (p0 p1 p2 p3 p0 p1 ...), 10 response tokens each."""
    rows = [{"prompt_id": f"p{i % 4}", "prompt_ids": [1, 2], "response_ids": list(range(10)), "n": i}
            for i in range(12)]
    path = tmp_path / "distill.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ns(path: Path) -> list[int]:
    return [json.loads(x)["n"] for x in path.read_text().splitlines()]


def test_prefix_from_row_keeps_the_heldout_rows_and_starts_later(distill, tmp_path):
    out = tmp_path / "data.jsonl"
    r = _run("bench/demo_data.py", "prefix", str(distill), str(out), "1000", "2", "--from-row", "8")
    assert r.returncode == 0, r.stderr
    assert _ns(out) == [8, 9, 10, 11, 0, 1]  # training rows from 8, then the 2 held-out rows
    r = _run("bench/demo_data.py", "prefix", str(distill), str(out), "1000", "2", "--disjoint",
             "--from-row", "6")
    assert _ns(out) == [6, 7, 10, 11, 0, 1]  # rows 8, 9 share p0, p1 with the held-out rows
    assert "2 rows skipped" in r.stderr
    r = _run("bench/demo_data.py", "prefix", str(distill), str(out), "25", "2")
    assert _ns(out) == [2, 3, 4, 0, 1]  # stops once 1.05 x 25 tokens are in
    bad = _run("bench/demo_data.py", "prefix", str(distill), str(out), "100", "4", "--from-row", "2")
    assert bad.returncode != 0 and "inside the 4 held-out rows" in bad.stderr


def test_heldout_prompts_load_as_categories_by_source(tmp_path):
    """``heldout``: the distinct prompts of the first HELD rows, readable by ``fastmtp bench
    --prompts`` with their source as the category (a selector that is not an evaluation file)."""
    from fastmtp_sglang.core.prompts import load_prompts

    ids = ["alpaca_eval-7", "synth-rag-0003", "alpaca_eval-7", "seed-12", "synth-rag-0009"]
    src = tmp_path / "distill.jsonl"
    src.write_text("".join(json.dumps({"prompt_id": p, "prompt": f"say {p}"}) + "\n" for p in ids))
    out = tmp_path / "heldout.jsonl"
    r = _run("bench/demo_data.py", "heldout", str(src), str(out), "4")
    assert r.returncode == 0, r.stderr
    got = load_prompts(out)
    assert [(p.id, p.category, p.text) for p in got] == [
        ("alpaca_eval-7", "alpaca_eval", "say alpaca_eval-7"),
        ("synth-rag-0003", "synth-rag", "say synth-rag-0003"),
        ("seed-12", "seed", "say seed-12"),
    ]  # row 5 is past the held-out rows; the repeated prompt once


def test_usable_counts_what_training_reads(llama_target, tmp_path):
    """``usable``: response tokens and rows before the held-out tail, responses cut at max-len
    (the largest point fastmtp curve can train; head_demo.sh checks POINTS against it)."""
    rows = [{"prompt_id": f"p{i}", "prompt_ids": [1, 2, 3], "response_ids": list(range(4, 4 + n))}
            for i, n in enumerate([10, 30, 5, 7])]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _run("bench/demo_data.py", "usable", str(data), "1", str(llama_target.path), "20")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(10 + 17 + 5), "3"]  # 30 cut to 20 - 3; the last row held out


def _curve(path: Path, steps: int, walks: list[float], served: float) -> str:
    every = steps // len(walks)
    point = {"arm": "fastmtp", "tokens": 1000, "rows": 10, "optimizer_steps": steps,
             "heldout": {"tau_walk": 9.0}, "served_tau": {"3": served},
             "step_curve": [{"step": every * (i + 1), "tau_walk": w, "A_k": [0.5]}
                            for i, w in enumerate(walks)]}
    path.write_text(json.dumps({"meta": {"cpu": "test"}, "points": [point]}))
    return str(path)


def test_lineage_counts_steps_across_warm_restarts(tmp_path):
    a = _curve(tmp_path / "a.json", 100, [1.2, 1.4], 1.3)
    b = _curve(tmp_path / "b.json", 60, [1.45, 1.5, 1.55], 1.42)
    out = tmp_path / "lin"
    r = _run("bench/head_lineage.py", "--run", f"first=run={a}", "--run", f"second={b}",
             "--hline", "lookup=1.301", "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "lineage.json").read_text())
    first, second = doc["runs"]
    assert first["label"] == "first=run"  # the label may hold '=': the path is after the last one
    assert [c["step"] for c in second["curve"]] == [120, 140, 160]
    assert (second["steps_before"], second["steps_after"]) == (100, 160)
    assert second["heldout_tau_walk"] == 1.55 and second["served_tau"] == 1.42
    md = (out / "lineage.md").read_text()
    assert "| second | 1,000 | 60 | 160 | 1.550 | 1.420 |" in md and "| lookup |" in md
    assert (out / "lineage.png").stat().st_size > 1000
    bad = _run("bench/head_lineage.py", "--run", a, "--out", str(out))
    assert bad.returncode != 0 and "LABEL=VALUE" in bad.stderr


def test_lineage_takes_a_runs_served_tau_from_a_bench_result(tmp_path):
    a = _curve(tmp_path / "a.json", 100, [1.2, 1.4], 1.3)
    doc = json.loads(Path(b := _curve(tmp_path / "b.json", 50, [1.5], 0.0)).read_text())
    del doc["points"][0]["served_tau"]  # trained where it could not be served
    Path(b).write_text(json.dumps(doc))
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"results": {"overall": {"0": {"tau": 1.0}, "3": {"tau": 1.675}}}}))
    out = tmp_path / "lin"
    r = _run("bench/head_lineage.py", "--run", f"one={a}", "--run", f"gpu={b}",
             "--served", f"gpu={bench}", "--out", str(out))
    assert r.returncode == 0, r.stderr
    one, gpu = json.loads((out / "lineage.json").read_text())["runs"]
    assert (one["served_tau"], gpu["served_tau"]) == (1.3, 1.675)
    assert gpu["served_source"] == str(bench) and one["served_source"] == a
    assert "| gpu | 1,000 | 50 | 150 | 1.500 | 1.675 |" in (out / "lineage.md").read_text()
    typo = _run("bench/head_lineage.py", "--run", f"one={a}", "--served", f"ghost={bench}", "--out", str(out))
    assert typo.returncode != 0 and "--served names no --run: ghost" in typo.stderr
    wrong_k = _run("bench/head_lineage.py", "--run", f"one={a}", "--served", f"one={bench}", "--k", "5",
                   "--out", str(out))
    assert wrong_k.returncode != 0 and "has no K=5" in wrong_k.stderr


def test_prefix_replay_mixes_older_rows_into_a_warm_restart(distill, tmp_path):
    out = tmp_path / "data.jsonl"
    r = _run("bench/demo_data.py", "prefix", str(distill), str(out), "1000", "2", "--disjoint",
             "--from-row", "8", "--replay", "15", "--replay-from", "2")
    assert r.returncode == 0, r.stderr
    ns = _ns(out)
    # new rows 10, 11 (8, 9 share held-out prompts), and replayed rows of 2-7 without held-out
    # prompts (2, 3, 6, 7) until 15 tokens: two of them (10 tokens each); the held-out rows last
    train, replayed = ns[:-2], [n for n in ns[:-2] if n < 8]
    assert ns[-2:] == [0, 1] and sorted(n for n in train if n >= 8) == [10, 11]
    assert len(replayed) == 2 and set(replayed) <= {2, 3, 6, 7}
    assert "4 training rows (40 response tokens, 2 rows replayed)" in r.stdout
    again = tmp_path / "again.jsonl"
    _run("bench/demo_data.py", "prefix", str(distill), str(again), "1000", "2", "--disjoint",
         "--from-row", "8", "--replay", "15", "--replay-from", "2")
    assert again.read_text() == out.read_text()  # seeded
    bad = _run("bench/demo_data.py", "prefix", str(distill), str(out), "1000", "2", "--from-row", "8",
               "--replay", "15", "--replay-from", "9")
    assert bad.returncode != 0 and "--replay-from 9 must lie between" in bad.stderr


def test_copy_share_counts_lookup_cycles_and_groups_greedy_rows_by_source(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import copy_share
    finally:
        sys.path.remove(str(REPO / "bench"))
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    # nothing to copy: one target token a cycle
    assert copy_share.lookup_cycles(prompt, [1, 2, 3, 4]) == 4
    # the answer repeats the prompt: 10 (nothing matches yet), then 10 matches the prompt's 10:
    # 11-15 drafted and accepted + 16, then 17-20 (the answer ends inside the drafts)
    assert copy_share.lookup_cycles(prompt, prompt) == 3
    assert copy_share.lookup_cycles(prompt, prompt, k=2) == 5  # 10 | 11 12 13 | 14 15 16 | 17 18 19 | 20
    rows = [{"prompt": "a", "prompt_ids": prompt, "response_ids": prompt, "sampling_params": {"temperature": 0}},
            {"prompt": "b", "prompt_ids": prompt, "response_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0}},
            {"prompt": "a", "prompt_ids": prompt, "response_ids": [1, 2], "sampling_params": {"temperature": 0.6}}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"id": "x", "source": "copy", "prompt": "a"}) + "\n")
    r = _run("bench/copy_share.py", str(data), "--sources", str(src))
    assert r.returncode == 0, r.stderr
    assert "| copy | 1 | 3.67 |" in r.stdout  # 11 tokens in 3 cycles; the sampled row is skipped
    assert "| other | 1 | 1.00 |" in r.stdout
