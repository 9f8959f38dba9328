"""fastmtp-sglang: FastMTP draft heads (one MTP module run K times) for SGLang.

Owns: ``__main__`` (``python -m fastmtp_sglang``: the ``fastmtp`` command). Everything else is in
the subpackages; docs/design.md section 10.1 maps them, with what each may import.
"""

__version__ = "0.1.0"
