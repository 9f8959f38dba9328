"""The SGLang model class for FastMTP draft directories: what ``SGLANG_EXTERNAL_MODEL_PACKAGE``
points at (SGLang imports every module here in every scheduler process, so nothing here imports
vLLM).

Owns: ``fastmtp`` (FastMTPForCausalLM on SGLang's layers, with ``EntryClass``),
``compressed_projection`` (the per-request compressed vocabulary inside SGLang),
``draft_common`` (what the SGLang and vLLM draft classes share).

May import: ``fastmtp_sglang.vocab``, ``fastmtp_sglang.core`` and ``fastmtp_sglang.kernels``.
"""
