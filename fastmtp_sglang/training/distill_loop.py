"""The run loop of `fastmtp distill`: requests in flight on an engine, and each result handled
(filtered, then written to the output or the rejected file) in job order, so what the files hold
does not depend on timing."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from fastmtp_sglang.serving import client
from fastmtp_sglang.training.distill_drivers import Backend, GeneratorStopped, Refused, Unreachable
from fastmtp_sglang.training.distill_filters import ResponseFilter, finish_type, is_truncated
from fastmtp_sglang.training.distill_io import rejected_path
from fastmtp_sglang.training.distill_prompts import Job
from fastmtp_sglang.training.features_server import NoHiddenStates

if TYPE_CHECKING:
    from fastmtp_sglang.training.distill_config import DistillConfig, Stats


def _record(job: Job, out: dict, tokenizer, target: str, stats: Stats) -> dict[str, Any]:
    """The output line for one server-shaped reply (``output_ids`` tokenized from the text when
    the reply has none, counted in ``stats``)."""
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


class ResultWriter:
    """What becomes of each result, called in job order: counted (refused, failed, aborted by the
    server), dropped by a filter (a line in the rejected file) or kept (a line in the output)."""

    def __init__(self, out: Path, filt: ResponseFilter, tokenizer, target: str, stats: Stats,
                 lines_in_output: int):
        self.out, self.filt, self.tokenizer, self.target = out, filt, tokenizer, target
        self.stats = stats
        self.lines_in_output = lines_in_output
        self.listed_refused: set[str] = set()
        self.fout = self.frej = None  # the output and rejected files, open while run_jobs runs
        self.features = None  # --with-features: a features_server.FeatureSink, open

    def handle(self, job: Job, kind: str, payload: Any) -> None:
        if kind in ("refused", "skipped"):  # skipped: a sibling sample of a refused prompt
            self.stats.refused += 1
            if kind == "refused" and job.prompt.id not in self.listed_refused:
                self.listed_refused.add(job.prompt.id)
                self.stats.refused_list.append(f"{job.prompt.id}: {payload}")
            return
        if kind == "failed":
            self.stats.failed += 1
            self.stats.failed_list.append(f"{job.id}: {payload}")
            return
        reply, used = payload
        self.stats.retries += used
        rec = _record(job, reply, self.tokenizer, self.target, self.stats)
        if finish_type(rec["finish_reason"]) == "abort":  # cut off by the server (shutdown,
            self.stats.failed += 1                           # /abort_request): asked again next run
            self.stats.failed_list.append(f"{job.id}: aborted by the server after "
                                          f"{len(rec['response_ids'])} tokens")
            return
        truncated = is_truncated(rec["finish_reason"])
        self.stats.truncated += truncated
        why = self.filt.reason(job.prompt.id, rec["response"], rec["response_ids"],
                               rec["finish_reason"])
        if why is not None:
            self.stats.dropped[why] += 1
            self.frej.write(json.dumps({"id": job.id, "prompt_id": job.prompt.id, "reason": why,
                                        "response": rec["response"]}, ensure_ascii=False) + "\n")
            self.frej.flush()
            return
        self.stats.truncated_kept += truncated
        if self.features is not None:  # the rows first: every line of the output has its rows
            self.features.add(job.id, reply["hidden"], reply.get("topk"))
        self.fout.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.fout.flush()
        self.stats.written += 1
        self.lines_in_output += 1
        self.stats.completion_tokens += rec["completion_tokens"]


def run_jobs(cfg: DistillConfig, backend: Backend, jobs: list[Job], writer: ResultWriter,
             stats: Stats, finish: Callable[[], Stats]) -> None:
    """Ask ``backend`` for every job and hand each result to ``writer``, in job order. Sets
    ``stats.aborted`` when the server became unreachable or the in-process generator failed; on
    Ctrl-C (or SIGTERM, see the command) writes the statistics (``finish``) and re-raises."""
    from tqdm import tqdm

    # Requests run concurrently, but results are handled (filtered, written) in job order, so
    # the output's order, and which of two identical samples is kept (the lower index), do not
    # depend on timing. Bounded: `window` requests in flight, at most 4 windows of finished
    # results waiting behind a slow one.
    window = backend.window
    pending: dict[Future, int] = {}
    results: dict[int, tuple[str, Any]] = {}
    refused_prompts: set[str] = set()

    backend.prepare(jobs)
    t_gen = time.monotonic()

    def drive() -> None:
        with open(writer.out, "a", encoding="utf-8") as writer.fout, \
                open(rejected_path(writer.out), "a", encoding="utf-8") as writer.frej, \
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
                            except (GeneratorStopped, NoHiddenStates):
                                raise
                    while next_write in results:
                        writer.handle(jobs[next_write], *results.pop(next_write))
                        next_write += 1
                        bar.update(1)
                        stats.generate_seconds = time.monotonic() - t_gen
                    bar.set_postfix(written=stats.written, dropped=sum(stats.dropped.values()),
                                    refused=stats.refused, refresh=False)
            except Unreachable as exc:
                who = cfg.url if len(cfg.urls) <= 1 else "a server"
                stats.aborted = f"{who} unreachable after {cfg.retries} retries: {exc}"
            except (GeneratorStopped, NoHiddenStates) as exc:
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
        # decode.generator.GenWorker); submitting and writing run beside it on a thread of their own
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
