"""The draft's compressed vocabulary inside the reference engine, chosen per request.

At prefill every request gets a table (its language, from the script classes of its prompt's
tokens: no text decoding, no host sync); every draft step then projects onto that table's rows of
the shared lm_head only. Verification keeps the full vocabulary, so greedy output is unchanged, and
sampling stays lossless because the draft's q is zero outside the table and the residual
``max(p - q, 0)`` is taken over the full vocabulary (fastmtp_sglang.decode.sampling).

Optionally a request's own prompt tokens join its table (``extra="prompt"``): copy-heavy tasks
(RAG, summarisation) lose the most tau to compression (FR-Spec, arXiv 2502.14856).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.cpu_kernels.packed_linear import prepared_argmax, prepared_linear, weight_stamp
from fastmtp_sglang.kernels.compressed_head import compressed_head, scatter_to_full, slot_ids
from fastmtp_sglang.vocab.language import token_script_classes
from fastmtp_sglang.vocab.tables import TableSet

EXTRA_MODES = ("none", "prompt")


@dataclass
class DraftVocab:
    tables: TableSet
    weight: torch.Tensor          # [V, H] the target's lm_head weight (shared, not copied)
    table_weight: torch.Tensor    # [L, S_max, H] the tables' rows, gathered once
    script_classes: torch.Tensor  # [V] int8
    extra: str = "none"
    max_extra: int = 2048
    _prepared: dict = field(default_factory=dict, repr=False, compare=False)  # table -> oneDNN layout
    # table -> (the table weight's version, its AMX tiles, its ids): a greedy step's fast path
    _tiled: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, tables: TableSet, lm_head: torch.nn.Module, tokenizer, extra: str = "none") -> "DraftVocab":
        if extra not in EXTRA_MODES:
            raise ValueError(f"extra must be one of {EXTRA_MODES}, got {extra!r}")
        w = lm_head.weight
        tables = tables.to(w.device)
        return cls(tables, w, tables.gather_weight(w), token_script_classes(tokenizer).to(w.device), extra)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def choose(self, prompt_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prompt_ids, mask [B, T] -> (table index [B], extra ids [B, E] or None)."""
        idx = self.tables.pick(prompt_ids, mask, self.script_classes)
        extra = None
        if self.extra == "prompt":
            ids = torch.where(mask, prompt_ids, torch.full_like(prompt_ids, -1))[:, -self.max_extra:]
            extra = ids.contiguous()  # duplicates and ids already in the table are masked by the kernel
        return idx, extra

    def greedy(self, hidden: torch.Tensor, idx: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """hidden [N, H] -> the argmax over each row's table, as full-vocabulary ids [N]."""
        if hidden.device.type == "cpu" and hidden.shape[0] == 1 and extra is None:
            # one row on CPU (a draft step at batch 1): one product with the table's gathered
            # rows and an argmax; the kernel's log-probability and masking are not needed
            # (the first maximum, as compressed_head returns; tested equal)
            t = int(idx)
            fast = self._tiled.get(t)
            if (fast is not None and fast[0] == weight_stamp(self.table_weight) and hidden.dtype == torch.bfloat16
                    and hidden.shape[1] == fast[1].k and hidden.is_contiguous() and not hidden.requires_grad):
                # the same kernel as below, the ids looked up in its call, without the ~15 checks
                # and views around it: right after a target step has swept the caches each
                # tensor op costs 10-25 us (~0.1 ms a step)
                return amx.linear_argmax_rows(hidden, fast[1], fast[2])
            w = self.table_weight[t, : int(self.tables.lens[t])]
            # bf16 on a CPU with bf16 units: the table's rows laid out for oneDNN once
            # (on AMX the product's largest output found without writing the products; else
            # max's index, not argmax: the same first maximum, 4x faster over 16K bf16 logits)
            slot = prepared_argmax(hidden.to(w.dtype), w, self._prepared, t)
            state = self._prepared.get(t)
            if (state is not None and isinstance(state[1], amx.Packed) and hidden.dtype == torch.bfloat16
                    and state[1].k % amx.TILE_K == 0 and self.tables.tables.dtype == torch.int64):
                self._tiled[t] = (weight_stamp(self.table_weight), state[1], self.tables.tables[t].contiguous())
            return self.tables.tables[t].index_select(0, slot)
        top, _, _ = compressed_head(hidden.to(self.weight.dtype).contiguous(), self.weight,
                                    self.tables.tables, self.tables.lens, idx, extra,
                                    table_weight=self.table_weight)
        return top

    def compressed_logits(self, hidden: torch.Tensor, idx: torch.Tensor,
                          extra: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, H] -> (logits [N, S] float32 over each row's slots, their full-vocabulary
        ids [N, S] with ``-1`` at padded slots, whose logit is ``-inf``; so is a masked extra's).

        What a sampled draft step needs: a softmax and a draw over the table's S slots, not over
        the vocabulary (at batch 1 on CPU, the same one product with the table's rows as
        :meth:`greedy`, without the kernel's log-probability)."""
        if hidden.device.type == "cpu" and hidden.shape[0] == 1 and extra is None:
            t = int(idx[0])
            n = int(self.tables.lens[t])
            w = self.table_weight[t, :n]
            lg = prepared_linear(hidden.to(w.dtype), w, self._prepared, t).float()     # [1, n]
            return lg, self.tables.tables[t, :n][None]
        _, _, lg = compressed_head(hidden.to(self.weight.dtype).contiguous(), self.weight,
                                   self.tables.tables, self.tables.lens, idx, extra,
                                   return_logits=True, table_weight=self.table_weight)
        ids = slot_ids(self.tables.tables, self.tables.lens, idx, extra)
        return lg.float().masked_fill(ids < 0, float("-inf")), ids

    def logits(self, hidden: torch.Tensor, idx: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """hidden [N, H] -> full-width logits [N, V], -inf outside each row's table."""
        lg, ids = self.compressed_logits(hidden, idx, extra)
        return scatter_to_full(lg, ids, self.vocab_size)


def auto_tables(tokenizer) -> list[str]:
    """The shipped tables for this tokenizer, the largest one per language."""
    from fastmtp_sglang.vocab.tables import shipped_tables

    best: dict[str, tuple[int, str]] = {}
    for p in shipped_tables(tokenizer):
        lang, _, size = p.stem.partition("-")
        if size.isdigit() and int(size) > best.get(lang, (0, ""))[0]:
            best[lang] = (int(size), str(p))
    return [path for _, path in best.values()]


def resolve_vocab(spec: str | None, tokenizer, lm_head: torch.nn.Module, extra: str = "none",
                  draft_dir: str | None = None) -> DraftVocab | None:
    """``--vocab`` -> a DraftVocab, or None for the full vocabulary.

    spec: None (the draft directory's own tables if its config lists any, else the full
    vocabulary: what the SGLang backend does too), ``full`` / ``none``, ``auto`` (the draft's own
    tables, else the shipped tables for the target's tokenizer, largest per language), or
    comma-separated table paths / ``builtin:<tokenizer>/<lang>-<N>`` refs.
    """
    import json
    from pathlib import Path

    from fastmtp_sglang.core.errors import FastMTPError

    if spec in (None, ""):
        listed = False
        if draft_dir is not None and (Path(draft_dir) / "config.json").is_file():
            cfg = json.loads((Path(draft_dir) / "config.json").read_text())
            listed = bool((cfg.get("fastmtp") or {}).get("vocab_tables"))
        if not listed:
            return None
        return DraftVocab.build(TableSet.from_draft_dir(draft_dir, tokenizer), lm_head, tokenizer, extra)
    if spec in ("full", "none"):
        return None
    if spec == "auto":
        tables = None
        if draft_dir is not None:
            try:
                tables = TableSet.from_draft_dir(draft_dir, tokenizer)
            except FastMTPError:
                tables = None
        if tables is None:
            refs = auto_tables(tokenizer)
            if not refs:
                raise FastMTPError("--vocab auto: no shipped table fits this tokenizer; build one "
                                   "with `fastmtp build-vocab` and pass its path")
            tables = TableSet.from_paths(refs, tokenizer)
    else:
        tables = TableSet.from_paths([s.strip() for s in spec.split(",") if s.strip()], tokenizer)
    return DraftVocab.build(tables, lm_head, tokenizer, extra)
