"""Serving: the reference HTTP server (SGLang's ``/generate`` API over the reference engine),
the SGLang and vLLM launch builders, the HTTP client, and the vLLM metrics proxy.

The reference server: ``protocol`` (the API: parsing, checks, limits) < ``worker`` (the engine
worker: queue, batching, abort, info) < ``app`` (``ReferenceServer``: FastAPI on uvicorn over the
worker) < ``reference`` (engine + server built from a target and a draft). The launch commands:
``launch`` (what both share) < ``sglang_launch``, ``vllm_launch``; ``sglang_versions``: the two
supported SGLang releases (0.5.17, 0.5.23) and every difference between them that our code meets.

May import: ``fastmtp_sglang.decode``, ``fastmtp_sglang.vocab`` and ``fastmtp_sglang.core``.
Never ``training``, ``benchmark`` or ``cli``.
"""
