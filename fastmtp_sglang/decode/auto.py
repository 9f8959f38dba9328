"""``--steps auto``: the number of drafts K chosen every cycle from measured costs and running
acceptance estimates (K=0 when nothing pays).

For a row whose step-j drafts are accepted with (conditional) probability a_j, a cycle at K emits
``E(K) = 1 + sum_{k<=K} prod_{j<=k} a_j`` tokens on average and costs
``T(K) = verify(K+1) + K * draft_step + extend`` (``T(0) = verify(1)``: plain decoding, no draft
work at all). The controller picks the K in 0..Kmax with the most expected tokens per second,
``sum_rows E_r(K) / T_B(K)`` for a batch of B rows that shares one cycle, with T_B from the
costs measured at batch sizes around B (so K falls, then reaches 0, as the batch grows and
verification stops being free). Anchors: vLLM's adaptive-K goodput
rule ``E_acc(K) / (1 + K c_draft)``, SGLang 0.5.23's ``--speculative-adaptive``.

Acceptance estimates start from a prior and follow each row's cycles with an exponential moving
average per position: a cycle at K that accepted m drafts observes "accepted" at positions 1..m
and "rejected" at m+1 (positions beyond it are not observed; after a chain accepted whole, the
next position's estimate is raised to the last one's). A row's estimate of a source that did not
draft in a cycle moves a little back towards the estimate all rows share (``relax``), so a few
misses do not shut a source out for the rest of a request. A batch decoding at K=0 learns
nothing, so after ``probe_every`` cycles at K=0 the controller may draft once at K=1 to look again. A probe
is not free where verification is not (at batch 16 a K=1 cycle costs ~1.6x a plain one, plus the
head's catch-up over the skipped positions), so it waits until the K=0 time since the last
drafting cycle, times ``probe_budget``, covers what the probe is expected to lose against plain
decoding: probes cost at most that fraction of the time spent at K=0; and it is not made at
all at a batch size where even the head's best average acceptance would not make a head cycle
pay.
Any K is lossless (every cycle is verified), so the choice changes speed, never the output.

Costs come from :func:`fastmtp_sglang.decode.costs.measure` on the machine at hand, and are
corrected online: every cycle's wall time is compared with what the curve says a cycle at that K
and batch size costs, and the median of the last 15 ratios per K and batch-size class scales that
K's cost from then on (a serving loop costs more per cycle than the bare calls the curve times,
and more so at larger K; a median, so the odd cycle that pays a repack or a VM pause does not
set the price); prompt-lookup cycles that run without the head keep ratios of their own. The
margin drafting must promise over K=0 grows with the batch (:meth:`AutoK.margin_at`).
"""

from __future__ import annotations

import statistics
from collections import deque


from fastmtp_sglang.decode.auto_model import (  # noqa: F401  (re-exported: decode.auto's names)
    StepCosts, batch_class, expected_curve, expected_curve_leaves, expected_tokens)


