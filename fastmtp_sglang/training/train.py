"""`fastmtp train`: recursive K-step FastMTP fine-tuning that reproduces serving.

  fastmtp train --target T --init D0 --data data.jsonl --steps 3 --beta 0.6 --out D1
  fastmtp train --target T --init D0 --data data.jsonl --steps 3 --vanilla --out D1v
  fastmtp train --target T --data data.jsonl --resume D1 --out D1     # continue exactly

The target (with its embedding and lm_head) is frozen and shared; only the head trains.

**Train as you serve** (docs/design.md section 3, where FastMTP's own training disagrees with
serving). For a sequence x_0..x_{T-1} with the target's post-norm hidden states h_0..h_{T-1},
anchor j runs K steps:

- step 1: input (h_j, x_{j+1}) at position j, predicts x_{j+2};
- step k: input (g^{k-1}_j, x_{j+k}) at position j+k-1, predicts x_{j+k+1}, where g^{k-1}_j is the
  head's own step k-1 output hidden state (the ground-truth token stands in for the drafted one:
  on the accepted path they are equal).

At serving time, when step k of anchor j runs, the head's KV cache holds step-1 keys at positions
<= j (the draft extend rebuilds them from the target's states after every verification) plus
one key per earlier recursive step of this cycle, at positions j+1..j+k-1. Training computes all
anchors of a sequence at once with keys ``[K_1 | K_2 | ... | K_k]`` (each [T], rotated at the
positions above) and a boolean mask: block 1 causal (key i <= query j), blocks 2..k diagonal
(i == j). Gradients flow through the recursion, as in FastMTP. ``--attention fastmtp`` is
FastMTP's original pattern instead (every step at position j, causal over its own step's keys),
for comparison.

Loss: sum_k w_k L_k with w_k = beta^(k-1) / sum_j beta^(j-1) (beta 0.6, K 3: 0.51/0.31/0.18);
L_k is the mean over the step's targets that are response tokens of cross-entropy ("ce"), KL(target
|| draft) to the frozen target's own logits for the same token ("kl"), or their sum ("ce+kl").
Logits are computed per step and per chunk of ``--ce-chunk`` positions inside
``torch.utils.checkpoint``, so K x T x V logits never sit in memory. ``--vocab TABLE.pt`` trains
with the compressed head that will serve (lm_head rows of the table only; CE targets outside the
table are masked out and counted; KL is over the table, the target renormalised on it).

Each epoch, a held-out split is scored as training-time tau by simulated greedy acceptance with the
serve pattern: ``tau_train`` = 1 + mean over every anchor of the number of leading steps whose
argmax equals the ground truth; ``tau_walk`` follows the cycles a greedy server would run on the
text (anchor j -> j + accepted + 1), which is exactly the served tau when the text is the target's
greedy output.

Checkpoints (each epoch, every ``--save-every`` optimizer steps, and at the end) are draft
directories written atomically, with ``trainer_state.pt`` (fp32 weights, optimizer, scheduler,
position in the data, RNG) and ``train_log.jsonl`` beside ``model.safetensors``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastmtp_sglang.core.draft_dir import load_draft_dir, save_draft_dir
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.head import FastMTPHead

LOSSES = ("ce", "kl", "ce+kl")
ATTENTIONS = ("serve", "fastmtp")
STATE_NAME = "trainer_state.pt"
LOG_NAME = "train_log.jsonl"
STATE_FORMAT = 1


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

COMPUTE_DTYPES = ("float32", "bfloat16")
LENGTH_SPAN = 50  # group_by_length sorts spans of this many batches


def epoch_batches(train_idx: list[int], lengths: list[int], batch_size: int, seed: int, epoch: int,
                  group_by_length: bool = False) -> list[list[int]]:
    """The micro-batches of one epoch: a seeded shuffle cut into batches, a function of (seed,
    epoch) only, so a resumed run replays the same order. ``group_by_length`` sorts each span of
    LENGTH_SPAN batches of the shuffle by length before cutting it (padding to the longest row of
    a batch then wastes little), and shuffles the batches; the number of batches is unchanged."""
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=g).tolist()]
    if not group_by_length:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    span = LENGTH_SPAN * batch_size
    batches = []
    for s in range(0, len(order), span):
        part = sorted(order[s:s + span], key=lambda i: -lengths[i])
        batches += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def autocast(device: torch.device | str, compute_dtype: str):
    """The context the head's training forward and backward run in: torch.autocast to bf16, or
    nothing for fp32. bf16 matmuls use AMX / AVX512-BF16 where the CPU has them (this machine: a
    [4096, 576] x [576, 16384] product 84 ms in bf16 vs 316 ms in fp32); the fp32 master weights,
    the optimizer and the held-out evaluation are unchanged."""
    dev = torch.device(device).type
    return torch.autocast(dev, dtype=torch.bfloat16, enabled=compute_dtype == "bfloat16")


@dataclass
class TrainConfig:
    """Everything that decides a training run (CLI flags map 1:1, kebab-case).

    The paper's settings are LR 5e-5, 3 epochs, max length 4096; the default LR here is 2e-4
    because CPU runs see far fewer tokens (a few hundred optimizer steps), and 3e-3
    (:data:`NEW_HEAD_LR`) for a head from `fastmtp init-head`, chosen by ablation.
    """

    steps: int = 3                    # K: draft steps trained (and scored)
    beta: float = 0.6                 # step-weight decay: w_k ~ beta^(k-1)
    vanilla: bool = False             # train step 1 only, teacher-forced (DeepSeek / MiMo MTP)
    attention: str = "serve"          # "serve" (train as you serve) | "fastmtp" (the paper's)
    loss: str = "ce"                  # "ce" | "kl" | "ce+kl"
    lr: float = 2e-4                  # peak learning rate
    warmup: float = 0.05              # fraction of optimizer steps with linear warmup
    adam_betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 1.0            # max global grad norm; 0 = off
    epochs: int = 3
    max_len: int = 1024               # tokens per sequence (prompt + response); longer responses cut
    batch_size: int = 4               # sequences per micro-batch
    grad_accum: int = 1               # micro-batches per optimizer step
    ce_chunk: int = 1024              # positions per logits chunk; 0 = one unchunked pass
    heldout_fraction: float = 0.05    # share of sequences scored as training-time tau each epoch
    max_sequences: int | None = None  # use the first N usable rows of the data
    seed: int = 0
    save_every: int = 0               # optimizer steps between checkpoints; 0 = each epoch only
    halt_after_steps: int | None = None  # stop (and checkpoint) after this many optimizer steps
    cache_hidden_gb: float = 2.0      # memory for caching the target's hidden states; 0 = off
    kl_topk: int = 0                  # KL to the target's top-k from the feature cache; 0 = exact
    compute_dtype: str = "float32"    # head fwd/bwd under autocast in this dtype; weights, optimizer
                                      # state and evaluation stay fp32
    group_by_length: bool = False     # batches of similar lengths (less padding), order still random

    def __post_init__(self) -> None:
        self.adam_betas = tuple(float(b) for b in self.adam_betas)  # type: ignore[assignment]
        bad = []
        if self.steps < 1:
            bad.append(f"steps must be >= 1, got {self.steps}")
        if not 0 < self.beta <= 1:
            bad.append(f"beta must lie in (0, 1], got {self.beta}")
        if self.attention not in ATTENTIONS:
            bad.append(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.loss not in LOSSES:
            bad.append(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not self.lr > 0:
            bad.append(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup < 1:
            bad.append(f"warmup is a fraction in [0, 1), got {self.warmup}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            bad.append(f"adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            bad.append("weight_decay and grad_clip must be >= 0")
        if self.epochs < 1:
            bad.append(f"epochs must be >= 1, got {self.epochs}")
        if self.max_len < self.train_steps + 2:
            bad.append(f"max_len must be >= steps + 2 = {self.train_steps + 2}, got {self.max_len}")
        if self.batch_size < 1 or self.grad_accum < 1:
            bad.append(f"batch_size and grad_accum must be >= 1, got {self.batch_size}, {self.grad_accum}")
        if self.ce_chunk < 0:
            bad.append(f"ce_chunk must be >= 0 (0 = unchunked), got {self.ce_chunk}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            bad.append(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if not 0 <= self.heldout_fraction < 1:
            bad.append(f"heldout_fraction must lie in [0, 1), got {self.heldout_fraction}")
        if self.max_sequences is not None and self.max_sequences < 1:
            bad.append(f"max_sequences must be >= 1, got {self.max_sequences}")
        if self.save_every < 0:
            bad.append(f"save_every must be >= 0, got {self.save_every}")
        if self.halt_after_steps is not None and self.halt_after_steps < 1:
            bad.append(f"halt_after_steps must be >= 1, got {self.halt_after_steps}")
        if self.cache_hidden_gb < 0:
            bad.append(f"cache_hidden_gb must be >= 0, got {self.cache_hidden_gb}")
        if self.kl_topk < 0:
            bad.append(f"kl_topk must be >= 0 (0 = exact KL from the hidden states), got {self.kl_topk}")
        if bad:
            raise FastMTPError("bad training configuration: " + "; ".join(bad))

    @property
    def train_steps(self) -> int:
        """Steps that carry loss: 1 in vanilla mode, else K."""
        return 1 if self.vanilla else self.steps

    @property
    def weights(self) -> list[float]:
        return step_weights(self.train_steps, self.beta)


# fields that must not change when a run resumes (they decide data order, schedule and maths)
RESUME_FIXED = ("steps", "beta", "vanilla", "attention", "loss", "lr", "warmup", "adam_betas",
                "weight_decay", "grad_clip", "epochs", "max_len", "batch_size", "grad_accum",
                "heldout_fraction", "max_sequences", "seed", "kl_topk", "group_by_length")


def step_weights(steps: int, beta: float) -> list[float]:
    """w_k = beta^(k-1) / sum_j beta^(j-1), k = 1..steps."""
    raw = [beta ** (k - 1) for k in range(1, steps + 1)]
    total = sum(raw)
    return [w / total for w in raw]


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


def unroll(head: FastMTPHead, hidden: torch.Tensor, input_ids: torch.Tensor, steps: int,
           attention: str = "serve") -> list[torch.Tensor]:
    """The head's K recursive steps for every anchor of a batch of sequences.

    Parameters
    ----------
    hidden : [B, T, H] the target's post-norm hidden states h_0..h_{T-1}.
    input_ids : [B, T] the tokens x_0..x_{T-1} (right-padded; padding never reaches a real
        anchor: every key a real query sees belongs to an earlier or the same anchor).
    steps : K.
    attention : "serve" (train as you serve) or "fastmtp" (step k at position j, causal over
        step k's own keys at every prefix position).

    Returns
    -------
    K tensors [B, T, H]: element k-1, column j is g^k_j, the step-k output hidden of anchor j,
    whose logits predict x_{j+k+1}. Columns whose inputs run past the sequence are garbage.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    b, t = input_ids.shape
    pos = torch.arange(t, device=input_ids.device)[None].expand(b, t)
    outs: list[torch.Tensor] = []
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    g = hidden
    for k in range(1, steps + 1):
        ids_k = shift_left(input_ids, k)                                   # x_{j+k}
        if attention == "serve":
            g, kv = head.forward_train_step(g, ids_k, pos + (k - 1), past,
                                            serve_mask(t, k, input_ids.device))
            past.append(kv)
        else:
            g, _ = head.forward_train_step(g, ids_k, pos, [], serve_mask(t, 1, input_ids.device))
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
        """hidden [..., H] -> fp32 logits [..., S]."""
        return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()


def _chunk_terms(proj: Projection, kind: str, g: torch.Tensor, labels: torch.Tensor,
                 target_h: torch.Tensor | None, topk_ids: torch.Tensor | None = None,
                 topk_logp: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE sum over in-table labels, KL sum, correct count) of one chunk. g [N, H], labels [N].

    KL is exact from ``target_h`` [N, H] (the target's logits recomputed), or, with ``topk_ids``
    / ``topk_logp`` [N, k] from the feature cache, the KL of the two distributions coarsened to
    {the target's top-k tokens, everything else} (kl_topk_terms)."""
    logits = proj(g)                                                        # [N, S]
    zero = logits.new_zeros(())
    ce = F.cross_entropy(logits, labels, ignore_index=-1, reduction="sum") if "ce" in kind else zero
    kl = zero
    if "kl" in kind:
        logq = F.log_softmax(logits, dim=-1)
        if topk_ids is not None:
            kl = kl_topk_terms(logq, proj.labels(topk_ids), topk_logp).sum()
        else:
            with torch.no_grad():
                logp_t = F.log_softmax(proj(target_h), dim=-1)              # [N, S]
            kl = (logp_t.exp() * (logp_t - logq)).sum()
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


def step_loss_terms(proj: Projection, g: torch.Tensor, labels: torch.Tensor,
                    target_h: torch.Tensor | None = None, kind: str = "ce", chunk: int = 1024,
                    topk: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's loss sums over N selected positions, in chunks of ``chunk`` rows.

    g : [N, H] draft output hidden states; labels : [N] logit columns (-1 = outside the table:
    no CE, counted wrong); target_h : [N, H] the target's hidden states whose logits predict the
    same tokens (needed for KL). Each chunk's projection and loss run inside
    ``torch.utils.checkpoint``, so backward recomputes the [chunk, V] logits instead of keeping
    them; ``chunk=0`` computes everything in one pass without checkpointing (the reference).

    Returns (CE sum, KL sum, number of argmax hits), each a 0-d tensor.
    """
    n = g.shape[0]
    ti, tl = topk if topk is not None else (None, None)
    if chunk <= 0 or n == 0:
        return _chunk_terms(proj, kind, g, labels, target_h, ti, tl)
    ce = kl = g.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.long, device=g.device)
    for s in range(0, n, chunk):
        th = target_h[s:s + chunk] if target_h is not None else None
        c, k, hit = checkpoint(_chunk_terms, proj, kind, g[s:s + chunk], labels[s:s + chunk], th,
                               ti[s:s + chunk] if ti is not None else None,
                               tl[s:s + chunk] if tl is not None else None,
                               use_reentrant=False)
        ce, kl, correct = ce + c, kl + k, correct + hit
    return ce, kl, correct


@dataclass
class Batch:
    input_ids: torch.Tensor   # [B, T] x_0..x_{T-1}, right-padded with 0
    hidden: torch.Tensor      # [B, T, H] the target's post-norm hidden states (zeros on padding)
    loss_mask: torch.Tensor   # [B, T] bool: position t holds a response token of the sequence
    lengths: torch.Tensor     # [B]
    prompt_lens: torch.Tensor  # [B]
    topk_ids: torch.Tensor | None = None   # [B, T, k] the target's top-k next tokens at each position
    topk_logp: torch.Tensor | None = None  # [B, T, k] their log-probabilities


def batch_loss(head: FastMTPHead, batch: Batch, proj: Projection, steps: int, weights: list[float],
               kind: str = "ce", attention: str = "serve", chunk: int = 1024,
               labels: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, list]]:
    """sum_k w_k L_k over one batch, and per-step statistics.

    ``labels`` [B, T] are the ground-truth tokens (default: ``batch.input_ids``); step k at anchor
    j is scored against labels[:, j+k+1] where ``loss_mask`` holds there (response tokens only).

    Returns (loss, stats) with stats lists over steps: ``loss`` (L_k), ``correct``, ``targets``
    (scored positions), ``in_table`` (targets inside a compressed vocabulary).
    """
    if len(weights) != steps:
        raise ValueError(f"{len(weights)} weights for {steps} steps")
    labels = batch.input_ids if labels is None else labels
    gs = unroll(head, batch.hidden, batch.input_ids, steps, attention)
    total = batch.hidden.new_zeros((), dtype=torch.float32)
    stats: dict[str, list] = {"loss": [], "correct": [], "targets": [], "in_table": []}
    for k, (g, w) in enumerate(zip(gs, weights), start=1):
        sel = shift_left(batch.loss_mask, k + 1, False)                    # target x_{j+k+1} scored
        lab = proj.labels(shift_left(labels, k + 1)[sel])                  # [N]
        th = tk = None
        if "kl" in kind and batch.topk_ids is not None:                     # cached top-k at j+k
            tk = (shift_left(batch.topk_ids, k)[sel], shift_left(batch.topk_logp, k)[sel])
        elif "kl" in kind:
            th = shift_left(batch.hidden, k)[sel]                           # h_{j+k} predicts x_{j+k+1}
        ce, kl, hit = step_loss_terms(proj, g[sel], lab, th, kind, chunk, tk)
        n = int(sel.sum())
        n_in = int((lab >= 0).sum())
        lk = ce / max(n_in, 1) + kl / max(n, 1)
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
    """hits [B, K, T] bool: step k's argmax at anchor j equals x_{j+k+1} (serve pattern)."""
    gs = unroll(head, batch.hidden, batch.input_ids, steps, "serve")
    b, t = batch.input_ids.shape
    hits = torch.zeros(b, steps, t, dtype=torch.bool, device=batch.input_ids.device)
    for k, g in enumerate(gs, start=1):
        flat = g.reshape(b * t, -1)
        step = chunk if chunk > 0 else b * t
        pred = torch.cat([proj(flat[s:s + step]).argmax(-1) for s in range(0, b * t, step)])
        hits[:, k - 1] = pred.view(b, t) == proj.labels(shift_left(batch.input_ids, k + 1))
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
# data
# ------------------------------------------------------------------------------------------------

@dataclass
class Example:
    ids: torch.Tensor   # [T] int64 prompt + response
    prompt_len: int


@dataclass
class DataCounts:
    lines: int = 0
    used: int = 0
    blank: int = 0
    bad_json: int = 0
    bad_fields: int = 0       # no usable prompt/response fields, wrong types, ids out of range
    empty_response: int = 0   # no response, or a sequence too short to score a target
    prompt_too_long: int = 0  # prompt leaves no room for a scored response token within max_len
    truncated: int = 0        # response cut at max_len (kept)
    over_limit: int = 0       # usable rows past --max-sequences

    def skipped(self) -> int:
        return self.bad_json + self.bad_fields + self.empty_response + self.prompt_too_long


def _ids(value: Any, vocab: int) -> list[int] | None:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    if any(v < 0 or v >= vocab for v in value):
        return None
    return value


def parse_row(row: Any, tokenizer, vocab_size: int) -> tuple[list[int], list[int]] | None:
    """(prompt ids, response ids) from one data row, or None when it has no usable fields.

    Rows as ``fastmtp distill`` writes them carry ``prompt_ids`` (or ``input_ids``) and
    ``response_ids``; rows with ``prompt`` / ``response`` text are tokenized with the target's
    chat template (prompt) and without special tokens (response).
    """
    if not isinstance(row, dict):
        return None
    pid = row.get("prompt_ids", row.get("input_ids"))
    rid = row.get("response_ids")
    if pid is not None and rid is not None:
        p, r = _ids(pid, vocab_size), _ids(rid, vocab_size)
        return (p, r) if p is not None and r is not None else None
    prompt, response = row.get("prompt"), row.get("response")
    if isinstance(prompt, str) and isinstance(response, str) and tokenizer is not None:
        from fastmtp_sglang.core.prompts import render_chat

        text = render_chat(tokenizer, prompt)
        p = tokenizer(text, add_special_tokens=False).input_ids
        r = tokenizer(response, add_special_tokens=False).input_ids
        return _ids(list(p), vocab_size), _ids(list(r), vocab_size)  # type: ignore[return-value]
    return None


def load_examples(path: str | Path, tokenizer, vocab_size: int, max_len: int, min_targets: int = 1,
                  max_sequences: int | None = None) -> tuple[list[Example], DataCounts]:
    """Read a JSONL data file; bad lines are skipped and counted, never fatal.

    A row is kept when its prompt leaves room for at least ``min_targets`` scored response
    tokens within ``max_len`` (a step-1 target sits two tokens after its anchor).
    """
    path = Path(path)
    if not path.is_file():
        raise FastMTPError(f"data file {path} does not exist")
    counts = DataCounts()
    out: list[Example] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            counts.lines += 1
            line = line.strip()
            if not line:
                counts.blank += 1
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                counts.bad_json += 1
                continue
            try:
                parsed = parse_row(row, tokenizer, vocab_size)
            except FastMTPError:
                raise  # e.g. a tokenizer without chat template: every text row would fail
            except Exception:  # noqa: BLE001 - a malformed row of any kind is skipped and counted
                parsed = None
            if parsed is None or parsed[0] is None or parsed[1] is None:
                counts.bad_fields += 1
                continue
            prompt, response = parsed
            if not response:
                counts.empty_response += 1
                continue
            if not prompt:  # serving always has a prompt: the first response token's anchor
                counts.bad_fields += 1
                continue
            # a scored target sits >= 2 tokens after its anchor (step 1 predicts x_{j+2})
            if len(prompt) + len(response) < 3:
                counts.empty_response += 1
                continue
            if len(prompt) + min_targets > max_len:
                counts.prompt_too_long += 1
                continue
            if max_sequences is not None and counts.used >= max_sequences:
                counts.over_limit += 1
                continue
            ids = prompt + response
            if len(ids) > max_len:
                counts.truncated += 1
                ids = ids[:max_len]
            out.append(Example(torch.tensor(ids, dtype=torch.long), len(prompt)))
            counts.used += 1
    return out, counts


def split_heldout(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices), a seeded shuffle; at least one of each when possible."""
    if fraction <= 0 or n < 2:
        return list(range(n)), []
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    k = min(max(1, round(fraction * n)), n - 1)
    return sorted(perm[k:]), sorted(perm[:k])


class HiddenStates:
    """The frozen target's post-norm hidden states per sequence, under no_grad, optionally cached.

    Each sequence is run alone (no padding), so its states do not depend on which batch it is
    in: a resumed run sees bit-identical inputs.
    """

    def __init__(self, model: nn.Module, cache_bytes: float = 0):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache: dict[int, torch.Tensor] = {}
        self.budget = cache_bytes
        self.used = 0

    @torch.no_grad()
    def __call__(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden [T, H]."""
        h = self.cache.get(index)
        if h is not None:
            return h
        h = self.model.model(input_ids=ids[None].to(self.device)).last_hidden_state[0]
        size = h.numel() * h.element_size()
        if self.used + size <= self.budget:
            self.cache[index] = h
            self.used += size
        return h


def collate(examples: list[Example], hiddens: list[torch.Tensor], device: torch.device,
            topks: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Batch:
    """Right-padded batch. Cached hidden states (bf16 on disk) are widened to fp32: the head
    trains in fp32."""
    b = len(examples)
    t = max(len(e.ids) for e in examples)
    h = hiddens[0].shape[-1]
    ids = torch.zeros(b, t, dtype=torch.long, device=device)
    hdt = torch.float32 if hiddens[0].dtype in (torch.bfloat16, torch.float16) else hiddens[0].dtype
    hidden = torch.zeros(b, t, h, dtype=hdt, device=device)
    lengths = torch.tensor([len(e.ids) for e in examples], device=device)
    prompt_lens = torch.tensor([e.prompt_len for e in examples], device=device)
    for i, (e, hs) in enumerate(zip(examples, hiddens)):
        ids[i, : len(e.ids)] = e.ids.to(device)
        hidden[i, : len(e.ids)] = hs
    ar = torch.arange(t, device=device)[None]
    mask = (ar >= prompt_lens[:, None]) & (ar < lengths[:, None])
    tk_ids = tk_lp = None
    if topks is not None:
        k = topks[0][0].shape[-1]
        tk_ids = torch.zeros(b, t, k, dtype=torch.long, device=device)
        tk_lp = torch.full((b, t, k), -30.0, dtype=torch.float32, device=device)
        for i, (ti, tl) in enumerate(topks):
            tk_ids[i, : len(ti)] = ti.to(device)
            tk_lp[i, : len(tl)] = tl.to(device)
    return Batch(ids, hidden, mask, lengths, prompt_lens, tk_ids, tk_lp)


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
        hits = draft_hits(head, batch, proj, steps, chunk)
        for r, (_, e) in enumerate(chunk_ex):
            pa, w = acceptance(hits[r], e.prompt_len, len(e.ids))
            per_anchor += pa
            walk += w
        for k in range(1, steps + 1):
            sel = shift_left(batch.loss_mask, k + 1, False)
            hit_k[k - 1] += int(hits[:, k - 1][sel].sum())
            n_k[k - 1] += int(sel.sum())
    head.train(was_training)
    out = tau_summary(per_anchor, walk, steps)
    out["acc_k"] = [h / n if n else None for h, n in zip(hit_k, n_k)]
    return out


def training_tau(head: FastMTPHead, target, examples: list[Example], steps: int,
                 vocab_ids: torch.Tensor | None = None, batch_size: int = 4) -> dict[str, Any]:
    """Training-time tau of a head on examples (for benchmarks: compare with served tau)."""
    hs = HiddenStates(target.model)
    return evaluate(head, hs, list(enumerate(examples)), Projection(target.lm_head, vocab_ids),
                    steps, batch_size)


# ------------------------------------------------------------------------------------------------
# schedule, checkpoints
# ------------------------------------------------------------------------------------------------

def lr_lambda(total_steps: int, warmup: float):
    """Linear warmup over ceil(warmup * total) steps, then cosine to 0. LambdaLR saves no function state: rebuilt identically on resume."""
    warm = math.ceil(warmup * total_steps)

    def fn(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return fn


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checkpoint(out: Path, config: dict[str, Any], state_dict: dict[str, torch.Tensor],
                     trainer_state: dict[str, Any], log_lines: list[str]) -> None:
    """A draft directory plus trainer_state.pt and train_log.jsonl, atomically (replaces ``out``;
    a failed write leaves the previous checkpoint intact)."""
    def extra(tmp: Path) -> None:
        torch.save(trainer_state, tmp / STATE_NAME)
        (tmp / LOG_NAME).write_text("".join(line + "\n" for line in log_lines))

    save_draft_dir(out, config, state_dict, overwrite=True, write_extra=extra)


def load_trainer_state(path: Path) -> dict[str, Any]:
    f = Path(path) / STATE_NAME
    if not f.is_file():
        raise FastMTPError(f"{path} has no {STATE_NAME}: it is not a checkpoint `fastmtp train` "
                           "wrote, so it cannot be resumed (use it as --init instead)")
    state = torch.load(f, map_location="cpu", weights_only=True)
    if state.get("format") != STATE_FORMAT:
        raise FastMTPError(f"{f} has trainer-state format {state.get('format')!r}; expected {STATE_FORMAT}")
    return state


# ------------------------------------------------------------------------------------------------
# the training loop
# ------------------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    out: Path
    global_step: int
    finished: bool                    # all epochs done (False when halted early)
    last_eval: dict[str, Any] | None
    log: list[dict[str, Any]] = field(default_factory=list)


def _freeze(target) -> None:
    target.model.requires_grad_(False)
    target.model.eval()


def train(cfg: TrainConfig, target, data: str | Path, out: str | Path, init: str | Path | None = None,
          resume: str | Path | None = None, vocab_ids: torch.Tensor | None = None,
          vocab_name: str | None = None, overwrite: bool = False, progress: bool = True,
          allow_base_mismatch: bool = False, features: str | Path | None = None,
          target_dir: str | Path | None = None, feature_dtype: str = "bfloat16"
          ) -> TrainResult:
    """Train a FastMTP head; returns where the final checkpoint is and the log.

    Parameters
    ----------
    cfg : TrainConfig
    target : fastmtp_sglang.core.target.Target, frozen here (requires_grad False, never saved).
    data : JSONL data file (see :func:`parse_row`).
    out : output draft directory (replaced atomically at every checkpoint).
    init : draft directory to start from (ignored with ``resume``).
    resume : a checkpoint this function wrote; training continues exactly where it stopped.
    vocab_ids : optional [S] compressed vocabulary the loss uses (``vocab_name`` is recorded).
    features : a feature cache directory (fastmtp_sglang.training.features): the target's hidden states
        (and top-k logits for ``cfg.kl_topk``) are read from it, built there first when missing
        (needs ``target_dir``, the target's directory, for the weights hash). A resumed run
        reuses the cache its checkpoint names.
    """
    from fastmtp_sglang.core.target import require_fits

    data, out = Path(data), Path(out)
    if resume is None and init is None:
        raise FastMTPError("pass --init (a draft directory to start from) or --resume")
    if out.exists() and not overwrite and (resume is None or Path(resume).resolve() != out.resolve()):
        raise FastMTPError(f"{out} already exists; choose another --out or pass --overwrite")
    state = load_trainer_state(Path(resume)) if resume is not None else None
    if state is not None:
        saved = state["config"]
        diff = [f"{k}: checkpoint {saved.get(k)!r}, now {getattr(cfg, k)!r}" for k in RESUME_FIXED
                if _norm_value(saved.get(k)) != _norm_value(getattr(cfg, k))]
        if diff:
            raise FastMTPError("--resume needs the settings the run started with; these differ: "
                               + "; ".join(diff))
    src = Path(resume) if resume is not None else Path(init)  # type: ignore[arg-type]
    draft = load_draft_dir(src)
    require_fits(draft.config, target.config, target.tokenizer, where=str(src),
                 allow_base_mismatch=allow_base_mismatch)
    _freeze(target)
    device = next(target.model.parameters()).device

    head = FastMTPHead(draft.head_config, target.embed, target.lm_head)
    head.load_state_dict(state["head"] if state is not None else draft.state_dict, strict=True)
    head = head.to(device=device, dtype=torch.float32).train()
    if vocab_ids is None and state is not None and state.get("vocab_ids") is not None:
        vocab_ids = state["vocab_ids"]
    proj = Projection(target.lm_head, vocab_ids)

    vocab_size = int(target.config.get("vocab_size") or proj.full_size)
    examples, counts = load_examples(data, target.tokenizer, min(vocab_size, proj.full_size),
                                     cfg.max_len, 1, cfg.max_sequences)
    data_sha = file_sha256(data)
    if state is not None and state["data"]["sha256"] != data_sha:
        raise FastMTPError(f"{data} is not the data file the checkpoint was trained on "
                           f"(sha256 differs): resume with the same --data")
    train_idx, held_idx = split_heldout(len(examples), cfg.heldout_fraction, cfg.seed)
    if not train_idx:
        raise FastMTPError(f"{data}: no usable training rows ({counts.lines} lines, "
                           f"{counts.skipped()} skipped: {asdict(counts)})")
    if state is not None and state.get("features"):
        if features is None and Path(state["features"]).is_dir():
            features = state["features"]
        feature_dtype = state.get("feature_dtype") or feature_dtype  # the cache's, not the default
    if cfg.kl_topk and features is None:
        raise FastMTPError("--kl-topk reads the target's top-k logits from a feature cache: pass "
                           "--features DIR")
    store = None
    if features is not None:
        from fastmtp_sglang.training.features import open_or_build

        if target_dir is None:
            raise FastMTPError("a feature cache needs the target's directory (target_dir)")
        need_topk = cfg.kl_topk if "kl" in cfg.loss else 0
        store = open_or_build(target, target_dir, data, examples, features, cfg.max_len,
                              cfg.max_sequences, feature_dtype, need_topk, progress)
        if len(store) < len(examples):
            raise FastMTPError(f"feature cache {features} holds {len(store)} sequences, the data "
                               f"{len(examples)}: rebuild it")
    hidden_fn = store if store is not None else HiddenStates(target.model, cfg.cache_hidden_gb * 1e9)
    use_topk = store is not None and cfg.kl_topk > 0 and "kl" in cfg.loss

    def topks_of(idxs: list[int]):
        if not use_topk:
            return None
        return [tuple(x[:, :cfg.kl_topk] for x in store.topk(i)) for i in idxs]

    n_batches = math.ceil(len(train_idx) / cfg.batch_size)
    per_epoch = math.ceil(n_batches / cfg.grad_accum)
    total = per_epoch * cfg.epochs
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=cfg.adam_betas,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup))
    log_lines: list[str] = []
    epoch, batch_pos, global_step = 0, 0, 0
    last_eval: dict[str, Any] | None = None
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        epoch, batch_pos, global_step = state["epoch"], state["batch_in_epoch"], state["global_step"]
        last_eval = state.get("last_eval")
        torch.set_rng_state(state["rng"])
        log_file = Path(resume) / LOG_NAME  # type: ignore[arg-type]
        if log_file.is_file():
            log_lines = [ln for ln in log_file.read_text().splitlines() if ln.strip()]
    else:
        torch.manual_seed(cfg.seed)
    wrote_out = False
    records: list[dict[str, Any]] = []

    def log(rec: dict[str, Any]) -> None:
        records.append(rec)
        line = json.dumps(rec)
        log_lines.append(line)
        if wrote_out:  # live tail in the directory this run owns
            with (out / LOG_NAME).open("a") as f:
                f.write(line + "\n")

    def checkpoint_now(finished: bool) -> None:
        nonlocal wrote_out
        trainer_state = {
            "format": STATE_FORMAT, "config": asdict(cfg), "head": {k: v.detach().cpu().clone()
                                                                   for k, v in head.state_dict().items()},
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "epoch": epoch, "batch_in_epoch": batch_pos, "global_step": global_step,
            "rng": torch.get_rng_state(), "last_eval": last_eval,
            "data": {"path": str(data), "sha256": data_sha},
            "vocab_ids": proj.vocab_ids.cpu() if proj.vocab_ids is not None else None,
            "features": str(features) if features is not None else None,
            "feature_dtype": feature_dtype if features is not None else None,
        }
        config = json.loads(json.dumps(draft.config))
        meta = config.setdefault("fastmtp", {})
        meta["trained_steps"] = cfg.train_steps
        meta["step_weights"] = [round(w, 6) for w in cfg.weights]
        meta["training"] = {
            "mode": "vanilla" if cfg.vanilla else "fastmtp",
            "attention": cfg.attention,
            "data": str(data), "data_sha256": data_sha, "data_counts": asdict(counts),
            "sequences_train": len(train_idx), "sequences_heldout": len(held_idx),
            "optimizer_steps": global_step, "optimizer_steps_total": total, "finished": finished,
            "epochs_done": epoch if batch_pos == 0 else epoch + (batch_pos / n_batches),
            "last_train": _last_train(records, log_lines),
            "heldout": last_eval,
            "tau_train": (last_eval or {}).get("tau_train"),
            "vocab": {"name": vocab_name, "size": proj.size} if proj.vocab_ids is not None else None,
            "init": str(init) if init is not None else draft.meta.get("training", {}).get("init"),
            "config": asdict(cfg),
        }
        write_checkpoint(out, config, head.state_dict(), trainer_state, log_lines)
        wrote_out = True

    if state is None:
        log({"event": "start", "data": str(data), "counts": asdict(counts), "train": len(train_idx),
             "heldout": len(held_idx), "optimizer_steps": total, "config": asdict(cfg)})
    print(f"train: {len(train_idx)} sequences ({len(held_idx)} held out) from {data}; "
          f"{counts.skipped()} lines skipped, {counts.truncated} truncated; K={cfg.train_steps} "
          f"trained, weights {[round(w, 3) for w in cfg.weights]}, {total} optimizer steps",
          file=sys.stderr)

    from tqdm import tqdm

    bar = tqdm(total=total, initial=global_step, desc="train", unit="step", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)
    halted = False
    t0 = time.perf_counter()
    try:
        while epoch < cfg.epochs and not halted:
            batches = epoch_batches(train_idx, [len(e.ids) for e in examples], cfg.batch_size,
                                    cfg.seed, epoch, cfg.group_by_length)
            while batch_pos < len(batches):
                group = batches[batch_pos: batch_pos + cfg.grad_accum]
                opt.zero_grad(set_to_none=True)
                agg: dict[str, list] = {}
                loss_sum = 0.0
                for idxs in group:
                    batch = collate([examples[i] for i in idxs],
                                    [hidden_fn(i, examples[i].ids) for i in idxs], device,
                                    topks_of(idxs))
                    with autocast(device, cfg.compute_dtype):
                        loss, st = batch_loss(head, batch, proj, cfg.train_steps, cfg.weights,
                                              cfg.loss, cfg.attention, cfg.ce_chunk)
                    (loss / len(group)).backward()
                    loss_sum += float(loss.detach()) / len(group)
                    for key, vals in st.items():
                        agg[key] = [a + b for a, b in zip(agg[key], vals)] if key in agg else list(vals)
                gnorm = (torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
                         if cfg.grad_clip > 0 else _grad_norm(head))
                lr = opt.param_groups[0]["lr"]
                opt.step()
                sched.step()
                batch_pos += len(group)
                global_step += 1
                acc = [c / n if n else None for c, n in zip(agg["correct"], agg["targets"])]
                rec = {"event": "step", "step": global_step, "epoch": epoch + batch_pos / len(batches),
                       "lr": lr, "loss": loss_sum,
                       "loss_k": [v / len(group) for v in agg["loss"]], "acc_k": acc,
                       "targets": agg["targets"][0],
                       "out_of_table": [n - i for n, i in zip(agg["targets"], agg["in_table"])],
                       "grad_norm": float(gnorm), "elapsed_s": round(time.perf_counter() - t0, 3)}
                log(rec)
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum:.3f}",
                                acc="/".join(f"{a:.2f}" if a is not None else "-" for a in acc))
                if cfg.halt_after_steps is not None and global_step >= cfg.halt_after_steps:
                    halted = True
                    break
                if cfg.save_every and global_step % cfg.save_every == 0 and batch_pos < len(batches):
                    checkpoint_now(False)
            if halted and batch_pos < len(batches):
                break
            if held_idx:
                last_eval = evaluate(head, hidden_fn, [(i, examples[i]) for i in held_idx], proj,
                                     cfg.steps, cfg.batch_size, cfg.ce_chunk)
                log({"event": "eval", "epoch": epoch + 1, "step": global_step, **last_eval})
                print(f"train: epoch {epoch + 1}: held-out tau_train {_fmt(last_eval['tau_train'])} "
                      f"(walk {_fmt(last_eval['tau_walk'])}), A_k "
                      f"{[_fmt(a) for a in last_eval['A_k']]}", file=sys.stderr)
            epoch += 1
            batch_pos = 0
            checkpoint_now(epoch >= cfg.epochs)
        if halted and batch_pos != 0:
            checkpoint_now(False)
    finally:
        bar.close()
    return TrainResult(out, global_step, epoch >= cfg.epochs, last_eval, records)


def _grad_norm(head: nn.Module) -> torch.Tensor:
    norms = [p.grad.detach().norm() for p in head.parameters() if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.zeros(())


def _last_train(records: list[dict[str, Any]], log_lines: list[str]) -> dict[str, Any] | None:
    """Mean loss / accuracy over the most recent (up to 50) optimizer steps."""
    steps = [r for r in records if r.get("event") == "step"]
    if not steps:
        steps = [json.loads(ln) for ln in log_lines[-200:]]
        steps = [r for r in steps if r.get("event") == "step"]
    steps = steps[-50:]
    if not steps:
        return None
    k = len(steps[0]["loss_k"])

    def mean(vals: Iterable[float | None]) -> float | None:
        v = [x for x in vals if x is not None]
        return sum(v) / len(v) if v else None

    return {"steps": len(steps), "loss": mean(r["loss"] for r in steps),
            "loss_k": [mean(r["loss_k"][i] for r in steps) for i in range(k)],
            "acc_k": [mean(r["acc_k"][i] for r in steps) for i in range(k)]}


def _norm_value(v: Any) -> Any:
    return list(v) if isinstance(v, (tuple, list)) else v


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

# Peak LR for a head that starts from `fastmtp init-head` (no trained MTP weights): on the demo
# target 3e-3 beat 1e-3 by +0.043 held-out tau (seed noise 0.002) at 190 steps, while CE vs KL vs
# both and greedy data moved it by <= 0.004 (bench/results/ablation/). Converted native MTP layers
# keep the small default: their weights are already trained.
NEW_HEAD_LR = 3e-3


def _is_new_head(init: str | Path | None) -> bool:
    """True when ``init`` is a draft directory written by `fastmtp init-head` (its config records
    how the input projection was fitted) rather than a converted, already trained MTP layer."""
    if not init:
        return False
    try:
        cfg = json.loads((Path(init) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    fm = cfg.get("fastmtp") if isinstance(cfg, dict) else None  # a malformed config is load_draft_dir's to report
    init_info = fm.get("init") if isinstance(fm, dict) else None
    return isinstance(init_info, dict) and bool(init_info.get("method"))


def _config_from_args(args: argparse.Namespace, saved: dict[str, Any] | None) -> TrainConfig:
    """Flags given on the command line, over the checkpoint's settings (resume) or the defaults
    (the peak LR defaults to :data:`NEW_HEAD_LR` for a head from `fastmtp init-head`)."""
    names = {f.name for f in fields(TrainConfig)}
    # a halt belongs to the run that asked for it: the resumed run goes on unless told otherwise
    kw = {k: v for k, v in (saved or {}).items() if k in names and k != "halt_after_steps"}
    for name in names:
        val = getattr(args, name, None)
        if val is not None:
            kw[name] = val
    if "lr" not in kw and _is_new_head(getattr(args, "init", None)):
        kw["lr"] = NEW_HEAD_LR
    return TrainConfig(**kw)


def _run(args: argparse.Namespace) -> int:
    from fastmtp_sglang.core.target import load_target

    saved = load_trainer_state(Path(args.resume))["config"] if args.resume else None
    cfg = _config_from_args(args, saved)
    if not args.resume and not args.init:
        raise FastMTPError("pass --init DIR (a draft directory from `fastmtp init-head` or "
                           "`fastmtp convert`) or --resume DIR")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, dtype=args.dtype, device=device)
    vocab_ids = vocab_name = None
    if args.vocab:
        from fastmtp_sglang.vocab.tables import load_table

        table = load_table(args.vocab, target.tokenizer)
        vocab_ids, vocab_name = table.ids, table.name
    res = train(cfg, target, args.data, args.out, init=args.init, resume=args.resume,
                vocab_ids=vocab_ids, vocab_name=vocab_name, overwrite=args.overwrite,
                progress=not args.no_progress, allow_base_mismatch=args.allow_base_mismatch,
                features=args.features, target_dir=args.target, feature_dtype=args.feature_dtype)
    ev = res.last_eval or {}
    print(f"wrote draft directory {res.out} after {res.global_step} optimizer steps"
          + ("" if res.finished else " (halted early: continue with --resume)")
          + (f"; held-out tau_train {_fmt(ev.get('tau_train'))}" if ev else ""))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="FastMTP fine-tune of a draft head (train as you serve)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory (Hugging Face format)")
    p.add_argument("--init", help="draft directory to start from (fastmtp init-head / convert)")
    p.add_argument("--data", required=True, help="JSONL rows with prompt_ids/response_ids (as "
                   "`fastmtp distill` writes) or prompt/response text")
    p.add_argument("--out", required=True, help="output draft directory (rewritten at each checkpoint)")
    p.add_argument("--resume", help="checkpoint directory to continue from (same data and settings)")
    p.add_argument("--steps", type=int, help=f"K, recursive draft steps trained and scored (default {d.steps})")
    p.add_argument("--beta", type=float, help=f"step-weight decay, w_k ~ beta^(k-1) (default {d.beta})")
    p.add_argument("--vanilla", action="store_true", default=None, help="vanilla MTP: train step 1 only, "
                   "teacher-forced (held-out tau is still scored at --steps)")
    p.add_argument("--attention", choices=ATTENTIONS, help="serve: train as you serve (default); "
                   "fastmtp: the paper's pattern (step k at position j, causal over its own step)")
    p.add_argument("--loss", choices=LOSSES, help="ce on the data, kl to the target's logits, or "
                   "their sum (default ce)")
    p.add_argument("--epochs", type=int, help=f"passes over the training split (default {d.epochs})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {NEW_HEAD_LR} for a head from "
                   f"`fastmtp init-head`, {d.lr} for a converted MTP layer; the paper: 5e-5)")
    p.add_argument("--warmup", type=float, help=f"warmup fraction of optimizer steps (default {d.warmup})")
    p.add_argument("--weight-decay", type=float, help=f"AdamW weight decay (default {d.weight_decay})")
    p.add_argument("--grad-clip", type=float, help=f"max gradient norm, 0 = off (default {d.grad_clip})")
    p.add_argument("--batch-size", type=int, help=f"sequences per micro-batch (default {d.batch_size})")
    p.add_argument("--grad-accum", type=int, help=f"micro-batches per optimizer step (default {d.grad_accum})")
    p.add_argument("--max-len", type=int, help=f"tokens per sequence, prompt + response; longer "
                   f"responses are cut (default {d.max_len})")
    p.add_argument("--ce-chunk", type=int, help=f"positions per logits chunk, 0 = unchunked "
                   f"(default {d.ce_chunk})")
    p.add_argument("--vocab", help="compressed-vocabulary table (.pt) to train the head with")
    p.add_argument("--heldout-fraction", type=float, help=f"share of sequences held out and scored "
                   f"as training-time tau each epoch, 0 = none (default {d.heldout_fraction})")
    p.add_argument("--max-sequences", type=int, help="use only the first N usable rows (default all)")
    p.add_argument("--seed", type=int, help=f"data order and split seed (default {d.seed})")
    p.add_argument("--save-every", type=int, help="optimizer steps between checkpoints, 0 = each "
                   "epoch only (default 0)")
    p.add_argument("--halt-after-steps", type=int, help="stop after N optimizer steps, with a "
                   "checkpoint to --resume from (default: run all epochs)")
    p.add_argument("--cache-hidden-gb", type=float, help=f"GB of memory for caching the target's "
                   f"hidden states across epochs, 0 = recompute (default {d.cache_hidden_gb})")
    p.add_argument("--features", help="feature cache directory: the target runs once over the "
                   "data and epochs read its hidden states from disk (built here when missing; "
                   "see `fastmtp features`). Default: run the target every epoch")
    p.add_argument("--feature-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of cached hidden states when --features builds (default bfloat16)")
    p.add_argument("--kl-topk", type=int, help="with --loss kl/ce+kl and --features: KL to the "
                   "target's cached top-k distribution instead of recomputing its full logits "
                   f"(default {d.kl_topk} = exact)")
    p.add_argument("--group-by-length", action="store_true", default=None,
                   help="batch sequences of similar length together (less padding, same number of "
                        "batches, batch order still shuffled; default off)")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES,
                   help="the head's forward/backward under autocast: bfloat16 is ~2-4x faster on "
                        "CPUs with AMX or AVX512-BF16 and on GPUs; weights, optimizer and evaluation "
                        f"stay fp32 (default {d.compute_dtype})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the target's dtype; the head always trains in fp32 (default float32)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--allow-base-mismatch", action="store_true", help="train a draft made for another target (its recorded config / tokenizer hash differs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
