"""Training a head: self-distillation, the feature cache, the FastMTP trainer, learning curves,
prompt synthesis and the initialisation of a new head.

May import: ``fastmtp_sglang.serving`` (the HTTP client, for distilling from a server),
``fastmtp_sglang.decode``, ``fastmtp_sglang.vocab`` and ``fastmtp_sglang.core``. Never
``benchmark`` or ``cli``.
"""
