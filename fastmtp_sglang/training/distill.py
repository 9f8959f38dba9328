"""`fastmtp distill`: self-distilled training data, the target's own responses.

    # in-process on CPU (continuous batching, no server):
    fastmtp distill --target T --batch-size 64 \\
        --prompts fastmtp_sglang/data/train_prompts/*.jsonl bench/train_prompts/*.jsonl \\
        --exclude bench/data/spec_bench.jsonl bench/data/c_eval_zh.jsonl --out data.jsonl
    # through any SGLang-compatible server (SGLang on a GPU):
    fastmtp distill --url http://127.0.0.1:30000 --tokenizer T --prompts ... --out data.jsonl
    # several servers, and the feature cache in the same pass (servers started with
    # --enable-return-hidden-states; docs/scale.md, "Features from SGLang servers"):
    fastmtp distill --url http://h1:30000 --url http://h2:30000 --tokenizer T --prompts ... \\
        --out data.jsonl --with-features data.features      # then: train --features data.features

(paths in a source checkout; an installed wheel ships the Apache-2.0 ones: ``python -m
fastmtp_sglang.cli.prompt_files --train`` prints the training-prompt folder, ``python -m
fastmtp_sglang.cli.prompt_files`` the folder holding spec_bench.jsonl. The non-commercial
files, AlpacaEval's instructions and the C-Eval sample, are in the source repository only, at
bench/train_prompts/ and bench/data/)

Two engines, one output format. ``--target`` generates in this process through the serving
engine at K=0 (``fastmtp_sglang.decode.generator``: ``--batch-size`` rows decoding together,
refilled as rows finish; each sample seeded as below, sampling from exactly the distribution the
server samples from; greedy output token-identical to the server's in fp32). ``--url`` sends ``/generate``
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

Several ``--url``: each takes ``--concurrency`` requests at once, a request going to the
server with the fewest in flight; they must serve the same model. ``--with-features F`` writes
the feature cache ``fastmtp train --features F`` reads (training/features_server.py), for
``--max-len`` and ``--feature-dtype``, in the same pass: in process, from what the engine kept
as it generated (decode/capture.py: states and ``--feature-topk`` log-probabilities); with
``--url``, from the hidden states each reply carries (SGLang's ``return_hidden_states``), and
``--tokenizer`` (or the server's model_path) must then be the target's model directory, whose
config, tokenizer and weight files make the cache's key. A server that returns no hidden states
is refused with one line before anything is written.

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

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from fastmtp_sglang.serving import client
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.prompts import Prompt, render_chat
from fastmtp_sglang.training.distill_config import DistillConfig, Stats
from fastmtp_sglang.training.distill_drivers import Backend, HttpBackend, LocalBackend
from fastmtp_sglang.training.distill_filters import Excluder, ResponseFilter, eval_texts
from fastmtp_sglang.training.distill_io import (atomic_write, check_resume, load_jsonl_repair,
                                                rejected_path, stats_path)
from fastmtp_sglang.training.distill_loop import ResultWriter, run_jobs
from fastmtp_sglang.training.distill_prompts import SAMPLE_SEP, plan_jobs, read_prompts_tolerant
from fastmtp_sglang.training.features import FeatureStore, key_from_parts
from fastmtp_sglang.training.features_server import ENABLE, FeatureSink, NoHiddenStates, hidden_rows


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------

def distill(cfg: DistillConfig, log: Callable[[str], None] | None = None) -> Stats:
    """Run the distillation described by ``cfg``; returns the statistics (also written to
    ``<out>.stats.json``). Raises FastMTPError on bad arguments or an unreachable server."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    out = Path(cfg.out)
    stats = Stats(prompt_files=[str(p) for p in cfg.prompts], exclude_files=[str(p) for p in cfg.exclude])

    prompts = _select_prompts(cfg, stats, log)
    backend, target, tokenizer = _open_engine(cfg, log)
    stats.engine = backend.describe
    records, rejected = _read_output(out, stats, log)
    base_sp = cfg.sampling_params()
    check_resume(records, lambda rec: cfg.sampling_params(_sample_index(rec)), target, out,
                 lambda text: render_chat(tokenizer, text, cfg.system))
    filt = ResponseFilter(cfg.max_repeat_fraction, cfg.drop_truncated)
    for r in records:
        filt.remember(str(r.get("prompt_id")), str(r.get("response", "")))
    jobs = plan_jobs(cfg, prompts, tokenizer, base_sp, done={r["id"] for r in records},
                     done_rejected={r["id"] for r in rejected}, stats=stats)
    writer = ResultWriter(out, filt, tokenizer, target, stats, lines_in_output=len(records))
    feats = _open_features(cfg, backend, records, jobs, log) if cfg.with_features else None
    writer.features = feats.sink if feats is not None else None

    def finish() -> Stats:
        stats.lines_in_output = writer.lines_in_output
        stats.seconds = time.monotonic() - t0
        if isinstance(backend, HttpBackend):
            stats.requests_per_server = dict(backend.sent)
        atomic_write(stats_path(out), json.dumps(asdict(stats), indent=2, ensure_ascii=False) + "\n")
        return stats

    interrupted = False
    try:
        if not jobs:
            log(f"fastmtp distill: nothing to do: the {stats.samples_planned} samples planned are "
                f"all in {out} or were dropped by a filter earlier ({rejected_path(out).name})")
        else:
            run_jobs(cfg, backend, jobs, writer, stats, finish)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: run_jobs wrote the stats; publish the
        if feats is None:      # features too, then stop as asked
            raise
        interrupted = True
    finally:
        if feats is not None:
            feats.sink.close()
    if feats is not None:  # also after an abort or a stop: every line written so far has its rows
        store = feats.finish(out, tokenizer)
        stats.feature_tokens = int(store.index["tokens"])
        log(f"fastmtp distill: features of {len(store)} sequences ({stats.feature_tokens} tokens, "
            f"max_len {cfg.max_len}) in {store.path}")
        part = store.index.get("partial")
        if part:
            log(f"fastmtp distill: the cache covers {part['rows']} of the {part['of']} usable rows "
                f"(its data file: {store.index['data']}); for all of {out}: `fastmtp features "
                f"--data {out} --reuse {store.path} ...`")
    if interrupted:
        raise KeyboardInterrupt
    finish()
    if stats.aborted:
        raise FastMTPError(f"{stats.aborted}; {stats.written} samples written to {out}, rerun "
                           "the same command to resume")
    return stats


