"""The parts of ReferenceEngine's cycle that ``auto``, ``hybrid`` and a model-free drafter add
(decode/engine.py runs the cycle itself): each cycle's K and each row's draft source, prompt
lookup's proposals (with splices on, chains spliced from both where that pays), and the head's
work that auto defers, done when the head next drafts: its reading of the prompts and its
draft extend over the cycles that ran without it.

:class:`AutoDrafting` is a mixin of :class:`fastmtp_sglang.decode.engine.ReferenceEngine`: its
methods read the engine's attributes (``auto``, ``hybrid``, ``drafter``, ``steps``, ``head``,
``target``, ``device``, ``clock``, ``prefill_call_tokens``, ``_prompts_s``) and call its
``_head`` and ``_draft_head``, and they stay the engine's own
methods (tests and probes replace them on an engine). Without auto, hybrid or a drafter the
ones the cycle always calls return at once (``_choose`` gives ``steps``, ``_head_idle`` False,
``_catch_up`` finds nothing deferred).
"""

from __future__ import annotations

import statistics

import torch

from fastmtp_sglang.decode.batch import Batch, Row, prefill_groups
from fastmtp_sglang.decode.ngram import NgramIndex


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device``, so that a clock read next covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AutoDrafting:
    """ReferenceEngine's methods for auto's K, hybrid drafting, prompt lookup and the head's
    deferred work (see the module docstring)."""

    def _choose(self, b: Batch) -> int:
        """This cycle's K: ``steps``, or what the auto controller picks for the live rows (and,
        hybrid, which rows take prompt lookup's proposal: ``b.plan``)."""
        if self.auto is None:
            return self.steps
        rows = b.rows
        if not self.hybrid:
            return self.auto.choose([r.est for r in rows], b.zero_run, b.deferred_positions(),
                                    self._prompts_once(rows), self._cycles_left(rows))
        if self._plan_backs_off(b) or not self.auto.room(len(rows)):
            # the last plans at this size all found K=0, or no source could pay at this batch
            # size, not even for rows as good as its best shared estimate (AutoK.room, the rule
            # probes follow): K=0 without computing proposals (their cost: docs/design.md
            # section 6.8, "The margin grows with the batch" and "Where auto's cycles go under
            # load"). The back-off is asked first: it is a few comparisons, room prices every K
            b.plan, b.plan_head = [(False, 0, [])] * len(rows), False
            return 0
        b.plan_rows = len(rows)
        once, left = self._prompts_once(rows), self._cycles_left(rows)  # (a plan's alone: K=0 needs neither)
        props = [self._lookup(r, self.steps) for r in rows]
        looks = []
        for r, (toks, m) in zip(rows, props):
            if m and m not in r.est_lookup:
                r.est_lookup[m] = self.auto.new_estimate(f"lookup{m}")
            looks.append((r.est_lookup[m], len(toks)) if m else None)
        K, use, b.plan_head = self.auto.plan_hybrid([r.est for r in rows], looks, b.zero_run,
                                                    b.deferred_positions(), once, left, self.splice)
        b.plan = [(take, m, toks) for take, (toks, m) in zip(use, props)]
        return K

    PLAN_EVERY = 4      # under load, after a run of K=0: one cycle in this many plans
    PLAN_BACKOFF_ROWS = 4  # from this many rows (below, a plan costs < 0.5% of a cycle)

    def _plan_backs_off(self, b: Batch) -> bool:
        """Hybrid auto at ``PLAN_BACKOFF_ROWS`` rows or more, after ``probe_every`` cycles in a
        row at K=0 with no fewer rows than the last plan had: plan only one cycle in
        ``PLAN_EVERY`` (the others run at K=0 without proposals). Why: a plan asks prompt lookup
        for every row and prices every K for every row, ~0.3 ms at 8 rows, 1-2% of a cycle
        there, and under load the plans keep finding K=0 (docs/design.md section 6.8, "Where
        auto's cycles go under load, and plans that back off"). A batch that loses rows plans
        at once; probes still come (``probe_due`` runs in the plans made), at most
        ``PLAN_EVERY - 1`` cycles late."""
        n = len(b.rows)
        return (n >= self.PLAN_BACKOFF_ROWS and b.zero_run >= self.auto.probe_every
                and n >= b.plan_rows and b.zero_run % self.PLAN_EVERY != 0)

    @staticmethod
    def _cycles_left(rows: list[Row]) -> float:
        """auto: the median of the live rows' remaining token budgets (the most cycles they have
        left), over which a head cycle's catch-up is spread (AutoK._head_share); 1 when none has
        a budget left."""
        left = [n for n in map(AutoDrafting._budget_left, rows) if n > 0]
        return float(statistics.median(left)) if left else 1.0

    @staticmethod
    def _budget_left(r: Row) -> int:
        """Tokens the row may still emit (0 once finishing or aborted: the server sets its budget to 0)."""
        return r.req.params.max_new_tokens - len(r.out)

    def _prompts_once(self, rows: list[Row]) -> float:
        """auto: a head cycle's share of reading the prompts the head has not read yet (their
        positions, spread over the median of those rows' remaining token budgets: at one token
        a cycle, the most cycles they have left; AutoK.once_ms). 0 when every prompt has been
        read. Rows with no budget left (finishing, or aborted: the server sets their budget
        to 0) are not counted: they will not draft."""
        unread = [(len(r.head_prompt[1]), self._budget_left(r)) for r in rows if r.head_prompt is not None]
        unread = [(n, left) for n, left in unread if left > 0]
        if not unread:
            return 0.0
        return self.auto.once_ms(sum(n for n, _ in unread), statistics.median(left for _, left in unread))

    def _draft_hybrid(self, b: Batch, K: int) -> tuple[torch.Tensor, list, int]:
        """Per ``b.plan``: head drafts for the rows that want them, prompt lookup's proposal for
        the others. In a cycle that runs the head (``b.plan_head``) a proposal shorter than K is
        continued by the head past its end (a splice: the head's steps read the proposal's
        tokens); without the head it is padded to K."""
        n = len(b)
        if K == 0:
            return torch.empty(n, 0, dtype=torch.long, device=self.device), [], 0
        fixed = torch.zeros(n, K, dtype=torch.bool, device=self.device)  # positions lookup proposed
        b.fixed = None
        if not b.plan_head:
            drafts = torch.empty(n, K, dtype=torch.long, device=self.device)
            qs: list = [None] * K
            for j, (take, _, toks) in enumerate(b.plan):
                if take:  # (no proposal: this row verifies nothing, see step; any token will do)
                    pad = toks or [int(b.pending[j])]
                    drafts[j] = torch.tensor((pad + [pad[-1]] * K)[:K], device=self.device)
                    fixed[j] = True
        else:
            # (splices off: a short proposal is padded, as in a cycle without the head)
            forced = [(toks if self.splice or not toks else (toks + [toks[-1]] * K)[:K]) if take else []
                      for take, _, toks in b.plan]
            # head rows ask prompt lookup again after each of their drafts (_requery)
            requery = [not take for take, _, _ in b.plan] if self.splice and K > 1 else None
            drafts, qs = self._draft_head(b, K, forced, requery)
            if b.fixed is not None:
                fixed = b.fixed
        if not b.greedy and bool(fixed.any()):  # a deterministic proposal: q one-hot at its tokens
            V = self.target.lm_head.weight.shape[0]
            one = torch.nn.functional.one_hot(drafts, V).float()                   # [n, K, V]
            qs = [one[:, k] if q is None else torch.where(fixed[:, k, None], one[:, k], q)
                  for k, q in enumerate(qs)]
        return drafts, qs, K

    def _requery(self, b: Batch, drafts: torch.Tensor, over: torch.Tensor, requery: list[bool],
                 k: int, K: int) -> None:
        """After the head's k-th draft: for each head row still drafting with the head, prompt
        lookup asked again with the head's drafts after the sequence (``NgramIndex.
        propose_after``); a proposal it finds takes positions k+1.. where its estimates promise
        more than the head's (``AutoK.takes_over``), recorded in ``b.splice_at`` as (k, match
        length). Its tokens go into ``over``; the head's later steps read them."""
        rows = [j for j, (want, r) in enumerate(zip(requery, b.rows))
                if want and j not in b.splice_at and r.ngram is not None]
        if not rows:
            return
        mine = drafts[:, :k].tolist()
        for j in rows:
            r = b.rows[j]
            toks, m = r.ngram.propose_after(mine[j], K - k)
            if len(toks) < K - k:  # (none, or one that ends early: the chain stays the head's)
                continue
            if m not in r.est_lookup:
                r.est_lookup[m] = self.auto.new_estimate(f"lookup{m}")
            if self.auto.takes_over(r.est, r.est_lookup[m], k, K):
                over[j, k: k + len(toks)] = torch.tensor(toks, device=self.device)
                b.splice_at[j] = (k, m)

    def _chain_sources(self, b: Batch, j: int, k: int, Kc: int) -> tuple[str, int, int, int]:
        """Row ``j``'s chain of ``k`` drafts this cycle: (the source of its first ``c``
        positions, ``c``, prompt lookup's match length m, the chain position where lookup's
        proposal starts); positions c.. came from the other source (a splice). "lookup" first:
        its proposal, continued by the head past its end in a cycle that ran the head; "head"
        first with c < k: prompt lookup, asked again after the head's c drafts, took the
        positions after them (``_requery``)."""
        if not self.hybrid or not Kc:
            return "head", k, 0, 0
        take, m, toks = b.plan[j]
        if take and m > 0:
            return "lookup", (len(toks) if self.splice and b.plan_head and len(toks) < k else k), m, 0
        at = b.splice_at.get(j) if b.plan_head else None
        if at is not None and at[0] < k:
            return "head", at[0], at[1], at[0]
        return "head", k, m, 0

    def _head_idle(self, b: Batch, drafted: int) -> bool:
        """auto: did this cycle run without the head (K=0, or hybrid with every row on prompt
        lookup)? Its draft extend then waits for the head's next drafting cycle."""
        if self.auto is None:
            return False
        return drafted == 0 or (self.hybrid and not b.plan_head)

    def _head_prompts(self, b: Batch) -> None:
        """auto: the head's draft extend over the prompts of rows that have not needed the head
        yet (``Row.head_prompt``), before anything else the head runs for them: one forward per
        group of similar lengths (``prefill_groups``), each into a cache of its own rows that
        is then copied into the batch's (nothing was written there for these rows). A group's
        shorter prompts repeat their last position up to the longest: the head writes the same
        key there again and gives the same output."""
        if self.auto is None:  # (only auto defers prompts: nothing to scan in the cycle's hot path)
            return
        rows = [r for r in b.rows if r.head_prompt is not None]
        if not rows:
            return
        t0 = self.clock()
        dev = self.device
        for group in prefill_groups([len(r.head_prompt[1]) for r in rows], self.prefill_call_tokens):
            part = [rows[i] for i in group]
            L = max(len(r.head_prompt[1]) for r in part)
            pad = lambda x, n: torch.cat([x, x[-1:].expand(n, *x.shape[1:])]) if n else x  # noqa: E731
            feats = torch.stack([pad(r.head_prompt[0], L - len(r.head_prompt[1])) for r in part])
            ids = torch.stack([pad(r.head_prompt[1], L - len(r.head_prompt[1])) for r in part])
            pos = torch.stack([pad(torch.arange(len(r.head_prompt[1]), device=dev),
                                   L - len(r.head_prompt[1])) for r in part])       # [m, L]
            sub = self.head.new_cache(len(part), b.dcache.max_len, dtype=b.dcache.k.dtype, device=dev)
            g = self._head(feats, ids, pos, sub)                                      # [m, L, H]
            idx = torch.tensor([r.index for r in part], device=dev)
            b.dcache.reserve(sub.capacity)
            b.dcache.k[idx, :, : sub.capacity] = sub.k
            b.dcache.v[idx, :, : sub.capacity] = sub.v
            b.g[idx] = g[torch.arange(len(part), device=dev),
                         torch.tensor([len(r.head_prompt[1]) - 1 for r in part], device=dev)]
            for r in part:
                r.head_prompt = None
        sync(dev)
        spent = self.clock() - t0
        self._prompts_s += spent  # (step keeps it out of the cycle's calibration)
        self.auto.observe_prompts(sum(len(r.req.input_ids) for r in rows), 1e3 * spent)

    def _catch_up(self, b: Batch) -> None:
        """Before the head drafts: its extend over the prompts it has not read (_head_prompts),
        then the draft extend of the cycles that ran without it (auto: K=0, or prompt lookup for
        every row), in one head forward; each part ends at each row's last accepted position
        (see _draft_extend), so the last column is every row's end."""
        self._head_prompts(b)
        if not b.deferred:
            return
        t, z = self.clock(), b.deferred_positions()
        vh, ids, pos = (torch.cat(parts, dim=1) for parts in zip(*b.deferred))
        ge = self._head(vh, ids, pos, b.dcache)
        b.g = ge[:, -1]
        b.deferred = []
        if self.auto is not None:  # what a catch-up over z positions costs here, for its price
            sync(self.device)
            self.auto.observe_catch_up(len(b), z, 1e3 * (self.clock() - t))

    def _propose(self, rows: list[Row], K: int, pending: torch.Tensor
                 ) -> tuple[torch.Tensor, int]:
        """The drafter's proposals for the live rows: (drafts [n, K] or [n, 0], K verified).

        A row without a full proposal is padded with its last proposed (or pending) token: a
        guess that costs one verified slot and changes nothing else."""
        props = [self._lookup(r, K)[0] for r in rows]
        n = len(props)
        if not any(props):
            return torch.empty(n, 0, dtype=torch.long, device=self.device), 0
        pend = pending.tolist()
        out = [(p + [p[-1] if p else pend[j]] * K)[:K] for j, p in enumerate(props)]
        return torch.tensor(out, dtype=torch.long, device=self.device), K

    def _lookup(self, r: Row, k: int) -> tuple[list[int], int]:
        """The drafter's proposal for row ``r`` and the length of the suffix it matched, from
        the row's own index of its sequence (decode/ngram.py: NgramIndex; same result as
        ``drafter.propose_match(prompt + out, k)``)."""
        if r.ngram is None:
            r.ngram = NgramIndex(self.drafter)
        r.ngram.sync(r.req.input_ids, r.out)
        return r.ngram.propose_match(k)
