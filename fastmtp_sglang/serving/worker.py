"""The reference server's engine side: the bounded queue, the loop that owns the engine and
batches, failure isolation, abort, and the /server_info and /get_model_info data (the requests
in flight and the counters are in fastmtp_sglang.serving.jobs, the answers' shape in
fastmtp_sglang.serving.responses).

``EngineWorker`` is everything of the reference server but HTTP; ``ReferenceServer``
(fastmtp_sglang.serving.app) holds one and puts FastAPI on uvicorn in front of it, through this
public face only: ``start`` (the loop on a thread of its own) or ``run`` (on the caller's),
``admit``, ``prepare_soon`` (``prepare`` on the tokenizer thread), ``submit``, ``stream_chunk``,
``abort`` / ``abort_rid`` / ``abort_all``, ``retry_after_s``, ``drain`` (refuse new requests,
abort what is left after ``shutdown_timeout_s``), ``close``, ``draining`` / ``alive``,
``server_info`` / ``model_info`` and ``stats``; each job's events come back through its ``emit``
callable.

Isolation: when the engine raises on a batch (a prefill of joining requests, or a cycle), its
open requests are run apart, in halves, each half in a batch of its own, until the request that
fails alone is found; it gets 500, every other request is answered as if nothing happened. The
halves run beside the running batch, one prefill and one cycle of each per cycle of it, so a bad
request never holds the other streams up for whole generations. A stream that had already sent
tokens resumes after them (its prompt extended by what it was sent), so a re-run cannot
contradict the client. Each request without a ``sampling_seed`` gets a random
one, so a re-run of a request that had sent nothing reproduces its tokens (in float32; see
docs/design.md section 6.3 on bf16).

Concurrency: bodies are parsed and prompts tokenized on one tokenizer thread, never on the
engine's. One loop owns the engine and batches **continuously**: between two verify cycles,
requests waiting join the running batch (``ReferenceEngine.join``: prefilled, then merged into
its slot cache) up to ``max_batch`` rows, and each row leaves it the moment it finishes and is
answered at once (``ReferenceEngine.step``). When no batch runs, the first request may wait
``batch_window_s`` for company. At most ``max_queue`` requests wait (counted from the moment
their body has arrived, so clients still sending take no place); more get 503 with
``Retry-After``. A request aborted while it waits leaves the queue at once. The loop runs on a worker
thread (``start``, as ``ReferenceServer.start`` does), or on the caller's thread (``run``: what
``ReferenceServer.serve_forever``, which ``fastmtp serve`` calls on the main thread, and
``ReferenceServer.drive`` do), where PyTorch's CPU kernels are fastest.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from http import HTTPStatus
from typing import Any, Callable

from fastmtp_sglang.decode.engine import Request, RequestError
from fastmtp_sglang.serving.info import METRIC_DEFINITIONS, is_auto, model_info, steps_info
from fastmtp_sglang.serving.hidden_states import HIDDEN_STATES_OFF, sglang_hidden_states
from fastmtp_sglang.serving.jobs import ServerStats, _Job, _rss_bytes, _Slot
from fastmtp_sglang.serving.options import ServerOptions
from fastmtp_sglang.serving.protocol import (
    BadRequest, GenerateInput, HTTPError, max_token_chars, parse_generate)
from fastmtp_sglang.serving.responses import generate_response, resumed_result, stream_event, text_delta

STOP_WORKER_S = 10.0       # after the last request is answered, how long to wait for the engine

@dataclasses.dataclass
class _Isolation:
    """Requests the engine failed on, run apart from the running batch: ``groups`` wait to be
    prefilled into a batch of their own (one group per turn of the worker loop), ``batches``
    take one cycle each per turn, beside the running batch's."""

    groups: deque = dataclasses.field(default_factory=deque)   # deque[list[_Job]]
    batches: list = dataclasses.field(default_factory=list)    # engine Batches keyed by _Job

    def rows(self) -> int:
        return sum(len(g) for g in self.groups) + sum(len(q) for q in self.batches)


# ----------------------------------------------------------------------------------------------
# the worker
# ----------------------------------------------------------------------------------------------

