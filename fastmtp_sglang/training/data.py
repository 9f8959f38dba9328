"""The training data: JSONL rows parsed into :class:`Example` sequences (bad rows skipped and
counted in :class:`DataCounts`), the held-out split, each epoch's batch order, the frozen target's
hidden states per sequence, right-padded :class:`Batch` es, and the data file's sha256."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.head import head_input

LENGTH_SPAN = 50  # group_by_length sorts spans of this many batches


@dataclass
class Example:
    ids: torch.Tensor   # [T] int64 prompt + response
    prompt_len: int
    line: int = 0       # its line in the data file (1-based; 0 = not from a file)
    cover: torch.Tensor | None = None  # [T] int8 lookup_cover.lookup_cover (hybrid-aware weights)


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
            out.append(Example(torch.tensor(ids, dtype=torch.long), len(prompt), counts.lines))
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


@dataclass
class TrainData:
    """A training run's data: the file (and its sha256), its usable rows, the train / held-out
    split of their indices."""
    path: Path
    sha256: str
    examples: list[Example]
    counts: DataCounts
    train_idx: list[int]
    held_idx: list[int]


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


@dataclass
class Batch:
    input_ids: torch.Tensor   # [B, T] x_0..x_{T-1}, right-padded with 0
    hidden: torch.Tensor      # [B, T, H] the target's post-norm hidden states (zeros on padding)
    loss_mask: torch.Tensor   # [B, T] bool: position t holds a response token of the sequence
    lengths: torch.Tensor     # [B]
    prompt_lens: torch.Tensor  # [B]
    topk_ids: torch.Tensor | None = None   # [B, T, k] the target's top-k next tokens at each position
    topk_logp: torch.Tensor | None = None  # [B, T, k] their log-probabilities
    lookup_cover: torch.Tensor | None = None  # [B, T] int8: prompt lookup's right tokens per anchor


class HiddenStates:
    """The frozen target's post-norm hidden states per sequence, under no_grad, optionally cached.

    Each sequence is run alone (no padding), so its states do not depend on which batch it is
    in: a resumed run sees bit-identical inputs.
    """

    def __init__(self, model: nn.Module, cache_bytes: float = 0, aux_layers: tuple[int, ...] = ()):
        self.model = model
        self.aux = tuple(aux_layers)  # a fused head's middle layers (core.head.head_input)
        self.device = next(model.parameters()).device
        self.cache: dict[int, torch.Tensor] = {}
        self.budget = cache_bytes
        self.used = 0

    @torch.no_grad()
    def __call__(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden [T, H] (or [T, (n+1) H] with n aux layers)."""
        h = self.cache.get(index)
        if h is not None:
            return h
        out = self.model.model(input_ids=ids[None].to(self.device), output_hidden_states=bool(self.aux))
        h = head_input(out, self.aux)[0]
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
    cover = None
    if any(e.cover is not None for e in examples):  # a row without one: nothing covered (weight 1)
        cover = torch.zeros(b, t, dtype=torch.int8, device=device)
        for i, e in enumerate(examples):
            if e.cover is not None:
                cover[i, : len(e.cover)] = e.cover.to(device)
    return Batch(ids, hidden, mask, lengths, prompt_lens, tk_ids, tk_lp, cover)



def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
