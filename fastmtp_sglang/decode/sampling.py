"""Sampling parameters, logits -> probabilities, and lossless speculative verification.

Terms used throughout (one verification cycle of K drafted tokens):

- **accepted** tokens: the leading drafts the target agrees with. Greedy: the draft equals the
  target's argmax. Sampling: draft ``d`` at step k is kept with probability
  ``min(1, p_k(d) / q_k(d))`` (``p`` the target's distribution, ``q`` the draft's).
- **recovered** token: emitted at the first rejected step k, drawn from
  ``normalise(max(p_k - q_k, 0))`` over the *full* vocabulary (greedy: the target's argmax).
  This residual is what makes the output distribution exactly ``p`` whatever ``q`` is, including
  a ``q`` that is zero outside a compressed vocabulary (docs/design.md section 1.5).
- **bonus** token: emitted when all K drafts are accepted, drawn from the target's distribution
  at position K+1, which the verification pass computed anyway.

So every cycle emits ``num_accepted + 1`` tokens: the accepted drafts, then one recovered or
bonus token. ``emitted`` rows are padded with -1 after that.

Everything here is pure torch, batch-vectorised, and runs on CPU and GPU. Nothing synchronises
with the device except what torch itself does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from fastmtp_sglang.decode.nucleus import top_k_top_p

__all__ = [
    "SamplingParams",
    "first_argmax",
    "draw_distinct",
    "logits_to_probs",
    "plain_temperature",
    "sample",
    "sample_each",
    "sample_rows",
    "verify_greedy",
    "verify_sampling",
]


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the index of the first maximum along the last axis, through
    ``max(-1)``, which returns the same index (the first of tied maxima) ~3x faster on CPU
    (fp32, 49K wide: 25 against 72 us a row at 1 row, 120 against 371 at 10)."""
    return x.max(-1).indices


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Per-request sampling settings.

    Parameters
    ----------
    temperature : float
        0 = greedy (argmax). Note SGLang's own default is 1.0; ours is greedy.
    top_p : float
        Nucleus mass in (0, 1]; 1 = disabled.
    top_k : int
        Keep the k most likely tokens; -1 = disabled.
    max_new_tokens : int
        Upper bound on generated tokens, >= 1.
    stop : list of str
        Stop strings (non-empty).
    stop_token_ids : list of int
        Extra token ids that end generation (besides EOS).
    ignore_eos : bool
        Keep generating past EOS.
    seed : int or None
        Seed for this request's ``torch.Generator``; None = nondeterministic.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be an int >= 1, or -1 to disable, got {self.top_k!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0, or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from SGLang's ``sampling_params`` JSON object.

        Accepts ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop`` (a string or
        a list of strings), ``stop_token_ids``, ``ignore_eos`` and ``seed`` (or SGLang's name,
        ``sampling_seed``). A JSON null means "use the default".

        Raises
        ------
        ValueError
            On an unknown key or a value of the wrong type or range; the message names the key.
        """
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"sampling_seed"})
        if unknown:
            raise ValueError(
                f"unknown sampling_params key(s) {unknown}; supported: {sorted(known)} "
                "(and 'sampling_seed' as an alias of 'seed')"
            )
        kwargs = {k: v for k, v in d.items() if v is not None}
        if "sampling_seed" in kwargs:
            alias = kwargs.pop("sampling_seed")
            if "seed" in kwargs and kwargs["seed"] != alias:
                raise ValueError(
                    f"sampling_params gives both seed={kwargs['seed']!r} and "
                    f"sampling_seed={alias!r}; give one"
                )
            kwargs["seed"] = alias
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        # Check each key alone, so the message names the offending key even when __post_init__
        # would have phrased it differently.
        for key, value in kwargs.items():
            try:
                cls(**{key: value})
            except ValueError as e:
                raise ValueError(f"sampling_params[{key!r}]: {e}") from None
        return cls(**kwargs)


def _per_row(x: torch.Tensor | float | int, n: int, name: str, device, dtype) -> torch.Tensor:
    """A per-row parameter as a tensor of shape [n]; a Python scalar is broadcast."""
    t = torch.as_tensor(x, device=device, dtype=dtype)
    if t.ndim == 0:
        return t.expand(n)
    if t.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}] (one value per row), got {tuple(t.shape)}")
    return t


def logits_to_probs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor | float,  # [N] float, 0 = greedy
    top_p: torch.Tensor | float,  # [N] float in (0, 1]
    top_k: torch.Tensor | int,  # [N] int64, -1 = disabled
) -> torch.Tensor:
    """Turn logits into the distribution a request samples from.

    Greedy rows (temperature 0) get a one-hot at the argmax, so greedy is just another
    distribution and one verifier serves mixed batches. Other rows: ``softmax(logits / T)``, then
    top-k, then top-p on what top-k kept, then renormalise. Logits of ``-inf`` (a compressed-vocab
    draft's non-support) get probability exactly 0. Values are not range-checked here (that would
    synchronise with the device); ``SamplingParams`` checks them.

    Parameters
    ----------
    logits : torch.Tensor
        Shape [N, V], any float dtype. Each row needs at least one finite logit.
    temperature, top_p, top_k : torch.Tensor or scalar
        Shape [N] each, or a scalar used for every row.

    Returns
    -------
    torch.Tensor
        Shape [N, V], float32, rows sum to 1.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if _plain(temperature, top_p, top_k):
        # every row at one temperature, no filter: the softmax alone (the per-row parameter
        # handling below took ~26 of 38 us at 16K entries, more than the softmax itself). The
        # same division and softmax as below, so the same probabilities (test_sampling.py)
        x = logits.float()
        return torch.softmax(x if temperature == 1.0 else x / temperature, dim=-1)
    n, v = logits.shape
    dev = logits.device
    temperature = _per_row(temperature, n, "temperature", dev, torch.float32)
    top_p = _per_row(top_p, n, "top_p", dev, torch.float32)
    top_k = _per_row(top_k, n, "top_k", dev, torch.int64)
    logits = logits.float()

    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)
    # The sort behind top-k / top-p (7 ms a row at 49K entries on 2 cores) and the one-hot of
    # greedy rows are skipped when no row needs them (docs/results.md, "Sampling as cheap as greedy")
    filters = (top_k > 0) | (top_p < 1)  # [N]: rows that keep less than the vocabulary
    if _any(filters):
        probs = top_k_top_p(probs, top_p, top_k, filters)
    if _any(greedy):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _plain(temperature, top_p, top_k) -> bool:
    """Python scalars asking for a softmax at one positive temperature and nothing else."""
    return (isinstance(temperature, float) and temperature > 0.0 and not isinstance(top_p, torch.Tensor)
            and top_p == 1.0 and not isinstance(top_k, torch.Tensor) and top_k == -1)


