"""Per-request language: token script classes and table routing (device), text-level detection.

:func:`token_script_classes` classes every token of a tokenizer by script (CJK / Latin / other /
neutral). :func:`pick_table_index` chooses a table per request on the device from the prompt's
token ids through that lookup (:func:`script_counts`, :func:`table_index_from_counts`), with torch
ops only, so it needs no host sync and can run inside a captured graph. :func:`detect_language`
is the text-level detector for offline tools.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "DEFAULT_CJK_THRESHOLD",
    "NUM_SCRIPTS",
    "SCRIPT_CJK",
    "SCRIPT_LATIN",
    "SCRIPT_NEUTRAL",
    "SCRIPT_OTHER",
    "detect_language",
    "pick_table_index",
    "script_counts",
    "table_index_from_counts",
    "token_script_classes",
]

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
