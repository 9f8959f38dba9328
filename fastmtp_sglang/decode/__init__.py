"""Decoding on the reference engine: the speculative cycle, lossless verification and sampling,
prompt-lookup drafts, the metrics every report uses, and the batched target-only generator.

Owns: ``engine`` (ReferenceEngine: draft, verify, accept, roll back, draft extend), ``sampling``
(greedy and speculative-sampling verification, logits to probabilities), ``ngram`` (prompt
lookup), ``metrics`` (tau, A_k, a_k, accept histogram), ``batch_gen`` (continuous-batching
generation of the target alone, used by distillation).

May import: ``fastmtp_sglang.core`` and ``fastmtp_sglang.vocab``.
"""
