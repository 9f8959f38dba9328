"""Acceptance metrics, defined once (docs/design.md section 2).

- A cycle is one target verification; it emits ``accepted + 1`` tokens.
- tau (acceptance length) = emitted tokens / cycles (SGLang: ``spec_accept_length``).
- A_k (cumulative) = fraction of cycles whose first k drafts were all accepted; tau = 1 + sum A_k.
- a_k (conditional) = A_k / A_{k-1}; where cycles verify different numbers of drafts (``auto``),
  among the cycles that accepted k-1 drafts only those that drafted a k-th: a cycle at K=1
  says nothing about position 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass
class CycleLog:
    accepted: int
    draft_s: float = 0.0
    verify_s: float = 0.0
    drafted: int | None = None  # drafts verified this cycle (differs from the engine's K under auto)
    source: str = ""            # hybrid: "lookup" when the row took prompt lookup's proposal, "splice" when the head continued it
    leaf: bool = False          # width > 1: the last accepted draft was a leaf, not the chain's (decode/leaves.py)


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    steps: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_memory_bytes: int = 0
    cycles: list[CycleLog] = field(default_factory=list)

    @property
    def verify_ct(self) -> int:
        return len(self.cycles)

    def summary(self) -> dict[str, Any]:
        s = summarize_cycles([c.accepted for c in self.cycles], self.steps)
        decode_tokens = max(self.completion_tokens - 1, 0)  # the first token comes from prefill
        s.update(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            prefill_s=self.prefill_s,
            decode_s=self.decode_s,
            decode_tokens_per_s=decode_tokens / self.decode_s if self.decode_s > 0 else 0.0,
            draft_s=sum(c.draft_s for c in self.cycles),
            verify_s=sum(c.verify_s for c in self.cycles),
            peak_memory_bytes=self.peak_memory_bytes,
        )
        return s


def summarize_cycles(accepted: Iterable[int], steps: int,
                     drafted: Iterable[int] | None = None) -> dict[str, Any]:
    """tau, A_k, a_k and the histogram of accepted counts from per-cycle accepted counts;
    ``drafted``: per cycle, the drafts it verified, where that varies (module docstring)."""
    acc = list(accepted)
    n = len(acc)
    hist = [0] * (steps + 1)
    for a in acc:
        hist[min(a, steps)] += 1
    A = [sum(1 for a in acc if a >= k) / n if n else 0.0 for k in range(1, steps + 1)]
    a_cond = []
    if drafted is not None:  # among the cycles that reached position k with a draft there
        pairs = list(zip(acc, drafted, strict=True))
        for k in range(1, steps + 1):
            tried = sum(1 for a, d in pairs if a >= k - 1 and d >= k)
            a_cond.append(sum(1 for a, d in pairs if a >= k and d >= k) / tried if tried else 0.0)
    else:
        prev = 1.0
        for v in A:
            a_cond.append(v / prev if prev > 0 else 0.0)
            prev = v
    return {
        "cycles": n,
        "emitted": sum(acc) + n,
        "tau": (sum(acc) + n) / n if n else 0.0,
        "A_k": A,
        "a_k": a_cond,
        "accept_hist": hist,
    }


def aggregate(metrics: list[RequestMetrics]) -> dict[str, Any]:
    """Pool cycles over requests (tau over all cycles), sum tokens and times."""
    steps = max((m.steps for m in metrics), default=0)
    s = summarize_cycles([c.accepted for m in metrics for c in m.cycles], steps)
    decode_tokens = sum(max(m.completion_tokens - 1, 0) for m in metrics)
    decode_s = sum(m.decode_s for m in metrics)
    s.update(
        requests=len(metrics),
        completion_tokens=sum(m.completion_tokens for m in metrics),
        decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
        prefill_s=sum(m.prefill_s for m in metrics),
        decode_s=decode_s,
        draft_s=sum(c.draft_s for m in metrics for c in m.cycles),
        verify_s=sum(c.verify_s for m in metrics for c in m.cycles),
        peak_memory_bytes=max((m.peak_memory_bytes for m in metrics), default=0),
    )
    return s
