"""Serving: the reference HTTP server (SGLang's ``/generate`` API over the reference engine),
the SGLang and vLLM launch builders, the HTTP client, and the vLLM metrics proxy.

May import: ``fastmtp_sglang.decode``, ``fastmtp_sglang.vocab`` and ``fastmtp_sglang.core``.
Never ``training``, ``benchmark`` or ``cli``.
"""
