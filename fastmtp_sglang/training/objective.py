"""What the head is trained and scored on: the K-step recursion with the serve attention pattern
(:func:`unroll`), the lm_head rows it scores (:class:`Projection`), the chunked CE / KL loss
(:func:`batch_loss`), and training-time tau by simulated greedy acceptance (:func:`evaluate`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.head import FastMTPHead, rows_at
from fastmtp_sglang.training.config import ATTENTIONS, divergence
from fastmtp_sglang.training.data import Batch, Example, HiddenStates, collate
from fastmtp_sglang.training.fused_loss import projected_loss
from fastmtp_sglang.training.lookup_cover import step_weights_at


# ------------------------------------------------------------------------------------------------
# the recursion and its attention pattern
# ------------------------------------------------------------------------------------------------

def serve_mask(length: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Keys step ``step`` of every anchor sees at serving time: bool [T, step * T].

    Column block 1 (step-1 keys, position i) is causal: i <= j for the query of anchor j.
    Column block s >= 2 (step-s keys of anchor i, position i+s-1) is diagonal: i == j.
    """
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (step - 1), dim=1)


def shift_left(x: torch.Tensor, k: int, fill: int | float = 0) -> torch.Tensor:
    """out[:, j] = x[:, j + k]; the last k columns are ``fill``. x [B, T, ...]."""
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def anchors(prompt_lens: torch.Tensor, lengths: torch.Tensor, steps: int, t: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchors whose draft steps matter: j >= prompt_len - K - 1 (some step k <= K of anchor j
    predicts a response token x_{j+k+1}) and j < length. Returns (index [B, A], valid [B, A]):
    row b's anchors first_b, first_b + 1, ...; padding entries (valid False) repeat position
    t - 1 and are never scored."""
    first = (prompt_lens - steps - 1).clamp(min=0)
    a = max(int((lengths - first).max()), 1)
    idx = first[:, None] + torch.arange(a, device=lengths.device)[None]
    valid = idx < lengths[:, None]
    return idx.clamp(max=t - 1), valid


def at(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, ...] at the anchors ``index`` [B, A] -> [B, A, ...]; x itself when index is None."""
    return x if index is None else rows_at(x, index)


def unroll(head: FastMTPHead, hidden: torch.Tensor, input_ids: torch.Tensor, steps: int,
           attention: str = "serve", index: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head's K recursive steps for every anchor of a batch of sequences.

    Parameters
    ----------
    hidden : [B, T, H] the target's post-norm hidden states h_0..h_{T-1} ([B, T, (n+1) H] for a
        head with n aux layers: see core/head.py).
    input_ids : [B, T] the tokens x_0..x_{T-1} (right-padded; padding never reaches a real
        anchor: every key a real query sees belongs to an earlier or the same anchor).
    steps : K.
    attention : "serve" (train as you serve) or "fastmtp" (step k at position j, causal over
        step k's own keys at every prefix position).
    index : "serve" only: [B, A] the anchors to compute (:func:`anchors`); default every position.
        Step 1 still adds keys at every position (later anchors attend to them), but its query,
        output projection and MLP run at the anchors only, and steps 2..K at the anchors only:
        prompt anchors that no scored target needs cost only their keys.

    Returns
    -------
    K tensors [B, A, H] (A = T without ``index``): element k-1, column a is g^k_j for anchor
    j = index[:, a], the step-k output hidden whose logits predict x_{j+k+1}. Columns whose inputs
    run past the sequence are garbage.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if index is not None and attention != "serve":
        raise ValueError("anchor subsets are for the serve pattern (the fastmtp pattern's steps "
                         "attend to every position of their own step)")
    b, t = input_ids.shape
    dev = input_ids.device
    pos = torch.arange(t, device=dev)[None].expand(b, t)
    outs: list[torch.Tensor] = []
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    g = hidden
    if index is not None:
        causal = (torch.arange(t, device=dev)[None, None, :] <= index[:, :, None])[:, None]
        diag = torch.eye(index.shape[1], dtype=torch.bool, device=dev).expand(b, 1, -1, -1)
    for k in range(1, steps + 1):
        ids_k = shift_left(input_ids, k)                                   # x_{j+k}
        if attention != "serve":
            g, _ = head.forward_train_step(g, ids_k, pos, [], serve_mask(t, 1, dev))
        elif index is None:
            g, kv = head.forward_train_step(g, ids_k, pos + (k - 1), past, serve_mask(t, k, dev))
            past.append(kv)
        elif k == 1:  # keys at every position, outputs at the anchors
            g, kv = head.forward_train_step(g, ids_k, pos, [], causal, queries=index)
            past.append(kv)
        else:
            g, kv = head.forward_train_step(g, at(ids_k, index), index + (k - 1), past,
                                            torch.cat([causal] + [diag] * (k - 1), dim=-1))
            past.append(kv)
        outs.append(g)
    return outs


# ------------------------------------------------------------------------------------------------
# projection (full or compressed vocabulary) and the chunked loss
# ------------------------------------------------------------------------------------------------

class Projection:
    """The lm_head rows the draft scores: all of them, or a compressed table's.

    Parameters
    ----------
    lm_head : the target's output projection (``weight`` [V, H], optional ``bias`` [V]); frozen.
    vocab_ids : optional [S] int64 full-vocabulary ids; logits are then [.., S] and
        :meth:`labels` maps full ids to table indices (-1 = not in the table).
    """

    def __init__(self, lm_head: nn.Module, vocab_ids: torch.Tensor | None = None):
        w = lm_head.weight.detach()
        b = getattr(lm_head, "bias", None)
        b = b.detach() if b is not None else None
        self.full_size = w.shape[0]
        self.vocab_ids = None
        self.index = None
        if vocab_ids is not None:
            vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long).reshape(-1).to(w.device)
            if vocab_ids.numel() == 0 or int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= w.shape[0]:
                raise FastMTPError(f"vocabulary table ids must lie in [0, {w.shape[0]}) (the target's "
                                   "lm_head rows); this table was built for another model")
            if vocab_ids.unique().numel() != vocab_ids.numel():
                raise FastMTPError("vocabulary table holds repeated ids")
            w = w[vocab_ids]
            b = b[vocab_ids] if b is not None else None
            self.vocab_ids = vocab_ids
            self.index = torch.full((self.full_size,), -1, dtype=torch.long, device=w.device)
            self.index[vocab_ids] = torch.arange(vocab_ids.numel(), device=w.device)
        self.weight, self.bias = w, b

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def labels(self, full_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ids -> logit columns (-1 where the table lacks the id)."""
        return full_ids if self.index is None else self.index[full_ids]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> fp32 logits [..., S] (fp64 for fp64 weights)."""
        out = F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        return out.to(torch.promote_types(out.dtype, torch.float32))


def _chunk_terms(proj: Projection, kind: str, g: torch.Tensor, labels: torch.Tensor,
                 target_h: torch.Tensor | None, topk_ids: torch.Tensor | None = None,
                 topk_logp: torch.Tensor | None = None, row_w: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE sum over in-table labels, divergence sum, correct count) of one chunk. g [N, H],
    labels [N]; ``row_w`` [N] weighs each row's terms (default 1).

    The divergence (config.divergence(kind)) is KL(p || q), or with "acc" -log of the acceptance
    rate alpha = sum_x min(p_x, q_x), what sampled verification accepts of a draft token: the
    objective of LK losses (Samarin et al., arXiv 2602.23881), which moved DeepSeek-V3's native
    MTP at K=7 from an accept length of 3.20 to 4.83 where KL fine-tuning reached 4.79. It is
    exact from ``target_h`` [N, H] (the target's logits recomputed), or, with ``topk_ids`` /
    ``topk_logp`` [N, k] from the feature cache, over the target's top-k tokens: KL coarsened
    to {top-k, everything else} (kl_topk_terms), alpha summed over the top-k alone (a lower
    bound, acceptance_topk). alpha is clamped at ``eps`` (a row with no overlap: no gradient)."""
    logits = proj(g)                                                        # [N, S]
    zero = logits.new_zeros(())

    def wsum(rows: torch.Tensor) -> torch.Tensor:
        return (rows * row_w.to(rows.dtype)).sum() if row_w is not None else rows.sum()

    ce = (wsum(F.cross_entropy(logits, labels, ignore_index=-1, reduction="none"))
          if "ce" in kind else zero)
    kl = zero
    div = divergence(kind)
    if div:
        logq = F.log_softmax(logits, dim=-1)
        if topk_ids is not None:
            cols = proj.labels(topk_ids)
            if div == "kl":
                kl = wsum(kl_topk_terms(logq, cols, topk_logp))
            else:
                kl = wsum(-acceptance_topk(logq, cols, topk_logp).clamp(min=1e-6).log())
        else:
            with torch.no_grad():
                logp_t = F.log_softmax(proj(target_h), dim=-1)              # [N, S]
            if div == "kl":
                kl = wsum((logp_t.exp() * (logp_t - logq)).sum(-1))
            else:
                alpha = torch.minimum(logp_t.exp(), logq.exp()).sum(-1)
                kl = wsum(-alpha.clamp(min=1e-6).log())
    correct = (logits.detach().argmax(-1) == labels).sum()
    return ce, kl, correct


def kl_topk_terms(logq: torch.Tensor, cols: torch.Tensor, logp: torch.Tensor,
                  eps: float = 1e-6) -> torch.Tensor:
    """KL(p || q) per row over the partition {top-k tokens of p} + {the rest}.

    logq [N, S] the draft's log-probabilities; cols [N, k] the target's top-k tokens as logit
    columns (-1: outside a compressed table, so the draft cannot score it: it joins "the rest");
    logp [N, k] the target's log-probabilities of those tokens (over the full vocabulary).
    Coarsening never increases a KL, so this is a lower bound of the exact one that is tight when
    the top-k hold the target's mass (k=32 holds >0.99 of it at most positions of a chat model).
    Returns [N].
    """
    inside = cols >= 0
    p = logp.exp() * inside                                                 # [N, k]
    lq = logq.gather(-1, cols.clamp(min=0))                                 # [N, k]
    top = (p * (logp - lq)).sum(-1)
    rest_p = (1 - p.sum(-1)).clamp(min=eps)
    rest_q = (1 - (lq.exp() * inside).sum(-1)).clamp(min=eps)
    return top + rest_p * (rest_p.log() - rest_q.log())


def acceptance_topk(logq: torch.Tensor, cols: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """sum over the target's top-k tokens of min(p, q) per row: the acceptance rate of a draft
    token sampled from q under p's verification, less what the tokens outside the top-k add
    (a lower bound, tight when the top-k hold p's mass). Arguments as kl_topk_terms. [N]."""
    inside = cols >= 0
    p = logp.exp() * inside
    q = logq.gather(-1, cols.clamp(min=0)).exp() * inside
    return torch.minimum(p, q).sum(-1)


def step_loss_terms(proj: Projection, g: torch.Tensor, labels: torch.Tensor,
                    target_h: torch.Tensor | None = None, kind: str = "ce", chunk: int = 1024,
                    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
                    row_w: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's loss sums over N selected positions, in chunks of ``chunk`` rows.

    g : [N, H] draft output hidden states; labels : [N] logit columns (-1 = outside the table:
    no CE, counted wrong); target_h : [N, H] the target's hidden states whose logits predict the
    same tokens (needed for KL). Each chunk is projected and scored with its gradient in one pass
    (training/fused_loss.py: no [N, V] logits are kept for backward, none recomputed);
    ``chunk=0`` computes everything through autograd in one pass (the reference). ``row_w`` [N]
    weighs each position's terms (default 1).

    Returns (CE sum, KL sum, number of argmax hits), each a 0-d tensor.
    """
    n = g.shape[0]
    ti, tl = topk if topk is not None else (None, None)
    if chunk <= 0 or n == 0:
        return _chunk_terms(proj, kind, g, labels, target_h, ti, tl, row_w)
    return projected_loss(proj.weight, proj.bias, kind, g, labels, target_h,
                          proj.labels(ti) if ti is not None else None, tl, chunk,
                          row_weights=row_w)


def batch_loss(head: FastMTPHead, batch: Batch, proj: Projection, steps: int, weights: list[float],
               kind: str = "ce", attention: str = "serve", chunk: int = 1024,
               labels: torch.Tensor | None = None,
               denominators: tuple[list[int], list[int]] | None = None,
               lookup_weight: float = 1.0
               ) -> tuple[torch.Tensor, dict[str, list]]:
    """sum_k w_k L_k over one batch, and per-step statistics.

    ``labels`` [B, T] are the ground-truth tokens (default: ``batch.input_ids``); step k at anchor
    j is scored against labels[:, j+k+1] where ``loss_mask`` holds there (response tokens only).
    ``denominators`` (scored targets, in-table targets) per step are what L_k's means divide by;
    default this batch's own counts. A data-parallel rank passes its global batch's
    (training.parallel.token_counts), so the ranks' losses sum to the global batch's.
    ``lookup_weight`` < 1 with ``batch.lookup_cover``: a target prompt lookup would have proposed
    right weighs that much (training/lookup_cover.py); the means still divide by the counts.

    Returns (loss, stats) with stats lists over steps: ``loss`` (L_k), ``correct``, ``targets``
    (scored positions), ``in_table`` (targets inside a compressed vocabulary).
    """
    if len(weights) != steps:
        raise ValueError(f"{len(weights)} weights for {steps} steps")
    labels = batch.input_ids if labels is None else labels
    idx = valid = None
    if attention == "serve":
        idx, valid = anchors(batch.prompt_lens, batch.lengths, steps, batch.input_ids.shape[1])
    gs = unroll(head, batch.hidden, batch.input_ids, steps, attention, idx)
    total = batch.hidden.new_zeros((), dtype=torch.float32)
    stats: dict[str, list] = {"loss": [], "correct": [], "targets": [], "in_table": []}
    for k, (g, w) in enumerate(zip(gs, weights), start=1):
        sel = at(shift_left(batch.loss_mask, k + 1, False), idx)           # target x_{j+k+1} scored
        if valid is not None:
            sel = sel & valid
        lab = proj.labels(at(shift_left(labels, k + 1), idx)[sel])         # [N]
        th = tk = None
        if divergence(kind) and batch.topk_ids is not None:                 # cached top-k at j+k
            tk = (at(shift_left(batch.topk_ids, k), idx)[sel],
                  at(shift_left(batch.topk_logp, k), idx)[sel])
        elif divergence(kind):
            # h_{j+k} predicts x_{j+k+1} (the last H columns: a fused head's input starts with aux layers)
            th = at(shift_left(batch.hidden[..., -g.shape[-1]:], k), idx)[sel]
        rw = None
        if lookup_weight != 1.0 and batch.lookup_cover is not None:
            rw = at(step_weights_at(batch.lookup_cover, k, lookup_weight), idx)[sel]
        ce, kl, hit = step_loss_terms(proj, g[sel], lab, th, kind, chunk, tk, rw)
        n = int(sel.sum())
        n_in = int((lab >= 0).sum())
        d, d_in = ((n, n_in) if denominators is None
                   else (denominators[0][k - 1], denominators[1][k - 1]))
        lk = ce / max(d_in, 1) + kl / max(d, 1)
        total = total + w * lk
        stats["loss"].append(float(lk.detach()))
        stats["correct"].append(int(hit))
        stats["targets"].append(n)
        stats["in_table"].append(n_in)
    return total, stats


# ------------------------------------------------------------------------------------------------
# training-time tau: simulated greedy acceptance with the serve pattern
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def draft_hits(head: FastMTPHead, batch: Batch, proj: Projection, steps: int, chunk: int = 1024
               ) -> torch.Tensor:
    """hits [B, K, T] bool: step k's argmax at anchor j equals x_{j+k+1} (serve pattern); False
    at anchors no scored target needs (j < prompt_len - K - 1, see :func:`anchors`)."""
    b, t = batch.input_ids.shape
    idx, valid = anchors(batch.prompt_lens, batch.lengths, steps, t)
    gs = unroll(head, batch.hidden, batch.input_ids, steps, "serve", idx)
    hits = torch.zeros(b, steps, t, dtype=torch.bool, device=batch.input_ids.device)
    rows = torch.arange(b, device=idx.device)[:, None].expand_as(idx)[valid]
    for k, g in enumerate(gs, start=1):
        flat = g[valid]
        n = flat.shape[0]
        step = chunk if chunk > 0 else max(n, 1)
        pred = torch.cat([proj(flat[s:s + step]).argmax(-1) for s in range(0, n, step)]
                         or [flat.new_zeros(0, dtype=torch.long)])
        truth = at(proj.labels(shift_left(batch.input_ids, k + 1)), idx)[valid]
        hits[rows, k - 1, idx[valid]] = pred == truth
    return hits


def acceptance(hits: torch.Tensor, prompt_len: int, length: int) -> tuple[list[int], list[int]]:
    """Accepted drafts of one sequence from its hits [K, T].

    Returns (per_anchor, walk). ``per_anchor``: the leading-hit count at every anchor j with
    x_{j+1} in the response and all K targets inside the sequence (prompt_len-1 <= j <= length-K-2).
    ``walk``: the accepted count of each cycle a greedy server would run on this text, starting at
    anchor prompt_len-1 (the first response token comes from prefill) and moving to j + a + 1; a
    cycle near the end scores only the targets the text has.
    """
    steps = hits.shape[0]
    run = hits[:, :length].long().cumprod(0)                                # [K, L] leading hits
    lead = run.sum(0).tolist()
    per_anchor = lead[max(prompt_len - 1, 0): max(length - steps - 1, 0)]
    walk = []
    j = max(prompt_len - 1, 0)
    while j <= length - 3:                                                  # >= 1 target left
        avail = min(steps, length - 2 - j)
        a = int(run[:avail, j].sum())
        walk.append(a)
        j += a + 1
    return per_anchor, walk


def tau_summary(per_anchor: list[int], walk: list[int], steps: int) -> dict[str, Any]:
    n = len(per_anchor)
    return {
        "tau_train": 1 + sum(per_anchor) / n if n else None,
        "A_k": [sum(1 for a in per_anchor if a >= k) / n if n else None for k in range(1, steps + 1)],
        "anchors": n,
        "tau_walk": 1 + sum(walk) / len(walk) if walk else None,
        "cycles": len(walk),
    }


# ------------------------------------------------------------------------------------------------
# evaluation on held-out sequences
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(head: FastMTPHead, hidden_fn, examples: list[tuple[int, Example]], proj: Projection,
             steps: int, batch_size: int = 4, chunk: int = 1024) -> dict[str, Any]:
    """Training-time tau (and per-step top-1 accuracy) on ``(index, example)`` pairs."""
    was_training = head.training
    head.eval()
    device = head.enorm.weight.device
    per_anchor: list[int] = []
    walk: list[int] = []
    hit_k = [0] * steps
    n_k = [0] * steps
    for s in range(0, len(examples), batch_size):
        chunk_ex = examples[s:s + batch_size]
        batch = collate([e for _, e in chunk_ex], [hidden_fn(i, e.ids) for i, e in chunk_ex], device)
        # one copy to the host per batch: acceptance() reads the hits a cycle at a time, and on a
        # GPU each read was a sync (thousands per held-out score)
        hits = draft_hits(head, batch, proj, steps, chunk).cpu()
        for r, (_, e) in enumerate(chunk_ex):
            pa, w = acceptance(hits[r], e.prompt_len, len(e.ids))
            per_anchor += pa
            walk += w
        mask = batch.loss_mask.cpu()
        for k in range(1, steps + 1):
            sel = shift_left(mask, k + 1, False)
            hit_k[k - 1] += int(hits[:, k - 1][sel].sum())
            n_k[k - 1] += int(sel.sum())
    head.train(was_training)
    out = tau_summary(per_anchor, walk, steps)
    out["acc_k"] = [h / n if n else None for h, n in zip(hit_k, n_k)]
    return out


def training_tau(head: FastMTPHead, target, examples: list[Example], steps: int,
                 vocab_ids: torch.Tensor | None = None, batch_size: int = 4) -> dict[str, Any]:
    """Training-time tau of a head on examples (for benchmarks: compare with served tau)."""
    hs = HiddenStates(target.model, aux_layers=head.cfg.aux_hidden_states)
    return evaluate(head, hs, list(enumerate(examples)), Projection(target.lm_head, vocab_ids),
                    steps, batch_size)

