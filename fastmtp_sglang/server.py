"""An SGLang-compatible HTTP server around the reference engine (CPU serving, and the oracle).

Run it with ``fastmtp serve --engine reference --target T --draft D --steps K --port P``.

Endpoints (the shapes of SGLang's native API, so one client serves both):

- ``POST /generate``: ``{"text": str | "input_ids": [int], "sampling_params": {...},
  "stream": bool, "rid": str}`` -> ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "spec_verify_ct", "spec_accept_length",
  "e2e_latency", ...}}``. ``meta_info`` also carries our own acceptance metrics: ``tau``
  (emitted tokens per verification, prefill token excluded), ``A_k``, ``a_k``, ``accept_hist``
  and the time split (``prefill_s``, ``decode_s``, ``draft_s``, ``verify_s``,
  ``decode_tokens_per_s``). With ``"stream": true`` the reply is server-sent events, one
  ``data: {json}\\n\\n`` per verification cycle with the *cumulative* text and output ids (SGLang's
  default), the last one carrying the finish reason and metrics, then ``data: [DONE]\\n\\n``.
- ``GET /health`` (``OK``), ``GET /health_generate`` (runs a one-token generation),
  ``GET /server_info`` (alias ``/get_server_info``), ``GET /get_model_info``.

SGLang compatibility decisions:

- Text is tokenized as SGLang's tokenizer manager does it: ``tokenizer(text)`` with the
  tokenizer's defaults, so a BOS is added when the tokenizer adds one. No chat template is
  applied: clients do that.
- ``sampling_params`` without ``temperature`` (or with ``null``) samples at temperature 1.0, as
  SGLang does; send ``"temperature": 0`` for greedy.
- ``spec_accept_length`` is ``completion_tokens / spec_verify_ct`` as SGLang computes it (the
  prefill token counts in the numerator, so it sits slightly above ``tau``); 0 when no
  verification ran. ``avg_spec_accept_length`` in ``/server_info`` is pooled over every
  verification cycle served (accepted + 1 per cycle), as SGLang's scheduler counts it.
- A prompt that fills the context is refused with 400 (SGLang does too); a prompt that fits but
  whose ``max_new_tokens`` would overflow the context is cut at the context with finish reason
  ``length`` (SGLang refuses it).

Errors: malformed JSON, a bad field, a bad sampling parameter or a prompt longer than the context
give HTTP 400 ``{"error": {"message": ...}}`` and the server keeps serving. An exception inside
the engine fails the requests of that batch with 500 and the worker continues.

Concurrency: requests are **batched**. One worker thread owns the engine; HTTP handler threads
put requests on a queue. The worker takes the first waiting request, then everything else
already waiting (after an optional ``batch_window_s`` wait for more), up to ``max_batch``, and
runs one ``ReferenceEngine.generate`` call over that batch. A request arriving while a batch runs
waits for the next batch (no continuous batching: a batch runs until all its rows finish).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fastmtp_sglang.engine import Request, RequestError
from fastmtp_sglang.sampling import SamplingParams

# Top-level /generate fields we act on; SGLang has many more. Fields that only change logging or
# scheduling are ignored whatever their value; fields that would change the reply are accepted
# only at SGLang's default (null / false / 0 / empty, or the value listed), so a request never
# silently loses a feature it asked for. Anything else is refused with 400.
GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "rid")
IGNORED_FIELDS = ("log_metrics", "priority", "background", "extra_key", "data_parallel_rank",
                  "bootstrap_host", "bootstrap_port", "bootstrap_room", "return_text_in_logprobs")
DEFAULT_ONLY_FIELDS = {
    "return_logprob": None, "logprob_start_len": -1, "top_logprobs_num": None,
    "token_ids_logprob": None, "lora_path": None, "image_data": None, "audio_data": None,
    "video_data": None, "modalities": None, "session_params": None,
    "custom_logit_processor": None, "return_hidden_states": None, "input_embeds": None,
    "require_reasoning": None,
}
SGLANG_DEFAULT_TEMPERATURE = 1.0
MAX_BODY_BYTES = 64 << 20
RESULT_POLL_S = 1.0  # how often a waiting handler checks that the worker is still alive


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message says what to fix."""


@dataclass
class GenerateInput:
    """A parsed /generate body: exactly one of ``text`` / ``input_ids`` is set."""

    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    stream: bool
    rid: str


