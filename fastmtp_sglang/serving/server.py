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
- ``POST /abort_request`` ``{"rid": str}`` or ``{"abort_all": true}``: as SGLang's. The request
  ends at once with ``finish_reason {"type": "abort", "message": ...}`` and what it had generated
  (a stream gets that as its last event); an unknown rid is not an error.
- ``GET /health`` (``OK``; 503 while shutting down), ``GET /health_generate`` (runs a one-token
  generation), ``GET /server_info`` (alias ``/get_server_info``), ``GET /get_model_info``.

SGLang compatibility decisions:

- Text is tokenized as SGLang's tokenizer manager does it: ``tokenizer(text)`` with the
  tokenizer's defaults, so a BOS is added when the tokenizer adds one. No chat template is
  applied: clients do that.
- ``sampling_params`` without ``temperature`` (or with ``null``) samples at temperature 1.0, as
  SGLang does; send ``"temperature": 0`` for greedy. A temperature below 1e-6 is greedy, as in
  SGLang (dividing float32 logits by 1e-45 gives inf and NaN probabilities).
- ``spec_accept_length`` is ``completion_tokens / spec_verify_ct`` as SGLang computes it (the
  prefill token counts in the numerator, so it sits slightly above ``tau``); 0 when no
  verification ran. ``avg_spec_accept_length`` in ``/server_info`` is pooled over every
  verification cycle served (accepted + 1 per cycle), as SGLang's scheduler counts it.
- A prompt that fills the context is refused with 400 (SGLang does too); a prompt that fits but
  whose ``max_new_tokens`` would overflow the context is cut at the context with finish reason
  ``length`` (SGLang refuses it).
- A client that disconnects aborts its request (SGLang does the same): its row leaves the batch
  at the next verification cycle.

Errors: every error is JSON ``{"error": {"message": ...}}``. 400: malformed or too deeply nested
JSON, a bad field, a sampling parameter outside what the engine's float32 / int64 tensors hold, a
lone surrogate in ``text``, a prompt longer than the context (checked from its length in
characters before tokenizing when that already proves it). 404 / 405: unknown route or method.
408: the body did not arrive within ``read_timeout_s``. 413: a body over ``max_body_bytes``,
refused from its Content-Length before any of it is read. 503 + ``Retry-After``: the queue is
full, or the server is shutting down. 500: the engine failed on this request.

Isolation: when ``engine.generate`` raises on a batch, the batch is re-run in halves until the
request that fails alone is found; it gets 500, every other request of the batch is answered as
if nothing happened. Each request without a ``sampling_seed`` gets a random one, so a re-run
reproduces the tokens a stream has already sent (in float32; see docs/design.md section 6.3 on bf16).

