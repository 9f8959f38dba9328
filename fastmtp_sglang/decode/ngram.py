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


AUTO_MAX_NGRAM = 4  # the longest match `--steps auto`'s prompt lookup tries (decode/auto_setup.py)


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


class NgramIndex:
    """:meth:`NgramDrafter.propose_match` over one growing sequence (a request's prompt and its
    output so far) in O(max_ngram) dictionary lookups per call: the earliest start of every
    n-gram that has a token after it is kept, and :meth:`sync` adds only the new tokens' n-grams.
    Why: the scan is a Python loop over the whole sequence per call, paid for every row every
    cycle before the hybrid drafter could choose K=0 (its cost against this index:
    docs/design.md section 6.7, "Prompt lookup's index")."""

    def __init__(self, drafter: NgramDrafter):
        self.drafter = drafter
        self.seq: list[int] = []
        self.first: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(drafter.min_ngram, drafter.max_ngram + 1)}

    def sync(self, prompt: list[int], out: list[int]) -> None:
        """Catch up with ``prompt + out`` (which only grows; anything else rebuilds)."""
        have, plen = len(self.seq), len(prompt)
        # (an empty prompt: the sequence starts with the output; have > 0 means out is not empty)
        if have > plen + len(out) or (have and (have < plen or self.seq[0] != (prompt or out)[0])):
            self.__init__(self.drafter)
            have = 0
        if have < plen:
            self._extend(prompt[have:])
            have = plen
        if have - plen < len(out):
            self._extend(out[have - plen:])

    def _extend(self, toks: list[int]) -> None:
        seq = self.seq
        old = len(seq)
        seq.extend(toks)
        new = len(seq)
        for n, table in self.first.items():
            # starts i with a token after the n-gram (i + n < len): those not registered before
            for i in range(max(0, old - n), new - n):
                table.setdefault(tuple(seq[i:i + n]), i)

    def propose_after(self, extra: list[int], k: int) -> tuple[list[int], int]:
        """The proposal for the sequence followed by ``extra`` (a head's drafts, not added): the
        ``k`` tokens after the earliest place in the sequence where its longest suffix that
        ends with ``extra`` occurs, and that suffix's length (([], 0) when none does)."""
        seq, d = self.seq, self.drafter
        for n in range(min(d.max_ngram, len(seq) + len(extra) - 1), d.min_ngram - 1, -1):
            key = tuple((seq[len(seq) - (n - len(extra)):] if n > len(extra) else []) + extra[-n:])
            i = self.first[n].get(key)
            if i is not None:
                return seq[i + n: i + n + k], n
        return [], 0

    def propose_match(self, k: int) -> tuple[list[int], int]:
        """What ``drafter.propose_match(self.seq, k)`` returns."""
        return self.propose_after([], k)
