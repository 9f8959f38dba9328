"""`fastmtp distill`: self-distilled training data, the target's own responses.

    # in-process on CPU (continuous batching, no server):
    fastmtp distill --target T --batch-size 64 \\
        --prompts fastmtp_sglang/data/train_prompts/*.jsonl \\
        --exclude bench/data/spec_bench.jsonl bench/data/c_eval_zh.jsonl --out data.jsonl
    # through any SGLang-compatible server (SGLang on a GPU):
    fastmtp distill --url http://127.0.0.1:30000 --tokenizer T --prompts ... --out data.jsonl

(paths in a source checkout; an installed wheel ships the same files: ``python -m
fastmtp_sglang.benchmark.data --train`` prints the training-prompt folder, ``python -m
fastmtp_sglang.benchmark.data`` the folder holding spec_bench.jsonl and c_eval_zh.jsonl)

Two engines, one output format. ``--target`` generates in this process with
``fastmtp_sglang.decode.batch_gen`` (a static KV cache of ``--batch-size`` slots, refilled as rows
finish; each sample seeded as below, sampling from exactly the distribution the server samples
from; greedy output token-identical to the server's in fp32). ``--url`` sends ``/generate``
requests to a server (``fastmtp serve`` or SGLang).

The chat template is applied here, with the target's tokenizer (``--tokenizer``, else the
server's ``tokenizer_path`` when that is a local directory), and the templated prompt is sent as
``input_ids`` tokenized without special tokens: the template already wrote them, and SGLang
tokenizing ``text`` itself would add a second BOS for templates that start with one. So
``prompt_ids`` in the output are exactly the ids the server conditioned on.

Output: one JSON object per line, one line per kept sample::

    {"id": "<prompt id>#<sample>", "prompt_id", "prompt" (the user text), "prompt_text"
     (templated), "prompt_ids", "response", "response_ids" (the server's output_ids; tokenized
     from the text only when a server returns none), "finish_reason", "sampling_params",
     "target", "completion_tokens"}

Sampling defaults are FastMTP's (T=0.6, top-p 0.95, top-k 20). Each sample carries its own
``sampling_seed``, a hash of (``--seed``, prompt id, sample index), so a rerun asks for the same
thing. Whether the answer is the same depends on the server: SGLang honours ``sampling_seed``
with ``--enable-deterministic-inference``.

Resuming: a rerun with the same ``--out`` reads what is there and skips the samples it holds
(and those already dropped by a filter, listed in ``<out>.rejected.jsonl``). A line cut short by
a crash (no newline, or not JSON) is dropped and the file rewritten cleanly before anything is
appended. Samples are appended and flushed as they complete, in prompt order (requests run
concurrently; results wait for the ones before them, so the file's order, and which of two
identical samples is kept, do not depend on timing). A rerun with different
sampling settings or another target is refused: one file holds one distribution.

Filters (counts printed at the end and written to ``<out>.stats.json``):

- ``bad prompt lines``: a prompt-file line that is not JSON, not a recognised row (see
  fastmtp_sglang.core.prompts), or repeats an id: skipped and reported as file:line, never fatal.
- ``excluded``: a prompt whose normalised text (whitespace collapsed, case-folded) equals an
  evaluation text from ``--exclude`` files (every turn of a Spec-Bench row, the question of a
  C-Eval row, the prompt/text of others), or contains one or is contained in one when the
  shorter of the two has at least ``MIN_CONTAINED_CHARS`` characters.
- ``refused``: the server answered 4xx (a prompt longer than the context, say): the prompt is
  skipped with the server's message and retried on a later run, as the server may have changed.
- ``empty``: the response text is blank (no tokens, or only EOS / whitespace).
- ``duplicate``: the response text (stripped) equals an earlier kept response to the same prompt.
- ``degenerate``: repetition, see ``repetition_coverage``: some n-gram of response tokens that
  occurs at least ``MIN_REPEATS`` times covers more than ``--max-repeat-fraction`` of them.
- ``truncated``: finish reason ``length``. Kept and counted; dropped with ``--drop-truncated``.

Retries: connection errors, timeouts and 5xx answers are retried ``--retries`` times with
exponential backoff (``--backoff`` s, doubling, capped at ``MAX_BACKOFF_S``). A sample still
failing with 5xx is counted as failed and the run goes on; a server that cannot be reached
after the retries stops the run (rerun to resume).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Sequence

from fastmtp_sglang.serving import client
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.prompts import Prompt, parse_prompt_row, render_chat

MIN_CONTAINED_CHARS = 32  # shorter normalised texts only count as overlap when equal
MIN_REPEATS = 3           # an n-gram seen once or twice is not a loop (a restated sentence)
MIN_DEGENERATE_LEN = 16   # shorter responses are never called degenerate
# n-gram sizes checked: a loop with period p is caught by any n <= p, and a window longer than
# the period still repeats, so a sparse ladder up to 64 finds periods up to 64 tokens and beyond
# at O(len * 226) work per response instead of O(len * 64^2).
NGRAM_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
MAX_BACKOFF_S = 60.0
SAMPLE_SEP = "#"          # sample id = <prompt id>#<sample index>
# settings that must match between runs writing one file (the seed differs per sample)
RESUME_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------

@dataclass
class DistillConfig:
    url: str | None
    prompts: list[str]
    out: str
    target: str | None = None     # in-process generation from this model directory (no --url)
    batch_size: int = 64          # in-process: rows decoded together
    dtype: str = "bfloat16"       # in-process: target dtype
    tokenizer: str | None = None
    target_name: str | None = None
    n: int = 1
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 512
    concurrency: int = 8
    retries: int = 4
    backoff: float = 1.0
    timeout: float = 600.0
    exclude: list[str] = field(default_factory=list)
    drop_truncated: bool = False
    limit: int | None = None
    system: str | None = None
    seed: int = 0
    max_repeat_fraction: float = 0.5
    progress: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.n >= 1, f"--n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"--top-p must lie in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"--top-k must be -1 (off) or >= 1, got {self.top_k}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (self.concurrency >= 1, f"--concurrency must be >= 1, got {self.concurrency}"),
            (self.retries >= 0, f"--retries must be >= 0, got {self.retries}"),
            (self.backoff >= 0, f"--backoff must be >= 0 seconds, got {self.backoff}"),
            (self.timeout > 0, f"--timeout must be > 0 seconds, got {self.timeout}"),
            (self.limit is None or self.limit >= 1, f"--limit must be >= 1, got {self.limit}"),
            (0 < self.max_repeat_fraction <= 1,
             f"--max-repeat-fraction must lie in (0, 1] (1 = off), got {self.max_repeat_fraction}"),
            (bool(self.prompts), "give at least one --prompts file"),
            ((self.url is None) != (self.target is None),
             "give either --url (a server) or --target (generate in this process), not both"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise FastMTPError(msg)

    def sampling_params(self) -> dict[str, Any]:
        """What every request sends, less its ``sampling_seed``."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens}


