"""Compressed draft-vocabulary tables: the table file format, sidecars, shipped tables, TableSet.

A *table* is the draft's vocabulary for one language: the ``size`` most frequent full-vocabulary
token ids of that language's text under the target's tokenizer (FR-Spec, arXiv 2502.14856: 16K
for Chinese and 32K for English of Qwen2's 152K keep most of the acceptance length). The draft
scores only its request's table; verification keeps the full vocabulary, so output is unchanged.

On disk, ``<lang>-<N>.pt`` is ``torch.save`` of a 1-D int64 tensor of full-vocabulary ids in
descending frequency (what SGLang's ``--speculative-token-map`` loads), with a sidecar
``<lang>-<N>.json``: the tokenizer it was built for (name, size, vocabulary hash), sources, token
counts and coverage on held-out text. :func:`load_table` refuses a table built for another
tokenizer.

Building a table from text is :mod:`fastmtp_sglang.vocab.build`; choosing one per request, from
the script classes of the prompt's tokens, is :mod:`fastmtp_sglang.vocab.language`.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError, MismatchError
from fastmtp_sglang.vocab.language import pick_table_index

__all__ = [
    "FORMAT_VERSION",
    "TableSet",
    "VocabTable",
    "load_table",
    "resolve_table_ref",
    "save_table",
    "shipped_dir",
    "shipped_tables",
    "tokenizer_identity",
    "union_table",
]

FORMAT_VERSION = 1


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