def _sample_index(rec: dict) -> int:
    """The sample index k of an output record (its id is ``<prompt id>#<k>``); 0 when absent."""
    tail = str(rec.get("id", "")).rpartition(SAMPLE_SEP)[2]
    return int(tail) if tail.isdigit() else 0


def _select_prompts(cfg: DistillConfig, stats: Stats, log: Callable[[str], None]) -> list[Prompt]:
    """The prompts to distil: read tolerantly (bad lines skipped and counted), those overlapping
    an ``--exclude`` text dropped, the first ``--limit``. Raises FastMTPError when none is left."""
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
    return prompts


@dataclass
class _Features:
    """--with-features: the sink and what the cache's key is made of."""
    sink: FeatureSink
    cfg: DistillConfig
    model_dir: str
    config: dict[str, Any]

    def finish(self, data: Path, tokenizer) -> FeatureStore:
        key = key_from_parts(self.config, tokenizer, self.model_dir, data, self.cfg.max_len, None,
                             self.cfg.feature_dtype, self.sink.topk)
        return self.sink.finish(data, key, tokenizer, int(self.config.get("vocab_size") or 0)
                                or len(tokenizer), int(self.config["hidden_size"]))


def _open_features(cfg: DistillConfig, backend: Backend, records: list[dict],
                   jobs: list, log: Callable[[str], None]) -> _Features:
    """Check everything --with-features needs before a request is sent: the target's directory
    (config, weight files: the cache's key hashes them, as `train --features` does), the cache
    path, hidden states from every server (one short request each), rows for the samples already
    in the output. Then open the sink. Raises FastMTPError with one line."""
    from fastmtp_sglang.core.target import read_target_config

    model_dir = getattr(backend, "model_dir", None) or cfg.target
    if model_dir is None:
        raise FastMTPError("--with-features needs the target's model directory (config.json, "
                           "tokenizer, weight files: the cache's key hashes them, as `fastmtp "
                           "train --features` does): give --tokenizer DIR")
    config = read_target_config(model_dir)
    if not any(Path(model_dir).glob("*.safetensors")) and not any(Path(model_dir).glob("*.bin")):
        raise FastMTPError(f"--with-features: {model_dir} has no *.safetensors or *.bin weight "
                           "files (the cache's key hashes them): give --tokenizer DIR, the "
                           "target's model directory")
    width = int(config["hidden_size"])
    sink = FeatureSink(cfg.with_features, width, cfg.feature_dtype, cfg.feature_topk)
    sink.check()
    lost = sink.missing([str(r["id"]) for r in records])
    if lost:
        log(f"fastmtp distill: {len(lost)} samples already in {cfg.out} have no hidden states in "
            f"{cfg.with_features} (written without --with-features): the cache will cover the "
            f"others; then `fastmtp features --data {cfg.out} --reuse {cfg.with_features}` "
            "computes only the missing ones")
    if jobs:
        for url in getattr(backend, "urls", ()):
            _probe_hidden(url, jobs[0].prompt_ids[:16], width, cfg.timeout)
    backend.width = width
    sink.open()
    return _Features(sink, cfg, model_dir, config)


