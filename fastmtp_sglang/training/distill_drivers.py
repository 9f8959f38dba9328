"""The engines `fastmtp distill` generates with: a server over HTTP (``/generate`` requests with
retries, ``--concurrency`` of them at once on a thread pool) or the target in this process
(the serving engine at K=0 fed from a queue, fastmtp_sglang.decode.generator, ``--batch-size``
rows at once). Both answer a job with a Future of a server-shaped reply."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from fastmtp_sglang.serving import client
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.distill_prompts import Job

if TYPE_CHECKING:
    from fastmtp_sglang.training.distill_config import DistillConfig

MAX_BACKOFF_S = 60.0


# ----------------------------------------------------------------------------------------------
# requests
# ----------------------------------------------------------------------------------------------

class Refused(Exception):
    """The server refused the request (4xx): not worth retrying."""


class Unreachable(Exception):
    """The server could not be reached after all retries."""


class GeneratorStopped(Exception):
    """The in-process generator failed as a whole (not one request's fault)."""


def request_with_retries(url: str, job: Job, retries: int, backoff: float, timeout: float,
                         sleep: Callable[[float], None] = time.sleep,
                         hidden: bool = False) -> tuple[dict, int]:
    """(the server's reply, retries used). Raises Refused on 4xx (but 408 / 429, which are
    retried), Unreachable when the connection kept failing, ServerError on a lasting 5xx.
    ``hidden``: ask for the target's hidden states too (SGLang's ``return_hidden_states``)."""
    attempt = 0
    while True:
        try:
            out = client.generate(url, input_ids=job.prompt_ids,
                                  sampling_params=job.sampling_params, timeout=timeout,
                                  return_hidden_states=hidden)
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
# engines: a server over HTTP, or the serving engine in this process
# ----------------------------------------------------------------------------------------------

class Backend:
    """An engine: jobs in, Futures of server-shaped replies out."""

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


class HttpBackend(Backend):
    """One server, or several: ``cfg.concurrency`` requests in flight on each, a request going to
    the server with the fewest in flight (on a tie, the one sent fewest), so a faster server
    takes more, and the second request of a run always goes to a second server.
    ``width``: also ask for the hidden states and check they are [P + N - 1, width]; the rows
    come back as ``reply["hidden"]`` (features_server.hidden_rows), NoHiddenStates otherwise."""

    def __init__(self, cfg: DistillConfig, width: int | None = None):
        import threading

        self.cfg, self.width = cfg, width
        self.urls = list(cfg.urls or (cfg.url,))
        n = len(self.urls)
        self.window = 2 * cfg.concurrency * n
        self.pool = ThreadPoolExecutor(cfg.concurrency * n, thread_name_prefix="distill")
        self.in_flight = {u: 0 for u in self.urls}
        self.sent = {u: 0 for u in self.urls}
        self._lock = threading.Lock()
        self.model_dir: str | None = None  # the target's local directory, when known
        self.describe = (f"server {cfg.url}, {cfg.concurrency} requests in flight" if n == 1 else
                         f"{n} servers ({', '.join(self.urls)}), {cfg.concurrency} requests in "
                         "flight each")

    def submit(self, job: Job) -> Future:
        with self._lock:
            url = min(self.urls, key=lambda u: (self.in_flight[u], self.sent[u]))
            self.in_flight[url] += 1
            self.sent[url] += 1
        fut = self.pool.submit(self._ask, url, job)
        fut.add_done_callback(lambda _f, u=url: self._done(u))
        return fut

    def _done(self, url: str) -> None:
        with self._lock:
            self.in_flight[url] -= 1

    def _ask(self, url: str, job: Job) -> tuple[dict, int]:
        from fastmtp_sglang.training.distill_filters import finish_type
        from fastmtp_sglang.training.features import FEATURE_DTYPES
        from fastmtp_sglang.training.features_server import hidden_rows

        c = self.cfg
        reply, used = request_with_retries(url, job, c.retries, c.backoff, c.timeout,
                                           hidden=self.width is not None)
        if self.width is not None:
            meta = reply.get("meta_info") or {}
            if finish_type(meta.get("finish_reason")) != "abort":  # an abort is not written
                rows = hidden_rows(reply, url, len(job.prompt_ids), self.width)
                # in the cache's dtype at once: replies wait here behind slower ones
                reply["hidden"] = rows.to(FEATURE_DTYPES[c.feature_dtype])
            meta.pop("hidden_states", None)
        return reply, used

    def shutdown(self, wait: bool) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=True)


