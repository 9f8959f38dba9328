"""The reference server's transport: uvicorn with our h11 protocol, the listening socket and the
stop signals (serving/app.py is the HTTP side above it: routes and streams). ``srv`` below is
app.ReferenceServer (its ``options``, and its ``worker``'s stats, drain and aborts), not imported
here: app imports this module.

What a hostile client can hold is bounded here: connections past ``max_connections`` are answered
503 as they open; a request's headers must arrive within ``read_timeout_s`` on every request of
a keep-alive connection; a response left unread for ``write_timeout_s`` cuts the connection (its
request is aborted by the app, told why through ``CLOSE_REASON``). SIGTERM / SIGINT start the
server's drain; a second signal aborts what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import threading
from http import HTTPStatus
from typing import Any

CLOSE_REASON = "fastmtp_close_reason"  # scope["state"] key: why our protocol cut a connection


def listen(host: str, port: int, backlog: int) -> socket.socket:
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


def refusal_bytes(message: str, retry_after: int) -> bytes:
    """A whole HTTP/1.1 503 response, written before any request has been read (h11 cannot
    answer a request it has not seen)."""
    body = json.dumps({"error": {"message": message}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {retry_after}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def h11_protocol(srv: Any):
    """uvicorn's h11 protocol with three limits uvicorn lacks:

    - **headers**: a connection is closed when a request's headers have not arrived within
      ``read_timeout_s`` of the connection opening or of the previous response. (uvicorn waits
      for a first request forever, and its keep-alive timer is cancelled by any byte, so the
      partial headers of a second request held a connection forever.)
    - **connections**: past ``max_connections`` open connections, a new one is answered 503 with
      Retry-After at once and closed (after reading what its client sends for a moment, so the
      client sees the 503 rather than a reset).
    - **writes**: when the transport's buffer stays above its high-water mark (the client reads
      nothing) for ``write_timeout_s``, the connection is cut (not closed gracefully: that would
      wait for the client to read), the request's coroutine sees a disconnect, and the log says
      why; a stream's abort message carries it (``CLOSE_REASON``).
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    opts, worker = srv.options, srv.worker
    header_s, write_s, limit = opts.read_timeout_s, opts.write_timeout_s, opts.max_connections

    class Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _refused = False
        _lost = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limit:
                self._refuse()
            else:
                self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            # the cycle of the last request: a new request's headers replace it
            self._header_timer = self.loop.call_later(header_s, self._header_timeout, self.cycle)

        def _header_timeout(self, cycle) -> None:
            if self._lost or self.cycle is not cycle or (cycle is not None
                                                         and not cycle.response_complete):
                return  # gone, or a request came (its response re-arms the timer)
            if not self.transport.is_closing():
                worker.stats.add(header_timeouts=1)
            if self.transport.is_closing() or self.transport.get_write_buffer_size():
                self.transport.abort()  # (a close waits for a client that may never read)
            else:
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # (may start a pipelined request: self.cycle)
            if not self._lost:
                self._arm_header_timer()

        def _refuse(self) -> None:
            self._refused = True
            self.connections.discard(self)  # not counted: it is on its way out
            worker.stats.add(connections_refused=1)
            self.transport.write(refusal_bytes(
                f"the server has {limit} connections open (its limit, max_connections); retry "
                "later", worker.retry_after_s()))
            self.transport.write_eof()
            # read (and drop) what the client sends until it closes, for a moment at most
            self._header_timer = self.loop.call_later(min(header_s, 2.0), self.transport.abort)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None and not self._lost:
                self._write_timer = self.loop.call_later(write_s, self._write_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timeout(self) -> None:
            self._write_timer = None
            if self._lost:
                return
            reason = (f"the client left what was sent unread for {write_s:g} s (write timeout); "
                      "connection closed")
            worker.stats.add(write_timeouts=1)
            what = ""
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.scope.setdefault("state", {})[CLOSE_REASON] = reason
                what = f" during {self.cycle.scope['method']} {self.cycle.scope['path']}"
            peer = "%s:%d" % self.client if self.client else "a client"
            print(f"fastmtp serve: {peer}{what}: {reason}"
                  + ("; its request is aborted if still running" if what else ""),
                  file=sys.stderr, flush=True)
            self.transport.abort()

        def connection_lost(self, exc) -> None:
            self._lost = True
            for timer in (self._header_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

    return Protocol


def make_uvicorn(srv: Any):
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
            srv.worker.drain()
            watcher = asyncio.ensure_future(self._second_signal())
            try:
                await super().shutdown(sockets)
            finally:
                watcher.cancel()

        async def _second_signal(self) -> None:
            while len(self.signals) < 2:
                await asyncio.sleep(0.1)
            srv.worker.abort_all("the server is stopping now (second stop signal)",
                          HTTPStatus.SERVICE_UNAVAILABLE)

    config = uvicorn.Config(
        srv.app, http=h11_protocol(srv), loop="asyncio", lifespan="off",
        log_level="warning", access_log=False, backlog=srv.options.backlog,
        # a safety net only: our own abort answers everything after shutdown_timeout_s, and a
        # body read ends after read_timeout_s
        timeout_graceful_shutdown=srv.options.shutdown_timeout_s + srv.options.read_timeout_s + 5)
    return Server(config)
