"""What decides a training run: :class:`TrainConfig` (the `fastmtp train` flags, validated), the
losses and attention patterns it names, the step weights, the settings a resumed run must keep,
the autocast context of the head's forward/backward, and the peak LR default for a new head."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.decode.ngram import AUTO_MAX_NGRAM

LOSSES = ("ce", "kl", "ce+kl", "acc", "ce+acc")


def divergence(loss: str) -> str | None:
    """The loss's term against the target's distribution: "kl" (KL(p || q)), "acc" (-log of
    the acceptance rate sum_x min(p_x, q_x), objective._chunk_terms), or None (CE alone)."""
    return next((d for d in ("kl", "acc") if d in loss.split("+")), None)

ATTENTIONS = ("serve", "fastmtp")
COMPUTE_DTYPES = ("float32", "bfloat16")

# Peak LR for a head that starts from `fastmtp init-head` (no trained MTP weights): on the demo
# target 3e-3 beat 1e-3 by +0.043 held-out tau (seed noise 0.002) at 190 steps, while CE vs KL vs
# both and greedy data moved it by <= 0.004 (bench/results/ablation/). Converted native MTP layers
# keep the small default: their weights are already trained.
NEW_HEAD_LR = 3e-3


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
    loss: str = "ce"                  # LOSSES: "ce" | "kl" | "ce+kl" | "acc" | "ce+acc"
    lr: float = 2e-4                  # peak learning rate
    warmup: float = 0.05              # fraction of optimizer steps with linear warmup
    adam_betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 1.0            # max global grad norm; 0 = off
    epochs: int = 3
    max_len: int = 1024               # tokens per sequence (prompt + response); longer responses cut
    batch_size: int = 4               # sequences per micro-batch
    grad_accum: int = 1               # micro-batches per optimizer step
    ce_chunk: int = 256               # rows per fused projection + loss chunk; 0 = autograd reference
    heldout_fraction: float = 0.05    # share of sequences scored as training-time tau each epoch
    max_sequences: int | None = None  # use the first N usable rows of the data
    seed: int = 0
    save_every: int = 0               # optimizer steps between checkpoints; 0 = each epoch only
    eval_every: int = 0               # optimizer steps between held-out scores (the learning curve
                                      # in steps); 0 = at the end of each epoch only
    halt_after_steps: int | None = None  # stop (and checkpoint) after this many optimizer steps
    cache_hidden_gb: float = 2.0      # memory for caching the target's hidden states; 0 = off
    kl_topk: int = 0                  # kl/acc against the target's top-k from the feature cache; 0 = exact
    compute_dtype: str = "float32"    # head fwd/bwd under autocast in this dtype; weights, optimizer
                                      # state and evaluation stay fp32
    group_by_length: bool = False     # batches of similar lengths (less padding), order still random
    lookup_weight: float = 1.0        # hybrid-aware: weight of a target prompt lookup proposes right
                                      # (training/lookup_cover.py); 1 = every target alike
    lookup_min_match: int = 2         # ...counting lookup matches of at least this many tokens

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
        if self.eval_every < 0:
            bad.append(f"eval_every must be >= 0 (0 = each epoch only), got {self.eval_every}")
        if self.halt_after_steps is not None and self.halt_after_steps < 1:
            bad.append(f"halt_after_steps must be >= 1, got {self.halt_after_steps}")
        if self.cache_hidden_gb < 0:
            bad.append(f"cache_hidden_gb must be >= 0, got {self.cache_hidden_gb}")
        if self.kl_topk < 0:
            bad.append(f"kl_topk must be >= 0 (0 = exact KL from the hidden states), got {self.kl_topk}")
        if not 0.0 <= self.lookup_weight <= 1.0:
            bad.append(f"lookup_weight must lie in [0, 1] (1 = off), got {self.lookup_weight}")
        if not 1 <= self.lookup_min_match <= AUTO_MAX_NGRAM:
            bad.append(f"lookup_min_match must lie in 1..{AUTO_MAX_NGRAM} (auto's prompt lookup "
                       f"matches at most {AUTO_MAX_NGRAM} tokens), got {self.lookup_min_match}")
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
                "heldout_fraction", "max_sequences", "seed", "kl_topk", "group_by_length",
                "lookup_weight", "lookup_min_match")


def step_weights(steps: int, beta: float) -> list[float]:
    """w_k = beta^(k-1) / sum_j beta^(j-1), k = 1..steps."""
    raw = [beta ** (k - 1) for k in range(1, steps + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def resume_mismatches(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """The RESUME_FIXED settings in which ``cfg`` differs from a checkpoint's saved config."""
    # a setting added after a checkpoint was written is read there as its default (the run
    # trained with it): a checkpoint of an older version resumes under the same settings
    defaults = TrainConfig()
    return [f"{k}: checkpoint {saved.get(k, getattr(defaults, k))!r}, now {getattr(cfg, k)!r}"
            for k in RESUME_FIXED
            if _norm_value(saved.get(k, getattr(defaults, k))) != _norm_value(getattr(cfg, k))]


def _norm_value(v: Any) -> Any:
    return list(v) if isinstance(v, (tuple, list)) else v


def is_new_head(init: str | Path | None) -> bool:
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