def plain_temperature(params: list) -> float | None:
    """The temperature every one of ``params`` (SamplingParams) samples at when they share one
    and none is greedy or filters (top-k, top-p): ``logits_to_probs(x, t, 1.0, -1)`` then serves
    them all with a softmax; None otherwise."""
    temps = {p.temperature for p in params}
    if (len(temps) != 1 or any(p.is_greedy or p.top_p < 1.0 or p.top_k != -1 for p in params)):
        return None
    return temps.pop()


def _any(flags: torch.Tensor) -> bool:
    """``flags.any()`` where it costs no device sync (CPU); True on an accelerator, where the
    work it would skip is a no-op for the rows it does not concern."""
    return flags.device.type != "cpu" or bool(flags.any())


def sample(
    probs: torch.Tensor,  # [N, V]
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row.

    Parameters
    ----------
    probs : torch.Tensor
        Shape [N, V], non-negative, each row with positive mass (need not sum to 1).
    generator : torch.Generator, optional
        On ``probs``' device; the same seed gives the same tokens.

    Returns
    -------
    torch.Tensor
        Shape [N], int64. A zero-probability token is never returned.
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must be [N, V], got shape {tuple(probs.shape)}")
    # Inverse CDF: one uniform per row, the first entry whose running mass exceeds u * total.
    # A zero-probability entry adds nothing to the running mass, so it is never the first to
    # exceed it. (torch.multinomial draws V exponentials a row: bench/results/sampling_cost/.)
    # No host sync.
    probs = probs.float()
    cum = probs.cumsum(dim=-1)                                                    # [N, V]
    total = cum[:, -1:]                                                           # [N, 1]
    u = torch.rand(probs.shape[0], 1, device=probs.device, generator=generator)  # [N, 1] in [0, 1)
    # u * total can round up to the total itself; the float just below it still lands on the
    # last entry with mass (no cumulative sum lies strictly between the two)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, x, right=True).squeeze(-1)


def sample_each(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """:func:`sample` for every row of ``probs`` [N, V] from its own generator (N of them, or
    None): the same tokens as N calls of ``sample(probs[i:i + 1], generators[i])``, from one
    running sum and one search for all rows (a call per row cost ~45 us at 49K entries)."""
    if probs.ndim != 2 or len(generators) != probs.shape[0]:
        raise ValueError(f"probs [N, V] with N generators, got {tuple(probs.shape)}, "
                         f"{len(generators)} generators")
    probs = probs.float()
    cum = probs.cumsum(dim=-1)                                                    # [N, V]
    total = cum[:, -1:]
    u = torch.cat([torch.rand(1, 1, device=probs.device, generator=g) for g in generators])
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, x, right=True).squeeze(-1)


def draw_distinct(probs: torch.Tensor, w: int, generators: list) -> torch.Tensor:
    """``w`` entries of each row without replacement: each drawn from what the earlier draws
    of the row left (the law of zeroing each drawn entry and calling :func:`sample` again), from
    the row's own generator.

    Parameters
    ----------
    probs : torch.Tensor
        Shape [N, S], non-negative, need not sum to 1.
    w : int
        Draws per row, >= 1.
    generators : list
        N torch.Generator (or None).

    Returns
    -------
    torch.Tensor
        Shape [N, w], int64 entries in draw order; -1 where a row had fewer than ``w`` entries
        with mass.

    One running sum serves every draw of a row: a uniform over the mass not yet drawn is
    walked past the drawn entries' intervals of the running sum (in order), and the entry
    whose interval holds it is the draw. Zeroing and re-summing per draw cost ~90 us a row
    for three draws over 16K entries; this ~30 us.
    """
    if probs.ndim != 2 or len(generators) != probs.shape[0] or w < 1:
        raise ValueError(f"probs [N, S] with N generators and w >= 1, got {tuple(probs.shape)}, "
                         f"{len(generators)} generators, w={w}")
    n, size = probs.shape
    # the running sums on the host, in float64: the loop below reads a few entries of them per
    # draw, and a numpy read or search costs ~0.1-1 us where a torch one costs ~2-5 (a search
    # of a float32 array for a Python float casts the array first: 5 us at 16K)
    cum = probs.cumsum(dim=-1, dtype=torch.float64).cpu().numpy()                 # [N, S]
    out = [[-1] * w for _ in range(n)]
    for i, gen in enumerate(generators):
        row = cum[i]
        total = float(row[-1])
        us = torch.rand(w, device=probs.device, generator=gen).tolist()
        taken: list[tuple[float, float, int]] = []  # drawn entries' (start, end, index), by start
        left = total
        for j in range(w):
            if not left > 0.0:
                break
            x = us[j] * left
            for lo, hi, _ in taken:  # step past the drawn intervals at or below x
                if x < lo:
                    break
                x += hi - lo
            # (x < total exactly; rounding may reach it: the last entry with mass is then drawn)
            x = min(x, math.nextafter(total, 0.0))
            idx = int(np.searchsorted(row, x, side="right"))
            if idx >= size or any(t == idx for _, _, t in taken):
                break  # (only rounding gets here; a row keeps the draws it has)
            lo = float(row[idx - 1]) if idx else 0.0
            hi = float(row[idx])
            out[i][j] = idx
            taken.append((lo, hi, idx))
            taken.sort()
            left -= hi - lo
    return torch.tensor(out, dtype=torch.long, device=probs.device)


TOPK_FAST = 1024  # rows with 0 < top_k <= this draw from their top-k logits (sample_rows)


def sample_rows(
    logits: torch.Tensor,  # [N, V]
    params: list,  # N SamplingParams
    generators: list,  # N torch.Generator (or None)
) -> torch.Tensor:
    """One token per row from the distribution ``logits_to_probs`` gives it, drawn with the
    row's own generator; the path is chosen per row, so a seeded row's draw does not depend on
    what else is in the batch.

    Greedy rows take the argmax. Rows with ``0 < top_k <= TOPK_FAST`` (distillation's default is
    20) draw from their top-k logits only: one batched ``topk`` instead of a sort of the
    vocabulary, and a draw over k entries instead of V (the sort and the full-width draw had
    taken most of a 64-row decode step: docs/design.md section 3.8). Their
    distribution is exactly ``logits_to_probs``'s: softmax at the temperature over the top k,
    then top-p over what top-k kept, renormalised. Other rows go through ``logits_to_probs``
    and ``sample``.

    Returns
    -------
    torch.Tensor
        Shape [N], int64.
    """
    if logits.ndim != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
        raise ValueError(f"logits [N, V] with N params and generators, got {tuple(logits.shape)}, "
                         f"{len(params)} params, {len(generators)} generators")
    if all(p.is_greedy for p in params):
        return first_argmax(logits)
    fast = [i for i, p in enumerate(params) if not p.is_greedy and 0 < p.top_k <= TOPK_FAST]
    fast_set = set(fast)
    slow = [i for i, p in enumerate(params) if not p.is_greedy and i not in fast_set]
    # (the argmax only where a row is greedy: ~25 us a row at 49K entries)
    out = first_argmax(logits).tolist() if len(fast) + len(slow) < len(params) else [0] * len(params)
    if fast:
        ps = [params[i] for i in fast]
        kmax = min(max(p.top_k for p in ps), logits.shape[-1])
        vals, idx = logits[fast].float().topk(kmax, dim=-1)                  # [f, kmax], sorted
        temp = torch.tensor([p.temperature for p in ps], device=logits.device)[:, None]
        rank = torch.arange(kmax, device=logits.device)[None]
        keep = rank < torch.tensor([p.top_k for p in ps], device=logits.device)[:, None]
        probs = torch.softmax(vals / temp, dim=-1) * keep
        cum = probs.cumsum(-1)
        before = cum - probs
        top_p = torch.tensor([p.top_p for p in ps], device=logits.device)[:, None]
        probs = probs * ((before < top_p * cum[:, -1:]) | (top_p >= 1))
        # inverse CDF with one uniform from each row's own generator (64 multinomial calls cost
        # 16 ms a step at 64 rows; one rand each and a batched search ~1 ms). The kept entries
        # are a prefix of the sorted top-k (top-k and top-p both keep leading ranks), so the
        # first entry whose running mass exceeds u * total is a kept one; the clamp covers u * total
        # rounding up to the total.
        u = torch.cat([torch.rand(1, device=logits.device, generator=generators[i]) for i in fast])
        cum = probs.cumsum(-1)                                                   # [f, kmax]
        pick = (cum <= u[:, None] * cum[:, -1:]).sum(-1)
        pick = torch.minimum(pick, (probs > 0).sum(-1) - 1)
        chosen = idx.gather(1, pick[:, None])[:, 0].tolist()
        for j, i in enumerate(fast):
            out[i] = chosen[j]
    if slow:
        ps = [params[i] for i in slow]
        dev = logits.device
        rows = logits if len(slow) == len(params) else logits[slow]
        t = plain_temperature(ps)
        if t is not None:  # one temperature, no filter: the softmax alone (logits_to_probs)
            probs = logits_to_probs(rows, t, 1.0, -1)
        else:
            probs = logits_to_probs(rows, torch.tensor([p.temperature for p in ps], device=dev),
                                    torch.tensor([p.top_p for p in ps], device=dev),
                                    torch.tensor([p.top_k for p in ps], device=dev))
        for i, tok in zip(slow, sample_each(probs, [generators[i] for i in slow]).tolist()):
            out[i] = tok
    return torch.tensor(out, dtype=torch.long, device=logits.device)


def _check_verify_shapes(draft_ids: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if draft_ids.ndim != 2:
        raise ValueError(f"draft_ids must be [B, K], got shape {tuple(draft_ids.shape)}")
    b, k = draft_ids.shape
    if target.ndim != 3 or target.shape[:2] != (b, k + 1):
        raise ValueError(
            f"{name} must be [B, K+1, V] = [{b}, {k + 1}, V] for draft_ids of shape [{b}, {k}], "
            f"got {tuple(target.shape)}"
        )


def _emit(
    draft_ids: torch.Tensor,  # [B, K]
    num_accepted: torch.Tensor,  # [B]
    last: torch.Tensor,  # [B], the recovered or bonus token
) -> torch.Tensor:
    """Rows of accepted drafts, then ``last``, then -1 padding. Shape [B, K+1]."""
    b, k = draft_ids.shape
    pos = torch.arange(k + 1, device=draft_ids.device)[None, :]
    n = num_accepted[:, None]
    drafts = torch.cat([draft_ids, draft_ids.new_zeros(b, 1)], dim=1).long()
    out = torch.where(pos == n, last[:, None], drafts)
    return torch.where(pos <= n, out, -1)


def _num_accepted(accept: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] int64
    """Length of the leading run of accepted steps."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(
    draft_ids: torch.Tensor,  # [B, K]
    target_logits: torch.Tensor,  # [B, K+1, V]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept drafts while they equal the target's argmax.

    Parameters
    ----------
    draft_ids : torch.Tensor
        Shape [B, K], the drafted tokens. K may be 0 (plain decoding).
    target_logits : torch.Tensor
        Shape [B, K+1, V]; position k scores the token after draft k-1 (position 0: after the
        last verified token).

    Returns
    -------
    num_accepted : torch.Tensor
        Shape [B], int64 in [0, K].
    emitted : torch.Tensor
        Shape [B, K+1], int64: the accepted drafts, then the target's argmax at the first
        rejected position (the recovered token) or at position K (the bonus token), then -1.
    """
    _check_verify_shapes(draft_ids, target_logits, "target_logits")
    k = draft_ids.shape[1]
    argmax = first_argmax(target_logits)  # [B, K+1]
    num_accepted = _num_accepted(draft_ids == argmax[:, :k])
    # Accepted drafts equal the argmax, so the emitted prefix is the argmax itself.
    pos = torch.arange(k + 1, device=argmax.device)[None, :]
    emitted = torch.where(pos <= num_accepted[:, None], argmax, -1)
    return num_accepted, emitted


def verify_sampling(
    draft_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K+1, V]
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling: the emitted tokens are distributed exactly as ``p``.

    Parameters
    ----------
    draft_ids : torch.Tensor
        Shape [B, K], draft k sampled from ``draft_probs[:, k]``. K may be 0.
    draft_probs : torch.Tensor
        Shape [B, K, V], the draft's distributions q. May be zero outside a compressed
        vocabulary; the residual below covers the rest of the vocabulary.
    target_probs : torch.Tensor
        Shape [B, K+1, V], the target's distributions p (``logits_to_probs`` output). Greedy rows
        are one-hot, and then this is exactly ``verify_greedy`` whatever q is.
    generator : torch.Generator, optional
        On the tensors' device, for reproducible draws.

    Returns
    -------
    num_accepted : torch.Tensor
        Shape [B], int64 in [0, K].
    emitted : torch.Tensor
        Shape [B, K+1], int64: accepted drafts, then the recovered or bonus token, then -1.
    """
    _check_verify_shapes(draft_ids, target_probs, "target_probs")
    b, k = draft_ids.shape
    if draft_probs.shape != (b, k, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [B, K, V] = [{b}, {k}, {target_probs.shape[-1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    dev = target_probs.device
    ids = draft_ids.long()[..., None]
    p_d = target_probs[:, :k].gather(-1, ids).squeeze(-1).float()  # [B, K]
    q_d = draft_probs.gather(-1, ids).squeeze(-1).float()  # [B, K]
    u = torch.rand(b, k, device=dev, generator=generator)
    # Accept with probability min(1, p/q), written without a division: u in [0, 1), so q <= p
    # always accepts, and p == 0 never does (also when q == 0).
    num_accepted = _num_accepted(u * q_d < p_d)

    rows = torch.arange(b, device=dev)
    p_n = target_probs[rows, num_accepted].float()  # [B, V]
    if k > 0:
        # Rows with every draft accepted use q = 0 here, which makes the residual p: the bonus.
        q_n = draft_probs[rows, num_accepted.clamp(max=k - 1)].float()
        q_n = q_n * (num_accepted < k)[:, None]
    else:
        q_n = torch.zeros_like(p_n)
    residual = (p_n - q_n).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass == 0 means p <= q everywhere, i.e. p == q: a rejection there only comes from
    # rounding, and p itself is the right distribution to draw from.
    residual = torch.where(mass > 0, residual, p_n)
    last = sample(residual, generator=generator)
    return num_accepted, _emit(draft_ids, num_accepted, last)
