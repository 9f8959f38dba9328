"""The filters of `fastmtp distill`: which prompts overlap evaluation texts (``--exclude``), and
which responses are dropped (empty, duplicate, degenerate, truncated). The rules, as the command
documents them, are in :mod:`fastmtp_sglang.training.distill`'s docstring."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Hashable, Iterable, Sequence

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.prompts import read_lines

MIN_CONTAINED_CHARS = 32  # shorter normalised texts only count as overlap when equal
MIN_REPEATS = 3           # an n-gram seen once or twice is not a loop (a restated sentence)
MIN_DEGENERATE_LEN = 16   # shorter responses are never called degenerate
# n-gram sizes checked: a loop with period p is caught by any n <= p, and a window longer than
# the period still repeats, so a sparse ladder up to 64 finds periods up to 64 tokens and beyond
# at O(len * 226) work per response instead of O(len * 64^2).
NGRAM_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


# ----------------------------------------------------------------------------------------------
# evaluation overlap (--exclude)
# ----------------------------------------------------------------------------------------------

def normalise(text: str) -> str:
    """Whitespace collapsed to single spaces, stripped, case-folded."""
    return " ".join(text.split()).casefold()


def eval_texts(paths: Iterable[str | Path]) -> list[str]:
    """Every normalised user text of evaluation files: all turns of Spec-Bench rows, C-Eval
    questions, ``prompt`` / ``text`` of other rows.

    Strict, unlike ``read_prompts_tolerant``: a line that cannot be read could hide an evaluation
    prompt, so it is an error (FastMTPError naming file:line).
    """
    texts: list[str] = []
    for path in map(Path, paths):
        for lineno, line in enumerate(read_lines(path, "--exclude file"), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FastMTPError(f"{path}:{lineno}: not valid JSON ({exc.msg}); an --exclude "
                                   "file must be readable in full, or evaluation prompts could "
                                   "leak into training") from None
            found = []
            if isinstance(row, dict):
                turns = row.get("turns")
                if isinstance(turns, list):
                    found += [t for t in turns if isinstance(t, str)]
                found += [row[k] for k in ("question", "prompt", "text") if isinstance(row.get(k), str)]
            found = [normalise(t) for t in found if t.strip()]
            if not found:
                raise FastMTPError(f"{path}:{lineno}: no user text found (expected turns, question, "
                                   "prompt or text)")
            texts += found
    return texts


class Excluder:
    """Decides whether a prompt overlaps evaluation texts (see the module docstring)."""

    def __init__(self, texts: Iterable[str], min_contained: int = MIN_CONTAINED_CHARS):
        self.exact = set(texts)
        self.min_contained = min_contained
        long = sorted(t for t in self.exact if len(t) >= min_contained)
        self.long = long
        # one string to search for "prompt inside an eval text"; \x00 never survives in prompts
        self.joined = "\x00".join(long)

    def __len__(self) -> int:
        return len(self.exact)

    def match(self, text: str) -> str | None:
        """None when ``text`` is clean, else how it overlaps: "equal" or "contained"."""
        t = normalise(text)
        if t in self.exact:
            return "equal"
        if len(t) >= self.min_contained and "\x00" not in t and t in self.joined:
            return "contained"
        if any(e in t for e in self.long if len(e) < len(t)):
            return "contained"
        return None

# ----------------------------------------------------------------------------------------------
# filters
# ----------------------------------------------------------------------------------------------

def repetition_coverage(seq: Sequence[Hashable], sizes: Iterable[int] = NGRAM_SIZES,
                        min_repeats: int = MIN_REPEATS) -> float:
    """The largest fraction of ``seq`` covered by the occurrences of one repeated n-gram.

    For each n in ``sizes`` the most frequent n-gram is found; if it occurs at least
    ``min_repeats`` times, the positions its occurrences span (overlaps counted once) are
    divided by ``len(seq)``. The maximum over n is returned, 0.0 when nothing repeats enough.
    ``seq`` is token ids in ``distill`` (so the rule does not depend on the language's spacing);
    any sequence works, e.g. a string (characters) or ``text.split()`` (words).

    Ties between equally frequent n-grams are all scored: "abcabc..." has three 3-grams that
    occur equally often.
    """
    seq = list(seq)
    L = len(seq)
    best = 0.0
    for n in sizes:
        if n * min_repeats > L:
            break
        starts: dict[tuple, list[int]] = defaultdict(list)
        for i in range(L - n + 1):
            starts[tuple(seq[i:i + n])].append(i)
        top = max(len(v) for v in starts.values())
        if top < min_repeats:
            continue
        for occ in (v for v in starts.values() if len(v) == top):
            covered, end = 0, 0
            for s in occ:  # union of [s, s + n) over sorted starts
                covered += s + n - max(s, end)
                end = s + n
            best = max(best, covered / L)
            if best >= 1.0:
                return 1.0
    return best


def is_degenerate(seq: Sequence[Hashable], max_fraction: float = 0.5,
                  min_len: int = MIN_DEGENERATE_LEN) -> bool:
    """True when one repeated n-gram covers more than ``max_fraction`` of ``seq`` (see
    ``repetition_coverage``); never for sequences shorter than ``min_len`` or max_fraction 1."""
    if len(seq) < min_len or max_fraction >= 1.0:
        return False
    return repetition_coverage(seq) > max_fraction


def finish_type(fr: Any) -> str | None:
    """SGLang's finish reason (``{"type": "length", ...}`` or a bare string) -> its type."""
    if isinstance(fr, dict):
        return fr.get("type")
    return fr if isinstance(fr, str) else None


def is_truncated(fr: Any) -> bool:
    return finish_type(fr) == "length"


class ResponseFilter:
    """Per-prompt state for the duplicate filter plus the stateless filters, in a fixed order:
    empty, duplicate, degenerate, truncated (only with ``drop_truncated``)."""

    def __init__(self, max_repeat_fraction: float = 0.5, drop_truncated: bool = False):
        self.max_repeat_fraction = max_repeat_fraction
        self.drop_truncated = drop_truncated
        self.seen: dict[str, set[str]] = defaultdict(set)

    def remember(self, prompt_id: str, response: str) -> None:
        self.seen[prompt_id].add(response.strip())

    def reason(self, prompt_id: str, response: str, response_ids: Sequence[int],
               finish_reason: Any) -> str | None:
        """None to keep the sample, else the filter that drops it. Kept responses are
        remembered for the duplicate check."""
        if not response.strip():  # nothing, or only EOS / whitespace: nothing to learn from
            return "empty"
        if response.strip() in self.seen[prompt_id]:
            return "duplicate"
        if is_degenerate(response_ids, self.max_repeat_fraction):
            return "degenerate"
        if self.drop_truncated and is_truncated(finish_reason):
            return "truncated"
        self.remember(prompt_id, response)
        return None
