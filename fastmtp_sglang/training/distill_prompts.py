"""Prompts for `fastmtp distill`: prompt files read tolerantly, and the run's jobs, one per sample
still to ask for (the prompt rendered with the chat template and tokenized, its sampling seed)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.prompts import Prompt, parse_prompt_row, render_chat

if TYPE_CHECKING:
    from fastmtp_sglang.training.distill_config import DistillConfig, Stats

SAMPLE_SEP = "#"          # sample id = <prompt id>#<sample index>


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


def sample_seed(base: int, prompt_id: str, index: int) -> int:
    """A stable 31-bit seed per (run seed, prompt, sample): reruns request the same samples."""
    digest = hashlib.sha256(f"{base}\x00{prompt_id}\x00{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def plan_jobs(cfg: DistillConfig, prompts: list[Prompt], tokenizer, base_sp: dict[str, Any],
              done: set[str], done_rejected: set[str], stats: Stats) -> list[Job]:
    """The jobs of the run in prompt order: ``cfg.n`` samples per prompt, less those already in
    the output (``done``) or dropped by a filter earlier (``done_rejected``); counted in
    ``stats``. A prompt is tokenized only when one of its samples is still to ask for."""
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
            sp = {**base_sp, "temperature": cfg.temperature_of(k),
                  "sampling_seed": sample_seed(cfg.seed, p.id, k)}
            jobs.append(Job(p, k, text, ids, sp))
    return jobs
