"""Language-aware compressed draft vocabularies: tables, language detection, building, and the
per-request draft vocabulary the reference engine drafts over.

Owns: ``tables`` (table files, sidecars, shipped tables, token script classes, language routing,
counting and selection for building), ``draft_vocab`` (DraftVocab: one table per request,
projected with the compressed-head kernel).

May import: ``fastmtp_sglang.core`` and ``fastmtp_sglang.kernels``.
"""
