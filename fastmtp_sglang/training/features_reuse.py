"""`fastmtp features --reuse CACHE`: copy the rows a finished cache already holds.

A sequence's features (hidden states, top-k log-probabilities) depend on its token ids and the
target, nothing else. So a build over data that shares sequences with an older cache (a training
prefix cut from a grown file, a disjoint split of it, the same file distilled further) copies
those rows instead of running the target over them again: on 2 CPU cores the target runs at
~900 tokens/s (SmolLM2-135M, bf16), so a 4.6M-token cache is 85 minutes, and its copy is a read.

Rows are matched by content (the sequence's ids after ``max_len``), found through the data file
the old cache recorded in its index. That file must still hash to the cache's key, and the old
cache must come from the same target weights, architecture, tokenizer, feature dtype and middle
layers, with at least as many top-k columns: anything else is refused with what differs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import torch

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.data import file_sha256, load_examples
from fastmtp_sglang.training.features import FeatureKey, FeatureStore

# key fields a copied row depends on (data, max_len and max_sequences only pick the rows)
SAME = ("weights_sha256", "config_sha256", "tokenizer_sha256", "dtype", "aux_layers")


def _digest(ids: torch.Tensor) -> bytes:
    return hashlib.blake2b(ids.to(torch.int64).numpy().tobytes(), digest_size=16).digest()


def reusable_rows(sources: list[str | Path], key: FeatureKey, examples, tokenizer, vocab_size: int,
                  log: Callable[[str], None] = print) -> dict[int, tuple[FeatureStore, int]]:
    """{row of ``examples``: (an old cache, its row)} for every row whose sequence one of the
    ``sources`` holds (the first source that has it wins)."""
    want: dict[bytes, list[int]] = {}
    for r, e in enumerate(examples):
        want.setdefault(_digest(e.ids), []).append(r)
    found: dict[int, tuple[FeatureStore, int]] = {}
    for src in sources:
        store = FeatureStore(src)
        have = store.index["key"]
        bad = [d for d in key.diff(have) if d.split(":")[0] in SAME]
        if int(have.get("topk", 0)) < key.topk:
            bad.append(f"topk: cache {have.get('topk')}, need {key.topk}")
        if bad:
            raise FastMTPError(f"--reuse {src}: built for another target or settings ("
                               + "; ".join(bad) + "): its rows are not this cache's rows")
        data = store.index.get("data")
        if not data:
            raise FastMTPError(f"--reuse {src}: its index records no data file (built before "
                               "caches recorded one): rebuild it, or drop --reuse")
        if not Path(data).is_file() or file_sha256(Path(data)) != have["data_sha256"]:
            raise FastMTPError(f"--reuse {src}: its data file {data} is missing or has changed "
                               "since the cache was built, so its rows cannot be matched: put the "
                               "file back, or drop this --reuse")
        old, _ = load_examples(data, tokenizer, vocab_size, int(have["max_len"]), 1,
                               have.get("max_sequences"))
        if len(old) != len(store):
            raise FastMTPError(f"--reuse {src}: {data} has {len(old)} usable rows and the cache "
                               f"{len(store)}: not the file it was built from")
        for i, e in enumerate(old):
            for r in want.pop(_digest(e.ids), ()):
                found[r] = (store, i)
    tokens = sum(len(examples[r].ids) for r in found)
    log(f"features: {len(found)} of {len(examples)} sequences ({tokens} tokens) copied from "
        f"{len(sources)} --reuse cache(s); the target runs over the other {len(examples) - len(found)}")
    return found
