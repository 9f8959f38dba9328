"""The draft's compressed vocabulary inside the reference engine, chosen per request.

At prefill every request gets a table (its language, from the script classes of its prompt's
tokens: no text decoding, no host sync); every draft step then projects onto that table's rows of
the shared lm_head only. Verification keeps the full vocabulary, so greedy output is unchanged, and
sampling stays lossless because the draft's q is zero outside the table and the residual
``max(p - q, 0)`` is taken over the full vocabulary (fastmtp_sglang.sampling).

Optionally a request's own prompt tokens join its table (``extra="prompt"``): copy-heavy tasks
(RAG, summarisation) lose the most tau to compression (FR-Spec, arXiv 2502.14856).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmtp_sglang.kernels.compressed_head import compressed_head, scatter_to_full, slot_ids
from fastmtp_sglang.vocab import TableSet, token_script_classes

EXTRA_MODES = ("none", "prompt")


@dataclass
class DraftVocab:
    tables: TableSet
    weight: torch.Tensor          # [V, H] the target's lm_head weight (shared, not copied)
    table_weight: torch.Tensor    # [L, S_max, H] the tables' rows, gathered once
    script_classes: torch.Tensor  # [V] int8
    extra: str = "none"
    max_extra: int = 2048

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
        top, _, _ = compressed_head(hidden.to(self.weight.dtype).contiguous(), self.weight,
                                    self.tables.tables, self.tables.lens, idx, extra,
                                    table_weight=self.table_weight)
        return top

    def logits(self, hidden: torch.Tensor, idx: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """hidden [N, H] -> full-width logits [N, V], -inf outside each row's table."""
        _, _, lg = compressed_head(hidden.to(self.weight.dtype).contiguous(), self.weight,
                                   self.tables.tables, self.tables.lens, idx, extra,
                                   return_logits=True, table_weight=self.table_weight)
        return scatter_to_full(lg, slot_ids(self.tables.tables, self.tables.lens, idx, extra),
                               self.vocab_size)
