"""Benchmarks across K: the sweep over K and drafters, in-process or against servers, its timing
discipline (warm-up, rotation, medians, the physics guard) and reports; the shipped evaluation
prompt files.

Owns: ``sweep`` (the K sweep, in-process or against servers), ``concurrency`` (closed-loop
clients per level and arm), ``sandwich`` (timing that cancels drift), ``data`` (where the shipped
prompt files are).

May import: ``fastmtp_sglang.serving`` (the client), ``fastmtp_sglang.decode`` and
``fastmtp_sglang.core``. Never ``training`` or ``cli``.
"""
