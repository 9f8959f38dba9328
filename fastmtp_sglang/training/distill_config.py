"""The settings of one distillation (``DistillConfig``, validated on construction) and what it
counts (``Stats``, written to ``<out>.stats.json``). The command is ``fastmtp distill``
(:mod:`fastmtp_sglang.training.distill` holds the method and the run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastmtp_sglang.core.errors import FastMTPError


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------

@dataclass
class DistillConfig:
    # a server, or several (a list: requests go to the one with the fewest in flight); ``url`` is
    # then the first and ``urls`` all of them
    url: str | list[str] | tuple[str, ...] | None
    prompts: list[str]
    out: str
    target: str | None = None     # in-process generation from this model directory (no --url)
    batch_size: int = 64          # in-process: rows decoded together
    dtype: str = "bfloat16"       # in-process: target dtype
    tokenizer: str | None = None
    target_name: str | None = None
    n: int = 1
    # one value, or one per sample index: sample k of a prompt uses temperature[k % len] (a mix
    # of temperatures, greedy (0) included, in one resumable file)
    temperature: float | tuple[float, ...] = 0.6
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
    # also write the target's hidden states into this feature cache (training/features_server.py),
    # for `train --features` at this max_len: as a server returns them with each answer (--url),
    # or as the in-process engine computed them (--target: with feature_topk top-k log-probs)
    with_features: str | None = None
    feature_dtype: str = "bfloat16"
    feature_topk: int | None = None  # None: 32 in process (what --loss kl reads), 0 with --url
    max_len: int = 1024
    urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.url, (list, tuple)):
            self.urls = tuple(self.url)
            self.url = self.urls[0] if self.urls else None
        elif self.url is not None and not self.urls:
            self.urls = (self.url,)
        temps = tuple(self.temperature) if isinstance(self.temperature, (list, tuple)) else (self.temperature,)
        if len(temps) == 1:
            self.temperature = temps[0]
        else:
            self.temperature = temps
        checks = [
            (self.n >= 1, f"--n must be >= 1, got {self.n}"),
            (bool(temps) and all(t >= 0 for t in temps),
             f"--temperature must be >= 0 (or a comma-separated list of such), got {self.temperature}"),
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
            (len(set(self.urls)) == len(self.urls), f"--url repeats a server: {list(self.urls)}"),
            (self.url is None or not self.feature_topk,
             "--feature-topk: a server returns hidden states but no top-k log-probabilities; "
             "with --url leave it at 0 (in process, --target, keeps them)"),
            (self.feature_topk is None or self.feature_topk >= 0,
             f"--feature-topk must be >= 0, got {self.feature_topk}"),
            (self.max_len >= 3, f"--max-len must be >= 3, got {self.max_len}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise FastMTPError(msg)
        if self.feature_topk is None:
            self.feature_topk = 32 if self.target is not None else 0

    def temperature_of(self, index: int) -> float:
        """The temperature of sample ``index`` of a prompt."""
        t = self.temperature
        return float(t[index % len(t)]) if isinstance(t, tuple) else float(t)

    def sampling_params(self, index: int = 0) -> dict[str, Any]:
        """What the request for sample ``index`` of a prompt sends, less its ``sampling_seed``."""
        return {"temperature": self.temperature_of(index), "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens}


# ----------------------------------------------------------------------------------------------
# statistics (printed at the end, written to <out>.stats.json)
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
    requests_per_server: dict[str, int] = field(default_factory=dict)  # --url: requests to each
    feature_tokens: int = 0  # --with-features: tokens in the feature cache

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