def parse_generate(body: bytes | str) -> GenerateInput:
    """Parse and check a /generate request body (SGLang's ``GenerateReqInput``, one prompt).

    Raises
    ------
    BadRequest
        On malformed JSON, a missing / doubled / mistyped field, a batch of prompts, an unknown
        field, or a bad sampling parameter; the message names the field.
    """
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(k for k in obj if k not in GENERATE_FIELDS and k not in IGNORED_FIELDS
                     and not (k in DEFAULT_ONLY_FIELDS
                              and (not obj[k] or obj[k] == DEFAULT_ONLY_FIELDS[k])))
    if unknown:
        raise BadRequest(f"unsupported field(s) {unknown}: the reference server takes "
                         f"{list(GENERATE_FIELDS)} (SGLang's other fields only at their defaults)")
    text, ids = obj.get("text"), obj.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text' (a string) or 'input_ids' (a list of ints)"
                         + ("; got both" if text is not None else ""))
    if text is not None and not isinstance(text, str):
        what = "a batch of prompts" if isinstance(text, list) else type(text).__name__
        raise BadRequest(f"'text' must be one string, got {what}: the reference server takes "
                         "one prompt per request (send concurrent requests; they are batched)")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in ids):
            what = ("a batch of prompts" if isinstance(ids, list) and ids and isinstance(ids[0], list)
                    else repr(ids)[:80])
            raise BadRequest(f"'input_ids' must be one list of ints, got {what}")
    sp = obj.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"'sampling_params' must be a JSON object, got {type(sp).__name__}")
    sp = dict(sp)
    if sp.get("temperature") is None:
        sp["temperature"] = SGLANG_DEFAULT_TEMPERATURE
    try:
        params = SamplingParams.from_dict(sp)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}")
    rid = obj.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise BadRequest(f"'rid' must be a non-empty string, got {rid!r}")
    return GenerateInput(text, ids, params, stream, rid)