class LocalBackend(Backend):
    """The target in this process, ``batch_size`` rows decoding at once through the serving
    engine at K=0 (fastmtp_sglang.decode.generator)."""

    def __init__(self, cfg: DistillConfig, log: Callable[[str], None]):
        from fastmtp_sglang.core.target import load_target

        log(f"fastmtp distill: loading {cfg.target} ({cfg.dtype}) for in-process generation")
        self.t = load_target(cfg.target, dtype=cfg.dtype)
        self.tokenizer = self.t.tokenizer
        if self.tokenizer is None:
            raise FastMTPError(f"target {cfg.target} has no tokenizer")
        self.cfg, self.log = cfg, log
        # --with-features: each request keeps its states and this many top-k (decode/capture.py)
        self.features = cfg.feature_topk if cfg.with_features else None
        self.window = 2 * cfg.batch_size
        self.describe = f"in-process {cfg.target}, {cfg.dtype}, batch {cfg.batch_size}"
        self.worker = None
        self.on_main_thread = True

    def prepare(self, jobs: list[Job]) -> None:
        from fastmtp_sglang.cpu_kernels import decode_attention
        from fastmtp_sglang.decode.batch import REPACK_SLACK
        from fastmtp_sglang.decode.engine import ReferenceEngine
        from fastmtp_sglang.decode.generator import QueueGenerator, kv_cache_bytes
        from fastmtp_sglang.decode.slot_cache import SLACK

        if not jobs:
            return
        max_pos = int(self.t.config.get("max_position_embeddings", 4096))
        # positions a row may hold: the longest prompt of the run plus the response, plus the
        # cache's free room and the holes a running batch carries before it repacks
        # (decode/slot_cache.py, decode/batch.py); a prompt longer than the context is refused
        # per request by the engine
        max_len = min(max_pos, max(len(j.prompt_ids) for j in jobs) + self.cfg.max_new_tokens + 1)
        need = kv_cache_bytes(self.t.model.config, self.cfg.batch_size, max_len + SLACK + REPACK_SLACK,
                              next(self.t.model.parameters()).element_size())
        avail = _available_memory()
        if avail is not None and need > 0.7 * avail:
            raise FastMTPError(
                f"the KV cache for --batch-size {self.cfg.batch_size} x {max_len} positions needs "
                f"{need / 2**30:.1f} GiB and {avail / 2**30:.1f} GiB are available: lower "
                "--batch-size or --max-new-tokens")
        engine = ReferenceEngine(self.t, None, 0)
        self.gen = QueueGenerator(engine, self.cfg.batch_size)
        bf16 = str(next(self.t.model.parameters()).dtype) == "torch.bfloat16"
        fast_attn = engine.lean is not None and bf16 and decode_attention.available()
        self.log(f"fastmtp distill: {self.cfg.batch_size} rows through the reference engine at K=0 "
                 f"(prepared weights {'on' if engine.packed else 'off'}, lean forward "
                 f"{'on' if engine.lean is not None else 'off'}, decode attention "
                 f"{'one-pass kernel' if fast_attn else 'PyTorch'}), "
                 f"KV cache up to {need / 2**30:.2f} GiB")
        self.worker = self.gen.worker()  # run() on the main thread, see distill_loop.run_jobs

    def run(self) -> None:
        if self.worker is not None:
            self.worker.run()

    def submit(self, job: Job) -> Future:
        from fastmtp_sglang.decode.generator import GenRequest
        from fastmtp_sglang.decode.sampling import SamplingParams

        outer: Future = Future()
        try:
            params = SamplingParams.from_dict(dict(job.sampling_params))
            inner = self.worker.submit(GenRequest(job.prompt_ids, params, features=self.features))
        except RuntimeError as exc:
            raise GeneratorStopped(str(exc)) from None
        except ValueError as exc:
            outer.set_exception(Refused(str(exc)))
            return outer

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is None:
                r = f.result()
                reply = {"text": self.tokenizer.decode(r.output_ids, skip_special_tokens=True),
                         "output_ids": r.output_ids,
                         "meta_info": {"finish_reason": r.finish_reason,
                                       "completion_tokens": len(r.output_ids)}}
                if r.features is not None:  # --with-features: the engine kept them (capture.py)
                    reply["hidden"] = r.features[0]
                    if r.features[1] is not None:
                        reply["topk"] = r.features[1:]
                outer.set_result((reply, 0))
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
