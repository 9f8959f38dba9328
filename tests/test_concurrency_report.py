"""The concurrency report's reading aids: auto against the best static arm per level, and how far
the repeats were apart (a noisy run is said to be one), from hand-made runs."""

from __future__ import annotations

import pytest

from fastmtp_sglang.benchmark.concurrency import (LevelRun, RequestRecord, against_best_static,
                                                  level_bodies, markdown, repeat_spread,
                                                  request_budgets, summarize_levels)
from fastmtp_sglang.core.errors import FastMTPError


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


def test_varied_lengths_give_every_arm_the_same_budgets_around_the_mean():
    """--length-spread: each request its own budget, uniform within the spread of the mean, the
    same for every call with the same arguments (so every arm of a level runs the same
    requests); spread 0 leaves every request at max_new_tokens; a spread of 1 or more is refused."""
    sampling = {"max_new_tokens": 64, "temperature": 0.0, "seed": 3}
    a = level_bodies([[1, 2], [3]], 8, 16, sampling, 2, length_spread=0.5)
    b = level_bodies([[1, 2], [3]], 8, 16, sampling, 2, length_spread=0.5)
    budgets = [x["sampling_params"]["max_new_tokens"] for x in a]
    assert budgets == [x["sampling_params"]["max_new_tokens"] for x in b] == request_budgets(16, 64, 0.5, 3)
    assert len(budgets) == 16 and all(32 <= n <= 96 for n in budgets) and len(set(budgets)) > 4
    assert sampling["max_new_tokens"] == 64  # the shared dict is not written
    assert [x["input_ids"] for x in a[:3]] == [[1, 2], [3], [1, 2]]
    many = request_budgets(4000, 64, 0.5, 0)
    assert min(many) == 32 and max(many) == 96 and abs(sum(many) / 4000 - 64) < 1.0
    assert request_budgets(16, 64, 0.5, 4) != budgets  # the seed picks the draws
    flat = level_bodies([[1]], 4, 4, sampling, 1)
    assert [x["sampling_params"]["max_new_tokens"] for x in flat] == [64] * 4
    with pytest.raises(FastMTPError, match=r"--length-spread must be in \[0, 1\)"):
        request_budgets(4, 64, 1.0)
    md = markdown(summarize_levels([_run("0", 1, 0, 40.0)]), {"max_new_tokens": 64, "length_spread": 0.5})
    assert "32-96 new tokens a request (uniform, mean 64)" in md
