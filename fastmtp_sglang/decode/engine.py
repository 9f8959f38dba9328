"""Reference speculative engine: a transformers target verifies what a FastMTPHead drafts.

It runs the draft exactly as SGLang's EAGLE worker does with ``--speculative-eagle-topk 1``
(a chain). With the target's KV holding positions ``< pos`` and ``pending`` the last emitted token
(at position ``pos``), one cycle is:

1. **draft**: d_1 comes from the previous draft extend. Step k >= 2 feeds the head its own step
   k-1 output hidden state and d_{k-1}, at position ``pos + k - 2``.
2. **verify**: one target forward over ``[pending, d_1 .. d_K]`` at positions ``pos .. pos + K``.
3. **accept**: greedy (draft == target argmax) or lossless rejection sampling; m drafts are
   accepted and one recovered / bonus token b is emitted.
4. **rollback**: the target's KV slots of the K - m rejected drafts are masked out (and cropped
   when every row has dropped them); the head's KV needs no rollback (see HeadKVCache).
5. **draft extend**: the head re-runs over the accepted positions ``pos .. pos + m`` with the
   target's hidden states and the tokens that followed them (d_1 .. d_m, b): its KV for those
   positions is rebuilt from target states, and the last output gives the next cycle's d_1.

``steps=0`` is plain decoding through the same code: the baseline of every speedup.

Rows of a batch advance by different amounts, so the target's cache is slot-based: every row
appends K + 1 slots per cycle, an attention mask hides rejected slots, and positions are per row.

What ``auto``, ``hybrid`` and a model-free drafter add to the cycle (each cycle's K and each
row's source, prompt lookup's proposals, the head's deferred work) is in decode/engine_auto.py.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

from fastmtp_sglang.core.head import FastMTPHead, head_input
from fastmtp_sglang.cpu_kernels.packed_linear import is_packed, pack_for_inference
from fastmtp_sglang.decode.batch import PREFILL_CALL_TOKENS, Batch, Row, prefill_groups
from fastmtp_sglang.decode.engine_auto import AutoDrafting, sync
from fastmtp_sglang.decode.lean_forward import lean_forward_for
from fastmtp_sglang.decode.lean_head import LeanHead
from fastmtp_sglang.decode.capture import capture_prompts, capture_verified
from fastmtp_sglang.decode import leaves
from fastmtp_sglang.decode.metrics import CycleLog, RequestMetrics
from fastmtp_sglang.decode.slot_cache import SLACK, SlotCache, use_gqa_sdpa
from fastmtp_sglang.decode.stops import emit
from fastmtp_sglang.decode.sampling import SamplingParams, first_argmax, verify_greedy, verify_sampling


class RequestError(ValueError):
    """A request the engine cannot run (too long, empty); the message says why."""


@dataclass
class Request:
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    # keep what training reads (decode/capture.py): the target's states of the fed positions
    # and this many top-k log-probabilities (0: states only); None: nothing
    features: int | None = None


@dataclass
class Result:
    output_ids: list[int]
    text: str | None
    finish_reason: dict[str, Any]
    metrics: RequestMetrics
    rid: str | None = None
    # Request.features: (post-norm states [P + N - 1, H], top-k ids int32, top-k log-probs fp16
    # or None)
    features: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None


# positions of head extends auto defers at most (cycles without the head; the oldest are
# forgotten): a batch that stays at K=0 (under load, where catching up costs more than probing
# may) would otherwise keep every cycle's hidden states
DEFER_MAX = 128


def _check_width(width, head, drafter, hybrid, lean) -> int:
    """``ReferenceEngine``'s ``width``, checked: leaves need the head (at a fixed K or auto's, or
    hybrid's head cycles) and the lean forward (their attention is a tree)."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an integer >= 1 (candidates per drafted position), got {width!r}")
    if width > 1:
        if head is None or (drafter is not None and not hybrid):
            raise ValueError("width > 1 (leaves) stands beside the head's drafts: give a head "
                             "(prompt lookup alone drafts no leaves)")
        if lean is None:
            raise ValueError("width > 1 (leaves) needs the lean forward (llama, qwen2, mistral; "
                             "FASTMTP_LEAN_FORWARD not 'off'): their attention is a tree")
    return width


