"""Decoding on the reference engine: the speculative cycle, lossless verification and sampling,
prompt-lookup drafts, the metrics every report uses, and the queue-fed generator distillation uses.

Owns: ``engine`` (ReferenceEngine: draft, verify, accept, roll back, draft extend),
``engine_auto`` (what auto, hybrid and prompt lookup add to the cycle), ``batch`` (Row, Batch:
the rows run together), ``slot_cache`` (the target's KV cache written in place),
``lean_forward`` and ``lean_head`` (the target's and the head's forward in fewer calls),
``sampling`` (greedy and speculative-sampling verification, logits to probabilities),
``nucleus`` (top-k / top-p from a row's largest entries), ``leaves``
(more candidates beside the head's drafts, verified in the same forward), ``ngram``
(prompt lookup), ``metrics`` (tau, A_k, a_k, accept histogram), ``costs`` (the cost curve),
``auto`` (AutoK: K per cycle), ``auto_model`` (the costs and expected tokens it prices with), ``auto_setup`` (``--steps auto`` from settings to engine),
``generator`` (requests from a queue through the engine with continuous batching:
distillation's in-process path), ``capture`` (what a request keeps for training), ``stops``
(where an output ends).

May import: ``fastmtp_sglang.cpu_kernels``, ``fastmtp_sglang.core`` and ``fastmtp_sglang.vocab``.
"""
