"""The state of the requests a ReferenceEngine runs together: one ``Row`` per request (host
side) and one ``Batch`` (device side: the target's slot cache and its mask, each row's pending
token and position, the head's cache and hidden state, the sampling settings).

Rows leave a batch when they finish (``Batch.remove``) and new ones join it between cycles
(``Batch.merge``, continuous batching): the batch is re-indexed each time, so row ``j`` of every
tensor is ``rows[j]``. The target's cache is slot-based (every cycle appends ``K + 1`` slots to
every row, a mask hides rejected ones); ``Batch.repack`` moves each row's live slots to the
front when the holes outgrow them, so a batch that never empties keeps a bounded cache.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fastmtp_sglang.decode.capture import Capture
from fastmtp_sglang.decode.metrics import RequestMetrics
from fastmtp_sglang.decode.sampling import first_argmax, logits_to_probs, plain_temperature, sample_each, sample_rows

REPACK_SLACK = 64  # slots of holes a batch may carry beyond its fullest row before a repack

PREFILL_CALL_TOKENS = 128  # a forward's fixed cost, in prompt tokens (a plain step ~ 128-token prefill share)


def prefill_groups(lengths: list[int], call_tokens: int = PREFILL_CALL_TOKENS) -> list[list[int]]:
    """Split prompts into the prefill forwards that cost least: a forward over n prompts is
    padded to its longest, so it costs ``call_tokens + n * longest`` token-units. Prompts are
    taken in length order and cut where that sum is smallest (dynamic programming over the
    sorted lengths); returns the groups as lists of indices into ``lengths``, each in input
    order. Prompts of 40..769 tokens prefilled as one padded batch computed 3.5x the tokens
    they needed (the Spec-Bench dev prompts)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n   # best[j]: cheapest split of the j shortest
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            c = best[i] + call_tokens + (j - i) * longest
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


class Row:
    """Host-side bookkeeping of one request in flight. ``key`` is what ``on_tokens`` and the
    finished results are reported under (the request's index in ``generate``)."""

    def __init__(self, req, key: Any, steps: int, device: torch.device):
        self.req, self.key, self.index = req, key, 0
        self.out: list[int] = []
        self.finish: dict[str, Any] | None = None
        self.metrics = RequestMetrics(prompt_tokens=len(req.input_ids), steps=steps)
        self.text_checked = 0  # how many output tokens the stop-string check has seen
        self.est: list[float] = []  # auto: running conditional acceptance per draft position
        self.est_lookup: dict[int, list[float]] = {}  # hybrid: the same for prompt lookup, by match n
        self.ngram = None  # prompt lookup's index of prompt + out (decode/ngram.py: NgramIndex)
        k = getattr(req, "features", None)  # what training reads, kept as it decodes
        self.capture = None if k is None else Capture(k)
        self.t_decode = 0.0  # perf_counter when its decoding began (after its prefill)
        # auto: the head's input over the prompt, (features [L, H'], next tokens [L]) at
        # positions 0..L-1, run when the row first needs the head (ReferenceEngine._head_prompts):
        # a row that only ever decodes at K=0 (a loaded server) never pays the head's prefill
        self.head_prompt: tuple[torch.Tensor, torch.Tensor] | None = None
        # one generator per request: a seeded request samples the same tokens whatever batch it
        # shares, at a fixed K (auto, or a batch near the context limit, can change the cycle's
        # K and with it the draws); rows without a seed draw theirs from torch's global generator
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(req.params.seed if req.params.seed is not None
                             else int(torch.randint(0, 2**62, (1,)).item()))


