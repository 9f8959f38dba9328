"""Identity of a target model: name plus hashes of its architecture and its tokenizer.

A draft records the identity of the target it was made for; `fastmtp inspect --target` and the
engines compare it to the target they are given. Hashes are short sha256 prefixes of canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# what decides whether a head fits a target (not dtype, not ids of special tokens)
_ARCH_KEYS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_scaling",
              "rope_parameters", "tie_word_embeddings")


def _digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def config_hash(config: dict[str, Any]) -> str:
    return _digest({k: config.get(k) for k in _ARCH_KEYS})


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 prefix over the sorted (token, id) pairs of the full vocabulary, specials included."""
    vocab = tokenizer.get_vocab()
    return _digest(sorted(vocab.items(), key=lambda kv: kv[1]))


def target_identity(name: str, config: dict[str, Any], tokenizer: Any | None) -> dict[str, Any]:
    ident = {"name": name, "config_sha256": config_hash(config)}
    if tokenizer is not None:
        ident["tokenizer_sha256"] = tokenizer_hash(tokenizer)
        ident["vocab_size_tokenizer"] = len(tokenizer)
    return ident
