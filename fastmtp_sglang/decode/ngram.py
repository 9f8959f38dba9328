"""Prompt lookup (n-gram) drafting: the peer every draft head has to beat.

The drafter matches the last ``n`` tokens of a request (prompt + output so far) against earlier
positions of the same sequence and proposes the ``K`` tokens that followed the match; ``n`` runs
from ``max_ngram`` down to ``min_ngram`` and the earliest match wins, which is what transformers'
``generate(prompt_lookup_num_tokens=K)`` does (``max_matching_ngram_size`` 2 by default). It
costs no model call, so on text that copies from its prompt (summaries, RAG answers, code edits)
it is hard to beat. Verification is the engine's usual one: the proposal is a deterministic draft
(q is one-hot at each proposed token), so greedy and sampled output stay exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NgramDrafter:
    max_ngram: int = 2
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    @property
    def name(self) -> str:
        return f"ngram (prompt lookup, n={self.max_ngram}..{self.min_ngram})"

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest
        matching suffix of ``seq``; [] when nothing matches."""
        return self.propose_match(seq, k)[0]

    def propose_match(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """:meth:`propose`, and the length n of the suffix that matched (0 when nothing did): the
        hybrid drafter trusts a long match more than a short one."""
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            pat = seq[n_seq - n:]
            first = pat[0]
            # candidate starts i < n_seq - n (the suffix itself is not a match)
            for i in range(n_seq - n):
                if seq[i] == first and seq[i:i + n] == pat:
                    cont = seq[i + n: i + n + k]
                    if cont:
                        return cont, n
        return [], 0
