"""Benchmarks across K: the sweep over K and drafters, in-process or against servers, its timing
discipline (warm-up, rotation, medians, the physics guard) and reports; the shipped evaluation
prompt files.

May import: ``fastmtp_sglang.serving`` (the client), ``fastmtp_sglang.decode`` and
``fastmtp_sglang.core``. Never ``training`` or ``cli``.
"""
