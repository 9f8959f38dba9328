"""Language-aware compressed draft vocabularies: tables, language detection, building, and the
per-request draft vocabulary the reference engine drafts over.

Owns: ``tables`` (the table file format, sidecars, shipped tables, TableSet), ``language`` (token
script classes, per-request table routing on the device, text-level language detection),
``corpora`` (builtin corpora, corpus files and specs, the held-out split), ``build`` (counting,
selection, coverage, and the whole ``fastmtp build-vocab`` build), ``draft_vocab`` (DraftVocab:
one table per request, projected with the compressed-head kernel).

May import: ``fastmtp_sglang.cpu_kernels`` (prepared linear layers), ``fastmtp_sglang.core`` and
``fastmtp_sglang.kernels``.
"""
