"""The concurrency report's reading aids: auto against the best static arm per level, and how far
the repeats were apart (a noisy run is said to be one), from hand-made runs."""

from __future__ import annotations

import pytest

from fastmtp_sglang.benchmark.concurrency import (LevelRun, RequestRecord, against_best_static,
                                                  markdown, repeat_spread, summarize_levels)


def _run(arm: str, level: int, repeat: int, tok_s: float) -> LevelRun:
    """A run whose output tokens/s is ``tok_s`` (10 requests of 10 tokens)."""
    recs = [RequestRecord(tokens=10, ttft_s=0.1, e2e_s=1.0, verify_ct=9) for _ in range(10)]
    return LevelRun(arm, level, repeat, wall_s=100 / tok_s, records=recs)


# level 1: lookup3 is the best static arm, auto 5% below it; level 16: K=0 best, auto 1% above
# it; at 16 K=0's repeats are 30% apart (paired: the arms' speedups agree), and K=1's speedup
# is 0.9x in one repeat and 1.1x in the other (only at the noisy level)
TOK = {(1, "0"): (40, 40), (1, "1"): (44, 44), (1, "lookup3"): (48, 48), (1, "auto"): (45.6, 45.6),
       (16, "0"): (100, 130), (16, "1"): (90, 143), (16, "lookup3"): (80, 104), (16, "auto"): (101, 131.3)}


@pytest.fixture
def table():
    runs = [_run(arm, lv, rep, tok[rep]) for (lv, arm), tok in TOK.items() for rep in (0, 1)]
    return summarize_levels(runs)


def test_auto_is_held_against_the_best_static_arm_at_each_level(table):
    best = against_best_static(table)
    assert best["1"]["best"] == "lookup3" and best["1"]["best_speedup"] == pytest.approx(1.2)
    assert best["1"]["vs_best"] == pytest.approx(1.14 / 1.2 - 1)
    assert best["16"]["best"] == "0" and best["16"]["best_speedup"] == 1.0   # K=0 itself (K=1: 1.0 median)
    assert best["16"]["vs_best"] == pytest.approx(0.01) and best["16"]["vs_baseline"] == pytest.approx(0.01)
    assert against_best_static(table, arm="none") == {}


def test_the_report_says_when_repeats_are_too_far_apart(table):
    spread = repeat_spread(table)
    assert spread["1"] == {"baseline": 0.0, "speedup": 0.0}
    assert spread["16"]["baseline"] == pytest.approx(30 / 115) and spread["16"]["speedup"] == pytest.approx(0.2)
    md = markdown(table, {"label": "x"})
    assert "| 1 | lookup3 | 1.20x | 1.14x | -5.0% | +14.0% |" in md
    assert "| 16 | 0 | 1.00x | 1.01x | +1.0% | +1.0% |" in md
    assert "- concurrency 16: K=0 26%, speedups 20%" in md
    assert "**Noisy run**" in md and "concurrency 16;" in md and "concurrency 1," not in md
    steady = summarize_levels([_run(a, 1, r, TOK[(1, a)][r]) for a in ("0", "auto") for r in (0, 1)])
    assert "Noisy run" not in markdown(steady, {"label": "x"})