# ----------------------------------------------------------------------------------------------
# prompts: tolerant reading, exclusion
# ----------------------------------------------------------------------------------------------

def read_prompts_tolerant(paths: Iterable[str | Path]) -> tuple[list[Prompt], list[str]]:
    """Read prompt files like ``load_prompts``, but skip bad lines instead of raising.

    Returns (prompts in file order, bad lines as ``"file:line: reason"``). A bad line is one that
    is not UTF-8, not JSON, not a recognised row, or repeats an id (within a file or across the
    files given: ids name output samples, so they must be unique). Blank lines are skipped
    silently. A missing or unreadable file is an error (FastMTPError), not a bad line.
    """
    prompts: list[Prompt] = []
    bad: list[str] = []
    seen: dict[str, str] = {}
    for path in map(Path, paths):
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise FastMTPError(f"prompt file not found: {path}") from None
        except OSError as exc:
            raise FastMTPError(f"cannot read prompt file {path}: {exc}") from None
        for lineno, line_b in enumerate(raw.splitlines(), start=1):
            where = f"{path}:{lineno}"
            try:
                line = line_b.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad.append(f"{where}: not UTF-8 ({exc.reason})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                bad.append(f"{where}: not valid JSON ({exc.msg})")
                continue
            try:
                p = parse_prompt_row(row, default_id=f"{path.stem}:{lineno}",
                                     default_category=path.stem)
            except ValueError as exc:
                bad.append(f"{where}: {exc}")
                continue
            if p.id in seen:
                bad.append(f"{where}: id {p.id!r} already used at {seen[p.id]}")
                continue
            seen[p.id] = where
            prompts.append(p)
    return prompts, bad


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
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise FastMTPError(f"--exclude file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise FastMTPError(f"cannot read --exclude file {path}: {exc}") from None
        for lineno, line in enumerate(lines, start=1):
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


# ----------------------------------------------------------------------------------------------
# the output file: resume and repair
# ----------------------------------------------------------------------------------------------

def sample_seed(base: int, prompt_id: str, index: int) -> int:
    """A stable 31-bit seed per (run seed, prompt, sample): reruns request the same samples."""
    digest = hashlib.sha256(f"{base}\x00{prompt_id}\x00{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_jsonl_repair(path: Path, required: tuple[str, ...] = ("id",)) -> tuple[list[dict], list[str]]:
    """Records of a JSONL file we append to, repairing it in place when damaged.

    A line that is not a JSON object with the ``required`` keys, a line without its newline
    (the last one, cut by a crash), and a repeated ``id`` are dropped; if any was, the file is
    rewritten (atomically) with the good lines only. Returns (records, "line N: reason" for each
    dropped line). A missing file is empty.
    """
    if not path.exists():
        return [], []
    raw = path.read_bytes()
    records: list[dict] = []
    good: list[bytes] = []
    dropped: list[str] = []
    ids: set[str] = set()
    lines = raw.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else the cut-off last line
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            dropped.append(f"line {lineno}: not JSON ({getattr(exc, 'msg', exc)})")
            continue
        if not isinstance(rec, dict) or any(k not in rec for k in required):
            dropped.append(f"line {lineno}: not an object with {list(required)}")
            continue
        if rec["id"] in ids:
            dropped.append(f"line {lineno}: id {rec['id']!r} repeated")
            continue
        ids.add(rec["id"])
        records.append(rec)
        good.append(line)
    if tail.strip():
        dropped.append(f"line {len(lines) + 1}: cut off (no newline; a crash mid-write)")
    if dropped:
        _atomic_write(path, "".join(g.decode("utf-8") + "\n" for g in good))
    return records, dropped


def check_resume(records: list[dict], sampling: dict[str, Any], target: str, out: Path,
                 render: Callable[[str], str] | None = None) -> None:
    """Refuse to append to a file written with other settings or for another target.

    ``render(prompt) -> templated text``: this run's chat template and system message; a record
    whose ``prompt_text`` differs was written with another ``--system`` (or template)."""
    for rec in records[:1] + records[-1:]:
        if render is not None and "prompt" in rec and "prompt_text" in rec:
            if render(str(rec["prompt"])) != rec["prompt_text"]:
                raise FastMTPError(
                    f"{out} was written with another system message or chat template (its prompt "
                    f"{rec.get('prompt_id')!r} was rendered differently): use another --out, or "
                    "the same --system to resume")
        sp = rec.get("sampling_params") or {}
        diff = {k: (sp.get(k), sampling[k]) for k in RESUME_KEYS if sp.get(k) != sampling[k]}
        if diff:
            what = ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in diff.items())
            raise FastMTPError(f"{out} was written with other sampling settings ({what}); "
                               "use another --out, or the same settings to resume")
        if rec.get("target") != target:
            raise FastMTPError(f"{out} holds samples of target {rec.get('target')!r}, this run's "
                               f"is {target!r}; use another --out (or --target-name to name it)")


# ----------------------------------------------------------------------------------------------
# requests
# ----------------------------------------------------------------------------------------------

class Refused(Exception):
    """The server refused the request (4xx): not worth retrying."""


class Unreachable(Exception):
    """The server could not be reached after all retries."""


@dataclass
class Job:
    prompt: Prompt
    index: int
    prompt_text: str
    prompt_ids: list[int]
    sampling_params: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.prompt.id}{SAMPLE_SEP}{self.index}"


def request_with_retries(url: str, job: Job, retries: int, backoff: float, timeout: float,
                         sleep: Callable[[float], None] = time.sleep) -> tuple[dict, int]:
    """(the server's reply, retries used). Raises Refused on 4xx (but 408 / 429, which are
    retried), Unreachable when the connection kept failing, ServerError on a lasting 5xx."""
    attempt = 0
    while True:
        try:
            out = client.generate(url, input_ids=job.prompt_ids,
                                  sampling_params=job.sampling_params, timeout=timeout)
            if not isinstance(out, dict):
                raise client.ServerError(url, 502, f"reply is not a JSON object: {str(out)[:80]}")
            return out, attempt
        except client.ServerError as exc:
            if 400 <= exc.status < 500 and exc.status not in (408, 429):
                raise Refused(exc.message) from None
            if attempt >= retries:
                raise
        except (FastMTPError, OSError, ValueError) as exc:  # cannot reach, timeout, bad JSON
            if attempt >= retries:
                raise Unreachable(str(exc)) from None
        sleep(min(MAX_BACKOFF_S, backoff * 2 ** attempt))
        attempt += 1


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------

@dataclass
class Stats:
    prompt_files: list[str] = field(default_factory=list)
    prompts_read: int = 0
    bad_prompt_lines: int = 0
    bad_prompt_line_list: list[str] = field(default_factory=list)
    excluded: int = 0
    excluded_ids: list[str] = field(default_factory=list)
    exclude_files: list[str] = field(default_factory=list)
    eval_texts: int = 0
    prompts_used: int = 0
    samples_planned: int = 0
    already_done: int = 0
    already_rejected: int = 0
    damaged_output_lines: list[str] = field(default_factory=list)
    requested: int = 0
    retries: int = 0
    written: int = 0
    refused: int = 0
    refused_list: list[str] = field(default_factory=list)
    failed: int = 0
    failed_list: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=lambda: {"empty": 0, "duplicate": 0,
                                                             "degenerate": 0, "truncated": 0})
    truncated: int = 0
    truncated_kept: int = 0
    response_ids_tokenized: int = 0
    completion_tokens: int = 0
    lines_in_output: int = 0
    aborted: str | None = None
    seconds: float = 0.0
    engine: str = ""
    generate_seconds: float = 0.0  # from the first request to the last result

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0

    def summary(self) -> str:
        d = self.dropped
        lines = [
            f"prompts: {self.prompts_read} read, {self.bad_prompt_lines} bad lines skipped, "
            f"{self.excluded} excluded (overlap with {self.eval_texts} evaluation texts), "
            f"{self.prompts_used} used",
            f"samples: {self.samples_planned} planned, {self.already_done} already in the output, "
            f"{self.already_rejected} rejected earlier, {self.requested} requested "
            f"({self.retries} retries)",
            f"results: {self.written} written, {self.refused} refused by the server "
            f"({len(self.refused_list)} prompts), "
            f"{self.failed} failed; dropped {d['duplicate']} duplicate, {d['degenerate']} "
            f"degenerate, {d['empty']} empty, {d['truncated']} truncated",
            f"truncated (finish_reason length): {self.truncated} this run, "
            f"{self.truncated_kept} of them kept",
            f"output: {self.lines_in_output} lines, {self.completion_tokens} response tokens "
            f"this run, {self.seconds:.1f} s ({self.tokens_per_s:.1f} response tokens/s while "
            f"generating; {self.engine})",
        ]
        for title, items in (("bad prompt lines", self.bad_prompt_line_list),
                             ("excluded (overlap with --exclude files)", self.excluded_ids),
                             ("damaged output lines (dropped)", self.damaged_output_lines),
                             ("refused", self.refused_list), ("failed", self.failed_list)):
            if items:
                lines.append(f"{title}:")
                lines += [f"  {s}" for s in items[:20]]
                if len(items) > 20:
                    lines.append(f"  ... {len(items) - 20} more in the stats file")
        if self.aborted:
            lines.append(f"stopped early: {self.aborted}")
        return "\n".join(lines)


