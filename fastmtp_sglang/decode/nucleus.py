"""Top-k and top-p (nucleus) filtering of probability rows without sorting the vocabulary
where the kept set lies among a row's largest entries: what ``sampling.logits_to_probs`` applies
to the rows that filter.

A sort of 49K entries costs 3.2 ms a row on 2 cores; a ``topk`` of 256 0.17 ms, and the kept set
of a trained model's peaked row is almost always there. Every path (the first width, the second,
the whole sort) gives the same kept set: the same entries in the same order, the same sums.
"""

from __future__ import annotations

import torch

__all__ = ["PARTIAL_TOP", "PARTIAL_TOP_K", "top_k_top_p"]


PARTIAL_TOP = 256    # entries a filtering row's kept set is first looked for among (top_k_top_p)
PARTIAL_TOP_K = 4096  # then among this many; a top-k up to this is always found there


def top_k_top_p(
    probs: torch.Tensor,  # [N, V] float32, rows sum to 1
    top_p: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N]
    filters: torch.Tensor,  # [N] bool, (top_k > 0) | (top_p < 1)
) -> torch.Tensor:
    """Top-k, then top-p on what top-k kept, then renormalise. Rows that keep everything are
    returned unchanged, so a row's distribution does not depend on the other rows' filters.

    The kept set is looked for among each row's largest entries first (``topk`` of
    ``PARTIAL_TOP``, or of the largest top-k asked up to ``PARTIAL_TOP_K``), then among
    ``PARTIAL_TOP_K`` of them: it lies there when the row's top-k is no larger, or when those
    entries' mass already reaches its top-p. Only the rows left sort the whole vocabulary (3.2 ms
    a row at 49K entries on 2 cores; ``topk`` of 256: 0.17 ms, of 4096: 0.37 ms). On the demo
    target's own sampled text at T=1 the nucleus of top-p 0.95 lay within the top 256 at 79% of
    positions, within 1024 at 94%; at T=0.7 at 99% / 100%. Every path gives the same kept set
    (the same entries in the same order, the same sums)."""
    n, v = probs.shape
    total_all = probs.sum(dim=-1)                                                 # [N]
    if probs.device.type != "cpu":  # every row sorted: picking rows would synchronise
        rows, widths, every = None, [], False
    else:
        rows = None if bool(filters.all()) else filters.nonzero().squeeze(-1)   # None: every row
        ks = top_k if rows is None else top_k[rows]
        first = PARTIAL_TOP
        if bool((ks > 0).any()):  # a top-k up to PARTIAL_TOP_K is found within the first width
            want = ks[(ks > 0) & (ks <= PARTIAL_TOP_K)]
            first = max([first] + ([int(want.max())] if want.numel() else []))
        widths = sorted({w for w in (first, PARTIAL_TOP_K) if w < v})
        every = rows is None  # every row filters: none to pass through unchanged
    pick = (lambda x: x) if rows is None else (lambda x: x[rows])  # noqa: E731
    keep = None
    for w in widths:  # the largest w entries of the rows not settled yet
        part_p, part_i = pick(probs).topk(w, dim=-1)                             # sorted, descending
        kept, covered = _kept_prefix(part_p, pick(top_p), pick(top_k), pick(total_all))
        found = torch.zeros(part_i.shape[0], v, dtype=torch.bool).scatter_(-1, part_i, kept & covered[:, None])
        keep = _put(keep, found, rows, n)
        if bool(covered.all()):
            rows = torch.empty(0, dtype=torch.long)
            break
        rows = (torch.arange(n) if rows is None else rows)[~covered]
        pick = lambda x: x[rows]  # noqa: E731
    if rows is None or rows.numel():
        sorted_p, order = pick(probs).sort(dim=-1, descending=True)
        kept, _ = _kept_prefix(sorted_p, pick(top_p), pick(top_k), pick(total_all))
        keep = _put(keep, torch.zeros_like(kept).scatter_(-1, order, kept), rows, n)
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return kept if every else torch.where(filters[:, None], kept, probs)


def _put(keep: torch.Tensor | None, found: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """``found`` [r, V], the kept entries of ``rows`` (None: all n rows), into ``keep`` [n, V]."""
    if rows is None:
        return found if keep is None else keep | found
    if keep is None:
        keep = torch.zeros(n, found.shape[1], dtype=torch.bool, device=found.device)
    keep[rows] |= found
    return keep


def _kept_prefix(sorted_p: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                 total_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' largest entries in descending order [r, w] (all V of them, or a prefix) ->
    (which of them top-k then top-p keep [r, w], whether the kept set lies within them [r]).

    Ranks are positions in the order, so top-k keeps exactly k tokens even among ties. Nucleus:
    keep entry i iff the mass strictly before it is < top_p times the total, the top-k
    survivors' mass (a row without top-k: every entry's, ``total_all``); this is the smallest
    prefix whose mass reaches top_p and always keeps the first entry. The exclusive cumsum is
    built by shifting, not by subtracting, to avoid rounding; top_p == 1 skips the test so float32
    rounding of a 150K-long cumsum cannot drop tail tokens."""
    r, w = sorted_p.shape
    has_k = top_k > 0
    if sorted_p.device.type == "cpu" and not bool(has_k.any()):
        # top-p alone, the usual request: what the lines below give such rows, in a few ops
        # (their generality had cost ~90 us a call at 16K entries)
        cum = sorted_p.cumsum(dim=-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        limit = top_p * total_all
        keep = (before < limit[:, None]) | (top_p[:, None] >= 1)
        return keep, (top_p < 1) & (cum[:, -1] >= limit)
    rank = torch.arange(w, device=sorted_p.device)
    k = torch.where(has_k, top_k, w + 1)
    keep = rank[None, :] < k[:, None]
    cum = (sorted_p * keep).cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    k_in = has_k & (k <= w)
    total = torch.where(k_in, cum.gather(1, (k.clamp(max=w) - 1)[:, None])[:, 0], total_all)
    limit = top_p * total
    keep &= (before < limit[:, None]) | (top_p[:, None] >= 1)
    # within: top-k inside the prefix, or (no top-k) the prefix's mass already reaches the
    # nucleus: every later entry has at least that much before it. A top-k beyond the prefix
    # needs the survivors' total, which the prefix does not hold
    covered = k_in | (~has_k & (top_p < 1) & (cum[:, -1] >= limit))
    return keep, covered