class AutoK:
    """Chooses each cycle's K (see the module docstring).

    Parameters
    ----------
    costs : StepCosts of this machine
    kmax : the most drafts per cycle (the head's steps, or the drafter's proposal length)
    prior : starting conditional acceptance at every position for the first request (0.5: a head
        that is right half the time; the first cycles then draft, and the estimates take over)
    alpha : weight of the newest observation in a request's moving average
    sampled_alpha : the same for a sampled row (``update`` with ``probs``), None = ``alpha``.
        A row observes a probability per position there, not a 0/1 outcome, but those swing
        from token to token while a greedy row's outcomes come in runs (copied spans): at
        alpha 0.2 a sampled row's estimate sank low on a few hard tokens, the row drafted short
        on what was only noise (K=1 cycles realised tau 1.46 where they were priced at ~1.35),
        and `auto` fell 3-5% behind the fixed K=2 + leaves at T=0.7-1 (docs/design.md section
        6.7, "A sampled row's estimate moves slower")
    shared_alpha : the same for the estimate shared by all requests, which is where each new
        request starts (so request 100 does not relearn from 0.5 what 99 requests measured)
    probe_every : cycles at K=0 after which one cycle may draft at K=1 to re-measure acceptance
    probe_budget : the fraction of the time spent at K=0 that probes may lose against plain
        decoding (a probe waits until the K=0 cycles since the last drafting one cover it)
    calibrate : scale each K's cost by what its cycles really took (``observe_cycle``), per
        K and batch-size class (1, 2-3, 4-7, 8-15, ...), and price the head's first reading of
        prompts at what it took (``observe_prompts``); off for costs that are not this
        machine's (tests that impose a curve)
    margin : drafting must promise this much more throughput than K=0 to be chosen (a cycle's
        estimate is noisy, and K=0 is the arm that cannot lose to plain decoding)
    row_margin : and this much more per row beyond the first (:meth:`margin_at`): what a
        drafting cycle costs a continuous batch beyond its own time grows with the rows
    relax : how far a row's estimate of a source moves back towards the shared one in each cycle
        that does not observe it (:meth:`relax_estimate`)
    width : candidates per position the head drafts (decode/leaves.py): a head cycle at K
        verifies 1 + K * width tokens, and a position whose chain draft is rejected may still
        take a leaf (``leaf``: per position, the share of such positions where one was taken,
        learnt from all rows' cycles, :meth:`observe_leaf`)
    """

    LEAF_PRIOR = 0.25   # a leaf taken where the chain's draft was rejected (measured 0.28-0.37)
    LEAF_ALPHA = 0.05
    # the prior counts as this many observations in the shared estimate: a shared position's
    # first observations are averaged with it (weight 1 / (SHARED_PRIOR_WEIGHT + n)), and only
    # once that weight falls to ``shared_alpha`` does it become a moving average (update)
    SHARED_PRIOR_WEIGHT = 4

    CALIB_WINDOW = 15  # cycles per (K, batch class) whose median ratio calibrates the curve

    def __init__(self, costs: StepCosts, kmax: int, prior: float = 0.5, alpha: float = 0.2,
                 probe_every: int = 8, shared_alpha: float = 0.02, calibrate: bool = True,
                 margin: float = 0.03, probe_budget: float = 0.02, row_margin: float = 0.01,
                 relax: float = 0.05, width: int = 1, sampled_alpha: float | None = None):
        if kmax < 1:
            raise ValueError(f"auto needs kmax >= 1, got {kmax}")
        if not (0.0 <= prior <= 1.0 and 0.0 < alpha <= 1.0 and 0.0 <= shared_alpha <= 1.0
                and probe_every >= 1 and 0.0 <= margin < 1.0 and probe_budget > 0.0
                and 0.0 <= row_margin < 1.0 and 0.0 <= relax <= 1.0):
            raise ValueError("prior in [0, 1], alpha in (0, 1], shared_alpha in [0, 1], probe_every >= 1, "
                             "margin in [0, 1), probe_budget > 0, row_margin in [0, 1), relax in [0, 1]")
        if sampled_alpha is not None and not 0.0 < sampled_alpha <= 1.0:
            raise ValueError(f"sampled_alpha in (0, 1], got {sampled_alpha}")
        self.sampled_alpha = alpha if sampled_alpha is None else sampled_alpha
        self.relax = relax
        self.width = width  # the engine's (ReferenceEngine checks they agree)
        self.leaf = [self.LEAF_PRIOR] * kmax if width > 1 else []
        self.margin, self.probe_budget, self.row_margin = margin, probe_budget, row_margin
        self.costs, self.kmax = costs, kmax
        self.prior, self.alpha, self.probe_every = prior, alpha, probe_every
        self.shared_alpha = shared_alpha
        # every request's observations, slowly, per draft source ("head", or "lookup<n>" for a
        # prompt-lookup proposal whose suffix matched n tokens)
        self.shared: dict[str, list[float]] = {}
        self._shared_n: dict[str, list[int]] = {}  # observations per source and position
        self._seen: dict[str, int] = {}  # drafting cycles observed per source (room())
        # measured / modelled cycle time, per (K, batch-size class): the costs were measured on
        # bare calls; a serving loop adds its own (attention over slot holes and the longest
        # row's width, bookkeeping per row), more so at larger K and batch. Starts at 1 (trust
        # the curve) and follows the cycles that ran.
        # The median of the last CALIB_WINDOW ratios, not a moving average: the odd cycle that
        # pays a repack, a leave or a pause of the VM must not set the price (an average of
        # them made drafting look as cheap as K=0; docs/design.md section 6.7, "Calibration").
        self.calib: dict[tuple, float] = {}  # keys: _calib_key
        self._ratios: dict[tuple, deque] = {}
        self._catch_up: dict[int, deque] = {}  # ms per deferred position of catch-ups, per batch class
        # head cycles in a row that each catch-up after K=0 started, per batch class
        # (_head_share, _track_run), and the run under way
        self._runs: dict[int, deque] = {}
        self._run_median: dict[int, float] = {}  # (kept with _runs: read for every K priced)
        self._open_run: list | None = None  # [batch class, cycles, opened by a probe]
        self._probe_next = False  # the K just chosen is a probe (the next observe_cycle's)
        self._prompt_tok: deque = deque(maxlen=self.CALIB_WINDOW)  # ms per prompt token the head read
        self.calibrate = calibrate  # False: trust the curve as given (tests)

    def new_estimate(self, source: str = "head") -> list[float]:
        """Where a new request starts: what the requests before it measured."""
        return list(self.shared.setdefault(source, [self.prior] * self.kmax))

    def update(self, est: list[float], k: int, accepted: int, source: str = "head",
               probs: list[float] | None = None, first: int = 0, shift: int = 0) -> None:
        """One cycle of a row (see :meth:`_observe`); the shared estimate learns from it too.
        ``probs``: when the row was sampled, each verified position's probability of acceptance
        (``sum_x min(p(x), q(x))``), observed in place of the 0/1 outcome. ``first``: the
        source drafted from this chain position on (a splice: the other source before it);
        ``shift``: chain position j is the source's position j - shift (a proposal that
        started there)."""
        self._observe(est, k, accepted, self.alpha if probs is None else self.sampled_alpha, probs,
                      first, shift)
        if k:
            self._seen[source] = self._seen.get(source, 0) + 1
        if self.shared_alpha:
            shared = self.shared.setdefault(source, [self.prior] * self.kmax)
            counts = self._shared_n.setdefault(source, [0] * self.kmax)
            self._observe(shared, k, accepted, self.shared_alpha, probs, first, shift,
                          counts, self.SHARED_PRIOR_WEIGHT)

    def observe_leaf(self, j: int, taken: bool) -> None:
        """A head row's chain draft at position j (0-based) was rejected where leaves stood
        beside it: whether one of them was accepted."""
        if j < len(self.leaf):
            self.leaf[j] += self.LEAF_ALPHA * (float(taken) - self.leaf[j])

    def head_curve(self, est: list[float]) -> list[float]:
        """E(0..kmax) of a row drafting with the head at estimates ``est`` (with leaves where
        the engine drafts them)."""
        if self.width > 1:
            return expected_curve_leaves(est, self.leaf, self.kmax)
        return expected_curve(est, self.kmax)

    def relax_estimate(self, est: list[float], source: str = "head") -> None:
        """A cycle of a row that did not observe ``source`` (K=0, or another source drafted):
        the row's estimate moves ``relax`` of the way back towards the shared one.

        Why: a row's estimate moves only while its source drafts, and a source drafts only while
        its estimate is high, so after a few misses in a row (at alpha 0.2, three misses take
        0.45 to 0.23) the row would stop drafting with it for the rest of the request, whatever
        the source would do now, and over many rows the estimates would sit low (measured:
        docs/design.md section 6.7, "The catch-up is spread"). Relaxed, a row that has sat out
        ~14 cycles is half-way back to what all rows measure, and drafts with the source again
        if that pays; a row where it really misses falls back at the next miss."""
        shared = self.shared.get(source)
        if shared is not None and self.relax:
            r = self.relax  # (every row, every source, every cycle: one list pass, not an index loop)
            est[: len(shared)] = [e + r * (s - e) for e, s in zip(est, shared)]

    @staticmethod
    def _observe(est: list[float], k: int, accepted: int, alpha: float,
                 probs: list[float] | None = None, first: int = 0, shift: int = 0,
                 counts: list[int] | None = None, prior_weight: int = 0) -> None:
        """One cycle of a row: ``k`` drafts were verified, the first ``accepted`` accepted.

        Each verified position up to the first rejection is observed: with ``probs`` (a sampled
        row) its probability of acceptance given the accepted prefix, else whether it was
        accepted. Why: when sampling, the 0/1 outcome of a position accepted 40% of the time
        swings a moving average so far that a row whose drafts pay by 10% spends most cycles
        below the break-even, at K=0, where it observes nothing (docs/design.md section 6.7,
        "Sampled rows observe acceptance probabilities"); the probability has the same mean.

        A chain accepted whole says nothing about the next position; its estimate is raised to
        the deepest observed one (a head's conditional acceptances are of one size across steps:
        docs/design.md section 6.7), so a row that only ever drafted at K=1 can grow its chain
        instead of staying at its prior.

        ``counts`` (the shared estimate's observations per position, counted here): position
        j's n-th observation weighs ``max(alpha, 1 / (prior_weight + n))``, so the shared
        estimate is the mean of its first observations and the prior (worth ``prior_weight``
        of them), then a moving average. Why: at the shared alpha 0.02 a source seen a hundred
        times still carried 13% of the prior 0.5, and at T=1 prompt lookup's one-token matches
        were priced at 0.28 where they realised 0.16 (docs/design.md section 6.7, "The shared
        estimate starts as a mean")."""
        for j in range(first, min(k, accepted + 1)):
            hit = probs[j] if probs is not None else (1.0 if j < accepted else 0.0)
            a = alpha
            if counts is not None:  # an average with the prior until alpha weighs more
                counts[j - shift] += 1
                a = max(alpha, 1.0 / (prior_weight + counts[j - shift]))
            est[j - shift] += a * (hit - est[j - shift])
        if shift < k == accepted and k - shift < len(est):
            est[k - shift] = max(est[k - shift], est[k - shift - 1])

    def cycle_ms(self, k: int, batch: int, head_steps: bool = True, deferred: int = 0,
                 once: float = 0.0) -> float:
        """A cycle's expected ms: the measured curve at this batch size, times what cycles at K
        really took against it (``observe_cycle``). A drafting cycle after ``deferred`` cycles
        at K=0 also runs the head's draft extend over those positions (the catch-up), and a
        cycle that runs the head pays ``once`` ms more: its share of the head's first reading
        of the rows' prompts (:meth:`once_ms`)."""
        ms = self._model_ms(k, batch, head_steps, deferred)
        # a K not yet seen at this batch class pays at least what K=0 was measured to pay there:
        # the loop's overhead that slows K=0 slows a drafting cycle too (trusting the bare curve
        # for it made drafting look cheap next to a calibrated K=0 under load)
        key = self._calib_key(k, batch, head_steps)
        ratio = self.calib[key] if key in self.calib else self._inherited(key)
        return ms * ratio + (once if k and head_steps else 0.0)

    def _inherited(self, key: tuple) -> float:
        """What a (K, class[, "lookup"]) not yet calibrated starts from: K=0's ratio at its class
        (1 before any), or, when larger, its own ratio at the class below. At long contexts a
        verify of K+1 tokens per row pays attention over K+1 queries where the curve's short
        ones barely did, so a drafting K falls further behind its price than K=0 does, and more
        so the more rows: a K first run at 16 rows is priced at least as it ran at 8, and at
        least at the median ratio of the smaller Ks of its kind (head or lookup) already run at
        16."""
        k, cls = key[0], key[1]
        own = self.calib.get((0, cls), 1.0)
        if k and cls > 1:
            below = self._calib_key(k, cls // 2, head_steps=not key[2:])
            own = max(own, self.calib.get(below, own))
            # and, when larger, the median of the smaller drafting Ks of its kind already run at
            # its class: under load the Ks a hybrid spreads its cycles over ran 1.4-2.3x their
            # price alike, and each K's own first cycles had been priced at K=0's ratio. Only
            # smaller Ks: a larger K's ratio can be higher (attention over more queries), and a
            # small K priced from it might never run to correct its price
            sib = [r for kk, r in self.calib.items()
                   if 0 < kk[0] < k and kk[1] == cls and kk[2:] == key[2:]]
            if sib:
                own = max(own, statistics.median(sib))
        return own

    @staticmethod
    def _calib_key(k: int, batch: int, head_steps: bool) -> tuple:
        """Where cycles at K of ``batch`` rows are calibrated: (K, batch class), and apart,
        (K, batch class, "lookup") for drafting cycles without the head (hybrid, every row on
        prompt lookup). The two are priced from different parts of the curve (the verify alone,
        or the verify with the head's steps and extend), so one ratio cannot fit both
        (docs/design.md section 6.8, "Lookup cycles are calibrated apart").

        At one row every drafting K of a kind shares one ratio, keyed as K=1: there a cycle's
        time beyond the curve is the loop's own, about the same at every K, and a ratio per K
        moved only while that K ran, so one slow stretch of K=2 cycles priced K=2 high until it
        ran again, which it then did not (measured: a bench run at T=1 spent whole requests at
        K=1, a quarter of its cycles, tau 1.53 there against 1.84 at K=2; docs/design.md
        section 6.7, "One ratio at one row"). From two rows on the loop's costs grow with K and
        the rows, and each K keeps its own."""
        cls = batch_class(batch)
        if k and cls == 1:
            k = 1
        return (k, cls) if head_steps or not k else (k, cls, "lookup")

    def _model_ms(self, k: int, batch: int, head_steps: bool, deferred: int) -> float:
        if k and not head_steps:
            # drafted without the head (hybrid, every row on prompt lookup): the verify alone;
            # the head's extend over these positions waits for its next drafting cycle
            return self.costs.verify_at(k + 1, batch)
        ms = self.costs.cycle_ms(k, batch)
        if k and self.width > 1:  # leaves: the target reads 1 + k * width tokens, not k + 1
            ms += self.costs.verify_at(1 + k * self.width, batch) - self.costs.verify_at(k + 1, batch)
        if k and deferred:
            ms += self.catch_up_ms(deferred, batch)
        return ms

    def catch_up_ms(self, deferred: int, batch: int) -> float:
        """The head's catch-up over ``deferred`` positions of ``batch`` rows (cycles that ran
        without it: K=0, or prompt lookup for every row): the curve's
        extend of one position plus, per further position, the median of what the catch-ups
        seen at this batch class took beyond it (``observe_catch_up``; the curve alone before
        the first). Why: the curve times extends of 1..K+1 positions, nearly flat, and priced
        long catch-ups far below what they took (docs/design.md section 6.7, "The catch-up's
        price")."""
        base = self.costs.extend_ms(1, batch)
        per = self._catch_up.get(batch_class(batch))
        if per and deferred > 1:
            return base + statistics.median(per) * (deferred - 1)
        return self.costs.extend_ms(deferred, batch)

    def observe_catch_up(self, batch: int, deferred: int, ms: float) -> None:
        """A catch-up over ``deferred`` positions of ``batch`` rows took ``ms``."""
        if deferred > 1 and ms > 0 and self.calibrate:
            extra = max(ms - self.costs.extend_ms(1, batch), 0.0) / (deferred - 1)
            self._catch_up.setdefault(batch_class(batch), deque(maxlen=self.CALIB_WINDOW)).append(extra)

    def once_ms(self, tokens: int, left: float) -> float:
        """Per cycle, the price of the head's first reading of prompts it has not read
        (``tokens`` prompt positions in all, ReferenceEngine._head_prompts), spread over the
        ``left`` cycles the rows have left at most (their remaining token budgets): ms per prompt
        token as measured here (:meth:`observe_prompts`; 0 before the first reading, so the
        first drafting cycle is not held back by a guess).

        ``left`` bounds the cycles from above (one token a cycle); the choosers scale the share
        by the tokens a row emits per cycle at each K (:meth:`_once_at`). Rows may still stop at
        EOS before their budget, so the price errs towards drafting.

        Why: unpriced, a batch that had decoded at K=0 under load paid it all in its first
        drafting cycle as the load fell, for rows with a few tokens left to draft
        (docs/design.md section 6.7, "The head's first reading of prompts is priced")."""
        if not tokens or not self._prompt_tok:
            return 0.0
        return statistics.median(self._prompt_tok) * tokens / max(left, 1.0)

    @staticmethod
    def _once_at(once: float, tokens_per_row: float) -> float:
        """``once`` (a share per cycle at one token a row, :meth:`once_ms`) for cycles that emit
        ``tokens_per_row``: the rows then have that many times fewer cycles left to spread it
        over."""
        return once * max(tokens_per_row, 1.0)

    def observe_prompts(self, tokens: int, ms: float) -> None:
        """The head read ``tokens`` prompt positions in ``ms``."""
        if tokens > 0 and ms > 0 and self.calibrate:
            self._prompt_tok.append(ms / tokens)

    def observe_cycle(self, k: int, batch: int, ms: float, head_steps: bool = True,
                      deferred: int = 0) -> None:
        """A cycle at K of ``batch`` rows took ``ms`` (wall, draft + verify + extend, with the
        catch-up over ``deferred`` positions of cycles without the head when it ran one; the
        head's first reading of prompts is not in ``ms``: it is priced apart, :meth:`once_ms`)."""
        if self.calibrate:
            self._track_run(k, batch, head_steps, deferred)
        model = self._model_ms(k, batch, head_steps, deferred)
        if model > 0 and ms > 0 and self.calibrate:
            key = self._calib_key(k, batch, head_steps)
            prior = self.calib[key] if key in self.calib else self._inherited(key)
            window = self._ratios.setdefault(key, deque(maxlen=self.CALIB_WINDOW))
            window.append(min(ms / model, 10.0))
            # a K's first cycles are weighed against what it inherited (_inherited)
            self.calib[key] = statistics.median(list(window) + [prior] * max(0, 3 - len(window)))

    def _track_run(self, k: int, batch: int, head_steps: bool, deferred: int) -> None:
        """Count the head cycles in a row that each catch-up after K=0 started (the catch-up's
        cycle included); a K=0 cycle ends the run, and its length is kept for the batch class
        the catch-up ran at. A cycle on prompt lookup alone neither counts nor ends it (the head
        catches up on it in the next head cycle, a small catch-up the run already paid for).
        A run a probe started is not kept: a probe pays its catch-up whole anyway, and failed
        probes (runs of one) would price every catch-up whole where the head is marginal."""
        probe, self._probe_next = self._probe_next, False
        if k and head_steps:
            if self._open_run is not None:
                self._open_run[1] += 1
            elif deferred:
                self._open_run = [batch_class(batch), 1, probe]
        elif not k:
            self._close_run()

    def _close_run(self) -> None:
        if self._open_run is not None:
            cls, n, probe = self._open_run
            if not probe:
                runs = self._runs.setdefault(cls, deque(maxlen=self.CALIB_WINDOW))
                runs.append(n)
                self._run_median[cls] = max(statistics.median(runs), 1.0)
            self._open_run = None

    def margin_at(self, batch: int) -> float:
        """How much more throughput than K=0 drafting must promise at ``batch`` rows:
        ``margin + row_margin * (batch - 1)`` (3% at one row, 18% at 16 by default).

        A drafting cycle costs a continuous batch more than its own time, and more so the more
        rows it has: rows that accept different counts stop finishing in the same cycle, so
        their clients' next requests arrive apart and join in more prefill calls, with the other
        rows waiting through each, and cycles run with more free rows meanwhile (measured:
        docs/design.md section 6.8, "The margin grows with the batch")."""
        return self.margin + self.row_margin * (max(int(batch), 1) - 1)

    def _head_share(self, once: float, deferred: int, batch: int, left: float,
                    tokens_per_row: float) -> float:
        """What a head cycle pays beyond its own calls, at ``tokens_per_row``: its share of the
        head's first reading of prompts (``once``, :meth:`_once_at`) and of the catch-up over
        the ``deferred`` positions of cycles without the head.

        The catch-up is paid once, by the next cycle that drafts with the head, but it buys the
        head back for the cycles the rows have left (``left`` at one token a cycle; fewer at more
        tokens a row), so it is spread over those, as the prompt reading is; ``left`` = 1 charges
        it whole to the one cycle. Charged whole, it grew with every cycle that went without the
        head, so the longer the head sat out the dearer it looked (docs/design.md section 6.7,
        "The catch-up is spread"). A probe still pays it whole (:meth:`probe_due`): it may learn
        the head is not worth it, and then the catch-up bought nothing.

        Nor is it spread over more cycles than the head went on drafting after the catch-ups
        seen at this batch class (the median run, :meth:`_track_run`): under load the head
        drafted a cycle or two after a catch-up and the batch went back to K=0, so those cycles
        paid the catch-up (1.5-2x their price at 8 rows) for the rows' whole budgets it was
        spread over (docs/design.md section 6.8, "A catch-up buys what the head drafts after
        it")."""
        share = self._once_at(once, tokens_per_row)
        if deferred:
            part = max(tokens_per_row, 1.0) / max(left, 1.0)
            run = self._run_median.get(batch_class(batch))
            if run:
                part = max(part, 1.0 / run)
            share += self.catch_up_ms(deferred, batch) * min(part, 1.0)
        return share

    def best(self, ests: list[list[float]], deferred: int = 0, once: float = 0.0,
             left: float = 1.0) -> int:
        """The K with the most expected tokens per ms for rows with these estimates
        (``deferred``, ``once``, ``left``: what a head cycle pays beyond its calls, :meth:`_head_share`)."""
        B = len(ests)
        curves = [self.head_curve(e) for e in ests]
        tokens = [sum(c[k] for c in curves) for k in range(self.kmax + 1)]
        rate = [tokens[k] / self.cycle_ms(k, B, once=self._head_share(once, deferred, B, left, tokens[k] / B))
                for k in range(self.kmax + 1)]
        rate[0] *= 1.0 + self.margin_at(len(ests))
        return max(range(self.kmax + 1), key=lambda k: (rate[k], -k))

    def room(self, batch: int, head_only: bool = False) -> bool:
        """Could drafting beat K=0 at this batch size for rows as good as the best any draft
        source has been on average (the shared estimates, position by position)? Where it could
        not, the hybrid engine skips the cycle's proposals (ReferenceEngine._choose). The head's
        estimate is asked as a head cycle, its leaves counted and priced; with prompt lookup
        among the sources, the best of all of them position by position is also asked as a
        cycle without the head (its verify alone), so the bound stays optimistic.
        ``head_only``: the head's own estimate alone: the question a probe asks
        (:meth:`probe_due`)."""
        seen = {src: e for src, e in self.shared.items()
                if self._seen.get(src) and (src == "head" or not head_only)}
        if not seen:  # nothing observed yet: the prior is no evidence against drafting
            return True
        plain = (1.0 + self.margin_at(batch)) / self.cycle_ms(0, batch)
        ks = range(1, self.kmax + 1)
        if "head" in seen:
            # a head cycle: its leaves' tokens counted as its price counts their verify (priced
            # with them but counted without, a head with leaves where verifying more tokens costs
            # more, AVX-512 without AMX: 4 tokens 1.3x one, found no room after one early miss,
            # and with no room no probe: K=0 for the rest of the process)
            tokens = self.head_curve(seen["head"])
            if any(tokens[k] / self.cycle_ms(k, batch, True) > plain for k in ks):
                return True
            if len(seen) == 1:
                return False
        # the best of every source position by position, as a chain priced at a cycle without
        # the head (its verify alone): the optimistic bound of a hybrid's cycles
        best = [max(e[j] for e in seen.values()) for j in range(self.kmax)]
        tokens = expected_curve(best, self.kmax)
        return any(tokens[k] / self.cycle_ms(k, batch, False) > plain for k in ks)

    def probe_due(self, ests: list[list[float]], zero_run: int, deferred: int = 0,
                  once: float = 0.0) -> bool:
        """After ``zero_run`` cycles at K=0: is a K=1 probe due? Not before ``probe_every`` of
        them, and not before ``probe_budget`` of their time covers what the probe is expected
        to lose against plain decoding (its cycle, catch-up and the share ``once`` of the head's
        first reading of prompts included, less the time K=0 takes for the tokens the probe is
        expected to emit). (In a hybrid batch the probe is priced as a head cycle even when
        every row then takes prompt lookup: the dearer of the two.)

        And not at a batch size where rows as good as the head's shared estimate could not make
        a head cycle pay (:meth:`room`, ``head_only``): at 16 rows a K=1 cycle costs ~1.6x a
        plain one, so drafting there needs step-1 acceptance above ~0.6 in every row at once.
        Judged with prompt lookup's estimates too, the room stayed open where head probes lost
        (docs/design.md section 6.8, "Probes ask about the head alone")."""
        if zero_run < self.probe_every:
            return False
        B = len(ests)
        if not self.room(B, head_only=True):
            return False
        plain = self.cycle_ms(0, B)
        e1 = sum(self.head_curve(e)[1] for e in ests) / B  # (with leaves, as the cycle is priced)
        loss = self.cycle_ms(1, B, deferred=deferred, once=self._once_at(once, e1)) - plain * e1
        return loss <= self.probe_budget * zero_run * plain

    def takes_over(self, head: list[float], lookup: list[float], k: int, K: int) -> bool:
        """A head row that has drafted ``k`` of its ``K`` positions, where prompt lookup, asked
        again with those drafts after the sequence, has a proposal (``lookup``: the estimate for
        its match length): should the proposal take positions k+1..K? Yes where its estimates
        promise more tokens over them than the head's own from position k+1 on. Not priced into
        the plan: such a match is only known once the head has drafted, and it costs no more."""
        n = K - k
        return n > 0 and expected_tokens(lookup, n) > expected_tokens(head[k:K], n)

    def plan_hybrid(self, heads: list[list[float]], lookups: list[tuple[list[float], int] | None],
                    zero_run: int, deferred: int = 0, once: float = 0.0, left: float = 1.0,
                    splice: bool = False) -> tuple[int, list[bool], bool]:
        """Hybrid drafting: K, for each row whether its chain starts with prompt lookup's
        proposal, and whether the cycle runs the head.

        ``heads``: each row's head estimate; ``lookups``: each row's (lookup estimate for its
        match length, proposal length) or None without a proposal. At each K a row takes the
        source with more expected tokens. In a cycle that runs the head, a proposal shorter than
        K is continued by the head past its end (``splice``: the chain is the proposal, then the
        head's drafts from there on, priced with lookup's estimates up to the proposal's end and
        the head's after it); otherwise it is padded, its extra positions counted as misses.
        The estimates are the gate: a splice is taken only where its expected tokens beat the
        head's own chain and the cycle's price, so where lookup's estimate is low it stays off.

        A cycle where no row uses the head costs its verify alone (the head's extend over its
        positions joins the catch-up of the next cycle that drafts with the head, over
        ``deferred`` positions, its price spread over the ``left`` cycles the rows have:
        :meth:`_head_share`). A cycle may also go without the head while some rows have no
        proposal: those verify nothing (True in the returned list for every row; the engine
        knows a row without a proposal by its empty one). A cycle that runs the head also pays
        its share ``once`` of the head's first reading of prompts (:meth:`once_ms`)."""
        B = len(heads)
        best = (B / self.cycle_ms(0, B) * (1.0 + self.margin_at(B)), 0, [False] * B, False)  # K=0
        # each row's E(k) for k = 0..kmax, computed once (the loop below asks for every k)
        ehs = [self.head_curve(h) for h in heads]
        els_k = [expected_curve(lk[0][:lk[1]], self.kmax) if lk and lk[1] else None for lk in lookups]
        for k in range(1, self.kmax + 1):
            total, use, head = 0.0, [], False
            els = [c[min(k, lk[1])] if c is not None else 0.0 for c, lk in zip(els_k, lookups)]
            for h, el, lk, ehc in zip(heads, els, lookups, ehs):
                eh = ehc[k]
                if splice and el and lk[1] < k:  # the head continues past the proposal's end
                    el = expected_tokens(lk[0][:lk[1]] + h[lk[1]:k], k)
                take = el > eh
                use.append(take)
                head |= not take or (splice and lk[1] < k)
                total += el if take else eh
            # without head steps: the verify only (no draft steps, no extend, no catch-up yet)
            ms = self.cycle_ms(k, B, head_steps=head,
                               once=self._head_share(once, deferred, B, left, total / B))
            if total / ms > best[0]:
                best = (total / ms, k, use, head)
            if head and any(els):
                # or no head at all: rows with a proposal take it (padded), the others verify
                # nothing this cycle (one token, as at K=0), so the cycle costs its verify alone
                # (as the prompt-lookup arm's cycles do; at 2 rows the head's share decided
                # against it)
                free = sum(el or 1.0 for el in els)
                ms = self.cycle_ms(k, B, head_steps=False)
                if free / ms > best[0]:
                    best = (free / ms, k, [True] * B, False)  # (a row without a proposal: nothing)
        _, k, use, head = best
        if k == 0 and self.probe_due(heads, zero_run, deferred, once):
            self._probe_next = True
            use = [bool(lk and lk[1]) and expected_tokens(lk[0], 1) > expected_tokens(h, 1)
                   for h, lk in zip(heads, lookups)]
            return 1, use, not all(use)
        return k, use, head

    def choose(self, ests: list[list[float]], zero_run: int, deferred: int = 0, once: float = 0.0,
               left: float = 1.0) -> int:
        """This cycle's K; ``zero_run`` = how many cycles in a row ran at K=0 before it,
        ``deferred`` = how many positions the head has not caught up on (cycles without it),
        ``once`` = the cycle's share of the head's first reading of prompts (:meth:`once_ms`),
        ``left`` = the cycles the rows have left at one token a cycle (:meth:`_head_share`)."""
        k = self.best(ests, deferred, once, left)
        if k == 0 and self.probe_due(ests, zero_run, deferred, once):
            self._probe_next = True
            return 1
        return k
