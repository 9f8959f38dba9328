"""Per-request compressed draft vocabulary inside SGLang (docs/design.md section 5.5).

:class:`CompressedProjection` stands in for the draft's lm_head in SGLang's ``LogitsProcessor``
(``FastMTPForCausalLM.set_draft_projection``). For every row it scores only the head rows of the
row's vocabulary table (``fastmtp_sglang.kernels.compressed_head``: Triton on CUDA, torch on CPU)
and scatters them into a full-width row of ``-inf``. The worker contract is unchanged: the
logits are ``[N, V_local]`` like the stock head's, so SGLang's all-gather, logits buffer, top-k,
rejection sampling (q = 0 off the table, lossless: the residual is taken over the full vocabulary)
and CUDA graphs see what they always see; the ``[V, H]`` matmul is not done.

Which table a row uses is device state, per request slot (``forward_batch.req_pool_indices``):

- EXTEND (the draft extend after each prefill chunk sees the prompt's tokens): per-token script
  classes (``fastmtp_sglang.vocab.language.script_counts``) are summed per request and added to the
  slot's running counts; the slot's table is re-picked from them
  (``table_index_from_counts``: zh when CJK tokens pass the threshold, else the default). A slot
  starts over when the request is new: prefix length 0, or a request id that differs from the
  one the slot last saw (a radix-cache hit gives a new request a prefix > 0). Torch ops only;
  the request ids are hashed on the host and copied in, no device-to-host sync.
- every pass (DECODE under CUDA graphs included): ``slot_table[req_pool_indices]``, a gather
  from a static buffer, so graph replay keeps reading the current choice.

Tensor parallelism: with a vocabulary-sharded ``ParallelLMHead`` each rank keeps, of every table,
the ids inside its own shard, as local rows (:class:`ShardRange`), and writes only those into its
``[N, V_local]`` slice; SGLang's stock all-gather then assembles the full row, each table id
computed once, on the rank that owns its head row. See docs/sglang_backend.md.

This module imports no SGLang code (SGLang's external-model loader imports every module of
``fastmtp_sglang.models``; this one defines no ``EntryClass``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError
from fastmtp_sglang.kernels.compressed_head import compressed_head, scatter_to_full, slot_ids
from fastmtp_sglang.vocab.language import (
    DEFAULT_CJK_THRESHOLD,
    NUM_SCRIPTS,
    script_counts,
    table_index_from_counts,
)
from fastmtp_sglang.vocab.tables import TableSet, resolve_table_ref

logger = logging.getLogger(__name__)
LOG_TABLES_ENV = "FASTMTP_SGLANG_LOG_TABLES"

__all__ = [
    "VOCAB_ENV",
    "CompressedHeadMethod",
    "CompressedProjection",
    "ShardRange",
    "build_projection",
    "default_slot_capacity",
    "load_script_classes",
    "projection_for_draft",
    "vocab_spec",
]

# Which draft vocabulary the SGLang model class uses; set by `fastmtp serve --engine sglang
# --vocab ...` for the scheduler processes it spawns. Unset: the draft directory's own tables
# (config.json fastmtp.vocab_tables), or the full vocabulary when it lists none.
VOCAB_ENV = "FASTMTP_SGLANG_VOCAB"
FULL_VOCAB = ("full", "none")


# ----------------------------------------------------------------------------------------------
# Vocabulary shard of one TP rank
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRange:
    """Which global token ids this rank's lm_head shard holds, and at which local rows.

    SGLang's ``VocabParallelEmbedding`` layout: local rows ``[0, org_padded)`` hold global ids
    ``[org_start, org_end)`` (then padding), local rows ``[org_padded, width)`` hold the added
    vocabulary ``[added_start, added_end)`` (then padding).
    """

    org_start: int
    org_end: int
    org_padded: int
    added_start: int
    added_end: int
    width: int  # local rows = logits columns of this rank

    @classmethod
    def full(cls, vocab_rows: int) -> ShardRange:
        """One rank holding everything (tp = 1)."""
        return cls(0, vocab_rows, vocab_rows, vocab_rows, vocab_rows, vocab_rows)

    @classmethod
    def from_lm_head(cls, lm_head: Any) -> ShardRange:
        """From SGLang's ``ParallelLMHead`` (its ``shard_indices``); a plain head is unsharded."""
        si = getattr(lm_head, "shard_indices", None)
        width = int(getattr(lm_head, "num_embeddings_per_partition", lm_head.weight.shape[0]))
        if si is None:
            return cls.full(width)
        return cls(int(si.org_vocab_start_index), int(si.org_vocab_end_index),
                   int(si.num_org_elements_padded), int(si.added_vocab_start_index),
                   int(si.added_vocab_end_index), width)

    def localize(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids (1-D, global) that lie in this shard, as local rows, order kept."""
        ids = ids[ids >= 0]
        org = (ids >= self.org_start) & (ids < self.org_end)
        added = (ids >= self.added_start) & (ids < self.added_end)
        local = torch.where(org, ids - self.org_start, ids - self.added_start + self.org_padded)
        return local[org | added]


def shard_tables(tables: torch.Tensor, lens: torch.Tensor, shard: ShardRange) -> tuple[torch.Tensor, torch.Tensor]:
    """Each table restricted to ``shard``, in local rows: (``[L, S_local]`` padded -1, ``[L]``).

    ``S_local >= 1`` (the kernel needs a non-empty tensor); a table with no id in the shard gets
    length 0 and contributes ``-inf`` only.
    """
    rows = [shard.localize(tables[l, : int(lens[l])]) for l in range(tables.shape[0])]
    s_max = max(1, max(r.numel() for r in rows))
    out = torch.full((len(rows), s_max), -1, dtype=torch.int64)
    for l, r in enumerate(rows):
        out[l, : r.numel()] = r
    return out, torch.tensor([r.numel() for r in rows], dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# The projection
# ----------------------------------------------------------------------------------------------


class CompressedHeadMethod:
    """What SGLang's ``LogitsProcessor._compute_lm_head`` calls: ``apply(layer, x, bias)``.

    Its class name is not one of SGLang's unquantised lm_head methods, so the logits processor
    hands the projection to it instead of doing the ``[V, H]`` matmul itself.
    """

    def apply(self, layer: CompressedProjection, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if bias is not None:
            raise ValueError("the compressed draft head has no bias")
        return layer.project(x)


def default_slot_capacity() -> int:
    """Rows of the per-slot state: above any ``ReqToTokenPool`` size SGLang picks.

    SGLang sizes the pool at ``min(max(estimate, 2048), 4096)`` requests, or
    ``--max-running-requests`` when given, plus a padding row 0; slots are taken modulo the
    capacity, so a larger pool only shares state between far-apart slots (the output stays exact,
    only acceptance could drop).
    """
    mrr = None
    try:
        from sglang.srt.runtime_context import get_schedule

        mrr = get_schedule().max_running_requests
    except Exception:  # noqa: BLE001 - no published runtime context (tests, other callers)
        pass
    return max(4096, int(mrr or 0)) + 1 + 1024


def _rid_hash(rid: Any) -> int:
    """A stable signed 64-bit hash of a request id (the same on every TP rank)."""
    return int.from_bytes(hashlib.blake2b(str(rid).encode("utf-8"), digest_size=8).digest(), "little", signed=True)


class CompressedProjection:
    """The draft's lm_head over per-request vocabulary tables, full width, ``-inf`` elsewhere.

    Parameters
    ----------
    tables : TableSet
        Global token ids per table (``[L, S_max]``, -1 padded) with languages.
    lm_head : module with ``weight`` ``[V_local, H]``
        The draft's ``ParallelLMHead``; its weight is read at every call, so the target's head
        bound later by ``set_embed_and_head`` is what gets used.
    shard : ShardRange, optional
        This rank's vocabulary shard; default ``ShardRange.from_lm_head(lm_head)``.
    script_classes : Tensor int8 ``[V_tok]``, optional
        Script class per token (``vocab.token_script_classes``). Without it every request gets
        the default table.
    capacity : int, optional
        Rows of the per-slot state (``default_slot_capacity()``).
    cjk_threshold, default_lang
        As in ``vocab.table_index_from_counts``; ``default_lang`` defaults to ``en`` if a table
        has it, else the first table's language.
    """

    def __init__(
        self,
        tables: TableSet,
        lm_head: torch.nn.Module,
        *,
        shard: ShardRange | None = None,
        script_classes: torch.Tensor | None = None,
        capacity: int | None = None,
        cjk_threshold: float = DEFAULT_CJK_THRESHOLD,
        default_lang: str | None = None,
    ) -> None:
        self.lm_head = lm_head
        self.quant_method = CompressedHeadMethod()
        self.table_set = tables
        self.shard = shard or ShardRange.from_lm_head(lm_head)
        device = lm_head.weight.device
        local, local_lens = shard_tables(tables.tables, tables.lens, self.shard)
        self.tables = local.to(device)  # [L, S_local] local rows
        self.lens = local_lens.to(device)  # [L]
        self.global_tables = tables.tables.to(device)
        self.global_lens = tables.lens.to(device)
        self.lang_to_table = dict(tables.lang_to_table)
        self.default_lang = default_lang or ("en" if "en" in self.lang_to_table else tables.langs[0])
        if self.default_lang not in self.lang_to_table:
            raise FastMTPError(f"default language {self.default_lang!r} has no table; tables: {tables.names}")
        self.default_table = int(self.lang_to_table[self.default_lang])
        self.cjk_threshold = cjk_threshold
        self.script_classes = None if script_classes is None else script_classes.to(device=device, dtype=torch.int8)
        self.capacity = int(capacity or default_slot_capacity())
        # per request slot: table index, script counts, hash of the request id last seen
        self.slot_table = torch.full((self.capacity,), self.default_table, dtype=torch.int64, device=device)
        self.slot_counts = torch.zeros(self.capacity, NUM_SCRIPTS, dtype=torch.int64, device=device)
        self.slot_rid = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.row_table: torch.Tensor | None = None  # [bs] table per request of the current pass
        self.full_fallbacks = 0  # passes whose row layout was not per request (full head used)
        # FASTMTP_SGLANG_LOG_TABLES=1: log each request's table at its EXTEND passes (one host
        # sync per pass; what launch/gpu_e2e.py reads to see the per-request choice)
        self.log_tables = os.environ.get(LOG_TABLES_ENV, "") not in ("", "0")

    # -- what SGLang's LogitsProcessor reads -------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        return self.lm_head.weight

    @property
    def names(self) -> list[str]:
        return list(self.table_set.names)

    def __repr__(self) -> str:
        return (f"CompressedProjection(tables={self.names}, local_lens={self.lens.tolist()}, "
                f"shard=[{self.shard.org_start}, {self.shard.org_end}) width={self.shard.width})")

    # -- per-request table -------------------------------------------------------------------
    def slots_of(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return req_pool_indices.to(torch.int64) % self.capacity

    def observe_extend(self, input_ids: torch.Tensor, forward_batch: Any) -> None:
        """Add an EXTEND pass's tokens to each request's script counts and re-pick its table.

        Torch ops on the device; request ids (if the batch carries them) are hashed on the
        host and copied in. Tokens past ``sum(extend_seq_lens)`` (padding) are not counted.
        """
        if self.script_classes is None or len(self.table_set) < 2:
            return
        seq_lens = getattr(forward_batch, "extend_seq_lens", None)
        if seq_lens is None or forward_batch.req_pool_indices is None:
            return
        dev = self.slot_table.device
        bs = int(forward_batch.req_pool_indices.shape[0])
        if bs == 0:
            return
        slots = self.slots_of(forward_batch.req_pool_indices.to(dev))
        ids = input_ids.to(dev).to(torch.int64)
        ends = torch.cumsum(seq_lens.to(dev).to(torch.int64), 0)  # [bs]
        row = torch.searchsorted(ends, torch.arange(ids.shape[0], device=dev), right=True)  # [T]
        valid = row < bs
        per_token = script_counts(ids[:, None], valid[:, None], self.script_classes)  # [T, C]
        new = torch.zeros(bs, NUM_SCRIPTS, dtype=torch.int64, device=dev)
        new.index_add_(0, row.clamp(max=bs - 1), per_token)

        prefix = getattr(forward_batch, "extend_prefix_lens", None)
        reset = (torch.zeros(bs, dtype=torch.bool, device=dev) if prefix is None
                 else prefix.to(dev) == 0)
        rids = getattr(forward_batch, "rids", None)
        capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if rids is not None and len(rids) == bs and not capturing:
            rid = torch.tensor([_rid_hash(r) for r in rids], dtype=torch.int64).to(dev, non_blocking=True)
            reset = reset | (self.slot_rid[slots] != rid)
            self.slot_rid[slots] = rid
        total = torch.where(reset[:, None], new, self.slot_counts[slots] + new)
        self.slot_counts[slots] = total
        self.slot_table[slots] = table_index_from_counts(
            total, self.lang_to_table, cjk_threshold=self.cjk_threshold, default_lang=self.default_lang)
        if self.log_tables and rids is not None and len(rids) == bs and not capturing:
            names = self.names  # a host sync: only with FASTMTP_SGLANG_LOG_TABLES=1 (checks, debugging)
            for r, t in zip(rids, self.slot_table[slots].tolist()):
                logger.info("fastmtp: request %s drafts with table %s", r, names[t])

    def select(self, forward_batch: Any) -> None:
        """This pass's table per request: ``slot_table[req_pool_indices]`` (graph safe)."""
        rpi = getattr(forward_batch, "req_pool_indices", None)
        self.row_table = None if rpi is None else self.slot_table[self.slots_of(rpi.to(self.slot_table.device))]

    def prepare(self, input_ids: torch.Tensor, forward_batch: Any) -> None:
        """Called by the model before its logits processor: update (EXTEND) and select."""
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is not None and mode.is_extend_or_draft_extend_or_mixed():  # not DRAFT_EXTEND_V2
            self.observe_extend(input_ids, forward_batch)
        self.select(forward_batch)

    def row_tables(self, n_rows: int) -> torch.Tensor | None:
        """Table per logits row: one row per request (EXTEND's last token, DECODE with topk 1,
        the draft-extend graph's selected rows), or k consecutive rows per request (DECODE with
        topk k, eager draft extend over the whole tree width). None for any other layout."""
        t = self.row_table
        if t is None or t.shape[0] == 0:
            return None
        if n_rows == t.shape[0]:
            return t
        if n_rows % t.shape[0] == 0:
            return t.repeat_interleave(n_rows // t.shape[0])
        return None

    # -- the head ----------------------------------------------------------------------------
    def project(self, hidden: torch.Tensor, table_idx: torch.Tensor | None = None) -> torch.Tensor:
        """hidden ``[N, H]`` -> logits ``[N, V_local]`` in the head's dtype, ``-inf`` off each
        row's table. ``table_idx`` ``[N]`` overrides the per-request choice.

        A row layout that is not per request (say an EXTEND returning input logprobs) gets the
        full head: exact, only not compressed.
        """
        w = self.weight
        if w.shape[0] != self.shard.width:
            raise ValueError(f"lm_head has {w.shape[0]} rows, the projection was built for {self.shard.width}")
        n = hidden.shape[0]
        if n == 0:
            return hidden.new_empty((0, self.shard.width), dtype=w.dtype)
        idx = table_idx if table_idx is not None else self.row_tables(n)
        if idx is None:
            self.full_fallbacks += 1
            return torch.matmul(hidden.to(w.dtype), w.T)
        idx = idx.to(torch.int64).contiguous()
        _, _, logits = compressed_head(hidden.to(w.dtype).contiguous(), w, self.tables, self.lens, idx,
                                       return_logits=True)
        full = scatter_to_full(logits, slot_ids(self.tables, self.lens, idx), self.shard.width)
        return full.to(w.dtype)


# ----------------------------------------------------------------------------------------------
# Building one from a draft directory
# ----------------------------------------------------------------------------------------------


def vocab_spec() -> str | None:
    """``$FASTMTP_SGLANG_VOCAB``: None/``auto`` (the draft's tables), ``full``, or table refs."""
    spec = os.environ.get(VOCAB_ENV, "").strip()
    return spec or None


def load_script_classes(path: str | Path) -> torch.Tensor:
    """A ``torch.save``d int8 ``[V]`` tensor of ``vocab.token_script_classes``."""
    path = Path(path)
    try:
        t = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same error
        raise DraftFormatError(f"script classes {path}: not a torch-saved tensor ({exc})") from exc
    if t.ndim != 1 or t.dtype.is_floating_point or t.numel() == 0 or int(t.min()) < 0 or int(t.max()) >= NUM_SCRIPTS:
        raise DraftFormatError(f"script classes {path}: expected a 1-D integer tensor of values in "
                               f"[0, {NUM_SCRIPTS}); got {t.dtype} {tuple(t.shape)}")
    return t.to(torch.int8)


def _server_tokenizer():
    """The target's tokenizer as the SGLang server names it (local files only), or None."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # noqa: BLE001 - no published server args
        return None
    if getattr(args, "skip_tokenizer_init", False):
        return None
    path = getattr(args, "tokenizer_path", None) or getattr(args, "model_path", None)
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    except Exception as exc:  # noqa: BLE001 - any failure: tables unchecked, default table
        logger.warning("fastmtp: cannot load the tokenizer %s for the vocab tables (%s)", path, exc)
        return None


def _draft_dir_of(config: Any) -> Path | None:
    for cand in (getattr(config, "_name_or_path", None), getattr(config, "name_or_path", None)):
        if cand and (Path(cand) / "config.json").is_file():
            return Path(cand)
    try:
        from sglang.srt.runtime_context import get_server_args

        cand = get_server_args().speculative_draft_model_path
        if cand and (Path(cand) / "config.json").is_file():
            return Path(cand)
    except Exception:  # noqa: BLE001
        pass
    return None


def build_projection(
    refs: Sequence[str],
    lm_head: torch.nn.Module,
    *,
    base_dir: str | Path | None = None,
    tokenizer: Any = None,
    script_classes: torch.Tensor | None = None,
    **kwargs: Any,
) -> CompressedProjection:
    """A projection over the tables ``refs`` (paths relative to ``base_dir``, or ``builtin:``).

    With ``tokenizer`` the tables are checked against it (``MismatchError`` for another
    tokenizer's table) and, without ``script_classes``, the script classes come from it.
    """
    tables = TableSet.from_paths(list(refs), tokenizer, base_dir=base_dir)
    if script_classes is None and tokenizer is not None and len(tables) > 1:
        from fastmtp_sglang.vocab.language import token_script_classes

        script_classes = token_script_classes(tokenizer)
    return CompressedProjection(tables, lm_head, script_classes=script_classes, **kwargs)


def _table_refs(fastmtp_cfg: dict) -> list[str]:
    entries = fastmtp_cfg.get("vocab_tables") or []
    if isinstance(entries, dict):
        entries = list(entries.values())
    return [e["path"] if isinstance(e, dict) else str(e) for e in entries]


def projection_for_draft(config: Any, lm_head: torch.nn.Module, *, tokenizer: Any = "server",
                         spec: str | None = "env", **kwargs: Any) -> CompressedProjection | None:
    """The projection a draft config asks for, or None (full vocabulary).

    ``spec`` (default ``$FASTMTP_SGLANG_VOCAB``): None / ``auto`` -> the tables listed in
    ``config.fastmtp.vocab_tables`` (``auto`` falls back to the shipped tables for the target's
    tokenizer); ``full`` / ``none`` -> None; otherwise comma-separated table refs. Script classes:
    ``config.fastmtp.script_classes`` (a file in the draft directory), else computed from the
    tokenizer (``tokenizer="server"``: the SGLang server's, local files only), else every
    request gets the default table.
    """
    if spec == "env":
        spec = vocab_spec()
    if spec is not None and spec.lower() in FULL_VOCAB:
        return None
    fcfg = getattr(config, "fastmtp", None) or {}
    if isinstance(fcfg, str):
        fcfg = json.loads(fcfg)
    base_dir = _draft_dir_of(config)
    if spec is None or spec.lower() == "auto":
        refs = _table_refs(fcfg)
    else:
        refs = [s.strip() for s in spec.split(",") if s.strip()]
    if not refs and spec is None:
        return None
    tok = _server_tokenizer() if tokenizer == "server" else tokenizer
    if not refs:  # auto without tables of its own: the shipped ones for this tokenizer
        if tok is None:
            raise FastMTPError(f"{VOCAB_ENV}=auto: the draft lists no vocab tables and the target's "
                               "tokenizer is not available to pick shipped ones")
        from fastmtp_sglang.vocab.tables import shipped_tables

        best: dict[str, tuple[int, str]] = {}
        for p in shipped_tables(tok):
            lang, _, size = p.stem.partition("-")
            if size.isdigit() and int(size) > best.get(lang, (0, ""))[0]:
                best[lang] = (int(size), str(p))
        refs = [path for _, path in best.values()]
        if not refs:
            raise FastMTPError(f"{VOCAB_ENV}=auto: no shipped vocab table fits the target's tokenizer")
    if any(not r.startswith("builtin:") for r in refs) and base_dir is None:
        rel = [r for r in refs if not r.startswith("builtin:") and not Path(r).is_absolute()]
        if rel:
            raise DraftFormatError(f"vocab tables {rel} are relative to the draft directory, which "
                                   "is not known here")
    script_classes = None
    if fcfg.get("script_classes"):
        script_classes = load_script_classes(resolve_table_ref(str(fcfg["script_classes"]), base_dir))
    proj = build_projection(refs, lm_head, base_dir=base_dir, tokenizer=tok,
                            script_classes=script_classes, **kwargs)
    if proj.script_classes is None and len(proj.table_set) > 1:
        logger.warning("fastmtp: no script classes (no tokenizer, no fastmtp.script_classes): every "
                       "request drafts over the %s table", proj.default_lang)
    logger.info("fastmtp: draft vocabulary %s", proj)
    return proj