def public_finish_reason(fr: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's finish reason in SGLang's shape (drops internal keys)."""
    if fr is None:
        return None
    return {k: v for k, v in fr.items() if k != "matched_str"}


@dataclass
class _Job:
    inp: GenerateInput
    received: float  # time.time() when the handler got it
    internal: bool = False  # a /health_generate probe: kept out of the statistics
    events: queue.Queue = field(default_factory=queue.Queue)
    input_ids: list[int] | None = None
    out_ids: list[int] = field(default_factory=list)
    sent_text: str = ""


class ServerStats:
    """Counters over the server's lifetime (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0            # finished with 200
        self.failed = 0              # refused (400) or failed (500) in the worker
        self.batches = 0
        self.largest_batch = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cycles = 0
        self.accepted = 0

    def add_batch(self, n: int) -> None:
        with self._lock:
            self.batches += 1
            self.largest_batch = max(self.largest_batch, n)

    def add_result(self, prompt_tokens: int, completion_tokens: int, accepted: list[int]) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.cycles += len(accepted)
            self.accepted += sum(accepted)

    def add_failure(self, n: int = 1) -> None:
        with self._lock:
            self.failed += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            tau = (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0
            return {
                "avg_spec_accept_length": tau,
                "requests_served": self.requests,
                "requests_failed": self.failed,
                "batches": self.batches,
                "largest_batch": self.largest_batch,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "spec_verify_ct": self.cycles,
            }


_STOP = object()


class ReferenceServer:
    """HTTP front end and batching worker around one ``ReferenceEngine``.

    Requests are batched: the worker thread owns the engine, takes every request waiting in the
    queue (up to ``max_batch``; after the first one it waits ``batch_window_s`` for more) and
    runs one ``engine.generate`` call over them. A request arriving while a batch runs waits for
    the next batch.

    Parameters
    ----------
    engine : ReferenceEngine (anything with ``generate``, ``validate``, ``max_context``,
        ``steps`` and ``target.tokenizer``)
    host, port : where to listen; port 0 picks a free port (see ``url``)
    model_path, draft_path : reported by /server_info and /get_model_info
    max_batch : most requests per ``generate`` call, >= 1
    batch_window_s : after the first request of a batch, how long to wait for more; 0 = run at once
    log_requests : print one line per finished request to stderr
    """

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 30000, *,
                 model_path: str = "", draft_path: str | None = None, max_batch: int = 8,
                 batch_window_s: float = 0.0, log_requests: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if batch_window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {batch_window_s}")
        self.engine = engine
        self.tokenizer = getattr(engine.target, "tokenizer", None)
        self.model_path, self.draft_path = model_path, draft_path
        self.max_batch, self.batch_window_s = max_batch, batch_window_s
        self.log_requests = log_requests
        self.stats = ServerStats()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="fastmtp-engine", daemon=True)
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        self._http_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "ReferenceServer":
        """Start the worker and serve HTTP on a background thread; returns self."""
        self._start_worker()
        self._http_thread = threading.Thread(target=self._httpd.serve_forever, name="fastmtp-http",
                                             daemon=True)
        self._http_thread.start()
        return self

    def serve_forever(self) -> None:
        """Start the worker and serve HTTP on this thread until shutdown() or Ctrl-C."""
        self._start_worker()
        try:
            self._httpd.serve_forever()
        finally:
            self._httpd.server_close()
            self._stop_worker(timeout=2.0)  # Ctrl-C: don't wait out a long batch (daemon thread)

    def shutdown(self) -> None:
        """Stop serving; a batch in flight finishes first."""
        if self._http_thread is not None:
            self._httpd.shutdown()
            self._http_thread.join()
            self._httpd.server_close()
        self._stop_worker()

    def __enter__(self) -> "ReferenceServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _start_worker(self) -> None:
        if not self._worker.is_alive():
            self._worker.start()

    def _stop_worker(self, timeout: float | None = None) -> None:
        if self._worker.is_alive():
            self._queue.put(_STOP)
            self._worker.join(timeout)

    @property
    def worker_alive(self) -> bool:
        return self._worker.is_alive()

    # -- the worker -----------------------------------------------------------------------------
    def submit(self, inp: GenerateInput, internal: bool = False) -> _Job:
        job = _Job(inp, time.time(), internal)
        self._queue.put(job)
        return job

    def _work(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            jobs = [first]
            deadline = time.monotonic() + self.batch_window_s
            stop = False
            while len(jobs) < self.max_batch:
                wait = deadline - time.monotonic()
                try:
                    job = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is _STOP:
                    stop = True
                    break
                jobs.append(job)
            try:
                self._run_batch(jobs)
            except Exception as exc:  # a bug outside generate(): fail this batch, keep serving
                traceback.print_exc(file=sys.stderr)
                for job in jobs:
                    job.events.put(("error", (HTTPStatus.INTERNAL_SERVER_ERROR,
                                              f"{type(exc).__name__}: {exc}")))
            if stop:
                return

    def _prepare(self, job: _Job) -> Request:
        """Tokenize and check one job (in the worker: the tokenizer is used by one thread)."""
        inp = job.inp
        if inp.text is not None:
            if self.tokenizer is None:
                raise BadRequest("this server's target has no tokenizer: send 'input_ids'")
            ids = list(self.tokenizer(inp.text)["input_ids"])
        else:
            ids = list(inp.input_ids)
        req = Request(ids, inp.params, inp.rid)
        try:
            self.engine.validate(req)
        except RequestError as exc:
            raise BadRequest(str(exc)) from None
        job.input_ids = ids
        return req

    def _run_batch(self, jobs: list[_Job]) -> None:
        ready: list[_Job] = []
        reqs: list[Request] = []
        for job in jobs:
            try:
                reqs.append(self._prepare(job))
                ready.append(job)
                job.events.put(("accepted", None))
            except BadRequest as exc:
                self.stats.add_failure()
                job.events.put(("error", (HTTPStatus.BAD_REQUEST, str(exc))))
            except Exception as exc:  # a tokenizer failure: this request only
                self.stats.add_failure()
                job.events.put(("error", (HTTPStatus.INTERNAL_SERVER_ERROR,
                                          f"{type(exc).__name__}: {exc}")))
        if not ready:
            return
        self.stats.add_batch(len(ready))

        def on_tokens(i: int, new: list[int]) -> None:
            job = ready[i]
            job.out_ids.extend(new)
            if job.inp.stream:
                self._stream_chunk(job)

        try:
            results = self.engine.generate(reqs, on_tokens=on_tokens)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self.stats.add_failure(len(ready))
            msg = f"the engine failed on this batch of {len(ready)}: {type(exc).__name__}: {exc}"
            for job in ready:
                job.events.put(("error", (HTTPStatus.INTERNAL_SERVER_ERROR, msg)))
            return
        for job, res in zip(ready, results):
            out = self._response(job, res)
            if not job.internal:
                acc = [c.accepted for c in res.metrics.cycles]
                self.stats.add_result(len(job.input_ids), len(res.output_ids), acc)
            if self.log_requests and not job.internal:
                mi = out["meta_info"]
                print(f"[fastmtp serve] {job.inp.rid}: {mi['prompt_tokens']} prompt + "
                      f"{mi['completion_tokens']} new tokens, tau {mi['tau']:.2f}, "
                      f"{mi['e2e_latency']:.2f} s, batch of {len(ready)}", file=sys.stderr, flush=True)
            job.events.put(("done", out))

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stream_chunk(self, job: _Job) -> None:
        text = self._decode(job.out_ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
            text = job.sent_text
        job.sent_text = text
        job.events.put(("chunk", {
            "text": text,
            "output_ids": list(job.out_ids),
            "meta_info": {"id": job.inp.rid, "finish_reason": None,
                          "prompt_tokens": len(job.input_ids),
                          "completion_tokens": len(job.out_ids), "cached_tokens": 0},
        }))

    def _response(self, job: _Job, res) -> dict[str, Any]:
        m = res.metrics
        s = m.summary()
        n, ct = len(res.output_ids), m.verify_ct
        meta = {
            "id": job.inp.rid,
            "finish_reason": public_finish_reason(res.finish_reason),
            "prompt_tokens": len(job.input_ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "spec_verify_ct": ct,
            "spec_accept_length": n / ct if ct else 0.0,
            "e2e_latency": time.time() - job.received,
            # ours: acceptance as DESIGN.md section 2 defines it, and the time split
            "tau": s["tau"],
            "A_k": s["A_k"],
            "a_k": s["a_k"],
            "accept_hist": s["accept_hist"],
            "steps": m.steps,
            "prefill_s": s["prefill_s"],
            "decode_s": s["decode_s"],
            "draft_s": s["draft_s"],
            "verify_s": s["verify_s"],
            "decode_tokens_per_s": s["decode_tokens_per_s"],
        }
        return {"text": res.text if res.text is not None else "", "output_ids": list(res.output_ids),
                "meta_info": meta}

    # -- info -----------------------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        stats = self.stats.snapshot()
        return {
            "engine": "reference",
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "speculative_draft_model_path": self.draft_path,
            "speculative_algorithm": "EAGLE" if self.engine.steps else None,
            "speculative_num_steps": self.engine.steps,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": self.engine.steps + 1,
            "steps": self.engine.steps,
            "max_batch": self.max_batch,
            "batch_window_s": self.batch_window_s,
            "context_length": self.engine.max_context,
            "queued": self._queue.qsize(),
            **stats,
            # where SGLang's /get_server_info puts it, for clients written against SGLang
            "internal_states": [{"avg_spec_accept_length": stats["avg_spec_accept_length"]}],
        }

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "draft_model_path": self.draft_path,
            "steps": self.engine.steps,
            "context_length": self.engine.max_context,
        }


def _make_handler(server: ReferenceServer):
    class Handler(_Handler):
        srv = server

    return Handler


class _Handler(BaseHTTPRequestHandler):
    srv: ReferenceServer
    server_version = "fastmtp-reference"
    # HTTP/1.0: one request per connection, and a streamed body ends when the connection closes.
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        pass  # per-request lines come from --log-requests instead

    # -- replies ----------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message}})

    # -- routes -----------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            self._send(200, b"OK", "text/plain")
        elif path == "/health_generate":
            self._health_generate()
        elif path in ("/server_info", "/get_server_info"):
            self._json(200, self.srv.server_info())
        elif path == "/get_model_info":
            self._json(200, self.srv.model_info())
        elif path == "/generate":
            self._error(405, "use POST for /generate")
        else:
            self._error(404, f"no route {path!r}; try POST /generate, GET /health, /server_info")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        if path != "/generate":
            self._error(404, f"no route POST {path!r}; try POST /generate")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(411, "send a Content-Length header with the JSON body")
            return
        if length > MAX_BODY_BYTES:
            self._error(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
            return
        body = self.rfile.read(length)
        try:
            inp = parse_generate(body)
        except BadRequest as exc:
            self._error(400, str(exc))
            return
        job = self.srv.submit(inp)
        if inp.stream:
            self._stream(job)
        else:
            self._wait_result(job)

    def _next_event(self, job: _Job) -> tuple[str, Any]:
        while True:
            try:
                return job.events.get(timeout=RESULT_POLL_S)
            except queue.Empty:
                if not self.srv.worker_alive:
                    return "error", (HTTPStatus.SERVICE_UNAVAILABLE, "the engine worker has stopped")

    def _wait_result(self, job: _Job) -> None:
        while True:
            kind, payload = self._next_event(job)
            if kind == "done":
                self._json(200, payload)
                return
            if kind == "error":
                self._error(*payload)
                return

    def _stream(self, job: _Job) -> None:
        kind, payload = self._next_event(job)
        if kind == "error":  # refused before generation started: a plain HTTP error
            self._error(*payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            while True:
                kind, payload = self._next_event(job)
                if kind == "error":
                    payload = {"error": {"message": payload[1]}}
                self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                self.wfile.flush()
                if kind in ("done", "error"):
                    break
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left; its rows still finish with the batch

    def _health_generate(self) -> None:
        tok = self.srv.tokenizer
        first = getattr(tok, "bos_token_id", None) if tok is not None else None
        inp = GenerateInput(None, [first if first is not None else 0],
                            SamplingParams(max_new_tokens=1), False, "health-" + uuid.uuid4().hex)
        job = self.srv.submit(inp, internal=True)
        kind, payload = self._next_event(job)
        while kind in ("accepted", "chunk"):
            kind, payload = self._next_event(job)
        if kind == "done":
            self._send(200, b"OK", "text/plain")
        else:
            self._error(503, f"health generation failed: {payload[1]}")
