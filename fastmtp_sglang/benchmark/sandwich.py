"""Timing that cancels drift: every arm's block sandwiched between two baseline blocks.

On a shared VM the machine's speed moves on the scale of tens of seconds (the concurrency runs
of the reference server saw repeats 13-148% apart), so comparing an arm's whole level with a
K=0 level measured minutes away reads the VM, not the arm. Here a level is a sequence of short
blocks (a fixed number of requests each):

    B a1 B a2 B a3 B | a2 B a3 B a1 B | ...      (B the baseline, arms rotated each round)

and each arm block's ratio is its throughput over the baseline's throughput *at the arm
block's midpoint*, interpolated linearly between the two neighbouring baseline blocks'
midpoints. A speed that drifts linearly in time cancels exactly (a block's throughput is the
rate at its midpoint times the work's own rate); slower drift than a block's length cancels
nearly. Rounds repeat until every arm's mean ratio is known to within ``bound`` (the half-width
of its 95% confidence interval, Student's t, relative to the mean) or the time budget or the
round limit is spent; the result says which. A burst inside one block (a neighbour's job for a
few seconds) shows as one ratio far from the arm's other rounds: ratios further than ``burst``
(relative) from the arm's median are flagged and left out, once an arm has 3 ratios.

Pure: the caller runs the blocks (``run_block(arm) -> (tokens, seconds)``) and gives the clock;
tests drive it with a synthetic machine (tests/test_sandwich.py).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

# Student's t, two-sided 95%, by degrees of freedom (n - 1); 2.0 beyond the table
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}


def t95(dof: int) -> float:
    if dof < 1:
        return math.inf
    keys = [k for k in _T95 if k <= dof]
    return _T95[max(keys)] if dof <= 30 else 2.0


@dataclass
class Block:
    """One block: ``arm`` ran from ``start`` to ``end`` (the caller's clock) and produced
    ``tokens`` in ``seconds`` of its own timing."""
    arm: str
    round: int
    start: float
    end: float
    tokens: int
    seconds: float

    @property
    def mid(self) -> float:
        return 0.5 * (self.start + self.end)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Ratio:
    arm: str
    round: int
    value: float             # the arm's rate / the baseline's rate at the arm's midpoint
    flagged: str | None = None


@dataclass
class Verdict:
    """An arm's ratios over the rounds: the mean of the kept ones, its 95% half-width
    relative to the mean, and which were flagged."""
    arm: str
    mean: float | None
    halfwidth: float         # relative; inf with fewer than 2 kept ratios
    kept: list[float] = field(default_factory=list)
    flagged: list[Ratio] = field(default_factory=list)

    def settled(self, bound: float) -> bool:
        return self.halfwidth <= bound


def schedule(arms: list[str], baseline: str, rnd: int) -> list[str]:
    """The arm blocks of round ``rnd``, each followed by a baseline block (the run starts with
    one baseline block): the arms rotated by the round and reversed every other round, so no
    arm always follows the same one."""
    others = [a for a in arms if a != baseline]
    if not others:
        return []
    k = rnd % len(others)
    order = others[k:] + others[:k]
    if rnd % 2:
        order = order[::-1]
    return [x for a in order for x in (a, baseline)]


def ratios(blocks: list[Block], baseline: str) -> list[Ratio]:
    """Each arm block's ratio against the baseline interpolated at its midpoint between the
    baseline blocks just before and just after it (blocks without both are skipped)."""
    blocks = sorted(blocks, key=lambda b: b.start)
    out = []
    for i, b in enumerate(blocks):
        if b.arm == baseline:
            continue
        before = next((x for x in reversed(blocks[:i]) if x.arm == baseline), None)
        after = next((x for x in blocks[i + 1:] if x.arm == baseline), None)
        if before is None or after is None or after.mid <= before.mid:
            continue
        w = (b.mid - before.mid) / (after.mid - before.mid)
        base = before.rate + w * (after.rate - before.rate)
        if base > 0:
            out.append(Ratio(b.arm, b.round, b.rate / base))
    return out


def judge(rs: list[Ratio], burst: float = 0.10) -> dict[str, Verdict]:
    """Per arm: flag ratios further than ``burst`` (relative) from the arm's median (once it
    has 3 or more), then the mean and relative 95% half-width of the rest."""
    out: dict[str, Verdict] = {}
    for arm in dict.fromkeys(r.arm for r in rs):
        mine = [r for r in rs if r.arm == arm]
        med = statistics.median(r.value for r in mine)
        if len(mine) >= 3:
            for r in mine:
                r.flagged = (f"{100 * (r.value / med - 1):+.0f}% from the median: a burst in "
                             "this block or a neighbour") if abs(r.value / med - 1) > burst else None
        kept = [r.value for r in mine if r.flagged is None]
        mean = statistics.fmean(kept) if kept else None
        hw = math.inf
        if len(kept) >= 2 and mean:
            hw = t95(len(kept) - 1) * statistics.stdev(kept) / math.sqrt(len(kept)) / mean
        out[arm] = Verdict(arm, mean, hw, kept, [r for r in mine if r.flagged])
    return out


@dataclass
class SandwichRun:
    blocks: list[Block]
    ratios: list[Ratio]
    verdicts: dict[str, Verdict]
    rounds: int
    stopped: str             # "settled", "time budget", "round limit"


def run(run_block: Callable[[str, int], tuple[int, float]], arms: list[str], baseline: str, *,
        bound: float = 0.02, min_rounds: int = 3, max_rounds: int = 12,
        budget_s: float | None = None, burst: float = 0.10,
        clock: Callable[[], float] = time.perf_counter,
        on_block: Callable[[Block], None] | None = None) -> SandwichRun:
    """Run sandwiched rounds until every arm is settled (half-width <= ``bound``), ``budget_s``
    of the clock has passed, or ``max_rounds`` ran; never fewer than ``min_rounds`` (a budget
    spent before them waits for them: one or two ratios an arm say nothing of their spread).
    ``run_block(arm, round) -> (tokens, seconds)`` runs one block."""
    if baseline not in arms:
        raise ValueError(f"the baseline {baseline!r} must be one of the arms {arms}")
    if min_rounds < 1 or max_rounds < min_rounds:
        raise ValueError(f"need 1 <= min_rounds <= max_rounds, got {min_rounds}, {max_rounds}")
    blocks: list[Block] = []
    t0 = clock()

    def one(arm: str, rnd: int) -> None:
        start = clock()
        tokens, seconds = run_block(arm, rnd)
        blocks.append(Block(arm, rnd, start, clock(), tokens, seconds))
        if on_block is not None:
            on_block(blocks[-1])

    one(baseline, 0)
    rnd, stopped = 0, "round limit"
    verdicts: dict[str, Verdict] = {}
    rs: list[Ratio] = []
    while rnd < max_rounds:
        for arm in schedule(arms, baseline, rnd):
            one(arm, rnd)
        rnd += 1
        rs = ratios(blocks, baseline)
        verdicts = judge(rs, burst)
        if rnd >= min_rounds and verdicts and all(v.settled(bound) for v in verdicts.values()):
            stopped = "settled"
            break
        if budget_s is not None and rnd >= min_rounds and clock() - t0 >= budget_s:
            stopped = "time budget"
            break
    return SandwichRun(blocks, rs, verdicts, rnd, stopped)
