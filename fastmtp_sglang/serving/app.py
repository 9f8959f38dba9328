"""An SGLang-compatible HTTP server around the reference engine (CPU serving, and the oracle).

Run it with ``fastmtp serve --engine reference --target T --draft D --steps K --port P``.

This module is the HTTP side: the FastAPI app and its routes and streaming responses, on uvicorn
with our h11 protocol, listening socket and signal handling (serving/http_transport.py: a header
timeout on every request of a connection, a connection limit, a write timeout). ``ReferenceServer``
holds an engine worker (fastmtp_sglang.serving.worker: queue, batching, abort, info) and puts this
in front of it, through the worker's public methods only; its options (limits, host, port) are one
``ServerOptions`` (fastmtp_sglang.serving.options). The API, its fields and its errors are
described in fastmtp_sglang.serving.protocol.

Concurrency: the HTTP side is FastAPI on uvicorn (SGLang's own HTTP stack): one event loop, so a
slow or stalled client holds a socket, not a thread. What a hostile client can hold is bounded:
at most ``max_connections`` connections (more are answered 503 as they open); each request's
headers within ``read_timeout_s`` (on every request of a keep-alive connection, not only the
first, as uvicorn's own keep-alive timer would have it); its body within ``read_timeout_s``,
before it takes a place in the queue; a response left unread for ``write_timeout_s`` ends the
connection and aborts its request; a stream buffers one cumulative chunk, however slowly its
client reads.

Shutdown (SIGTERM or SIGINT): the listening socket closes, new requests get 503, requests in
flight get ``shutdown_timeout_s`` to finish; then every one left is aborted with a proper final
answer (a stream's last event has ``finish_reason {"type": "abort"}``; a request that has sent
nothing yet gets 503 + Retry-After, so a client retries elsewhere), the engine worker stops, and
the process exits 0. A second signal aborts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.serving.options import ServerOptions
from fastmtp_sglang.serving.protocol import (
    ABORT_BODY_BYTES, DISCARD_BYTES, BadRequest, GenerateInput, HTTPError)
from fastmtp_sglang.serving.http_transport import CLOSE_REASON, listen, make_uvicorn
from fastmtp_sglang.serving.worker import STOP_WORKER_S, EngineWorker

if TYPE_CHECKING:
    from fastmtp_sglang.serving.jobs import _Job


# ----------------------------------------------------------------------------------------------
# the server
# ----------------------------------------------------------------------------------------------

class ReferenceServer:
    """HTTP front end (FastAPI on uvicorn) over a batching worker (``EngineWorker``, held as
    ``worker``) around one ``ReferenceEngine``.

    Parameters
    ----------
    engine : the ReferenceEngine to serve (see :class:`~fastmtp_sglang.serving.worker.EngineWorker`)
    options : ServerOptions (fastmtp_sglang.serving.options): where to listen (``port`` 0 picks
        a free port, see ``url``) and every limit; the socket is bound here, so a taken port
        raises OSError from the constructor
    model_path, draft_path : reported by /server_info and /get_model_info
    sock : a socket already listening (``load_reference_server`` binds it before the weights
        load); None: bind ``options.host``:``options.port`` here
    """

    def __init__(self, engine, options: ServerOptions | None = None, *,
                 model_path: str = "", draft_path: str | None = None,
                 sock: socket.socket | None = None):
        self.options = options if options is not None else ServerOptions()
        self.worker = EngineWorker(engine, self.options, model_path=model_path,
                                   draft_path=draft_path)
        self.receiving = 0  # /generate bodies being read (event loop only)
        try:
            self._sock = sock or listen(self.options.host, self.options.port, self.options.backlog)
        except OSError:
            self.worker.close()
            raise
        self.app = _build_app(self)
        self._uv: Any = None  # uvicorn.Server, once serving
        self._http_thread: threading.Thread | None = None

    @property
    def engine(self):
        """The engine the worker runs."""
        return self.worker.engine

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, engine_thread: bool = True) -> "ReferenceServer":
        """Serve HTTP on a background thread and start the engine worker thread; returns once
        listening. ``engine_thread=False``: HTTP only, the caller drives the engine on its own
        thread with ``drive`` (PyTorch runs fastest on the main thread)."""
        if engine_thread:
            self.worker.start()
        self._uv = make_uvicorn(self)
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

    def serve_forever(self, exit_if_stuck: bool = False) -> bool:
        """Serve until SIGTERM / SIGINT (or ``request_shutdown``), then shut down gracefully.

        The engine loop runs on the calling thread (the main thread, under ``fastmtp serve``),
        where PyTorch's CPU kernels run at full speed; HTTP runs on a thread of its own, as
        SGLang splits its HTTP side from its scheduler. Returns True after a clean stop, False
        when the HTTP side died on its own. With ``exit_if_stuck``, a loop still inside the
        engine ``STOP_WORKER_S`` after the last request was answered ends the process (exit 0;
        a forward pass cannot be interrupted)."""
        self._uv = make_uvicorn(self)
        handled = (signal.SIGINT, signal.SIGTERM)
        on_main = threading.current_thread() is threading.main_thread()
        original = {s: signal.signal(s, self._uv.handle_exit) for s in handled} if on_main else {}
        self._http_thread = threading.Thread(
            target=lambda: asyncio.run(self._uv.serve(sockets=[self._sock])),
            name="fastmtp-http", daemon=True)
        engine_done = threading.Event()
        http_died: list[bool] = []

        def close_after_http() -> None:  # then the worker's run() below returns
            self._http_thread.join()
            if not self._uv.should_exit:
                http_died.append(True)
                print("fastmtp serve: the HTTP server stopped on its own; shutting down",
                      file=sys.stderr, flush=True)
            self._close()
            if exit_if_stuck and not engine_done.wait(STOP_WORKER_S):
                print("fastmtp serve: the engine is still inside a forward pass; exiting without "
                      "waiting for it", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(0)

        closer = threading.Thread(target=close_after_http, name="fastmtp-close", daemon=True)
        self._http_thread.start()
        closer.start()
        try:
            self.worker.run()
        finally:
            engine_done.set()
            for s, handler in original.items():
                signal.signal(s, handler)
        closer.join(STOP_WORKER_S)
        return not http_died

    def drive(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on a helper thread while this thread runs the engine loop (a server
        started with ``start(engine_thread=False)``); returns what ``fn`` returned once every
        request it sent is answered, re-raising its exception."""
        if self.worker.alive:
            raise RuntimeError("drive() needs a server started with start(engine_thread=False)")
        done, box = threading.Event(), {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                box["error"] = exc
            finally:
                done.set()
                self.worker.wake()

        helper = threading.Thread(target=run, name="fastmtp-drive", daemon=True)
        helper.start()
        self.worker.run(until=done)
        helper.join()
        if "error" in box:
            raise box["error"]
        return box.get("value")

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

    def _close(self) -> bool:
        """After HTTP has stopped: the worker aborts what is left and stops; the socket closes."""
        stopped = self.worker.close()
        self._sock.close()
        return stopped

    def __enter__(self) -> "ReferenceServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def server_info(self) -> dict[str, Any]:
        """The worker's /server_info, with the HTTP side's limits and state."""
        info = self.worker.server_info()
        state = getattr(self._uv, "server_state", None)
        info.update(connections=len(state.connections) if state is not None else 0,
                    max_connections=self.options.max_connections,
                    max_body_bytes=self.options.max_body_bytes,
                    read_timeout_s=self.options.read_timeout_s,
                    write_timeout_s=self.options.write_timeout_s,
                    receiving=self.receiving)
        return info


# ----------------------------------------------------------------------------------------------
# HTTP: FastAPI routes, the event stream, uvicorn with our signals and connection limits
# ----------------------------------------------------------------------------------------------

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
    worker, opts = srv.worker, srv.options
    app = FastAPI(title="fastmtp reference server", docs_url=None, redoc_url=None,
                  openapi_url=None)
    get_routes = {"/health", "/health_generate", "/server_info", "/get_server_info",
                  "/get_model_info"}
    post_routes = {"/generate", "/abort_request"}

    async def discard_body(request: HTTPRequest) -> None:
        with contextlib.suppress(TimeoutError, ClientDisconnect):
            async with asyncio.timeout(opts.read_timeout_s):
                async for _ in request.stream():
                    pass

    async def read_body(request: HTTPRequest, limit: int) -> bytes:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise BadRequest(f"Content-Length {length!r} is not a number")
            if int(length) > limit:
                worker.stats.add(bodies_too_large=1)
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
            async with asyncio.timeout(opts.read_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        worker.stats.add(bodies_too_large=1)
                        raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                        f"the body is over {limit} bytes, this server's limit "
                                        "(fastmtp serve --max-body-mb)", {"Connection": "close"})
                    chunks.append(chunk)
        except TimeoutError:
            worker.stats.add(body_timeouts=1)
            raise HTTPError(HTTPStatus.REQUEST_TIMEOUT,
                            f"the request body did not arrive within {opts.read_timeout_s:g} s "
                            f"(got {size} of {length if length is not None else '?'} bytes)",
                            {"Connection": "close"}) from None
        return b"".join(chunks)

    @app.get("/health")
    async def health():
        if worker.draining:
            return _error_response(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        return Response(b"OK", media_type="text/plain")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return _json_response(200, srv.server_info())

    @app.get("/get_model_info")
    async def model_info():
        return _json_response(200, worker.model_info())

    @app.get("/health_generate")
    async def health_generate():
        tok = worker.tokenizer
        first = getattr(tok, "bos_token_id", None) if tok is not None else None
        inp = GenerateInput(None, [first if first is not None else 0],
                            SamplingParams(max_new_tokens=1), False, "health-" + uuid.uuid4().hex)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        slot = None
        try:  # admitted like any request: a full queue is 503 here too
            slot = worker.admit()
            worker.submit(inp, inp.input_ids, _emitter(loop, queue), slot, internal=True)
        except HTTPError as exc:
            if slot is not None:
                slot.release()
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
        n = worker.abort_all() if abort_all else worker.abort_rid(rid)
        return _json_response(200, {"aborted": n})  # SGLang answers 200 whether or not it found it

    @app.post("/generate")
    async def generate(request: HTTPRequest):
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        slot = None
        srv.receiving += 1
        try:
            try:
                body = await read_body(request, opts.max_body_bytes)
            finally:
                srv.receiving -= 1
            # a place in the queue once the body is here: clients still sending (or stalled
            # half-way, up to read_timeout_s) hold a connection, never a place
            slot = worker.admit()
            inp, ids = await asyncio.wrap_future(worker.prepare_soon(body))
            job = worker.submit(inp, ids, _emitter(loop, queue), slot)
        except BadRequest as exc:
            if slot is not None:
                slot.release()
            worker.stats.add(failed=1)
            return _error_response(HTTPStatus.BAD_REQUEST, str(exc))
        except HTTPError as exc:
            if slot is not None:
                slot.release()
            return _error_response(exc.status, exc.message, exc.headers)
        except ClientDisconnect:
            if slot is not None:
                slot.release()
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        if inp.stream:
            return _EventStream(srv, job, queue)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            while True:
                event = await _next_event(queue, gone)
                if event is None:
                    worker.abort(job, "the client disconnected")
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
                           {"Retry-After": str(srv.worker.retry_after_s())})





class _EventStream(Response):
    """The ASGI response of a streaming /generate: waits for the request to join a batch, then
    sends server-sent events until the final one, then ``data: [DONE]``. A disconnect aborts the
    request. Chunks are cumulative, and a ``chunk`` event carries no output: the newest output
    is taken when it can be sent (``EngineWorker.stream_chunk``), so a client that reads slower
    than tokens arrive costs one chunk of memory whatever it does; one that reads nothing for
    ``write_timeout_s`` is cut off by the protocol (``http_transport.h11_protocol``) and its request aborted."""

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
                reason = (scope.get("state") or {}).get(CLOSE_REASON, "the client disconnected")
                self.srv.worker.abort(self.job, reason)

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
            saw_chunk = any(e[0] == "chunk" for e in events)
            if not started:
                if final is not None and final[0] == "error" and not saw_chunk:
                    # refused before generation started: a plain HTTP error
                    return await _send_response(send, _error_response(*final[1]))
                if final is not None and final[0] == "aborted" and final[1][0] != HTTPStatus.OK \
                        and not saw_chunk:
                    return await _send_response(send, _aborted_response(self.srv, *final[1]))
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                        (b"cache-control", b"no-cache")]})
                started = True
            out = []
            if saw_chunk and final is None:
                chunk = self.srv.worker.stream_chunk(self.job)
                if chunk is not None:
                    out.append(_event_bytes(chunk))
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