def stats_path(out: Path) -> Path:
    return out.with_name(out.name + ".stats.json")


def rejected_path(out: Path) -> Path:
    return out.with_name(out.name + ".rejected.jsonl")


def _load_tokenizer(cfg: DistillConfig, info: dict[str, Any]):
    from transformers import AutoTokenizer

    path = cfg.tokenizer
    if path is None:
        cand = info.get("tokenizer_path") or info.get("model_path")
        if cand and Path(cand).is_dir():
            path = cand
        else:
            raise FastMTPError("give --tokenizer DIR (the target's tokenizer, for the chat template): "
                               f"the server's tokenizer path {cand!r} is not a local directory")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise FastMTPError(f"cannot load the tokenizer from {path}: {exc}") from None


def _record(job: Job, out: dict, tokenizer, target: str, stats: Stats) -> dict[str, Any]:
    meta = out.get("meta_info") or {}
    response = out.get("text") or ""
    ids = out.get("output_ids")
    if ids is None:
        ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        stats.response_ids_tokenized += 1
    ids = [int(t) for t in ids]
    return {
        "id": job.id,
        "prompt_id": job.prompt.id,
        "prompt": job.prompt.text,
        "prompt_text": job.prompt_text,
        "prompt_ids": job.prompt_ids,
        "response": response,
        "response_ids": ids,
        "finish_reason": meta.get("finish_reason"),
        "sampling_params": job.sampling_params,
        "target": target,
        "completion_tokens": int(meta.get("completion_tokens", len(ids))),
    }