class Batch:
    """The device-side state of the rows an engine runs together (see the module docstring)."""

    def __init__(self, engine, requests: list, keys: list):
        dev, K = engine.device, engine.steps
        self.engine = engine
        self.use_head = bool(K) and (engine.drafter is None or engine.hybrid)
        self.plan: list[tuple[bool, int, list[int]]] = []  # hybrid: (lookup?, match n, proposal) per row
        self.plan_head = False  # hybrid: this cycle runs the head (head rows, or splices)
        self.splice_at: dict[int, tuple[int, int]] = {}  # hybrid: row -> (chain position, match length)
        self.fixed: torch.Tensor | None = None  # [n, K]: chain positions that are not the head's picks
        self.rows = [Row(r, k, K, dev) for r, k in zip(requests, keys)]
        if engine.auto is not None:
            for row in self.rows:
                row.est = engine.auto.new_estimate()  # per-position acceptance, this request's own
        self._index()
        # set by ReferenceEngine._prefill
        self.cache = self.valid = self.pending = self.pos = None
        self.dcache = self.g = self.tidx = self.extra = None
        self.zero_run = 0    # cycles in a row at K=0 (auto)
        self.plan_rows = 0   # rows at the last hybrid plan (AutoDrafting._plan_backs_off)
        # sampled rows, auto: each verified position's probability of acceptance, [n][Kc] (set by
        # ReferenceEngine._verify; None for a greedy batch, whose outcomes are their own)
        self.accept_probs: list[list[float]] | None = None
        self.deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (vh, ids, pos)
        # the head's input at each row's last prompt position (auto): what a row joining a batch
        # with deferred extends repeats in their place (see merge)
        self.tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    DEFER_PARTS = 16  # deferred parts kept apart before they are joined into one

    def defer(self, part: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keep: int) -> None:
        """Keep a cycle's head input (vh, ids, pos: [n, w, ...]) for the head's next catch-up;
        at most ``keep`` positions, forgetting the oldest (the head never sees them: its drafts
        for those rows get worse, the output is the target's). Parts are joined into one when
        there are more than DEFER_PARTS: every join and leave of a row touches each part (at 16
        clients a row comes or goes every few cycles, and 128 one-position parts made that ~400
        small tensor ops)."""
        self.deferred.append(part)
        if len(self.deferred) > self.DEFER_PARTS:  # (a copy every DEFER_PARTS cycles at most)
            self.deferred = [tuple(torch.cat(x, dim=1) for x in zip(*self.deferred))]
        extra = self.deferred_positions() - keep
        while extra > 0:  # drop or cut the oldest part (views: no copy)
            w = self.deferred[0][1].shape[1]
            if w <= extra:
                del self.deferred[0]
            else:
                self.deferred[0] = tuple(x[:, extra:] for x in self.deferred[0])
            extra -= min(w, extra)

    def deferred_positions(self) -> int:
        """Positions the head's draft extend has not run over yet (auto: cycles without the head)."""
        return sum(d[1].shape[1] for d in self.deferred)

    def _index(self) -> None:
        """Number the rows 0..n-1 and rebuild the per-row sampling tensors."""
        dev = self.engine.device
        for j, r in enumerate(self.rows):
            r.index = j
        self.gens = [r.gen for r in self.rows]
        params = [r.req.params for r in self.rows]
        self.greedy = all(p.is_greedy for p in params)
        self.temp = torch.tensor([p.temperature for p in params], device=dev)
        self.top_p = torch.tensor([p.top_p for p in params], device=dev)
        self.top_k = torch.tensor([p.top_k for p in params], device=dev)
        # every row at one temperature without top-k / top-p: a softmax serves them (probs)
        self.plain_temp = None if self.greedy else plain_temperature(params)

    def dist_params(self, row: int | None = None, repeat: int = 1) -> tuple:
        """``logits_to_probs``' temperature, top_p and top_k for lines of logits of these rows:
        one line per row, ``repeat`` consecutive lines per row, or only row ``row``'s. Python
        scalars where every row samples plainly at one temperature (the softmax alone), the
        per-row tensors otherwise."""
        if self.plain_temp is not None:
            return self.plain_temp, 1.0, -1
        params = (self.temp, self.top_p, self.top_k)
        if row is not None:
            return tuple(x[row:row + 1] for x in params)
        return tuple(x.repeat_interleave(repeat) for x in params) if repeat > 1 else params

    def probs(self, logits: torch.Tensor, row: int | None = None, repeat: int = 1) -> torch.Tensor:
        """The distributions these rows sample from (``logits_to_probs``): logits [m, V] laid
        out as :meth:`dist_params` says -> probabilities [m, V], float32."""
        return logits_to_probs(logits, *self.dist_params(row, repeat))

    def __len__(self) -> int:
        return len(self.rows)

    # -- picking tokens ---------------------------------------------------------------------------
    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [n, V], one row per batch row -> (tokens [n], probs [n, V] or None)."""
        if self.greedy:
            return first_argmax(logits), None
        probs = self.probs(logits.float())
        return sample_each(probs, self.gens), probs

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's own token for each row (no draft to verify: a prompt's first token, a
        K=0 cycle): logits [n, V] -> tokens [n], each row from its own distribution and
        generator, top-k rows without a sort of the vocabulary (sampling.sample_rows)."""
        if self.greedy:
            return first_argmax(logits)
        return sample_rows(logits, [r.req.params for r in self.rows], self.gens)

    def draft_pick(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's output hidden g [n, H] -> (draft tokens [n], q [n, V] or None)."""
        e = self.engine
        if e.draft_vocab is None:
            return self.pick(e.head.project(g).float())
        if self.greedy:
            return e.draft_vocab.greedy(g, self.tidx, self.extra), None
        return sample_draft(e.draft_vocab, g, self.tidx, self.extra, *self.dist_params(), self.gens)

    # -- rows leaving and joining -------------------------------------------------------------------
    def finished(self) -> list[Row]:
        return [r for r in self.rows if r.finish is not None]

    def remove(self, gone: list[Row]) -> None:
        """Drop these rows from every batched tensor and re-index the rest. The last rows kept
        move into the places of rows leaving before them (the target's cache copies only the
        rows it moves), so the rows' order changes. When it raises, the rows kept are as they
        were (only the places of rows leaving are written before the batch changes)."""
        if not gone:
            return
        ids = {id(r) for r in gone}
        live = [r for r in self.rows if id(r) not in ids]
        if not live:
            self.rows = []
            self._index()
            self.cache = self.valid = self.pending = self.pos = None
            self.dcache = self.g = self.tidx = self.extra = None
            self.deferred = []
            return
        n = len(live)
        holes = [j for j in range(n) if id(self.rows[j]) in ids]
        tail = [j for j in range(n, len(self.rows)) if id(self.rows[j]) not in ids]
        order = list(range(n))
        for h, t in zip(holes, tail):
            order[h] = t
        sel = torch.tensor(order, dtype=torch.long, device=self.engine.device)
        new = {"valid": self.valid[sel], "pending": self.pending[sel], "pos": self.pos[sel]}
        if self.use_head:
            new.update(g=self.g[sel], deferred=[tuple(x[sel] for x in d) for d in self.deferred])
            if self.tidx is not None:
                new.update(tidx=self.tidx[sel],
                           extra=self.extra[sel] if self.extra is not None else None)
        self.cache.move_rows(holes, tail, n)
        if self.use_head:  # (in place, like the target's: only the moved rows are copied)
            self.dcache.move_rows(holes, tail, n)
        self.tail = None  # (only a freshly prefilled batch joins another)
        # nothing below allocates: the batch changes at once
        self.__dict__.update(new)
        self.rows = [self.rows[i] for i in order]
        self._index()

    def merge(self, other: "Batch", rows: int = 0, slots: int = 0) -> None:
        """Append the rows of a freshly prefilled batch (continuous batching; all or nothing:
        the target's cache writes them into free rows of its buffers, see SlotCache.append).
        When this batch has deferred draft extends (auto's K=0 cycles), the new rows' entries
        repeat their last prompt position (``other.tail``): re-running the head there rewrites
        the key it wrote at its prefill and gives the hidden state it gave, so the batch catches
        up when it next drafts, not at every join."""
        if self.deferred and other.tail is None:
            raise RuntimeError("rows joining a batch with deferred draft extends need their tail")
        if not self.rows:
            self.__dict__.update({k: v for k, v in other.__dict__.items() if k != "zero_run"})
            return
        S = max(self.valid.shape[1], other.valid.shape[1])
        pad = lambda v: torch.nn.functional.pad(v, (0, S - v.shape[1]), value=False)  # noqa: E731
        new = {"pending": torch.cat([self.pending, other.pending]),
               "pos": torch.cat([self.pos, other.pos]),
               "valid": torch.cat([pad(self.valid), pad(other.valid)])}
        if self.use_head:
            self.dcache.prepare_append(other.dcache, rows)  # (allocates; changes no row here)
            new["g"] = torch.cat([self.g, other.g])
            # (a part of a prompt-lookup cycle is several positions wide: the tail repeats)
            new["deferred"] = [tuple(torch.cat([x, t.expand(-1, x.shape[1], *t.shape[2:])])
                                     for x, t in zip(d, other.tail))
                               for d in self.deferred]
            if self.tail is not None and other.tail is not None:  # prefill groups merging
                new["tail"] = tuple(torch.cat([x, t]) for x, t in zip(self.tail, other.tail))
            if self.tidx is not None:
                new["tidx"] = torch.cat([self.tidx, other.tidx])
                if self.extra is not None:
                    new["extra"] = _cat_padded(self.extra, other.extra, -1)
        self.cache.append(other.cache, rows, slots)
        # nothing below allocates: the batch changes at once
        if self.use_head:
            self.dcache.append_rows(other.dcache)  # into free rows of its buffers
        self.__dict__.update(new)
        self.rows = self.rows + other.rows
        self._index()

    def repack(self) -> None:
        """Move every row's live slots to the front when the holes exceed REPACK_SLACK
        (attention over a row's keys does not depend on where they sit: positions are in the
        rotated keys, the mask says which are live)."""
        if self.valid.shape[1] <= REPACK_SLACK:  # (every cycle: skip the count while small)
            return
        counts = self.valid.sum(1)
        width = int(counts.max())
        if self.valid.shape[1] - width <= REPACK_SLACK:
            return
        # stable order: live slots first, each row's in their original order
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :width]
        valid = self.valid.gather(1, order)
        self.cache.repack(order)
        self.valid = valid

    def start_decode(self) -> None:
        now = time.perf_counter()
        for r in self.rows:
            r.t_decode = now


