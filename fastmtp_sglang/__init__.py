"""fastmtp-sglang: FastMTP draft heads (one MTP module run K times) for SGLang."""

__version__ = "0.1.0"