def distill(cfg: DistillConfig, log: Callable[[str], None] | None = None) -> Stats:
    """Run the distillation described by ``cfg``; returns the statistics (also written to
    ``<out>.stats.json``). Raises FastMTPError on bad arguments or an unreachable server."""
    from tqdm import tqdm

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    out = Path(cfg.out)
    stats = Stats(prompt_files=[str(p) for p in cfg.prompts], exclude_files=[str(p) for p in cfg.exclude])

    prompts, bad = read_prompts_tolerant(cfg.prompts)
    stats.prompts_read, stats.bad_prompt_lines, stats.bad_prompt_line_list = len(prompts), len(bad), bad
    if bad:
        log(f"fastmtp distill: skipped {len(bad)} bad prompt line(s), first {bad[0]} "
            "(all listed at the end and in the stats file)")
    if cfg.exclude:
        excluder = Excluder(eval_texts(cfg.exclude))
        stats.eval_texts = len(excluder)
        kept = []
        for p in prompts:
            if excluder.match(p.text):
                stats.excluded += 1
                stats.excluded_ids.append(p.id)
            else:
                kept.append(p)
        prompts = kept
    if cfg.limit is not None:
        prompts = prompts[: cfg.limit]
    stats.prompts_used = len(prompts)
    if not prompts:
        raise FastMTPError("no prompts left to distil" + (f" ({len(bad)} bad lines skipped)" if bad else ""))

    if cfg.target is not None:
        backend: _Backend = _LocalBackend(cfg, log)
        target, tokenizer = cfg.target_name or cfg.target, backend.tokenizer
    else:
        try:
            info = client.server_info(cfg.url, timeout=min(cfg.timeout, 60))
        except FastMTPError:
            if cfg.target_name is None or cfg.tokenizer is None:
                raise
            info = {}
        target = cfg.target_name or info.get("model_path") or info.get("tokenizer_path")
        if not target:
            raise FastMTPError(f"{cfg.url}/server_info names no model_path; give --target-name")
        tokenizer = _load_tokenizer(cfg, info)
        backend = _HttpBackend(cfg)
    stats.engine = backend.describe

    out.parent.mkdir(parents=True, exist_ok=True)
    records, damaged = load_jsonl_repair(out)
    stats.damaged_output_lines = damaged
    for d in damaged:
        log(f"fastmtp distill: {out}: dropped damaged {d}")
    rejected, damaged_rej = load_jsonl_repair(rejected_path(out))
    for d in damaged_rej:
        log(f"fastmtp distill: {rejected_path(out)}: dropped damaged {d}")
    base_sp = cfg.sampling_params()
    check_resume(records, base_sp, target, out, lambda text: render_chat(tokenizer, text, cfg.system))
    done = {r["id"] for r in records}
    done_rejected = {r["id"] for r in rejected}
    filt = ResponseFilter(cfg.max_repeat_fraction, cfg.drop_truncated)
    for r in records:
        filt.remember(str(r.get("prompt_id")), str(r.get("response", "")))

    jobs: list[Job] = []
    for p in prompts:
        text = render_chat(tokenizer, p.text, cfg.system)
        ids: list[int] | None = None
        for k in range(cfg.n):
            job_id = f"{p.id}{SAMPLE_SEP}{k}"
            stats.samples_planned += 1
            if job_id in done:
                stats.already_done += 1
                continue
            if job_id in done_rejected:
                stats.already_rejected += 1
                continue
            if ids is None:
                ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            sp = {**base_sp, "sampling_seed": sample_seed(cfg.seed, p.id, k)}
            jobs.append(Job(p, k, text, ids, sp))

    lines_in_output = len(records)
    refused_prompts: set[str] = set()

    def finish() -> Stats:
        stats.lines_in_output = lines_in_output
        stats.seconds = time.monotonic() - t0
        _atomic_write(stats_path(out), json.dumps(asdict(stats), indent=2, ensure_ascii=False) + "\n")
        return stats

    if not jobs:
        log(f"fastmtp distill: nothing to do: the {stats.samples_planned} samples planned are all in "
            f"{out} or were dropped by a filter earlier ({rejected_path(out).name})")
        return finish()

    # Requests run concurrently, but results are handled (filtered, written) in job order, so
    # the output's order, and which of two identical samples is kept (the lower index), do not
    # depend on timing. Bounded: `window` requests in flight, at most 4 windows of finished
    # results waiting behind a slow one.
    window = backend.window
    pending: dict[Future, int] = {}
    results: dict[int, tuple[str, Any]] = {}
    listed_refused: set[str] = set()

    fout = frej = None  # the output and rejected files, open while drive() runs

    def handle(job: Job, kind: str, payload: Any) -> None:
        nonlocal lines_in_output
        if kind in ("refused", "skipped"):  # skipped: a sibling sample of a refused prompt
            stats.refused += 1
            if kind == "refused" and job.prompt.id not in listed_refused:
                listed_refused.add(job.prompt.id)
                stats.refused_list.append(f"{job.prompt.id}: {payload}")
            return
        if kind == "failed":
            stats.failed += 1
            stats.failed_list.append(f"{job.id}: {payload}")
            return
        reply, used = payload
        stats.retries += used
        rec = _record(job, reply, tokenizer, target, stats)
        if finish_type(rec["finish_reason"]) == "abort":  # cut off by the server (shutdown,
            stats.failed += 1                            # /abort_request): asked again next run
            stats.failed_list.append(f"{job.id}: aborted by the server after "
                                     f"{len(rec['response_ids'])} tokens")
            return
        truncated = is_truncated(rec["finish_reason"])
        stats.truncated += truncated
        why = filt.reason(job.prompt.id, rec["response"], rec["response_ids"], rec["finish_reason"])
        if why is not None:
            stats.dropped[why] += 1
            frej.write(json.dumps({"id": job.id, "prompt_id": job.prompt.id, "reason": why,
                                   "response": rec["response"]}, ensure_ascii=False) + "\n")
            frej.flush()
            return
        stats.truncated_kept += truncated
        fout.write(json.dumps(rec, ensure_ascii=False) + "\n")
        fout.flush()
        stats.written += 1
        lines_in_output += 1
        stats.completion_tokens += rec["completion_tokens"]

    backend.prepare(jobs)
    t_gen = time.monotonic()

    def drive() -> None:
        nonlocal fout, frej
        with open(out, "a", encoding="utf-8") as fout, \
                open(rejected_path(out), "a", encoding="utf-8") as frej, \
                tqdm(total=len(jobs), desc="distill", unit="sample", disable=not cfg.progress,
                     file=sys.stderr) as bar:
            next_submit = next_write = 0
            try:
                while next_write < len(jobs):
                    while (next_submit < len(jobs) and len(pending) < window
                           and next_submit < next_write + 4 * window):
                        job = jobs[next_submit]
                        if job.prompt.id in refused_prompts:
                            results[next_submit] = ("skipped", None)
                        else:
                            pending[backend.submit(job)] = next_submit
                            stats.requested += 1
                        next_submit += 1
                    if next_write not in results:
                        finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                        for fut in finished:
                            i = pending.pop(fut)
                            try:
                                results[i] = ("ok", fut.result())
                            except Refused as exc:
                                results[i] = ("refused", str(exc))
                                refused_prompts.add(jobs[i].prompt.id)
                            except client.ServerError as exc:
                                results[i] = ("failed", str(exc))
                            except GeneratorStopped:
                                raise
                    while next_write in results:
                        handle(jobs[next_write], *results.pop(next_write))
                        next_write += 1
                        bar.update(1)
                        stats.generate_seconds = time.monotonic() - t_gen
                    bar.set_postfix(written=stats.written, dropped=sum(stats.dropped.values()),
                                    refused=stats.refused, refresh=False)
            except Unreachable as exc:
                stats.aborted = f"{cfg.url} unreachable after {cfg.retries} retries: {exc}"
            except GeneratorStopped as exc:
                stats.aborted = str(exc)
            except KeyboardInterrupt:
                stats.aborted = "interrupted"
                backend.shutdown(wait=False)
                finish()
                raise
            finally:
                # normal end: nothing pending; an abort: drop queued requests, leave in-flight ones
                # to finish on their own (their results are not written: a rerun requests them again)
                backend.shutdown(wait=not pending)

    if backend.on_main_thread:
        # the in-process generator computes on this thread (the fast one on CPU: see
        # batch_gen.GenWorker); submitting and writing run beside it on a thread of their own
        failure: list[BaseException] = []

        def driver() -> None:
            try:
                drive()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                failure.append(exc)
                backend.shutdown(wait=False)

        th = threading.Thread(target=driver, name="distill-driver", daemon=True)
        th.start()
        try:
            backend.run()
        except KeyboardInterrupt:
            th.join(timeout=60)  # the driver sees its requests fail, stops submitting, closes files
            stats.aborted = "interrupted"
            finish()
            raise
        except Exception:  # noqa: BLE001 - an engine fault: the driver's requests carry it
            pass
        th.join()
        if failure:
            raise failure[0]
    else:
        drive()
    finish()
    if stats.aborted:
        raise FastMTPError(f"{stats.aborted}; {stats.written} samples written to {out}, rerun "
                           "the same command to resume")
    return stats