def _probe_hidden(url: str, prompt_ids: list[int], width: int, timeout: float) -> None:
    """One two-token greedy request asking for hidden states; FastMTPError (one line) when the
    server refuses the field or returns none or the wrong rows."""
    try:
        reply = client.generate(url, input_ids=prompt_ids, timeout=min(timeout, 120),
                                sampling_params={"temperature": 0, "max_new_tokens": 2},
                                return_hidden_states=True)
        hidden_rows(reply, url, len(prompt_ids), width)
    except client.ServerError as exc:
        if 400 <= exc.status < 500:
            msg = " ".join(exc.message.split())[:200]
            raise FastMTPError(f"{url} refused return_hidden_states ({msg}): {ENABLE}") from None
        raise
    except NoHiddenStates as exc:
        raise FastMTPError(str(exc)) from None


def _open_engine(cfg: DistillConfig, log: Callable[[str], None]) -> tuple[Backend, str, Any]:
    """(the engine, the target's name written to each line, its tokenizer): the target loaded
    here with ``--target``, else the server's identity and tokenizer."""
    if cfg.target is not None:
        backend: Backend = LocalBackend(cfg, log)
        target, tokenizer = cfg.target_name or cfg.target, backend.tokenizer
    else:
        info = {}
        for url in cfg.urls:
            try:
                got = client.server_info(url, timeout=min(cfg.timeout, 60))
            except FastMTPError:
                if cfg.target_name is None or cfg.tokenizer is None:
                    raise
                continue
            if info and got.get("model_path") != info.get("model_path"):
                raise FastMTPError(f"the --url servers serve different models: {cfg.urls[0]} "
                                   f"{info.get('model_path')!r}, {url} {got.get('model_path')!r}")
            info = info or got
        target = cfg.target_name or info.get("model_path") or info.get("tokenizer_path")
        if not target:
            raise FastMTPError(f"{cfg.url}/server_info names no model_path; give --target-name")
        tokenizer = _load_tokenizer(cfg, info)
        backend = HttpBackend(cfg)
        backend.model_dir = _model_dir(cfg, info)
    return backend, target, tokenizer


def _model_dir(cfg: DistillConfig, info: dict[str, Any]) -> str | None:
    """The target's local directory: ``--tokenizer``, else the server's path when local."""
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    cand = info.get("tokenizer_path") or info.get("model_path")
    return cand if cand and Path(cand).is_dir() else None


def _load_tokenizer(cfg: DistillConfig, info: dict[str, Any]):
    """The target's tokenizer for a server run: ``--tokenizer``, else the server's
    ``tokenizer_path`` (or ``model_path``) when that is a local directory."""
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


def _read_output(out: Path, stats: Stats, log: Callable[[str], None]) -> tuple[list[dict], list[dict]]:
    """The records already in ``out`` and in its rejected file, each repaired first if a crash
    cut a line (the dropped lines logged and counted)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    records, damaged = load_jsonl_repair(out)
    stats.damaged_output_lines = damaged
    for d in damaged:
        log(f"fastmtp distill: {out}: dropped damaged {d}")
    rejected, damaged_rej = load_jsonl_repair(rejected_path(out))
    for d in damaged_rej:
        log(f"fastmtp distill: {rejected_path(out)}: dropped damaged {d}")
    return records, rejected