class ReferenceEngine(AutoDrafting):
    """Speculative decoding with a transformers target and a FastMTPHead draft.

    Parameters
    ----------
    target : fastmtp_sglang.core.target.Target (model, tokenizer, config)
    head : FastMTPHead sharing the target's embedding and lm_head, or None (then steps must be 0)
    steps : K, drafted tokens per verification; 0 = plain decoding
    max_context : positions a request may use (default: the target's max_position_embeddings)
    drafter : a model-free drafter (fastmtp_sglang.decode.ngram.NgramDrafter) used instead of ``head``;
        a cycle where no row has a proposal verifies the pending token alone (K=0 for that cycle)
    auto : an AutoK controller (fastmtp_sglang.decode.auto) that picks each cycle's K in 0..steps
        from measured costs and the rows' running acceptance; None = always ``steps``
    hybrid : with ``auto``, a ``head`` and a ``drafter``: every cycle each row drafts with the
        head or takes the drafter's proposal, whichever has more expected accepted tokens
        (prompt lookup's estimates are kept per length of the suffix it matched)
    splice : hybrid: in a cycle that runs the head, a row whose prompt-lookup proposal is shorter
        than K may continue it with the head's drafts past its end (AutoK.plan_hybrid prices it)
    packed : "auto" (default; bf16 on a CPU with native bf16), "on" or "off": run the target's
        and the head's linear layers on prepared oneDNN weights; None reads FASTMTP_PACKED_LINEAR
    lean : "auto" (default: where the model is covered) or "off": the target's forward through
        decode/lean_forward.py (same numbers, fewer calls); None reads FASTMTP_LEAN_FORWARD
    width : candidates per drafted position (default 1, a chain): the head's draft and ``width
        - 1`` leaves beside it, verified in the same forward (decode/leaves.py); wherever the
        head drafts (a fixed K, auto's and hybrid's head cycles), through the lean forward
    """

    def __init__(self, target, head: FastMTPHead | None, steps: int, max_context: int | None = None,
                 draft_vocab=None, drafter=None, auto=None, hybrid: bool = False,
                 packed: str | None = None, lean: str | None = None, splice: bool = False,
                 width: int = 1):
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if auto is not None and (steps < 1 or auto.kmax != steps):
            raise ValueError(f"auto chooses K in 0..steps: needs steps >= 1 and auto.kmax == steps "
                             f"(got steps {steps}, kmax {auto.kmax})")
        self.auto = auto  # fastmtp_sglang.decode.auto.AutoK: K chosen per cycle, or None = steps
        if hybrid and (auto is None or head is None or drafter is None):
            raise ValueError("hybrid drafting needs auto, a head and a drafter")
        self.hybrid, self.splice = hybrid, splice
        if steps > 0 and head is None and drafter is None:
            raise ValueError("steps > 0 needs a draft head (or a drafter such as NgramDrafter)")
        self.drafter = drafter  # fastmtp_sglang.decode.ngram.NgramDrafter: drafts without a model
        self.target, self.head, self.steps = target, head, steps
        self.model = target.model
        # grouped key/value heads read in place under a mask (same numbers; decode/slot_cache.py)
        use_gqa_sdpa(self.model)
        # bf16 projections on weights oneDNN laid out once (same numbers; cpu_kernels/packed_linear.py)
        # (the target is shared: an engine made earlier on it may have packed it already)
        self.packed = pack_for_inference(self.model, head, packed) or is_packed(self.model)
        # the target's forward in fewer calls, same numbers (decode/lean_forward.py), or None
        self.lean = lean_forward_for(self.model, lean)
        # and the head's on the bf16 CPU kernels where they run (decode/lean_head.py), or None
        self.lean_head = LeanHead(head) if head is not None and self.lean is not None else None
        self.width = _check_width(width, head, drafter, hybrid, self.lean)
        if auto is not None and getattr(auto, "width", 1) != self.width:
            raise ValueError(f"auto prices cycles at width {getattr(auto, 'width', 1)}, the engine "
                             f"drafts at width {self.width}: give both the same")
        self.device = next(self.model.parameters()).device
        cfg_max = int(target.config.get("max_position_embeddings", 4096))
        self.max_context = min(max_context or cfg_max, cfg_max)
        self.eos_ids = set(target.eos_ids)
        self.draft_vocab = draft_vocab  # fastmtp_sglang.vocab.draft_vocab.DraftVocab, or None = full vocab
        self.prefill_call_tokens = PREFILL_CALL_TOKENS  # how prompts are grouped into prefills
        # rows a running batch's cache makes room for when a join must grow it (the server sets
        # its max batch): it then copies itself once, not at every doubling
        self.rows_hint = 0
        self._prompts_s = 0.0  # seconds of this cycle spent in _head_prompts
        # what a cycle, a catch-up and the head's reading of prompts are timed with (auto's
        # calibration reads them): time is an input, tests put a clock they advance here
        self.clock: Callable[[], float] = time.perf_counter
        # {K: [cycles, seconds (draft + verify + extend), rows summed]} of every cycle run, for
        # reports of where a run's time went (`fastmtp bench --concurrency`); reset it at will
        self.cycle_stats: dict[int, list] = {}

    # -- checks -----------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        n = len(req.input_ids)
        if n == 0:
            raise RequestError("the prompt is empty: send at least one token")
        if n + 1 > self.max_context:
            raise RequestError(f"the prompt has {n} tokens; this engine's context is "
                               f"{self.max_context} tokens: shorten the prompt")
        vocab = int(self.target.config.get("vocab_size", 0)) or None
        if vocab and (max(req.input_ids) >= vocab or min(req.input_ids) < 0):
            raise RequestError(f"input_ids must lie in [0, {vocab})")

    # -- target calls -----------------------------------------------------------------------
    def _target(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache,
                tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, pos [B, S]; mask [B, slots + S] -> (post-norm hidden [B, S, H], the head's input
        from the target: the same tensor, or [B, S, (n+1) H] for a head with n aux layers).
        ``tree`` [S, S]: what each new token sees of the others (default causal; lean only)."""
        aux = self.head.cfg.aux_hidden_states if self.head is not None else ()
        if self.lean is not None:
            last, hs = self.lean(ids, pos, mask, cache, keep=tuple(aux), tree=tree)
            return last, head_input(SimpleNamespace(last_hidden_state=last, hidden_states=hs), aux)
        out = self.model.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                               past_key_values=cache, use_cache=True, output_hidden_states=bool(aux))
        return out.last_hidden_state, head_input(out, aux)

    def _head(self, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """The head's output hidden states [B, S, H] (its final norm's), through the lean path
        where it applies."""
        if self.lean_head is not None:
            return self.lean_head.run(hidden, ids, pos, cache)
        return self.head(hidden, ids, pos, cache, return_logits=False)[0]

    # -- the loop ---------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, requests: list[Request],
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Result]:
        """Run a batch to completion. ``on_tokens(i, ids)`` streams each row's new tokens."""
        b = self.start(requests, list(range(len(requests))), on_tokens)
        done: dict[Any, Result] = {}
        while len(b):
            done.update(self.step(b, on_tokens))
        return [done[i] for i in range(len(requests))]

    @torch.inference_mode()
    def start(self, requests: list[Request], keys: list, on_tokens=None) -> Batch:
        """Prefill ``requests`` into a new batch (each emits its first token) for ``step`` to
        run; ``keys`` name the rows in ``on_tokens(key, ids)`` and in ``step``'s results."""
        return self._start(requests, keys, on_tokens, self.rows_hint)

    def _start(self, requests: list[Request], keys: list, on_tokens, rows: int) -> Batch:
        """``start``, with room in the target's cache for ``rows`` rows (a batch others join)."""
        for r in requests:
            self.validate(r)
        # copies of one prompt (n samples of it) are grouped as one: _prefill reads it once
        first: dict[tuple[int, ...], int] = {}
        same = [first.setdefault(tuple(r.input_ids), i) for i, r in enumerate(requests)]
        uniq = sorted(first.values())
        groups = []
        for g in prefill_groups([len(requests[i].input_ids) for i in uniq], self.prefill_call_tokens):
            firsts = {uniq[u] for u in g}
            groups.append([i for i, f in enumerate(same) if f in firsts])
        groups = groups or [[]]
        # the first group's cache is made with room for every group: merging them copies nothing
        room = (max(len(requests), rows), max((len(r.input_ids) for r in requests), default=0) + SLACK)
        parts = [self._prefill([requests[i] for i in g], [keys[i] for i in g], on_tokens,
                               room if j == 0 else (0, 0))
                 for j, g in enumerate(groups)]
        b = parts[0]
        for part in parts[1:]:
            b.merge(part)
        return b

    @torch.inference_mode()
    def join(self, b: Batch, requests: list[Request], keys: list, on_tokens=None) -> None:
        """Continuous batching: prefill ``requests`` and add them to the running batch ``b``
        between two cycles. Raises before touching ``b`` when they fail validation or prefill."""
        b.merge(self._start(requests, keys, on_tokens, 0), rows=self.rows_hint)

    @torch.inference_mode()
    def step(self, b: Batch, on_tokens=None) -> list[tuple[Any, Result]]:
        """One verify cycle of every live row of ``b``; returns ``(key, Result)`` of the rows
        that finished (they leave ``b``). Rows that finished before it (at their prefill) are
        returned first, by a call that runs no cycle. When it raises, every row is still in
        ``b``: those with ``finish`` set are done (``result(row)``), the others are not."""
        done = self._collect(b)
        if done or not len(b):  # answer those first: a cycle that raises must not lose them
            return done
        t = self.clock()
        self._prompts_s = 0.0  # the head's first reading of prompts in this cycle (_head_prompts)
        # near the context limit a row may verify only what fits (the rest of its drafts are
        # ignored, see _verify), and no cycle drafts more than its roomiest row can use
        room = (self.max_context - 2 - b.pos).clamp(min=0)                           # [n]
        deferred = b.deferred_positions()  # what the head catches up on if this cycle drafts
        drafts, qs, Kc = self._draft(b, min(self._choose(b), int(room.max())))
        sync(self.device)
        t_draft = self.clock() - t
        t = self.clock()
        room = room.clamp(max=Kc)                          # drafts each row may accept
        if self.hybrid and Kc and not b.plan_head:  # a row with no proposal in a cycle without the head: nothing
            none = [j for j, (take, _, toks) in enumerate(b.plan) if take and not toks]
            if none:
                room[none] = 0
        vh, vpos, acc, emitted = self._verify(b, drafts, qs, Kc, room)
        sync(self.device)
        t_verify = self.clock() - t
        t = self.clock()
        bonus = self._draft_extend(b, drafts, vh, vpos, acc, emitted)
        sync(self.device)
        t_draft += self.clock() - t
        if self.auto is not None:  # what this cycle really cost, against the curve
            head_steps = not self._head_idle(b, Kc)  # (at K=0 the curve has no head share)
            # (less the head's first reading of prompts: priced apart, AutoK.once_ms)
            self.auto.observe_cycle(Kc, len(b), 1e3 * (t_draft + t_verify - self._prompts_s),
                                    head_steps, deferred if Kc else 0)
        st = self.cycle_stats.setdefault(Kc, [0, 0.0, 0])
        st[0] += 1
        st[1] += t_draft + t_verify
        st[2] += len(b)
        self._advance(b, acc, emitted, bonus, room.tolist(), t_draft, t_verify, on_tokens)
        return done + self._collect(b)

    # -- the steps of generate ----------------------------------------------------------------
    def _prefill(self, requests: list[Request], keys: list, on_tokens,
                 room: tuple[int, int] = (0, 0)) -> Batch:
        """Target forward over the prompts (and the head's draft extend over them); emits each
        row's first token."""

        dev, K = self.device, self.steps
        b = Batch(self, requests, keys)
        t0 = time.perf_counter()
        B = len(b.rows)
        lens = torch.tensor([len(r.input_ids) for r in requests], device=dev)
        L = int(lens.max())
        ids = torch.zeros(B, L, dtype=torch.long, device=dev)
        for i, r in enumerate(requests):
            ids[i, : len(r.input_ids)] = torch.tensor(r.input_ids, device=dev)
        ar = torch.arange(L, device=dev)
        b.valid = ar[None] < lens[:, None]                    # [B, slots] target KV slots in use
        b.cache = SlotCache(*room)  # in-place slots (decode/slot_cache.py)
        # rows with the same prompt (n samples of one prompt): the target reads it once, and the
        # copies take that row's keys and values and hidden states
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(r.input_ids), i) for i, r in enumerate(requests)]
        if len(first) < B:
            uniq = sorted(first.values())
            u = torch.tensor(uniq, device=dev)
            hidden, feats = self._target(ids[u], ar[None].expand(len(u), L), b.valid[u].long(), b.cache)
            where = {j: n for n, j in enumerate(uniq)}
            pick = torch.tensor([where[j] for j in src], device=dev)                  # [B]
            b.cache.take_rows(pick)
            feats = hidden[pick] if feats is hidden else feats[pick]
            hidden = hidden[pick]
        else:
            hidden, feats = self._target(ids, ar[None].expand(B, L), b.valid.long(), b.cache)  # [B, L, H]
        capture_prompts(b.rows, hidden, lens, src, self.target.lm_head)
        last_h = hidden[torch.arange(B, device=dev), lens - 1]                       # [B, H]
        b.pending = b.sample(self.target.lm_head(last_h).float())         # [B]
        b.pos = lens.clone()                                  # position of `pending`, per row
        if b.use_head:
            # draft extend over the prompt: (h_i, x_{i+1}) at position i; x_n is `pending`
            nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
            nxt[torch.arange(B, device=dev), lens - 1] = b.pending
            max_len = self.max_context + K + 2
            b.dcache = self.head.new_cache(B, max_len, device=dev)
            if self.auto is None:
                g = self._head(feats, nxt, ar[None].expand(B, L), b.dcache)
                b.g = g[torch.arange(B, device=dev), lens - 1]                        # [B, H]
            else:
                # auto: the head runs over the prompt when the row first drafts (_head_prompts);
                # under load auto decodes at K=0, where the head's prefill was its one extra
                # cost (docs/design.md section 6.8)
                b.g = hidden.new_zeros(B, hidden.shape[-1])                           # [B, H]
                for i, r in enumerate(b.rows):
                    r.head_prompt = (feats[i, : len(r.req.input_ids)], nxt[i, : len(r.req.input_ids)])
                # what the head reads at the last prompt position
                last = torch.arange(B, device=dev), lens - 1
                b.tail = (feats[last][:, None], b.pending[:, None], (lens - 1)[:, None])
            if self.draft_vocab is not None:  # each request's table, from its prompt's tokens
                b.tidx, b.extra = self.draft_vocab.choose(ids, b.valid)
        sync(dev)
        prefill = time.perf_counter() - t0
        for r in b.rows:
            r.metrics.prefill_s = prefill
            self._emit(r, [int(b.pending[r.index])], on_tokens)
            if r.finish is None and int(b.pos[r.index]) + 1 >= self.max_context:
                r.finish = {"type": "length", "length": len(r.out)}  # the context is full
        b.start_decode()
        return b

    def _draft(self, b: Batch, K: int) -> tuple[torch.Tensor, list, int]:
        """1. draft: (drafts [n, Kc], per-step draft probabilities q (sampling only), Kc).
        Kc is the number of drafts verified this cycle (a drafter with nothing to propose: 0)."""
        dev, n = self.device, len(b)
        drafts = torch.empty(n, K, dtype=torch.long, device=dev)
        qs: list = []
        Kc = K
        b.leaves = b.took_leaf = None  # [n, K, width - 1] where the head drafted with leaves (decode/leaves.py)
        if self.hybrid:
            return self._draft_hybrid(b, K)
        if self.drafter is not None and K:
            drafts, Kc = self._propose(b.rows, K, b.pending)
            if not b.greedy:  # a deterministic draft: q is one-hot at each proposed token
                V = self.target.lm_head.weight.shape[0]
                qs = list(torch.nn.functional.one_hot(drafts, V).float().unbind(1))
        elif b.use_head and K:
            drafts, qs = self._draft_head(b, K)
        return drafts, qs, Kc

    def _draft_head(self, b: Batch, K: int, forced: list[list[int]] | None = None,
                    requery: list[bool] | None = None) -> tuple[torch.Tensor, list]:
        """K recursive head steps for every live row: (drafts [n, K], q per step or None).
        Splices (hybrid): ``forced``, per row, tokens that take the first positions of its chain
        in place of the head's picks; ``requery``, per row, whether prompt lookup is asked again
        after each of the head's drafts (``_requery``: a proposal it then finds may take the
        positions after them). The head's later steps read whatever the chain holds;
        ``b.fixed`` marks the positions that are not the head's picks (their q is the
        caller's), None when there are none."""
        n = len(b)
        drafts = torch.empty(n, K, dtype=torch.long, device=self.device)
        qs: list = []
        self._catch_up(b)
        over = None  # per position, the token that takes it, or -1 for the head's pick
        b.splice_at = {}
        if (forced and any(forced)) or (requery and any(requery)):
            over = torch.tensor([(t[:K] + [-1] * K)[:K] for t in (forced or [[]] * n)], device=self.device)
        for k in range(1, K + 1):
            if k > 1:
                pos = (b.pos + k - 2).clamp(max=self.max_context - 1)[:, None]
                g = self._head(b.g[:, None], drafts[:, k - 2, None], pos, b.dcache)
                b.g = g[:, 0]
            if self.width > 1:
                d, q, lv = leaves.candidates(b, b.g, self.width)
                b.leaves = lv[:, None] if k == 1 else torch.cat([b.leaves, lv[:, None]], 1)
            else:
                d, q = b.draft_pick(b.g)
            drafts[:, k - 1] = d if over is None else torch.where(over[:, k - 1] >= 0, over[:, k - 1], d)
            if k < K and requery and any(requery):
                self._requery(b, drafts, over, requery, k, K)
            qs.append(q)
        b.fixed = None if over is None else over >= 0
        if b.leaves is not None and b.fixed is not None:  # no leaves beside another source's tokens
            b.leaves = b.leaves.masked_fill(b.fixed[..., None], -1)
        return drafts, qs

    def _verify(self, b: Batch, drafts: torch.Tensor, qs: list, Kc: int, room: torch.Tensor):
        """2. verify, 3. accept, 4. roll back: one target forward over [pending, drafts];
        returns (the head's input from the target [n, Kc+1, H or (n_aux+1) H], positions
        [n, Kc+1], accepted [n], emitted [n, Kc+1]).
        Row i accepts at most ``room[i]`` (<= Kc) drafts: what still fits its context."""
        dev, n = self.device, len(b)
        if b.leaves is not None and Kc:
            return self._verify_leaves(b, drafts, qs, Kc, room)
        vin = torch.cat([b.pending[:, None], drafts], dim=1)                         # [n, Kc+1]
        # slots past a row's context are verified (one forward for the batch) but never
        # accepted: their positions are clamped into the context (rotary tables end there)
        vpos = (b.pos[:, None] + torch.arange(Kc + 1, device=dev)[None]).clamp(max=self.max_context - 1)
        b.valid = torch.cat([b.valid, torch.ones(n, Kc + 1, dtype=torch.bool, device=dev)], dim=1)
        vh, vf = self._target(vin, vpos, b.valid.long(), b.cache)                     # [n, Kc+1, H]
        b.accept_probs = None
        tlogits = self.target.lm_head(vh).float()                                     # [n, K+1, V]
        cap = room.tolist()
        if Kc == 0 and not b.greedy:  # nothing to verify: each row samples its next token
            emitted = b.sample(tlogits[:, 0])[:, None]                               # [n, 1]
            acc = torch.zeros(n, dtype=torch.long, device=dev)
        elif b.greedy:
            acc, emitted = verify_greedy(drafts, tlogits)
            if min(cap) < Kc:  # the emitted prefix is the target's argmax: cut it at the cap
                acc = torch.minimum(acc, room)
                slot = torch.arange(Kc + 1, device=dev)[None]
                emitted = torch.where(slot <= acc[:, None], first_argmax(tlogits), -1)
        else:
            p = b.probs(tlogits.reshape(n * (Kc + 1), -1), repeat=Kc + 1).view(n, Kc + 1, -1)
            q = torch.stack(qs, 1) if Kc else p.new_zeros(n, 0, p.shape[-1])
            parts = [verify_sampling(drafts[i:i + 1, :c], q[i:i + 1, :c], p[i:i + 1, :c + 1], b.gens[i])
                     for i, c in enumerate(cap)]
            acc = torch.cat([a for a, _ in parts])
            emitted = torch.cat([torch.nn.functional.pad(e, (0, Kc - c), value=-1)
                                 for (_, e), c in zip(parts, cap)])
            if self.auto is not None and Kc:  # each position's chance of acceptance (AutoK._observe)
                b.accept_probs = torch.minimum(p[:, :Kc], q).sum(-1).tolist()
        capture_verified(b.rows, vh, tlogits, acc)  # (rows that keep features: decode/capture.py)
        # rollback: hide the slots of rejected drafts; crop what no row uses
        slot = torch.arange(Kc + 1, device=dev)[None]
        b.valid[:, -(Kc + 1):] = slot <= acc[:, None]
        used = int(b.valid.any(0).nonzero().max()) + 1
        if used < b.valid.shape[1]:
            b.cache.crop(used - b.valid.shape[1])  # negative: drop that many trailing slots
            b.valid = b.valid[:, :used]
        b.repack()  # a long-lived batch: keep its holes bounded
        return vf, vpos, acc, emitted

    def _verify_leaves(self, b: Batch, drafts: torch.Tensor, qs: list, Kc: int, room: torch.Tensor):
        """``_verify`` for a cycle drafted with leaves (decode/leaves.py): one target forward over
        the chain and its leaves; the accepted path's states come back in the chain's layout and
        ``drafts`` holds the path's tokens (a leaf in place of the draft it stood beside)."""
        dev, n, W = self.device, len(b), self.width
        vin = torch.cat([b.pending[:, None], drafts, b.leaves.reshape(n, -1).clamp(min=0)], dim=1)
        S = vin.shape[1]                                                              # 1 + Kc W
        vpos = leaves.positions(b.pos, Kc, W).clamp(max=self.max_context - 1)
        b.valid = torch.cat([b.valid, torch.ones(n, S, dtype=torch.bool, device=dev)], dim=1)
        vh, vf = self._target(vin, vpos, b.valid.long(), b.cache, tree=leaves.tree_mask(Kc, W, dev))
        b.accept_probs = None
        tlogits = self.target.lm_head(vh).float()                                     # [n, S, V]
        acc, emitted, path, b.took_leaf, probs = leaves.verify(drafts, b.leaves, qs, tlogits, b, room.tolist(),
                                                               chain_probs=self.auto is not None)
        if probs is not None:  # the chain's positions' chances of acceptance (AutoK._observe)
            b.accept_probs = probs
        # the accepted path in the chain's layout: what capture, the extend and the caller read
        take = path[..., None]
        same = vf is vh
        vh = vh.gather(1, take.expand(-1, -1, vh.shape[-1]))
        vf = vh if same else vf.gather(1, take.expand(-1, -1, vf.shape[-1]))
        tlogits = tlogits.gather(1, take.expand(-1, -1, tlogits.shape[-1]))
        slot = torch.arange(Kc, device=dev)[None]
        drafts.copy_(torch.where(slot < acc[:, None], emitted[:, :Kc], drafts))
        capture_verified(b.rows, vh, tlogits, acc)
        # rollback: only the path's slots stay
        keep = torch.zeros(n, S, dtype=torch.bool, device=dev)
        keep.scatter_(1, torch.where(torch.arange(Kc + 1, device=dev)[None] <= acc[:, None], path, 0), True)
        b.valid[:, -S:] = keep
        used = int(b.valid.any(0).nonzero().max()) + 1
        if used < b.valid.shape[1]:
            b.cache.crop(used - b.valid.shape[1])
            b.valid = b.valid[:, :used]
        b.repack()
        return vf, vpos[:, : Kc + 1], acc, emitted

    def _draft_extend(self, b: Batch, drafts: torch.Tensor, vh: torch.Tensor, vpos: torch.Tensor,
                      acc: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
        """5. draft extend over the accepted positions; returns each row's bonus token [n]."""
        n = len(b)
        bonus = emitted.gather(1, acc[:, None])[:, 0]                                 # [n]
        if b.use_head:
            # the token after each verified position: d_{j+1} up to the first rejection, then b
            # (slots past it are overwritten before any query sees them)
            ext_ids = torch.cat([drafts, bonus[:, None]], dim=1)                      # [n, Kc+1]
            ext_ids.scatter_(1, acc[:, None], bonus[:, None])
            Kc = drafts.shape[1]
            # (past DEFER_MAX positions the oldest are forgotten, lookup cycles' too: catching up
            # there instead cost a head forward over every deferred position whenever a batch
            # kept at K=0 under load took one lookup cycle; docs/design.md section 6.8)
            if self._head_idle(b, Kc):
                # no head drafts this cycle (K=0, or every row took prompt lookup): extend later,
                # when the head next drafts (_catch_up), in one forward with the other such cycles.
                # Each row's part ends at its last accepted position: positions past it repeat
                # that entry (the head writes the same key again and gives the same output), so
                # every part's last column is every row's end.
                if Kc:
                    last = torch.minimum(torch.arange(Kc + 1, device=self.device)[None],
                                         acc[:, None])                               # [n, Kc+1]
                    vh = vh.gather(1, last[..., None].expand(-1, -1, vh.shape[-1]))
                    ext_ids, vpos = ext_ids.gather(1, last), vpos.gather(1, last)
                b.defer((vh, ext_ids, vpos), DEFER_MAX)
            else:
                self._catch_up(b)  # (a no-op after the head drafted: its steps caught it up)
                ge = self._head(vh, ext_ids, vpos, b.dcache)
                b.g = ge[torch.arange(n, device=self.device), acc]
        return bonus

    def _advance(self, b: Batch, acc: torch.Tensor, emitted: torch.Tensor, bonus: torch.Tensor,
                 drafted: list[int], t_draft: float, t_verify: float, on_tokens) -> None:
        """Bookkeeping: log the cycle, emit each row's tokens, finish rows, move positions on.
        ``drafted``: the drafts each row verified (the cycle's K, less near the context limit)."""
        n = len(b)
        acc_l, em_l = acc.tolist(), emitted.tolist()
        Kc = max(drafted)
        b.zero_run = b.zero_run + 1 if Kc == 0 else 0
        for j, r in enumerate(b.rows):
            k = drafted[j]
            # the chain's sources: positions < c from the first, the rest from the second (a
            # splice: lookup's proposal continued by the head, or the head's first draft
            # continued by lookup's proposal where the two agreed on it)
            first, c, m, shift = self._chain_sources(b, j, k, Kc)
            second = "head" if first == "lookup" else "lookup"
            r.metrics.cycles.append(CycleLog(accepted=acc_l[j], draft_s=t_draft / n,
                                             verify_s=t_verify / n, drafted=k,
                                             source="splice" if c < k else "lookup" if first == "lookup" else "",
                                             leaf=bool(b.took_leaf and b.took_leaf[j])))
            if self.auto is not None:
                # the sources that drafted learn from the cycle, each at its own positions; the
                # row's other estimates move back towards the shared ones (AutoK.relax_estimate)
                seen = set()
                a_j = acc_l[j]
                if b.took_leaf is not None:  # leaves: the estimates are the chain's own
                    a_j -= int(b.took_leaf[j])
                    if a_j < k and int(b.leaves[j, a_j, 0]) >= 0:
                        self.auto.observe_leaf(a_j, b.took_leaf[j])
                if k:
                    probs = b.accept_probs[j] if b.accept_probs is not None else None
                    est = {"head": r.est, "lookup": r.est_lookup.get(m)}
                    name = {"head": "head", "lookup": f"lookup{m}"}
                    self.auto.update(est[first], c, min(a_j, c), name[first], probs)
                    seen.add(first)
                    if c < k and a_j >= c:
                        self.auto.update(est[second], k, a_j, name[second], probs, first=c, shift=shift)
                        seen.add(second)
                if "head" not in seen:
                    self.auto.relax_estimate(r.est)
                for n_, e in r.est_lookup.items():
                    if not ("lookup" in seen and n_ == m):
                        self.auto.relax_estimate(e, f"lookup{n_}")
            self._emit(r, em_l[j][: acc_l[j] + 1], on_tokens)
            # the new pending token sits at pos + acc + 1: the context is full when it is the last
            if r.finish is None and int(b.pos[j]) + acc_l[j] + 2 >= self.max_context:
                r.finish = {"type": "length", "length": len(r.out)}
            if r.finish is not None:
                r.metrics.decode_s = time.perf_counter() - r.t_decode
        b.pos = b.pos + acc + 1
        b.pending = bonus

    def _collect(self, b: Batch) -> list[tuple[Any, Result]]:
        """The finished rows' results; the rows leave the batch."""
        gone = b.finished()
        if not gone:
            return []
        results = [(r.key, self.result(r)) for r in gone]
        b.remove(gone)
        return results

    def result(self, r: Row) -> Result:
        """A finished row's Result."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        r.metrics.peak_memory_bytes = peak
        r.metrics.completion_tokens = len(r.out)
        text = self._decode(r.out) if self.target.tokenizer is not None else None
        if text is not None and r.finish.get("type") == "stop" and "matched_str" in r.finish:
            text = text[: text.find(r.finish["matched_str"])]
        feats = None if r.capture is None else r.capture.finish(len(r.req.input_ids) + len(r.out) - 1)
        return Result(r.out, text, r.finish, r.metrics, r.req.rid, feats)

    def _decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, r: Row, new: list[int], on_tokens) -> None:
        """Append a cycle's tokens to a row, cutting at EOS / stop strings / max_new_tokens
        (decode/stops.py)."""
        emit(r, new, self.eos_ids, self._decode, on_tokens)
