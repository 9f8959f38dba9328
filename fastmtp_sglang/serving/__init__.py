"""Serving: the reference HTTP server (SGLang's ``/generate`` API over the reference engine),
the SGLang and vLLM launch builders, the HTTP client, and the vLLM metrics proxy.

Owns: the reference server: ``options`` (every server limit, its default and its check) <
``protocol`` (the API: parsing, checks, refusals) < ``jobs`` (requests in flight, counters) <
``responses`` (what a request gets back), ``hidden_states`` (``return_hidden_states`` rows),
``info`` (K or auto, the model, what each acceptance figure means) <
``worker`` (the engine worker: queue, batching, abort, info) < ``app`` (``ReferenceServer``:
FastAPI routes and streams over the worker) < ``http_transport`` (uvicorn with our h11 limits,
the socket, stop signals) < ``reference`` (engine + server built from a target and a draft). The
launch commands: ``launch`` (what both share) < ``sglang_launch``, ``vllm_launch``;
``sglang_versions``: the two supported SGLang releases (0.5.17, 0.5.23) and every difference
between them that our code meets; ``engine_config`` (SGLang's and vLLM's K-per-batch-size
settings from a measured table). Clients: ``client`` (SGLang's ``/generate`` API),
``vllm_proxy`` (that API in front of a vLLM server).

May import: ``fastmtp_sglang.decode``, ``fastmtp_sglang.vocab`` and ``fastmtp_sglang.core``.
Never ``training``, ``benchmark`` or ``cli``.
"""
