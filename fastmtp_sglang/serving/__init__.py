"""Serving: the reference HTTP server (SGLang's ``/generate`` API over the reference engine),
the SGLang and vLLM launch builders, the HTTP client, and the vLLM metrics proxy.

The reference server: ``protocol`` (the API: parsing, checks, limits) < ``worker`` (the engine
worker: queue, batching, abort, info) < ``app`` (``ReferenceServer``: FastAPI on uvicorn over the
worker) < ``reference`` (engine + server built from a target and a draft). The launch commands:
``launch`` (what both share) < ``sglang_launch``, ``vllm_launch``.

May import: ``fastmtp_sglang.decode``, ``fastmtp_sglang.vocab`` and ``fastmtp_sglang.core``.
Never ``training``, ``benchmark`` or ``cli``.
"""