# ----------------------------------------------------------------------------------------------
# engines: a server over HTTP, or the in-process slot generator
# ----------------------------------------------------------------------------------------------

class GeneratorStopped(Exception):
    """The in-process generator failed as a whole (not one request's fault)."""


class _Backend:
    window: int       # requests in flight
    describe: str
    on_main_thread = False  # run() must be called on the main thread while drive() runs beside

    def run(self) -> None:
        """Compute until shutdown (only backends with ``on_main_thread``)."""

    def prepare(self, jobs: list[Job]) -> None:
        """Called once with every job of the run, before the first submit."""

    def submit(self, job: Job) -> Future:
        """A Future of (the server-shaped reply, retries used); raises Refused / ServerError."""
        raise NotImplementedError

    def shutdown(self, wait: bool) -> None:
        raise NotImplementedError


class _HttpBackend(_Backend):
    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        self.window = 2 * cfg.concurrency
        self.pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="distill")
        self.describe = f"server {cfg.url}, {cfg.concurrency} requests in flight"

    def submit(self, job: Job) -> Future:
        c = self.cfg
        return self.pool.submit(request_with_retries, c.url, job, c.retries, c.backoff, c.timeout)

    def shutdown(self, wait: bool) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=True)


class _LocalBackend(_Backend):
    """The target in this process, ``batch_size`` rows decoding at once (fastmtp_sglang.decode.batch_gen)."""

    def __init__(self, cfg: DistillConfig, log: Callable[[str], None]):
        from fastmtp_sglang.decode.batch_gen import SlotGenerator
        from fastmtp_sglang.core.target import load_target

        log(f"fastmtp distill: loading {cfg.target} ({cfg.dtype}) for in-process generation")
        self.t = load_target(cfg.target, dtype=cfg.dtype)
        self.tokenizer = self.t.tokenizer
        if self.tokenizer is None:
            raise FastMTPError(f"target {cfg.target} has no tokenizer")
        self.cfg, self.log = cfg, log
        self.window = 2 * cfg.batch_size
        self.describe = f"in-process {cfg.target}, {cfg.dtype}, batch {cfg.batch_size}"
        self.worker = None
        self.on_main_thread = True

    def prepare(self, jobs: list[Job]) -> None:
        from fastmtp_sglang.decode.batch_gen import SlotGenerator, kv_cache_bytes

        if not jobs:
            return
        max_pos = int(self.t.config.get("max_position_embeddings", 4096))
        # positions per slot: the longest prompt of the run plus the response (a longer prompt
        # than the context is refused per request by the generator)
        max_len = min(max_pos, max(len(j.prompt_ids) for j in jobs) + self.cfg.max_new_tokens + 1)
        need = kv_cache_bytes(self.t.model.config, self.cfg.batch_size, max_len,
                              next(self.t.model.parameters()).element_size())
        avail = _available_memory()
        if avail is not None and need > 0.7 * avail:
            raise FastMTPError(
                f"the KV cache for --batch-size {self.cfg.batch_size} x {max_len} positions needs "
                f"{need / 2**30:.1f} GiB and {avail / 2**30:.1f} GiB are available: lower "
                "--batch-size or --max-new-tokens")
        self.gen = SlotGenerator(self.t, self.cfg.batch_size, max_len)
        self.log(f"fastmtp distill: {self.cfg.batch_size} slots x {max_len} positions, KV cache "
                 f"{self.gen.cache_bytes / 2**30:.2f} GiB")
        self.worker = self.gen.worker()  # run() on the main thread, see distill()

    def run(self) -> None:
        if self.worker is not None:
            self.worker.run()

    def submit(self, job: Job) -> Future:
        from fastmtp_sglang.decode.batch_gen import GenRequest
        from fastmtp_sglang.decode.sampling import SamplingParams

        outer: Future = Future()
        try:
            params = SamplingParams.from_dict(dict(job.sampling_params))
            inner = self.worker.submit(GenRequest(job.prompt_ids, params))
        except RuntimeError as exc:
            raise GeneratorStopped(str(exc)) from None
        except ValueError as exc:
            outer.set_exception(Refused(str(exc)))
            return outer

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is None:
                r = f.result()
                outer.set_result(({"text": self.tokenizer.decode(r.output_ids, skip_special_tokens=True),
                                   "output_ids": r.output_ids,
                                   "meta_info": {"finish_reason": r.finish_reason,
                                                 "completion_tokens": len(r.output_ids)}}, 0))
            elif isinstance(exc, ValueError):  # this prompt's fault: too long, bad parameters
                outer.set_exception(Refused(str(exc)))
            else:
                outer.set_exception(GeneratorStopped(f"in-process generation failed: {exc!r}"))

        inner.add_done_callback(done)
        return outer

    def shutdown(self, wait: bool) -> None:
        """wait: finish the rows in flight; otherwise cancel them (an abort: nothing more is
        written, a rerun asks again)."""
        if self.worker is not None:
            if wait:
                self.worker.close(wait=False)  # run() returns once the last row is done
            else:
                self.worker.cancel()


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a batch scheduler, a background job whose SIGINT the shell ignores)
    stops a run the way Ctrl-C does: requests in flight are dropped, the files stay whole and a
    rerun resumes."""
    import signal

    def stop(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def run(args: argparse.Namespace) -> int:
    cfg = DistillConfig(
        url=args.url, prompts=args.prompts, out=args.out, tokenizer=args.tokenizer,
        target=args.target, batch_size=args.batch_size, dtype=args.dtype,
        target_name=args.target_name, n=args.n, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
        retries=args.retries, backoff=args.backoff, timeout=args.timeout,
        exclude=args.exclude or [], drop_truncated=args.drop_truncated, limit=args.limit,
        system=args.system, seed=args.seed, max_repeat_fraction=args.max_repeat_fraction,
        progress=not args.no_progress)
    _stop_on_sigterm()
    try:
        stats = distill(cfg)
    except KeyboardInterrupt:
        print(f"fastmtp distill: stopped; rerun the same command to resume ({cfg.out} holds only "
              "whole lines)", file=sys.stderr)
        raise
    except FastMTPError:
        if stats_path(Path(cfg.out)).exists():
            print(f"fastmtp distill: statistics so far in {stats_path(Path(cfg.out))}", file=sys.stderr)
        raise
    print(stats.summary())
    print(f"fastmtp distill: {stats.lines_in_output} samples in {cfg.out}; statistics in "
          f"{stats_path(Path(cfg.out))}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="self-distilled training data: the target's own responses",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="SGLang-compatible server, e.g. http://127.0.0.1:30000")
    src.add_argument("--target", help="generate in this process from this model directory "
                     "(continuous batching on CPU; no server)")
    p.add_argument("--batch-size", type=int, default=64, help="with --target: rows decoded "
                   "together (default 64; 2-core CPU, 135M model: 224 response tokens/s, 22x batch 1; "
                   "128 is no faster; bench/results/distill_throughput)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="with --target: model dtype (default bfloat16)")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                   help="prompt files (JSONL: training {id, source, prompt}, Spec-Bench, C-Eval, "
                        "{prompt|text})")
    p.add_argument("--out", required=True, help="output JSONL; appended to (resumed) if it exists")
    p.add_argument("--tokenizer", default=None, help="the target's tokenizer directory, for the chat "
                   "template (default: the server's tokenizer_path, if a local directory)")
    p.add_argument("--target-name", default=None, help="the target's identity written to each line "
                   "(default: the server's model_path)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=20, help="top-k tokens; -1 = off")
    p.add_argument("--max-new-tokens", type=int, default=512, help="response length limit in tokens")
    p.add_argument("--concurrency", type=int, default=8, help="with --url: requests in flight (default 8)")
    p.add_argument("--retries", type=int, default=4,
                   help="retries per request on connection errors, timeouts and 5xx; 0 = none")
    p.add_argument("--backoff", type=float, default=1.0,
                   help=f"first retry delay in seconds, doubling after each (max {MAX_BACKOFF_S:g} s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--exclude", nargs="+", default=[], metavar="FILE",
                   help="evaluation files: prompts overlapping their texts are refused (the "
                   "shipped ones: python -m fastmtp_sglang.benchmark.data)")
    p.add_argument("--drop-truncated", action="store_true",
                   help="drop responses cut at --max-new-tokens (default: keep and count them)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts (after --exclude)")
    p.add_argument("--system", default=None, help="system message before each prompt "
                   "(default: the chat template's own)")
    p.add_argument("--seed", type=int, default=0, help="base of the per-sample sampling seeds")
    p.add_argument("--max-repeat-fraction", type=float, default=0.5,
                   help="drop a response when one repeated n-gram covers more than this fraction "
                        "of its tokens; 1 = off")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
