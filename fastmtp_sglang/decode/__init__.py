"""Decoding on the reference engine: the speculative cycle, lossless verification and sampling,
prompt-lookup drafts, the metrics every report uses, and the queue-fed generator distillation uses.

Owns: ``engine`` (ReferenceEngine: draft, verify, accept, roll back, draft extend), ``sampling``
(greedy and speculative-sampling verification, logits to probabilities), ``ngram`` (prompt
lookup), ``metrics`` (tau, A_k, a_k, accept histogram), ``generator`` (requests from a queue
through the engine with continuous batching: distillation's in-process path).

May import: ``fastmtp_sglang.core`` and ``fastmtp_sglang.vocab``.
"""