Concurrency: the HTTP side is FastAPI on uvicorn (SGLang's own HTTP stack): one event loop, so a
slow or stalled client holds a socket, not a thread. Bodies are parsed and prompts tokenized on
one tokenizer thread, never on the engine's. One worker thread owns the engine and **batches**:
it takes the first waiting request, then everything else already waiting (after an optional
``batch_window_s`` wait for more), up to ``max_batch``, and runs one ``ReferenceEngine.generate``
call over them. A request arriving while a batch runs waits for the next batch (no continuous
batching: a batch runs until all its rows finish). At most ``max_queue`` requests wait (counted
from the moment their body starts to arrive); more get 503 with ``Retry-After``.

Shutdown (SIGTERM or SIGINT): the listening socket closes, new requests get 503, requests in
flight get ``shutdown_timeout_s`` to finish; then every one left is aborted with a proper final
answer (a stream's last event has ``finish_reason {"type": "abort"}``; a request that has sent
nothing yet gets 503 + Retry-After, so a client retries elsewhere), the engine worker stops, and
the process exits 0. A second signal aborts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Callable

import torch
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from fastmtp_sglang.decode.engine import Request, RequestError
from fastmtp_sglang.decode.sampling import SamplingParams

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
SGLANG_SAMPLING_EPS = 1e-6  # SGLang samples greedily below this temperature (sampling_params.py)
F32 = torch.finfo(torch.float32)
INT64_MAX = 2**63 - 1

# Defaults of the knobs `fastmtp serve` exposes.
MAX_BODY_BYTES = 8 << 20   # a 128K-token prompt is ~1 MB as input_ids, ~3 MB as escaped CJK text
MAX_QUEUE = 128            # requests waiting for a batch (or still sending / being tokenized)
READ_TIMEOUT_S = 30.0      # a request's headers and body must arrive within this
SHUTDOWN_TIMEOUT_S = 30.0  # in-flight requests get this long to finish on SIGTERM
BACKLOG = 2048             # listen backlog (uvicorn's default; Python's http.server had 5)
ABORT_BODY_BYTES = 64 << 10
DISCARD_BYTES = 256 << 20  # an oversized body up to this is drained unread before the 413
STOP_WORKER_S = 10.0       # after the last request is answered, how long to wait for the engine


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message says what to fix."""


class HTTPError(Exception):
    """A refusal with a status other than 400 (408, 413, 503, ...) and optional headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


# ----------------------------------------------------------------------------------------------
# parsing a /generate body
# ----------------------------------------------------------------------------------------------

@dataclass
class GenerateInput:
    """A parsed /generate body: exactly one of ``text`` / ``input_ids`` is set."""

    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    stream: bool
    rid: str


def _check_engine_dtypes(params: SamplingParams) -> None:
    """Refuse values the engine's tensors cannot hold (temperature, top_p: float32; top_k:
    int64): they passed SamplingParams' range checks but raise inside ``generate``."""
    if params.temperature > F32.max:
        raise BadRequest(f"sampling_params['temperature']: {params.temperature:g} overflows float32, "
                         f"the engine's dtype (largest {F32.max:.3g})")
    if 0 < params.temperature < SGLANG_SAMPLING_EPS:
        params.temperature = 0.0  # greedy, as SGLang; 1e-45 would make inf logits and NaN probs
    if params.top_p < F32.tiny:
        raise BadRequest(f"sampling_params['top_p']: {params.top_p:g} is below float32's smallest "
                         f"normal number ({F32.tiny:.3g}), the engine's dtype; a top_p that small "
                         "keeps only the most likely token: send 1e-6 for that")
    if params.top_k > INT64_MAX:
        raise BadRequest(f"sampling_params['top_k']: {params.top_k} overflows int64, the engine's "
                         "dtype; -1 disables top-k")


def parse_generate(body: bytes | str) -> GenerateInput:
    """Parse and check a /generate request body (SGLang's ``GenerateReqInput``, one prompt).

    Raises
    ------
    BadRequest
        On malformed or too deeply nested JSON, a missing / doubled / mistyped field, a batch of
        prompts, an unknown field, a lone surrogate in ``text``, or a bad sampling parameter
        (including one the engine's dtypes cannot hold); the message names the field.
    """
    try:
        obj = json.loads(body)
    except RecursionError:
        raise BadRequest("the request body is JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int over 4300 digits
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
    if text is not None:
        if not isinstance(text, str):
            what = "a batch of prompts" if isinstance(text, list) else type(text).__name__
            raise BadRequest(f"'text' must be one string, got {what}: the reference server takes "
                             "one prompt per request (send concurrent requests; they are batched)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON's "\ud800" escape decodes to a lone surrogate
            raise BadRequest(f"'text' is not valid Unicode: a lone surrogate "
                             f"(U+{ord(text[exc.start]):04X}) at character {exc.start}") from None
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
    _check_engine_dtypes(params)
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


def _max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry, in characters (0 = unknown).

    A token covers at most as many characters of text as its entry has (byte-level BPE spells
    each byte as one character; SentencePiece spells text as it is, byte-fallback entries are
    longer than the byte they stand for), so ``len(text) / (2 * this)`` tokens is a safe floor
    (the 2 allows for normalisers that merge characters, NFKC's e + U+0301 -> é)."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without get_vocab: no cheap check, tokenize everything
        return 0


# ----------------------------------------------------------------------------------------------
# requests in flight
# ----------------------------------------------------------------------------------------------

class _Slot:
    """One place in the bounded queue; released once, by whoever gets there first."""

    def __init__(self, server: "ReferenceServer"):
        self._server, self._held = server, True

    def release(self) -> None:
        with self._server._cond:
            if self._held:
                self._held = False
                self._server._admitted -= 1


@dataclass(eq=False)
class _Job:
    """One /generate request from submission to its final event.

    Events go to the HTTP side through ``emit`` (thread-safe, never blocks): ``accepted`` (it
    joined a batch), ``chunk`` (stream), then exactly one final event: ``done`` (the result),
    ``error`` ((status, message)) or ``aborted`` ((status, partial result)). ``lock`` orders the
    worker's events against an abort from the HTTP side, so nothing follows a final event."""

    inp: GenerateInput
    input_ids: list[int]
    received: float  # time.time() when the request arrived
    emit: Callable[[str, Any], None]
    slot: _Slot | None = None
    internal: bool = False  # a /health_generate probe: kept out of the statistics
    req: Request | None = None  # the engine request of the current run
    out_ids: list[int] = field(default_factory=list)        # this run's tokens so far
    streamed_ids: list[int] = field(default_factory=list)   # what a stream has sent the client
    sent_text: str = ""
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, kind: str, payload: Any = None) -> bool:
        """Emit a non-final event; False when the job is already closed."""
        with self.lock:
            if self.closed:
                return False
            self.emit(kind, payload)
            return True


class ServerStats:
    """Counters over the server's lifetime (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0            # finished with 200
        self.failed = 0              # refused (400) or failed (500)
        self.aborted = 0             # ended by /abort_request, a disconnect or shutdown
        self.busy = 0                # turned away with 503 (queue full, shutting down)
        self.retried_batches = 0     # batches the engine failed on, re-run in halves
        self.batches = 0
        self.largest_batch = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.generated_tokens = 0    # every token the engine emitted, aborted and re-run ones too
        self.cycles = 0
        self.accepted = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

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

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            tau = (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0
            return {
                "avg_spec_accept_length": tau,
                "requests_served": self.requests,
                "requests_failed": self.failed,
                "requests_aborted": self.aborted,
                "requests_busy": self.busy,
                "batches": self.batches,
                "batches_retried": self.retried_batches,
                "largest_batch": self.largest_batch,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "generated_tokens": self.generated_tokens,
                "spec_verify_ct": self.cycles,
            }


class _EngineFailure(Exception):
    """engine.generate raised on a batch (the original exception is the cause)."""


def _rss_bytes() -> int:
    """Resident memory of this process now (peak on systems without /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------------------------
# the server
# ----------------------------------------------------------------------------------------------

class ReferenceServer:
    """HTTP front end (FastAPI on uvicorn) and batching worker around one ``ReferenceEngine``.

    Parameters
    ----------
    engine : ReferenceEngine (anything with ``generate``, ``validate``, ``max_context``,
        ``steps`` and ``target.tokenizer``)
    host, port : where to listen; port 0 picks a free port (see ``url``). The socket is bound
        here, so a taken port raises OSError from the constructor.
    model_path, draft_path : reported by /server_info and /get_model_info
    max_batch : most requests per ``generate`` call, >= 1
    batch_window_s : after the first request of a batch, how long to wait for more; 0 = run at once
    log_requests : print one line per finished request to stderr
    max_queue : requests that may wait for a batch (counted from the first byte of their body);
        more get 503 + Retry-After
    max_body_bytes : larger bodies get 413 from their Content-Length, before they are read
    read_timeout_s : the headers and body of a request must arrive within this (else the
        connection is closed, or 408)
    shutdown_timeout_s : on shutdown, how long requests in flight get to finish before they
        are aborted
    """

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 30000, *,
                 model_path: str = "", draft_path: str | None = None, max_batch: int = 8,
                 batch_window_s: float = 0.0, log_requests: bool = False,
                 max_queue: int = MAX_QUEUE, max_body_bytes: int = MAX_BODY_BYTES,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S, backlog: int = BACKLOG):
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1),
                                 ("max_body_bytes", max_body_bytes, 1),
                                 ("batch_window_s", batch_window_s, 0),
                                 ("read_timeout_s", read_timeout_s, 1e-3),
                                 ("shutdown_timeout_s", shutdown_timeout_s, 0)):
            if not value >= low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self.engine = engine
        self.tokenizer = getattr(engine.target, "tokenizer", None)
        self.model_path, self.draft_path = model_path, draft_path
        self.max_batch, self.batch_window_s = max_batch, batch_window_s
        self.log_requests = log_requests
        self.max_queue, self.max_body_bytes = max_queue, max_body_bytes
        self.read_timeout_s, self.shutdown_timeout_s = read_timeout_s, shutdown_timeout_s
        self.stats = ServerStats()
        self._max_token_chars = _max_token_chars(self.tokenizer) if self.tokenizer is not None else 0
        self._cond = threading.Condition()  # guards everything below (an RLock inside)
        self._waiting: deque[_Job] = deque()
        self._jobs: dict[str, _Job] = {}    # rid -> job, from submit to its final event
        self._admitted = 0                  # queue slots held
        self._draining = False
        self._stop = False
        self._batch_s = 1.0                 # moving average of a batch's duration (Retry-After)
        self._worker = threading.Thread(target=self._work, name="fastmtp-engine", daemon=True)
        # bodies are parsed and prompts tokenized here: one thread, so the tokenizer is never
        # shared, and never the engine's thread, so a huge prompt does not stall generation
        self._prep = ThreadPoolExecutor(1, thread_name_prefix="fastmtp-tokenize")
        self._sock = _listen(host, port, backlog)
        self._backlog = backlog
        self.app = _build_app(self)
        self._uv: Any = None  # uvicorn.Server, once serving
        self._http_thread: threading.Thread | None = None
        self._abort_timer: threading.Timer | None = None

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "ReferenceServer":
        """Start the worker and serve HTTP on a background thread; returns once listening."""
        self._start_worker()
        self._uv = _make_uvicorn(self)
        self._http_thread = threading.Thread(
            target=lambda: asyncio.run(self._uv.serve(sockets=[self._sock])),
            name="fastmtp-http", daemon=True)
        self._http_thread.start()
        deadline = time.monotonic() + 30
        while not self._uv.started:
            if not self._http_thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> bool:
        """Serve on this thread until SIGTERM / SIGINT (or ``request_shutdown``), then shut down
        gracefully. Returns True when the engine worker stopped, False when it was still busy
        ``STOP_WORKER_S`` after the last request was answered."""
        self._start_worker()
        self._uv = _make_uvicorn(self)
        try:
            asyncio.run(self._uv.serve(sockets=[self._sock]))
        finally:
            stopped = self._close()
        return stopped

    def request_shutdown(self) -> None:
        """Ask a running server to shut down gracefully (any thread)."""
        if self._uv is not None:
            self._uv.should_exit = True

    def shutdown(self) -> None:
        """Stop a server started with ``start()``: graceful, as on SIGTERM."""
        if self._http_thread is not None:
            self.request_shutdown()
            self._http_thread.join()
            self._http_thread = None
        self._close()

    def __enter__(self) -> "ReferenceServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _start_worker(self) -> None:
        if not self._worker.is_alive():
            self._worker.start()

    def begin_shutdown(self) -> None:
        """Refuse new requests; abort what is still in flight after ``shutdown_timeout_s``."""
        with self._cond:
            if self._draining:
                return
            self._draining = True
            n = len(self._jobs)
        if n:
            print(f"fastmtp serve: shutting down: {n} request(s) in flight get up to "
                  f"{self.shutdown_timeout_s:g} s to finish", file=sys.stderr, flush=True)
        self._abort_timer = threading.Timer(
            self.shutdown_timeout_s, self.abort_all,
            args=("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE))
        self._abort_timer.daemon = True
        self._abort_timer.start()

    def _close(self) -> bool:
        """After HTTP has stopped: abort anything left, stop the worker, release resources."""
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
        self._sock.close()
        return not self._worker.is_alive()

    @property
    def worker_alive(self) -> bool:
        return self._worker.is_alive()

    # -- admission and submission ---------------------------------------------------------------
    def retry_after_s(self) -> int:
        """Seconds a turned-away client should wait: the batches ahead of it, from recent ones."""
        with self._cond:
            ahead = len(self._waiting) // self.max_batch + 1
            return int(min(60, max(1, math.ceil(self._batch_s * ahead))))

    def _busy(self, message: str) -> HTTPError:
        self.stats.add(busy=1)
        return HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, message,
                         {"Retry-After": str(self.retry_after_s())})

    def admit(self) -> _Slot:
        """Take a queue slot for a request about to be read, or raise HTTPError 503."""
        with self._cond:
            if self._draining:
                raise self._busy("the server is shutting down; retry (on another replica)")
            if self._admitted >= self.max_queue:
                raise self._busy(f"the server is busy: {self._admitted} requests are waiting "
                                 f"(--max-queue {self.max_queue}); retry later")
            self._admitted += 1
            return _Slot(self)

    def prepare(self, body: bytes) -> tuple[GenerateInput, list[int]]:
        """Parse, tokenize and check one /generate body (on the tokenizer thread).

        Raises BadRequest. A text prompt that is surely too long (from its length in characters)
        is refused before the tokenizer sees it."""
        inp = parse_generate(body)
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
            self._cond.notify_all()
        return job

    # -- ending a request -------------------------------------------------------------------------
    def _finish(self, job: _Job, kind: str, payload: Any) -> bool:
        """Send a job's final event (once); False when it had already ended."""
        with job.lock:
            if job.closed:
                return False
            job.closed = True
            job.emit(kind, payload)
        self._forget(job)
        return True

    def _forget(self, job: _Job) -> None:
        with self._cond:
            if self._jobs.get(job.inp.rid) is job:
                del self._jobs[job.inp.rid]
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
        job.emit("aborted", (int(status), partial))
        self._forget(job)
        if not job.internal:
            self.stats.add(aborted=1)
        if self.log_requests and not job.internal:
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
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stop:
                    self._cond.wait()
                if self._stop and not self._waiting:
                    return
                deadline = time.monotonic() + self.batch_window_s
                while len(self._waiting) < self.max_batch and not self._stop:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                jobs = []
                while self._waiting and len(jobs) < self.max_batch:
                    job = self._waiting.popleft()
                    if job.slot is not None:
                        job.slot.release()  # running now: its queue place goes to the next one
                    if not job.closed:
                        jobs.append(job)
            jobs = [job for job in jobs if job.send("accepted")]
            if not jobs:
                continue
            t0 = time.monotonic()
            try:
                self._run_isolating(jobs)
            except Exception as exc:  # a bug outside generate(): fail this batch, keep serving
                traceback.print_exc(file=sys.stderr)
                for job in jobs:
                    self._fail(job, HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
            with self._cond:
                self._batch_s = 0.7 * self._batch_s + 0.3 * (time.monotonic() - t0)

    def _fail(self, job: _Job, status: int, message: str) -> None:
        if self._finish(job, "error", (int(status), message)) and not job.internal:
            self.stats.add(failed=1)

    def _run_isolating(self, jobs: list[_Job]) -> None:
        """Run a batch; when the engine fails on it, re-run it in halves so that only the
        request that fails alone gets the error."""
        try:
            self._run_batch(jobs)
            return
        except _EngineFailure as exc:
            cause = exc.__cause__
            live = [job for job in jobs if not job.closed]
            if len(jobs) == 1:
                traceback.print_exception(cause, file=sys.stderr)
                for job in live:
                    self._fail(job, HTTPStatus.INTERNAL_SERVER_ERROR,
                               f"the engine failed on this request: {type(cause).__name__}: {cause}")
                return
        self.stats.add(retried_batches=1)
        print(f"fastmtp serve: the engine failed on a batch of {len(jobs)} "
              f"({type(cause).__name__}: {cause}); re-running its {len(live)} open request(s) "
              "in halves to find the one that caused it", file=sys.stderr, flush=True)
        half = (len(live) + 1) // 2
        for part in (live[:half], live[half:]):
            if part:
                self._run_isolating(part)

    def _run_batch(self, jobs: list[_Job]) -> None:
        """One engine.generate over ``jobs``; raises _EngineFailure when it raises."""
        reqs: list[Request] = []
        for job in jobs:
            with job.lock:
                job.out_ids = []
                # a fresh copy per run: an abort lowers max_new_tokens on it
                job.req = Request(job.input_ids, dataclasses.replace(job.inp.params), job.inp.rid)
                if job.closed:  # aborted while we were getting here: stop at once
                    job.req.params.max_new_tokens = 0
            reqs.append(job.req)
        self.stats.add_batch(len(jobs))

        def on_tokens(i: int, new: list[int]) -> None:
            job = jobs[i]
            self.stats.add(generated_tokens=len(new))
            with job.lock:
                job.out_ids.extend(new)
                if job.inp.stream and not job.closed:
                    self._stream_chunk(job)

        try:
            results = self.engine.generate(reqs, on_tokens=on_tokens)
        except Exception as exc:
            raise _EngineFailure() from exc
        for job, res in zip(jobs, results):
            out = self._response(job, res)
            if not self._finish(job, "done", out) or job.internal:
                continue
            acc = [c.accepted for c in res.metrics.cycles]
            self.stats.add_result(len(job.input_ids), len(res.output_ids), acc)
            if self.log_requests:
                mi = out["meta_info"]
                print(f"[fastmtp serve] {job.inp.rid}: {mi['prompt_tokens']} prompt + "
                      f"{mi['completion_tokens']} new tokens, tau {mi['tau']:.2f}, "
                      f"{mi['e2e_latency']:.2f} s, batch of {len(jobs)}", file=sys.stderr, flush=True)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stream_chunk(self, job: _Job) -> None:
        """Send the cumulative output (job.lock held). A re-run after an engine failure stays
        quiet until it has passed what the client was already sent."""
        ids = job.out_ids
        n = len(job.streamed_ids)
        if len(ids) <= n and ids == job.streamed_ids[:len(ids)]:
            return
        text = self._decode(ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
            text = job.sent_text
        job.sent_text = text
        job.streamed_ids = list(ids)
        job.emit("chunk", {
            "text": text,
            "output_ids": list(ids),
            "meta_info": {"id": job.inp.rid, "finish_reason": None,
                          "prompt_tokens": len(job.input_ids),
                          "completion_tokens": len(ids), "cached_tokens": 0},
        })

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
            # ours: acceptance as docs/design.md section 2 defines it, and the time split
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
        with self._cond:
            waiting = sum(not j.closed for j in self._waiting)
            in_flight, admitted, draining = len(self._jobs), self._admitted, self._draining
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
            "max_queue": self.max_queue,
            "max_body_bytes": self.max_body_bytes,
            "queued": waiting,
            "admitted": admitted,
            "requests_in_flight": in_flight,
            "draining": draining,
            "rss_bytes": _rss_bytes(),
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


# ----------------------------------------------------------------------------------------------
# HTTP: FastAPI routes, the event stream, uvicorn with our signals and header timeout
# ----------------------------------------------------------------------------------------------

def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket (bound here, so a taken port fails before anything starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    # json.dumps escapes non-ASCII: a lone surrogate echoed back (a rid, a stop string) stays valid
    return Response(json.dumps(obj), status_code=int(status), headers=headers,
                    media_type="application/json")


def _error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json_response(status, {"error": {"message": message}}, headers)


async def _disconnected(receive) -> None:
    """Return when the client goes away (after the request body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _next_event(queue: asyncio.Queue, gone: asyncio.Future) -> tuple[str, Any] | None:
    """The job's next event, or None when the client disconnected first."""
    if gone.done():
        return None
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


def _event_bytes(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _build_app(srv: ReferenceServer) -> FastAPI:
    app = FastAPI(title="fastmtp reference server", docs_url=None, redoc_url=None,
                  openapi_url=None)
    get_routes = {"/health", "/health_generate", "/server_info", "/get_server_info",
                  "/get_model_info"}
    post_routes = {"/generate", "/abort_request"}

    async def discard_body(request: HTTPRequest) -> None:
        with contextlib.suppress(TimeoutError, ClientDisconnect):
            async with asyncio.timeout(srv.read_timeout_s):
                async for _ in request.stream():
                    pass

    async def read_body(request: HTTPRequest, limit: int) -> bytes:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"Content-Length {length!r} is not a number")
            if int(length) > limit:
                if int(length) <= DISCARD_BYTES and "100-continue" not in request.headers.get(
                        "expect", "").lower():
                    # a client that sends its whole body before reading (urllib, requests) sees
                    # a reset instead of the 413 unless the body is drained: drop it unread
                    await discard_body(request)
                raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                f"the body has {int(length)} bytes; this server takes at most "
                                f"{limit} (fastmtp serve --max-body-mb)", {"Connection": "close"})
        chunks, size = [], 0
        try:
            async with asyncio.timeout(srv.read_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                        f"the body is over {limit} bytes, this server's limit "
                                        "(fastmtp serve --max-body-mb)", {"Connection": "close"})
                    chunks.append(chunk)
        except TimeoutError:
            raise HTTPError(HTTPStatus.REQUEST_TIMEOUT,
                            f"the request body did not arrive within {srv.read_timeout_s:g} s "
                            f"(got {size} of {length if length is not None else '?'} bytes)",
                            {"Connection": "close"}) from None
        return b"".join(chunks)

    @app.get("/health")
    async def health():
        if srv._draining:
            return _error_response(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        return Response(b"OK", media_type="text/plain")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return _json_response(200, srv.server_info())

    @app.get("/get_model_info")
    async def model_info():
        return _json_response(200, srv.model_info())

    @app.get("/health_generate")
    async def health_generate():
        tok = srv.tokenizer
        first = getattr(tok, "bos_token_id", None) if tok is not None else None
        inp = GenerateInput(None, [first if first is not None else 0],
                            SamplingParams(max_new_tokens=1), False, "health-" + uuid.uuid4().hex)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        try:
            srv.submit(inp, inp.input_ids, _emitter(loop, queue), internal=True)
        except HTTPError as exc:
            return _error_response(exc.status, exc.message, exc.headers)
        while True:
            kind, payload = await queue.get()
            if kind == "done":
                return Response(b"OK", media_type="text/plain")
            if kind in ("error", "aborted"):
                message = payload[1] if kind == "error" else "aborted"
                return _error_response(HTTPStatus.SERVICE_UNAVAILABLE,
                                       f"health generation failed: {message}")

    @app.post("/abort_request")
    async def abort_request(request: HTTPRequest):
        try:
            body = await read_body(request, ABORT_BODY_BYTES)
            try:
                obj = json.loads(body or b"{}")
            except (ValueError, RecursionError) as exc:
                raise BadRequest(f"the request body is not valid JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise BadRequest("the request body must be a JSON object {\"rid\": ...}")
            rid, abort_all = obj.get("rid") or "", obj.get("abort_all") or False
            if not isinstance(rid, str) or not isinstance(abort_all, bool):
                raise BadRequest("'rid' must be a string and 'abort_all' true or false")
            if not rid and not abort_all:
                raise BadRequest("give the 'rid' of the request to abort, or \"abort_all\": true")
        except BadRequest as exc:
            return _error_response(HTTPStatus.BAD_REQUEST, str(exc))
        except HTTPError as exc:
            return _error_response(exc.status, exc.message, exc.headers)
        except ClientDisconnect:
            return Response(status_code=499)
        n = srv.abort_all() if abort_all else srv.abort_rid(rid)
        return _json_response(200, {"aborted": n})  # SGLang answers 200 whether or not it found it

    @app.post("/generate")
    async def generate(request: HTTPRequest):
        try:
            slot = srv.admit()
        except HTTPError as exc:
            return _error_response(exc.status, exc.message, exc.headers)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        try:
            body = await read_body(request, srv.max_body_bytes)
            inp, ids = await loop.run_in_executor(srv._prep, srv.prepare, body)
            job = srv.submit(inp, ids, _emitter(loop, queue), slot)
        except BadRequest as exc:
            slot.release()
            srv.stats.add(failed=1)
            return _error_response(HTTPStatus.BAD_REQUEST, str(exc))
        except HTTPError as exc:
            slot.release()
            return _error_response(exc.status, exc.message, exc.headers)
        except ClientDisconnect:
            slot.release()
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            slot.release()
            raise
        if inp.stream:
            return _EventStream(srv, job, queue)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            while True:
                event = await _next_event(queue, gone)
                if event is None:
                    srv.abort(job, "the client disconnected")
                    return Response(status_code=499)
                kind, payload = event
                if kind == "done":
                    return _json_response(200, payload)
                if kind == "error":
                    return _error_response(*payload)
                if kind == "aborted":
                    return _aborted_response(srv, *payload)
        finally:
            gone.cancel()

    methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]

    @app.api_route("/{path:path}", methods=methods, include_in_schema=False)
    async def fallback(request: HTTPRequest, path: str):
        path, method = "/" + path.rstrip("/"), request.method
        allowed = "GET, HEAD" if path in get_routes else "POST" if path in post_routes else None
        if allowed is None:
            return _error_response(HTTPStatus.NOT_FOUND, f"no route {method} {path!r}; try POST "
                                   "/generate, GET /health, /server_info, /get_model_info")
        if method == "HEAD" and path in get_routes:  # headers only
            return Response(status_code=200)
        return _error_response(HTTPStatus.METHOD_NOT_ALLOWED,
                               f"{method} is not allowed on {path}; use {allowed.split(',')[0]}",
                               {"Allow": allowed})

    @app.exception_handler(Exception)
    async def internal_error(request: HTTPRequest, exc: Exception):
        traceback.print_exception(exc, file=sys.stderr)
        return _error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    app.add_middleware(_StripTrailingSlash)
    return app


class _StripTrailingSlash:
    """``/generate/`` is ``/generate`` (the http.server version accepted both)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)


def _emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[str, Any], None]:
    """A thread-safe, non-blocking hand-over of one event to a request's coroutine."""

    def emit(kind: str, payload: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    return emit


def _aborted_response(srv: ReferenceServer, status: int, partial: dict[str, Any]) -> Response:
    if status == HTTPStatus.OK:
        return _json_response(200, partial)
    message = partial["meta_info"]["finish_reason"]["message"]
    return _error_response(status, f"{message}; the request was not finished: retry it",
                           {"Retry-After": str(srv.retry_after_s())})


class _EventStream(Response):
    """The ASGI response of a streaming /generate: waits for the request to join a batch, then
    sends server-sent events until the final one, then ``data: [DONE]``. A disconnect aborts the
    request. Chunks are cumulative, so when the client reads slower than tokens arrive only the
    newest waiting chunk is sent (memory stays bounded whatever the client does)."""

    def __init__(self, srv: ReferenceServer, job: _Job, queue: asyncio.Queue):
        super().__init__(status_code=200, media_type="text/event-stream")
        self.srv, self.job, self.queue = srv, job, queue

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await self._run(send, gone)
        finally:
            gone.cancel()
            if not self.job.closed:
                self.srv.abort(self.job, "the client disconnected")

    async def _run(self, send, gone: asyncio.Future) -> None:
        started = False
        while True:
            event = await _next_event(self.queue, gone)
            if event is None:
                return
            events = [event]
            while not self.queue.empty():
                events.append(self.queue.get_nowait())
            final = next((e for e in events if e[0] in ("done", "error", "aborted")), None)
            chunks = [e for e in events if e[0] == "chunk"]
            if not started:
                if final is not None and final[0] == "error" and not chunks:
                    # refused before generation started: a plain HTTP error
                    return await _send_response(send, _error_response(*final[1]))
                if final is not None and final[0] == "aborted" and final[1][0] != HTTPStatus.OK \
                        and not chunks:
                    return await _send_response(send, _aborted_response(self.srv, *final[1]))
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                        (b"cache-control", b"no-cache")]})
                started = True
            out = []
            if chunks and final is None:
                out.append(_event_bytes(chunks[-1][1]))
            if final is not None:
                kind, payload = final
                if kind == "error":
                    payload = {"error": {"message": payload[1]}}
                elif kind == "aborted":
                    payload = payload[1]
                out += [_event_bytes(payload), _event_bytes(b"[DONE]")]
            if out:
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": final is None})
            if final is not None:
                return


async def _send_response(send, response: Response) -> None:
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def _h11_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose first request's headers have not
    arrived within ``header_timeout_s`` (uvicorn itself waits for them forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return Protocol


def _make_uvicorn(srv: ReferenceServer):
    """uvicorn.Server over ``srv.app`` with our shutdown: SIGTERM / SIGINT start a graceful drain
    (uvicorn's own handler re-raises the signal once it is done, so the process would exit -15 or
    130), and a second signal aborts the requests left at once instead of cutting their
    connections."""
    import uvicorn

    class Server(uvicorn.Server):
        signals: list[int] = []

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in handled}
            try:
                yield
            finally:
                for s, handler in original.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig, frame) -> None:
            # a signal handler: only set flags (printing or locking here could deadlock)
            self.signals = [*self.signals, sig]
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            if self.signals:
                print(f"fastmtp serve: {signal.Signals(self.signals[0]).name}: no new connections",
                      file=sys.stderr, flush=True)
            srv.begin_shutdown()
            watcher = asyncio.ensure_future(self._second_signal())
            try:
                await super().shutdown(sockets)
            finally:
                watcher.cancel()

        async def _second_signal(self) -> None:
            while len(self.signals) < 2:
                await asyncio.sleep(0.1)
            srv.abort_all("the server is stopping now (second stop signal)",
                          HTTPStatus.SERVICE_UNAVAILABLE)

    config = uvicorn.Config(
        srv.app, http=_h11_protocol(srv.read_timeout_s), loop="asyncio", lifespan="off",
        log_level="warning", access_log=False, backlog=srv._backlog,
        # a safety net only: our own abort answers everything after shutdown_timeout_s, and a
        # body read ends after read_timeout_s
        timeout_graceful_shutdown=srv.shutdown_timeout_s + srv.read_timeout_s + 5)
    return Server(config)
