"""Sandwiched timing (benchmark/sandwich.py) on a synthetic machine driven by a fake clock:
linear drift of 2x over the run gives the true ratios, a burst inside one block is flagged and
left out, rounds stop when the ratios are settled, and the budget stops an unsettled run."""

from __future__ import annotations

import random

import pytest

from fastmtp_sglang.benchmark import sandwich

TRUE = {"0": 100.0, "1": 130.0, "2": 150.0, "auto": 140.0}   # tokens/s on an unloaded machine
TOKENS = 600                                                  # per block


class Machine:
    """A fake clock and a machine whose speed is ``speed(t)``; a block of an arm takes the
    time its tokens need at that arm's rate times the speed, integrated over the block."""

    def __init__(self, speed, noise=0.0, seed=0):
        self.t, self.speed, self.noise = 0.0, speed, noise
        self.rng = random.Random(seed)

    def clock(self) -> float:
        return self.t

    def run_block(self, arm: str, rnd: int) -> tuple[int, float]:
        start, left, dt = self.t, float(TOKENS), 0.01
        jitter = 1 + self.noise * self.rng.uniform(-1, 1)
        while left > 0:
            left -= TRUE[arm] * jitter * self.speed(self.t) * dt
            self.t += dt
        return TOKENS, self.t - start


def test_linear_drift_of_2x_cancels():
    """Speed falls linearly from 1 to 0.5 over the run: every ratio is the true one (to the
    integration step), where comparing whole blocks with the first baseline is off by up to 2x."""
    span = 200.0
    m = Machine(lambda t: 1.0 - 0.5 * min(t, span) / span)
    res = sandwich.run(m.run_block, list(TRUE), "0", bound=0.005, min_rounds=3, max_rounds=3,
                       clock=m.clock)
    assert m.t > 0.9 * span or res.rounds == 3
    for arm in ("1", "2", "auto"):
        want = TRUE[arm] / TRUE["0"]
        assert res.verdicts[arm].mean == pytest.approx(want, rel=2e-3), arm
        assert not res.verdicts[arm].flagged
        for r in res.ratios:
            if r.arm == arm:
                assert r.value == pytest.approx(want, rel=4e-3)
    # the naive reading (each block against the run's first baseline block) is far off
    first = res.blocks[0].rate
    last_auto = [b for b in res.blocks if b.arm == "auto"][-1]
    assert last_auto.rate / first < 0.9 * TRUE["auto"] / TRUE["0"]


def test_a_burst_inside_one_block_is_caught_and_left_out():
    """Speed halves for a few seconds inside one block of arm 2: that block's ratio is flagged,
    the verdict is the true ratio from the other rounds."""
    holder = {}

    def speed(t):
        b = holder.get("burst")
        return 0.5 if b and b[0] <= t < b[1] else 1.0

    m = Machine(speed)
    seen = {"n": 0}

    def run_block(arm, rnd):
        if arm == "2" and rnd == 1 and "burst" not in holder:
            holder["burst"] = (m.t + 0.5, m.t + 3.0)   # inside this block only
        seen["n"] += 1
        return m.run_block(arm, rnd)

    res = sandwich.run(run_block, list(TRUE), "0", bound=0.01, min_rounds=4, max_rounds=4,
                       clock=m.clock)
    v = res.verdicts["2"]
    assert [r.round for r in v.flagged] == [1]
    assert "burst" in v.flagged[0].flagged
    assert v.mean == pytest.approx(TRUE["2"] / TRUE["0"], rel=2e-3)
    for arm in ("1", "auto"):
        assert not res.verdicts[arm].flagged


def test_rounds_stop_when_settled_and_the_budget_stops_a_noisy_run():
    steady = Machine(lambda t: 1.0, noise=0.01, seed=1)
    res = sandwich.run(steady.run_block, list(TRUE), "0", bound=0.02, min_rounds=3, max_rounds=20,
                       clock=steady.clock)
    assert res.stopped == "settled" and 3 <= res.rounds < 20
    for arm in ("1", "2", "auto"):
        assert res.verdicts[arm].settled(0.02)
        assert res.verdicts[arm].mean == pytest.approx(TRUE[arm] / TRUE["0"], rel=0.02)
    noisy = Machine(lambda t: 1.0, noise=0.09, seed=2)
    res = sandwich.run(noisy.run_block, list(TRUE), "0", bound=0.001, min_rounds=3, max_rounds=50,
                       budget_s=120, clock=noisy.clock)
    assert res.stopped == "time budget" and res.rounds < 50
    assert not all(v.settled(0.001) for v in res.verdicts.values())
    # a budget spent inside the first round still runs the rounds asked for at least
    res = sandwich.run(noisy.run_block, list(TRUE), "0", bound=0.001, min_rounds=3, max_rounds=50,
                       budget_s=1e-9, clock=noisy.clock)
    assert res.stopped == "time budget" and res.rounds == 3
    assert all(len(v.kept) + len(v.flagged) == 3 for v in res.verdicts.values())


def test_schedule_sandwiches_every_arm_and_rotates():
    arms = ["0", "1", "2", "3"]
    seen_first = set()
    for rnd in range(6):
        seq = sandwich.schedule(arms, "0", rnd)
        assert seq[1::2] == ["0"] * 3 and sorted(seq[0::2]) == ["1", "2", "3"]
        seen_first.add(seq[0])
    assert seen_first == {"1", "2", "3"}
    with pytest.raises(ValueError, match="baseline"):
        sandwich.run(lambda a, r: (1, 1.0), ["1", "2"], "0")


def test_the_concurrency_bench_reports_sandwiched_ratios_under_drift():
    """run_levels_sandwiched over synthetic runners (10 requests of 60 tokens a block) on a
    machine slowing 2x: the report's speedups are the true ratios, every level says how many
    rounds it took and that it settled, and auto is held against the best static arm."""
    from fastmtp_sglang.benchmark.concurrency import (RequestRecord, apply_sandwich, markdown,
                                                      run_levels_sandwiched, summarize_levels)

    m = Machine(lambda t: 1.0 - 0.5 * min(t, 400.0) / 400.0)

    def runner(arm):
        def run(bodies, level):
            tokens, wall = m.run_block(arm, 0)
            return wall, [RequestRecord(tokens // 10, 0.1, wall, 5) for _ in range(10)]
        return run

    runners = {a: runner(a) for a in TRUE}
    runs, verdicts = run_levels_sandwiched(runners, [[1, 2, 3]], [1, 4], {"max_new_tokens": 8}, 10,
                                           bound=0.01, min_rounds=3, max_rounds=6, warmup=False,
                                           progress=False, clock=m.clock)
    table = summarize_levels(runs)
    notes = apply_sandwich(table, verdicts, 0.01)
    for lv in ("1", "4"):
        assert notes[lv]["stopped"] == "settled" and notes[lv]["rounds"] == 3
        for arm in ("1", "2", "auto"):
            assert table[lv][arm]["speedup"] == pytest.approx(TRUE[arm] / TRUE["0"], rel=3e-3)
    md = markdown(table, {"label": "x", "sandwich": notes})
    assert "- concurrency 4: 3 rounds, settled at ±1.0%: 1 1.30" in md or \
        "- concurrency 4: 3 rounds, settled at ±1.0%: 1 1.29" in md
    assert "auto against the best static arm" in md and "| 4 | 2 | 1.50x | 1.40x |" in md
    assert "rounds of sandwiched blocks" in md and "paired within a repeat" not in md