def sample_draft(vocab, g: torch.Tensor, tidx: torch.Tensor, extra: torch.Tensor | None,
                 temp: torch.Tensor | float, top_p: torch.Tensor | float, top_k: torch.Tensor | int,
                 gens: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled draft step over a compressed vocabulary (``vocab``: vocab.draft_vocab.DraftVocab):
    the head's output g [n, H] -> (draft tokens [n], q [n, V]). The softmax and the draw run over
    each row's table slots only (16K, not the 49K vocabulary; batch 1 on CPU: the one product of
    the greedy step); q is zero outside them, so it is built by spreading the slots'
    probabilities into a zero row (a masked slot: padding, a duplicate or out-of-range extra id,
    has probability 0 and adds nothing). temp/top_p/top_k as ``Batch.dist_params`` gives them,
    and one generator per row."""
    lg, ids = vocab.compressed_logits(g, tidx, extra)                                # [n, S] each
    probs = logits_to_probs(lg, temp, top_p, top_k)                                  # [n, S]
    slot = sample_each(probs, gens)
    toks = ids.gather(1, slot[:, None])[:, 0]
    return toks, spread_slots(probs, ids, vocab.vocab_size)


def spread_slots(probs: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    """Table slots' probabilities [n, S] at their vocabulary ids [n, S] -> q [n, V], zero
    elsewhere (a masked slot, id -1, has probability 0 and adds nothing)."""
    return probs.new_zeros(probs.shape[0], V).scatter_add_(1, ids.clamp(0, V - 1), probs)


def _cat_padded(a: torch.Tensor, b: torch.Tensor, fill: int) -> torch.Tensor:
    """Concatenate [n1, E1] and [n2, E2] rows, right-padding the narrower with ``fill``."""
    w = max(a.shape[1], b.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, w - x.shape[1]), value=fill)  # noqa: E731
    return torch.cat([pad(a), pad(b)])
