"""The model ``auto`` prices its choices with (decode/auto.py): what a cycle's calls cost at a
batch size (:class:`StepCosts`, measured by decode/costs.py, interpolated between the row counts
measured) and how many tokens a row's acceptance estimates promise at each K
(:func:`expected_curve`, :func:`expected_tokens`; with leaves, :func:`expected_curve_leaves`).
Pure arithmetic on numbers; no engine, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCosts:
    """Milliseconds of the calls of one cycle at batch 1, and optionally at larger batches.

    verify : {n: ms} for the target forward over n new tokens (n = 1 is a plain step); n between
        measured points is interpolated, beyond the last one extrapolated linearly
    draft_step : one head step with its projection
    extend : the head's draft extend over the accepted positions
    extend_by_n : {n: ms} of the draft extend over n positions (the catch-up over the positions
        of K=0 cycles costs extend_ms(n)); empty: ``extend`` whatever n
    by_batch : {B: StepCosts measured with B rows}; a cycle of a batch of B rows costs what the
        nearest measured batch sizes say (linear in B between them, and beyond the largest)

    Read-only once built: the costs at a batch size are computed once and kept (the controller
    asks for the same few dozen every cycle; interpolated afresh they were most of what a
    cycle at K=0 spent choosing its K, docs/design.md section 6.8).
    """
    verify: dict[int, float]
    draft_step: float
    extend: float
    by_batch: dict[int, "StepCosts"] = field(default_factory=dict)
    extend_by_n: dict[int, float] = field(default_factory=dict)  # {n positions: ms}, measured
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_curve(cls, curve, batched: list | None = None) -> "StepCosts":
        """From a :class:`fastmtp_sglang.decode.costs.CostCurve` (measured with a head) at batch
        1, and optionally curves of the same calls at larger batches."""
        if curve.draft_step_ms is None:
            raise ValueError("the cost curve was measured without a head: no draft-step cost")
        ext = sorted(curve.extend_ms.values())
        own = cls(dict(curve.verify_ms), curve.draft_step_ms, ext[len(ext) // 2] if ext else 0.0,
                  extend_by_n=dict(curve.extend_ms))
        for c in batched or []:
            if getattr(c, "batch", 1) > 1:
                own.by_batch[c.batch] = cls.from_curve(c)
        return own

    def verify_ms(self, n: int) -> float:
        return _interp(self.verify, n)

    def _kept(self, key: tuple, fn) -> float:
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = fn()
        return v

    def verify_at(self, n: int, batch: int = 1) -> float:
        """The target forward over ``n`` new tokens of ``batch`` rows."""
        return self._kept(("v", n, batch), lambda: _at_batch(self, batch, lambda c: c.verify_ms(n)))

    def extend_ms(self, n: int, batch: int = 1) -> float:
        """The head's draft extend over ``n`` positions of ``batch`` rows (0 for n = 0)."""
        if n <= 0:
            return 0.0
        return self._kept(("e", n, batch), lambda: _at_batch(
            self, batch, lambda c: _interp(c.extend_by_n, n) if c.extend_by_n else c.extend))

    def cycle_ms(self, k: int, batch: int = 1) -> float:
        """A cycle at K of a batch of ``batch`` rows."""
        return self._kept(("c", k, batch), lambda: _at_batch(self, batch, lambda c: c._cycle_ms(k)))

    def _cycle_ms(self, k: int) -> float:
        return self.verify_ms(1) if k == 0 else self.verify_ms(k + 1) + k * self.draft_step + self.extend

    def draft_ms(self, k: int, batch: int = 1) -> float:
        """The head's share of a cycle at K: K draft steps, at the batch's size."""
        return _at_batch(self, batch, lambda c: k * c.draft_step)


def _interp(points: dict[int, float], n: int) -> float:
    """``points`` at ``n``: measured, interpolated between measured sizes, or beyond the last
    one along the last segment's slope."""
    if n in points:
        return points[n]
    pts = sorted(points)
    lo = max((p for p in pts if p < n), default=pts[0])
    hi = min((p for p in pts if p > n), default=None)
    if hi is None:  # beyond the last point: extend the last segment's slope
        a, b = (pts[-2], pts[-1]) if len(pts) > 1 else (pts[-1], pts[-1])
        slope = (points[b] - points[a]) / (b - a) if b != a else 0.0
        return points[b] + slope * (n - b)
    t = (n - lo) / (hi - lo)
    return points[lo] * (1 - t) + points[hi] * t


def _at_batch(costs: StepCosts, batch: int, fn) -> float:
    """``fn(costs at batch)``: from the measured batch sizes around ``batch``, linear in between
    and beyond the largest (batch 1 is ``costs`` itself)."""
    if batch <= 1 or not costs.by_batch:
        return fn(costs)
    pts = {1: costs, **costs.by_batch}
    sizes = sorted(pts)
    lo = max(b for b in sizes if b <= batch)
    hi = min((b for b in sizes if b > batch), default=None)
    if hi is None:  # beyond the largest measured batch: the last segment's slope
        lo, hi = sizes[-2], sizes[-1]
    a, b = fn(pts[lo]), fn(pts[hi])
    return a + (b - a) * (batch - lo) / (hi - lo)


def batch_class(batch: int) -> int:
    """The power of two at or below ``batch`` (1, 2, 4, 8, ...): batch sizes whose serving
    overhead is calibrated together."""
    return 1 << (max(int(batch), 1).bit_length() - 1)


def expected_curve(est: list[float], kmax: int) -> list[float]:
    """[E(0), E(1), ..., E(kmax)] of :func:`expected_tokens` in one pass (positions past
    ``est``'s end add nothing)."""
    out, total, run = [1.0], 1.0, 1.0
    for j in range(kmax):
        if j < len(est):
            run *= est[j]
            total += run
        out.append(total)
    return out


def expected_curve_leaves(est: list[float], leaf: list[float], kmax: int) -> list[float]:
    """:func:`expected_curve` of a head drafting with leaves (decode/leaves.py): at a position
    whose chain draft is rejected (1 - a_j), a leaf is accepted with probability ``leaf[j]``
    and ends the chain there, so E(K) = 1 + sum_{k<=K} prod_{j<k} a_j (a_k + (1 - a_k) l_k)."""
    out, total, run = [1.0], 1.0, 1.0
    for j in range(kmax):
        if j < len(est):
            a = est[j]
            total += run * (a + (1.0 - a) * (leaf[j] if j < len(leaf) else 0.0))
            run *= a
        out.append(total)
    return out


def expected_tokens(est: list[float], k: int) -> float:
    """E(K) = 1 + sum_{k'<=K} prod_{j<=k'} a_j for per-position conditional acceptances ``est``."""
    total, run = 1.0, 1.0
    for j in range(k):
        run *= est[j]
        total += run
    return total
