"""Training a head: self-distillation, the feature cache, the FastMTP trainer, learning curves,
prompt synthesis and the initialisation of a new head.

Owns: distillation (``distill``, ``distill_config``, ``distill_prompts``, ``distill_filters``,
``distill_io``, ``distill_drivers``, ``distill_loop``), the feature cache (``features``,
``features_reuse``, ``features_server``), the trainer (``config``, ``data``, ``objective``,
``fused_loss``, ``lookup_cover`` (the hybrid-aware weighting), ``checkpoints``, ``parallel``,
``train``), ``curve`` (learning curves),
``synth_prompts`` (prompts for the task kinds instruction sets lack), ``init_head`` (a new head
for a target without an MTP layer).

May import: ``fastmtp_sglang.serving`` (the HTTP client, for distilling from a server),
``fastmtp_sglang.decode``, ``fastmtp_sglang.vocab``, ``fastmtp_sglang.cpu_kernels`` and
``fastmtp_sglang.core``. Never ``benchmark`` or ``cli``.
"""