class EngineWorker:
    """The batching worker around one ``ReferenceEngine``, and its queue (no HTTP: see
    ``ReferenceServer`` in fastmtp_sglang.serving.app, which holds one).

    Parameters
    ----------
    engine : ReferenceEngine (anything with ``start`` / ``join`` / ``step`` / ``result`` for
        its batches, ``validate``, ``max_context``, ``steps``, ``eos_ids`` and
        ``target.tokenizer``)
    options : ServerOptions (fastmtp_sglang.serving.options); the worker uses ``max_batch``,
        ``batch_window_s``, ``max_queue``, ``shutdown_timeout_s``, ``log_requests`` and
        ``enable_return_hidden_states``, and reports them in ``server_info``
    model_path, draft_path : reported by /server_info and /get_model_info
    """

    def __init__(self, engine, options: ServerOptions | None = None, *,
                 model_path: str = "", draft_path: str | None = None):
        self.options = options = options if options is not None else ServerOptions()
        self.engine = engine
        if hasattr(engine, "rows_hint"):  # a join that grows the batch's cache makes room for all
            engine.rows_hint = options.max_batch
        self.tokenizer = getattr(engine.target, "tokenizer", None)
        self.model_path, self.draft_path = model_path, draft_path
        self.stats = ServerStats()
        self._max_token_chars = max_token_chars(self.tokenizer) if self.tokenizer is not None else 0
        self._cond = threading.Condition()  # guards everything below (an RLock inside)
        self._waiting: deque[_Job] = deque()
        self._jobs: dict[str, _Job] = {}    # rid -> job, from submit to its final event
        self._admitted = 0                  # queue slots held
        self._draining = False
        self._stop = False
        self._batch_s = 1.0                 # moving average of a request's latency (Retry-After)
        self._worker = threading.Thread(target=self._work, name="fastmtp-engine", daemon=True)
        # bodies are parsed and prompts tokenized here: one thread, so the tokenizer is never
        # shared, and never the engine's thread, so a huge prompt does not stall generation
        self._prep = ThreadPoolExecutor(1, thread_name_prefix="fastmtp-tokenize")
        self._abort_timer: threading.Timer | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine loop on a thread of its own (once)."""
        if not self._worker.is_alive():
            self._worker.start()

    def run(self, until: threading.Event | None = None) -> None:
        """Run the engine loop on the calling thread (PyTorch's CPU kernels are fastest on the
        main thread) until ``close``, or, with ``until``, until that is set and nothing is left
        to run. Not together with ``start``."""
        if self._worker.is_alive():
            raise RuntimeError("the engine loop already runs on its own thread (start())")
        self._work(until)

    def wake(self) -> None:
        """Make a loop waiting for requests look again (after setting its ``until`` event)."""
        with self._cond:
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        """Whether the loop's own thread (``start``) is running."""
        return self._worker.is_alive()

    @property
    def draining(self) -> bool:
        """True once ``drain`` or ``close`` was called: new requests are refused."""
        with self._cond:
            return self._draining

    def drain(self) -> None:
        """Refuse new requests; abort what is still in flight after ``shutdown_timeout_s``."""
        with self._cond:
            if self._draining:
                return
            self._draining = True
            n = len(self._jobs)
        if n:
            print(f"fastmtp serve: shutting down: {n} request(s) in flight get up to "
                  f"{self.options.shutdown_timeout_s:g} s to finish", file=sys.stderr, flush=True)
        self._abort_timer = threading.Timer(
            self.options.shutdown_timeout_s, self.abort_all,
            args=("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE))
        self._abort_timer.daemon = True
        self._abort_timer.start()

    def close(self) -> bool:
        """Abort anything left, stop the loop, stop the tokenizer thread; True when the loop has
        stopped (a loop inside a forward pass gets STOP_WORKER_S)."""
        with self._cond:
            self._draining = True
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        self.abort_all("the server has stopped", HTTPStatus.SERVICE_UNAVAILABLE)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._worker.is_alive():
            self._worker.join(STOP_WORKER_S)
        self._prep.shutdown(wait=False, cancel_futures=True)
        return not self._worker.is_alive()

    # -- admission and submission ---------------------------------------------------------------
    def retry_after_s(self) -> int:
        """Seconds a turned-away client should wait: a recent request's latency for every
        ``max_batch`` requests ahead of it."""
        with self._cond:
            ahead = len(self._waiting) // self.options.max_batch + 1
            return int(min(60, max(1, math.ceil(self._batch_s * ahead))))

    def _busy(self, message: str) -> HTTPError:
        self.stats.add(busy=1)
        return HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, message,
                         {"Retry-After": str(self.retry_after_s())})

    def admit(self) -> _Slot:
        """Take a queue slot for a request whose body has been read (a client still sending
        holds a connection, not a place in the queue), or raise HTTPError 503."""
        with self._cond:
            if self._draining:
                raise self._busy("the server is shutting down; retry (on another replica)")
            if self._admitted >= self.options.max_queue:
                raise self._busy(f"the server is busy: {self._admitted} requests are waiting "
                                 f"(--max-queue {self.options.max_queue}); retry later")
            self._admitted += 1
            return _Slot(self._free_place)

    def _free_place(self) -> None:
        with self._cond:
            self._admitted -= 1

    def prepare_soon(self, body: bytes) -> Future:
        """``prepare(body)`` on the tokenizer thread; a Future of its result (the HTTP side
        awaits it with ``asyncio.wrap_future``)."""
        return self._prep.submit(self.prepare, body)

    def prepare(self, body: bytes) -> tuple[GenerateInput, list[int]]:
        """Parse, tokenize and check one /generate body (on the tokenizer thread).

        Raises BadRequest. A text prompt that is surely too long (from its length in characters)
        is refused before the tokenizer sees it."""
        inp = parse_generate(body)
        if inp.return_hidden_states and not self.options.enable_return_hidden_states:
            raise BadRequest(HIDDEN_STATES_OFF)
        if inp.text is not None:
            if self.tokenizer is None:
                raise BadRequest("this server's target has no tokenizer: send 'input_ids'")
            if self._max_token_chars:
                floor = len(inp.text) // (2 * self._max_token_chars)
                if floor + 1 > self.engine.max_context:
                    raise BadRequest(
                        f"the prompt has {len(inp.text)} characters, so at least {floor} tokens; "
                        f"this engine's context is {self.engine.max_context} tokens: shorten the "
                        "prompt")
            ids = list(self.tokenizer(inp.text)["input_ids"])
        else:
            ids = list(inp.input_ids)
        try:
            self.engine.validate(Request(ids, inp.params, inp.rid))
        except RequestError as exc:
            raise BadRequest(str(exc)) from None
        # One rule, SGLang's: prompt + max_new_tokens must fit the context, else 400 saying the
        # room left (never a silent cut at the context: the answer would end "length" early)
        n, ctx = inp.params.max_new_tokens, self.engine.max_context
        if len(ids) + n > ctx:
            shown = n if n < 10**12 else f"a {len(str(n))}-digit number"
            raise BadRequest(
                f"sampling_params['max_new_tokens'] is {shown} and the prompt has {len(ids)} "
                f"tokens; this server's context is {ctx} tokens (prompt + output), so "
                f"{ctx - len(ids)} new tokens fit: lower max_new_tokens to at most "
                f"{ctx - len(ids)} (it is 128 when the request gives none), or shorten the prompt")
        if inp.params.seed is None:  # so a re-run after an engine failure samples the same tokens
            inp.params.seed = secrets.randbits(62)
        return inp, ids

    def submit(self, inp: GenerateInput, input_ids: list[int], emit: Callable[[str, Any], None],
               slot: _Slot | None = None, internal: bool = False) -> _Job:
        """Queue a prepared request for the worker. Raises BadRequest for a rid already in
        flight, HTTPError 503 while shutting down."""
        job = _Job(inp, input_ids, time.time(), emit, slot, internal)
        with self._cond:
            if self._draining:
                raise self._busy("the server is shutting down; retry (on another replica)")
            if inp.rid in self._jobs:
                raise BadRequest(f"rid {inp.rid!r} is already in flight; give each request its "
                                 "own rid")
            self._jobs[inp.rid] = job
            self._waiting.append(job)
            job.queued = True
            self._cond.notify_all()
        return job

    # -- ending a request -------------------------------------------------------------------------
    def _finish(self, job: _Job, kind: str, payload: Any, count=None) -> bool:
        """Send a job's final event (once); False when it had already ended. ``count()`` runs,
        and the job leaves the in-flight set, before the event is sent: /server_info never lags
        an answer a client has (closed under the lock: no other event follows it)."""
        with job.lock:
            if job.closed:
                return False
            job.closed = True
            if count is not None and not job.internal:
                count()
        self._forget(job)
        job.emit(kind, payload)
        return True

    def _forget(self, job: _Job) -> None:
        with self._cond:
            if self._jobs.get(job.inp.rid) is job:
                del self._jobs[job.inp.rid]
            if job.queued:  # aborted while waiting: out of the queue now, not when it is reached
                job.queued = False
                self._waiting.remove(job)
        if job.slot is not None:
            job.slot.release()

    def abort(self, job: _Job, message: str, status: int = HTTPStatus.OK) -> bool:
        """End a request now with finish reason abort and what it has generated so far.

        ``status`` is the HTTP status it gets if nothing has been sent yet: 200 (SGLang's, for
        /abort_request) or 503 (shutdown: the client should retry). A running row leaves its
        batch at the next verification cycle."""
        with job.lock:
            if job.closed:
                return False
            job.closed = True  # from here on the worker sends nothing more for it
            if job.req is not None:
                # the engine checks max_new_tokens after every token it appends to a row, so a
                # limit of 0 finishes the row at its next cycle (engine.py, _emit)
                job.req.params.max_new_tokens = 0
            ids = list(job.streamed_ids if job.inp.stream else job.out_ids)
        partial = {
            "text": self._decode(ids), "output_ids": ids,
            "meta_info": {"id": job.inp.rid, "finish_reason": {"type": "abort", "message": message},
                          "prompt_tokens": len(job.input_ids), "completion_tokens": len(ids),
                          "cached_tokens": 0, "e2e_latency": time.time() - job.received},
        }
        if not job.internal:  # (counted before the answer leaves: see _finish)
            self.stats.add(aborted=1)
        self._forget(job)
        job.emit("aborted", (int(status), partial))
        if self.options.log_requests and not job.internal:
            print(f"[fastmtp serve] {job.inp.rid}: aborted after {len(ids)} tokens ({message})",
                  file=sys.stderr, flush=True)
        return True

    def abort_rid(self, rid: str, message: str = "aborted by /abort_request") -> int:
        with self._cond:
            job = self._jobs.get(rid)
        return int(job is not None and self.abort(job, message))

    def abort_all(self, message: str = "aborted by /abort_request",
                  status: int = HTTPStatus.OK) -> int:
        with self._cond:
            jobs = list(self._jobs.values())
        return sum(self.abort(job, message, status) for job in jobs)

    # -- the worker -------------------------------------------------------------------------------
    def _work(self, until: threading.Event | None = None) -> None:
        """The engine loop (continuous batching): between two verify cycles, waiting requests
        join the running batch up to ``max_batch`` rows; finished rows leave it and are
        answered at once. Requests the engine failed on run apart meanwhile, in batches of
        their own that take one cycle each per turn of the loop (``_Isolation``). Runs on the
        worker thread, or on the caller's (``serve_forever``, ``drive``: then it also returns
        once ``until`` is set and nothing is left to run)."""
        b = None  # the running engine batch (fastmtp_sglang.decode.batch.Batch), keyed by job
        iso = _Isolation()
        while True:
            live = (len(b) if b is not None else 0) + iso.rows()
            with self._cond:
                def over() -> bool:
                    return self._stop or (until is not None and until.is_set())

                while not self._waiting and not over() and not live:
                    self._cond.wait(1.0)  # (a timeout: signal handlers on the main thread run)
                if over() and not self._waiting and not live:
                    return
                if not live:  # a fresh batch: optionally wait for company
                    deadline = time.monotonic() + self.options.batch_window_s
                    while len(self._waiting) < self.options.max_batch and not self._stop:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                jobs = []
                while self._waiting and live + len(jobs) < self.options.max_batch:
                    job = self._waiting.popleft()
                    job.queued = False
                    if job.slot is not None:
                        job.slot.release()  # running now: its queue place goes to the next one
                    if not job.closed:
                        jobs.append(job)
            jobs = [job for job in jobs if job.send("accepted")]
            try:
                if jobs:
                    b = self._join(b, jobs, iso)
                if iso.groups:  # one group of suspects starts apart per turn (one prefill)
                    self._start_apart(iso.groups.popleft(), iso)
                if b is not None and len(b):
                    b = self._cycle(b, iso)
                # a batch run apart that fails is dropped (its requests are suspects again)
                iso.batches = [q for q in iso.batches
                               if len(q) and self._cycle(q, iso, apart=True) is not None and len(q)]
            except Exception as exc:  # a bug outside the engine: fail what runs, keep serving
                traceback.print_exc(file=sys.stderr)
                running = [r.key for q in [b, *iso.batches] if q is not None for r in q.rows]
                for job in jobs + running + [j for g in iso.groups for j in g]:
                    self._fail(job, HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
                b, iso = None, _Isolation()

    def _on_tokens(self, job: _Job, new: list[int]) -> None:
        self.stats.add(generated_tokens=len(new))
        with job.lock:
            job.out_ids.extend(new)
            if job.inp.stream and not job.closed:
                self._stream_chunk(job)

    def _join(self, b, jobs: list[_Job], iso: "_Isolation"):
        """Prefill ``jobs`` into the running batch ``b`` (or a new one); returns the batch. When
        the engine fails there, ``b`` goes on (joining changes it all or nothing) and the joiners
        become suspects, run apart (``_suspect``) while ``b`` keeps its cycles."""
        jobs = [job for job in jobs if self._needs_engine(job)]
        if not jobs:
            return b
        reqs = [job.req for job in jobs]
        failure = None
        try:
            if b is None or not len(b):
                b = self.engine.start(reqs, jobs, self._on_tokens)
            else:
                self.engine.join(b, reqs, jobs, self._on_tokens)
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._suspect(jobs, failure, iso)
            return b
        self.stats.add_batch(len(b))
        return b

    def _cycle(self, b, iso: "_Isolation", apart: bool = False):
        """One verify cycle of batch ``b``; answers the rows that finished; returns ``b``. When
        the engine fails, rows it had finished are answered and every other open request of the
        batch becomes a suspect (``_suspect``; ``apart``: ``b`` is a batch of suspects), each
        stream to resume after what it had sent; returns None then."""
        try:
            finished = self.engine.step(b, self._on_tokens)
        except Exception as exc:
            failure = exc
        else:
            failure = None
        if failure is not None:
            open_jobs = []
            for r in b.rows:
                if r.finish is not None:  # done before the fault: its answer stands
                    self._answer_safely(r.key, lambda r=r: self.engine.result(r), len(b))
                else:
                    open_jobs.append(r.key)
            self._suspect(open_jobs, failure, iso, alone=apart and len(open_jobs) == 1)
            return None
        for job, res in finished:
            self._answer_safely(job, lambda res=res: res, len(b) + len(finished))
        return b

    def _answer_safely(self, job: _Job, result, batch: int) -> None:
        """Answer one job from ``result()``; a failure there fails this job alone."""
        try:
            self._answer(job, result(), batch)
        except Exception as exc:  # a bug in building one answer: the others still get theirs
            traceback.print_exc(file=sys.stderr)
            self._fail(job, HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def _suspect(self, jobs: list[_Job], exc: BaseException, iso: "_Isolation",
                 alone: bool = False) -> None:
        """The engine failed on a batch (or a prefill) holding ``jobs``. ``alone``: it held one
        request, already run apart: that request gets the error. Otherwise each open request is
        run apart, several in halves (``iso.groups``, started one per turn of the loop), so only
        a request that fails alone gets the error and the running batch is never held up by
        more than one prefill per cycle (it had been, by whole ``generate`` calls)."""
        live = [job for job in jobs if not job.closed]
        if alone:
            for job in live:
                self._fail_engine(job, exc)
            return
        if len(live) > 1:
            self.stats.add(retried_batches=1)
            print(f"fastmtp serve: the engine failed on a batch of {len(jobs)} "
                  f"({type(exc).__name__}: {exc}); running its {len(live)} open request(s) apart, "
                  "in halves, to find the one that caused it", file=sys.stderr, flush=True)
            half = (len(live) + 1) // 2
            iso.groups.extend([live[:half], live[half:]])
        elif live:
            iso.groups.append(live)

    def _start_apart(self, group: list[_Job], iso: "_Isolation") -> None:
        """Prefill a group of suspects into a batch of its own (``iso.batches``); the loop runs
        its cycles beside the running batch's. When the prefill fails, the group is split again
        (``_suspect``); a request alone in it gets the error."""
        jobs = [job for job in group if not job.closed and self._needs_engine(job)]
        if not jobs:
            return
        # a batch of suspects stays small: no room for max_batch rows (the engine's rows_hint)
        hint = getattr(self.engine, "rows_hint", None)
        if hint is not None:
            self.engine.rows_hint = 0
        failure = None
        try:
            q = self.engine.start([job.req for job in jobs], jobs, self._on_tokens)
        except Exception as exc:
            failure = exc
        finally:
            if hint is not None:
                self.engine.rows_hint = hint
        if failure is not None:
            self._suspect(jobs, failure, iso, alone=len(jobs) == 1)
            return
        self.stats.add_batch(len(q))
        iso.batches.append(q)

    def _fail(self, job: _Job, status: int, message: str) -> None:
        self._finish(job, "error", (int(status), message), count=lambda: self.stats.add(failed=1))

    def _fail_engine(self, job: _Job, exc: BaseException) -> None:
        traceback.print_exception(exc, file=sys.stderr)
        self._fail(job, HTTPStatus.INTERNAL_SERVER_ERROR,
                   f"the engine failed on this request: {type(exc).__name__}: {exc}")

    def _needs_engine(self, job: _Job) -> bool:
        """Prepare a job's next run (``job.req``); False when it needs none: the output its
        stream already sent is complete (a re-run after a fault), and it was answered here."""
        self._new_run(job)
        done = self._finished_prefix(job)
        if done is None:
            return True
        from fastmtp_sglang.decode.engine import Result
        from fastmtp_sglang.decode.metrics import RequestMetrics

        ids = job.prefix
        self._answer_safely(job, lambda: Result([], self._decode(ids), done, RequestMetrics(
            prompt_tokens=len(job.input_ids), steps=self.engine.steps), job.inp.rid), 1)
        return False

    def _finished_prefix(self, job: _Job) -> dict[str, Any] | None:
        """The finish reason of what a resumed stream has already sent, or None if it goes on."""
        ids, p = job.prefix, job.inp.params
        if not ids:
            return None
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.engine.eos_ids))
        if ids[-1] in stop_ids:
            return {"type": "stop", "matched": ids[-1]}
        text = self._decode(ids)
        hit = [s for s in (p.stop or []) if s in text]
        if hit:
            return {"type": "stop", "matched": hit[0], "matched_str": hit[0]}
        if len(ids) >= p.max_new_tokens or len(job.input_ids) + len(ids) >= self.engine.max_context:
            return {"type": "length", "length": len(ids)}
        return None

    def _new_run(self, job: _Job) -> Request:
        """The engine request of a job's next run. A stream that has already sent tokens (its
        batch failed and is re-run) resumes after them: the prompt is extended by what was sent
        and the budget shrinks by it, so nothing the client saw is contradicted."""
        with job.lock:
            params = dataclasses.replace(job.inp.params)  # a fresh copy: an abort lowers its limit
            job.prefix = list(job.streamed_ids) if job.inp.stream else []
            job.out_ids = list(job.prefix)
            if job.prefix:
                params.max_new_tokens = max(params.max_new_tokens - len(job.prefix), 1)
            # return_hidden_states: the engine keeps the states it computes (decode/capture.py)
            job.req = Request(job.input_ids + job.prefix, params, job.inp.rid,
                              features=0 if job.inp.return_hidden_states else None)
            if job.closed:  # aborted while we were getting here: stop at once
                job.req.params.max_new_tokens = 0
        return job.req

    def _answer(self, job: _Job, res, batch: int) -> None:
        if job.prefix:  # a resumed stream: its answer is what was sent and what followed
            res = resumed_result(job, res, self._decode)
        out = generate_response(job, res, auto=self.auto)
        if job.inp.return_hidden_states:  # SGLang's rows (serving/hidden_states.py)
            out["meta_info"]["hidden_states"] = sglang_hidden_states(
                self.engine.model, job.input_ids, out["output_ids"], res.features)
        acc = [c.accepted for c in res.metrics.cycles]
        if not self._finish(job, "done", out, count=lambda: self.stats.add_result(
                len(job.input_ids), len(res.output_ids), acc)) or job.internal:
            return
        with self._cond:
            self._batch_s = 0.7 * self._batch_s + 0.3 * (time.time() - job.received)
        if self.options.log_requests:
            mi = out["meta_info"]
            print(f"[fastmtp serve] {job.inp.rid}: {mi['prompt_tokens']} prompt + "
                  f"{mi['completion_tokens']} new tokens, tau {mi['tau']:.2f}, "
                  f"{mi['e2e_latency']:.2f} s, batch of {batch}", file=sys.stderr, flush=True)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stream_chunk(self, job: _Job) -> None:
        """Add a stream's new tokens to what the client sees (job.lock held) and tell its
        coroutine, unless a ``chunk`` event is already on its way (it takes the newest output,
        ``stream_chunk``). A re-run after an engine failure stays quiet until it has passed what
        the client was already given."""
        ids, n = job.out_ids, len(job.streamed_ids)
        if len(ids) <= n:
            return  # (a resumed run's output starts with streamed_ids: see _new_run)
        job.streamed_ids.extend(ids[n:])
        job.stream_text += text_delta(job, self._decode)
        if not job.chunk_pending:
            job.chunk_pending = True
            job.emit("chunk", None)

    def stream_chunk(self, job: _Job) -> dict[str, Any] | None:
        """The cumulative event of a stream's output so far (for the HTTP side, when it can send
        it); None once the job has ended (its final event follows)."""
        return stream_event(job)

    # -- info -----------------------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        stats = self.stats.snapshot()
        with self._cond:
            waiting = len(self._waiting)
            in_flight, admitted, draining = len(self._jobs), self._admitted, self._draining
        return {
            "engine": "reference",
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "speculative_draft_model_path": self.draft_path,
            "speculative_algorithm": "EAGLE" if self.engine.steps else None,
            # SGLang's fields; with speculative_adaptive (--steps auto) they hold the largest K,
            # as SGLang's adaptive mode does: K itself changes every cycle (steps_range)
            "speculative_num_steps": self.engine.steps,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": self.engine.steps + 1,
            "speculative_adaptive": self.auto,
            **self.steps_info(),
            "max_batch": self.options.max_batch,
            "enable_return_hidden_states": self.options.enable_return_hidden_states,
            "batch_window_s": self.options.batch_window_s,
            "context_length": self.engine.max_context,
            "max_queue": self.options.max_queue,
            "queued": waiting,
            "admitted": admitted,
            "requests_in_flight": in_flight,
            "draining": draining,
            "rss_bytes": _rss_bytes(),
            **stats,
            "tau": stats["avg_spec_accept_length"],
            # where SGLang's /get_server_info puts it, for clients written against SGLang
            "internal_states": [{"avg_spec_accept_length": stats["avg_spec_accept_length"]}],
            "metric_definitions": METRIC_DEFINITIONS,
        }

    @property
    def auto(self) -> bool:
        """Whether the engine picks K per cycle (``--steps auto``)."""
        return is_auto(self.engine)

    def steps_info(self) -> dict[str, Any]:
        return steps_info(self.engine)

    def model_info(self) -> dict[str, Any]:
        return model_info(self.engine, self.model_path, self.draft_path)
