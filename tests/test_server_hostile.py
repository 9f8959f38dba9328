"""The reference server against hostile and careless clients: what one client may hold is bounded.

Each test runs an in-process ``ReferenceServer`` on 127.0.0.1 over the tiny Llama target (K=0,
fp32) and talks to it with raw sockets where the client misbehaves. Nothing races a sleep: the
engine is held at a gate the test opens (``Gated``), server-side timeouts are set small against
hang guards of a minute, and waits poll a condition the server reports.

- slow bodies hold connections, not places in the queue (admission after the body is read);
- a keep-alive connection's second request gets the header timeout too; connections are capped;
- a stream nobody reads is cut off after the write timeout, its request aborted and logged, and
  it buffers one chunk meanwhile, not one per cycle;
- a request aborted while it waits leaves the queue at once (a POST-then-disconnect storm);
- a failed join is isolated beside the running batch, whose stream never stops for more than
  the isolation's one prefill and one cycle per cycle;
- stop lists and ``max_new_tokens`` are capped (400), stop strings are checked on the tail only;
- ``/health_generate`` is admitted like any request.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastmtp_sglang.serving import client

GUARD_S = 60.0      # hang guard: no wait here is meant to come near it
CONTEXT = 512       # the tiny Llama target's max_position_embeddings
POISON = [7, 7, 7, 7]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


# --------------------------------------------------------------------------------------------
# an engine the test can hold, and raw HTTP
# --------------------------------------------------------------------------------------------

def _gated_class():
    from fastmtp_sglang.decode.engine import ReferenceEngine

    class Gated(ReferenceEngine):
        """K=0. Each target forward waits while ``open`` is clear (``held`` is set meanwhile);
        ``hold_at`` closes the gate once a row has that many tokens; a prompt starting with
        POISON makes its prefill raise; ``log`` records the rids of each prefill and cycle."""

        def __init__(self, target, max_context: int = CONTEXT):
            super().__init__(target, None, 0, max_context)
            self.open, self.held = threading.Event(), threading.Event()
            self.open.set()
            self.hold_at: int | None = None
            self.log: list[tuple[str, list[str]]] = []

        def _target(self, *args, **kwargs):
            if not self.open.is_set():
                self.held.set()
                self.open.wait(GUARD_S)
                self.held.clear()
            return super()._target(*args, **kwargs)

        def _prefill(self, requests, *args, **kwargs):
            self.log.append(("prefill", [r.rid for r in requests]))
            if any(list(r.input_ids[:4]) == POISON for r in requests):
                raise RuntimeError("poisoned")
            return super()._prefill(requests, *args, **kwargs)

        def step(self, b, on_tokens=None):
            self.log.append(("step", [r.req.rid for r in b.rows]))
            done = super().step(b, on_tokens)
            if self.hold_at is not None and any(len(r.out) >= self.hold_at for r in b.rows):
                self.open.clear()
            return done

    return Gated


@pytest.fixture(scope="module")
def target(llama_target):
    from fastmtp_sglang.core.target import load_target

    return load_target(llama_target.path, "float32")


def gated(target, max_context: int = CONTEXT):
    return _gated_class()(target, max_context)


def server(engine, **kwargs):
    from fastmtp_sglang.serving.app import ReferenceServer
    from fastmtp_sglang.serving.options import ServerOptions

    return ReferenceServer(engine, ServerOptions(port=0, **kwargs))


def wait_until(cond, what: str = "") -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.005)


def addr(srv) -> tuple[str, int]:
    host, port = srv.url.rsplit("/", 1)[1].split(":")
    return host, int(port)


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body, read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def raw_request(srv, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(addr(srv), timeout=GUARD_S) as s:
        s.sendall(request)
        return read_response(s)


def post(path: str, obj) -> bytes:
    body = json.dumps(obj).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def alone(target, ids: list[int], params: dict) -> list[int]:
    """What the engine gives this request on its own."""
    from fastmtp_sglang.decode.engine import ReferenceEngine, Request
    from fastmtp_sglang.decode.sampling import SamplingParams

    eng = ReferenceEngine(target, None, 0, CONTEXT)
    return eng.generate([Request(ids, SamplingParams.from_dict(params))])[0].output_ids


# --------------------------------------------------------------------------------------------
# connections: slow bodies, slow headers, too many connections
# --------------------------------------------------------------------------------------------

def test_slow_bodies_take_no_place_in_the_queue(target):
    """10 clients that send their headers and 5 bytes of a 100-byte body, then stall, with a
    queue of 4: a normal request meanwhile gets its answer (a place in the queue had been taken
    before the body was read: 130 such clients made every request 503, nothing in flight)."""
    with server(gated(target), max_queue=4, read_timeout_s=GUARD_S) as srv:
        stalled = []
        try:
            for _ in range(10):
                s = socket.create_connection(addr(srv), timeout=GUARD_S)
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                          b"\r\nContent-Length: 100\r\n\r\n{\"te")
                stalled.append(s)
            wait_until(lambda: srv.server_info()["receiving"] + srv.server_info()["requests_busy"]
                       == 10, "every stalled body to be read or refused")
            out = client.generate(srv.url, input_ids=[5, 6, 7], sampling_params=GREEDY)
            assert out["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
            info = srv.server_info()
            assert info["receiving"] == 10 and info["requests_busy"] == 0, info
            assert info["admitted"] == 0, info
        finally:
            for s in stalled:
                s.close()


def test_headers_time_out_on_every_request_of_a_connection(target):
    """A keep-alive connection whose second request's headers stop half-way is closed after
    the read timeout (uvicorn cancels its keep-alive timer on any byte, and our header timeout
    had covered only a connection's first request: such a connection was held forever)."""
    with server(gated(target), read_timeout_s=0.5) as srv:
        with socket.create_connection(addr(srv), timeout=GUARD_S) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = read_response(s)
            assert status == 200 and body == b"OK"
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            s.settimeout(20)  # the guard; the server closes it after 0.5 s
            assert s.recv(1000) == b""
        assert srv.server_info()["header_timeouts"] == 1


def test_connections_past_the_limit_get_503_at_once(target):
    """With 4 connections open (idle, headers half sent), a fifth is answered 503 with
    Retry-After as it opens and closed; once they close, requests are served again."""
    with server(gated(target), max_connections=4, read_timeout_s=GUARD_S) as srv:
        idle = [socket.create_connection(addr(srv), timeout=GUARD_S) for _ in range(4)]
        try:
            for s in idle:
                s.sendall(b"GET /health HTTP/1.1\r\n")
            wait_until(lambda: srv.server_info()["connections"] == 4, "4 connections")
            status, headers, body = raw_request(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 503 and int(headers["retry-after"]) >= 1
            assert "4 connections open" in json.loads(body)["error"]["message"]
            assert headers["connection"] == "close"
            assert srv.server_info()["connections_refused"] == 1
        finally:
            for s in idle:
                s.close()
        wait_until(lambda: srv.server_info()["connections"] == 0, "the idle ones to close")
        status, _, body = raw_request(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and body == b"OK"


# --------------------------------------------------------------------------------------------
# a stream nobody reads
# --------------------------------------------------------------------------------------------

def test_a_stream_nobody_reads_is_cut_off_and_aborted(target, monkeypatch, capfd):
    """A streaming client that never reads: once the server's send is blocked the engine makes
    100 more cycles and the stream holds at most one chunk event meanwhile (each cycle had
    queued its whole cumulative output: memory quadratic in the output); after the write
    timeout the connection is cut, the request aborted (still running: the engine is held at
    its gate when the timeout fires), and the log says why."""
    from fastmtp_sglang.serving import app as app_module, http_transport

    eng = gated(target)
    queues = []
    real_emitter, real_protocol = app_module._emitter, http_transport.h11_protocol

    def recording(loop, queue):
        queues.append(queue)
        return real_emitter(loop, queue)

    def instrumented(srv):
        class Watched(real_protocol(srv)):
            def pause_writing(self) -> None:  # the client's window and our buffers are full
                super().pause_writing()
                eng.hold_at = min(srv.worker.stats.snapshot()["generated_tokens"] + 100, 470)

            def _write_timeout(self) -> None:  # (it fires 0.5 s after the pause)
                assert eng.held.wait(GUARD_S), "the engine never reached its gate"
                super()._write_timeout()

        return Watched

    monkeypatch.setattr(app_module, "_emitter", recording)
    monkeypatch.setattr(http_transport, "h11_protocol", instrumented)
    params = {"temperature": 0, "max_new_tokens": 480, "ignore_eos": True}
    srv = server(eng, write_timeout_s=0.5, log_requests=True)
    # accepted sockets inherit a small send buffer (loopback's autotuned one takes megabytes)
    srv._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with srv:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
        s.connect(addr(srv))
        try:
            s.sendall(post("/generate", {"input_ids": [5, 6, 7], "sampling_params": params,
                                         "stream": True, "rid": "deaf"}))
            assert eng.held.wait(GUARD_S)  # 100 cycles after the send blocked
            [queue] = queues
            assert queue.qsize() <= 2, queue.qsize()  # one chunk (and at most a final) waiting
            wait_until(lambda: srv.server_info()["requests_aborted"] == 1, "the write timeout")
            info = srv.server_info()
            assert info["write_timeouts"] == 1 and info["requests_served"] == 0, info
            eng.open.set()
            wait_until(lambda: srv.server_info()["requests_in_flight"] == 0, "the row to leave")
            assert srv.server_info()["generated_tokens"] < 480
        finally:
            eng.open.set()
            s.close()
    err = capfd.readouterr().err
    assert "during POST /generate" in err and "write timeout" in err, err  # the protocol's line
    assert "deaf: aborted after" in err and "(write timeout)" in err, err  # the request's


# --------------------------------------------------------------------------------------------
# the queue: aborts, failed joins, admission of /health_generate
# --------------------------------------------------------------------------------------------

def test_requests_aborted_while_queued_leave_the_queue_at_once(target):
    """With the batch full (one row, held), 50 clients each POST and disconnect once their
    request waits: each is aborted and leaves the queue then (it had stayed there until the
    batch had room, so such a loop grew the queue without limit), and none is turned away."""
    eng = gated(target)
    with server(eng, max_batch=1, max_queue=4) as srv:
        eng.open.clear()
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.generate, srv.url, input_ids=[5, 6, 7],
                                sampling_params=GREEDY, timeout=GUARD_S)
            assert eng.held.wait(GUARD_S)  # its prefill waits: the batch is full
            body = post("/generate", {"input_ids": [8, 9], "sampling_params": GREEDY})
            for i in range(50):
                with socket.create_connection(addr(srv), timeout=GUARD_S) as s:
                    s.sendall(body)
                    wait_until(lambda: srv.server_info()["requests_in_flight"] == 2, "queued")
                wait_until(lambda: srv.server_info()["requests_in_flight"] == 1, "aborted")
                assert srv.server_info()["queued"] == 0, i
            info = srv.server_info()
            assert info["queued"] == 0 and info["admitted"] == 0, info
            assert info["requests_aborted"] == 50 and info["requests_busy"] == 0, info
            eng.open.set()
            assert first.result()["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_a_poisoned_join_does_not_hold_up_the_running_stream(target):
    """A stream runs; a poisoned request and a good one join it together and the engine fails
    on their prefill. The pair is run apart in halves beside the stream: the poisoned one gets
    500, the good one its own answer, the stream its own, and between two of the stream's cycles
    the engine ran at most one isolation prefill and one cycle of each batch run apart (the
    isolation had run whole generate calls, every stream frozen meanwhile)."""
    eng = gated(target)
    long = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    short = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    good_ids = [5, 6, 7, 8]
    with server(eng, max_batch=4) as srv:
        eng.hold_at = 3

        def stream():
            return list(client.stream_generate(srv.url, input_ids=[9, 10, 11], rid="s",
                                               sampling_params=long, timeout=GUARD_S))

        with ThreadPoolExecutor(3) as pool:
            streamed = pool.submit(stream)
            assert eng.held.wait(GUARD_S)  # the stream has 3 tokens; its next cycle waits
            poisoned = pool.submit(client.generate, srv.url, input_ids=POISON + [5], rid="p",
                                   sampling_params=short, timeout=GUARD_S)
            good = pool.submit(client.generate, srv.url, input_ids=good_ids, rid="g",
                               sampling_params=short, timeout=GUARD_S)
            wait_until(lambda: srv.server_info()["queued"] == 2, "both to wait")
            eng.hold_at = None
            eng.open.set()
            with pytest.raises(client.ServerError) as err:
                poisoned.result()
            assert err.value.status == 500 and "poisoned" in err.value.message
            assert good.result()["output_ids"] == alone(target, good_ids, short)
            chunks = streamed.result()
        assert chunks[-1]["output_ids"] == alone(target, [9, 10, 11], long)
        for a, b in zip(chunks, chunks[1:]):  # cumulative: never taken back
            assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        info = srv.server_info()
        assert info["batches_retried"] == 1 and info["requests_failed"] == 1, info
    log = eng.log
    failed = next(i for i, (kind, rids) in enumerate(log)
                  if kind == "prefill" and {"p", "g"} <= set(rids))
    s_steps = [i for i, (kind, rids) in enumerate(log) if kind == "step" and "s" in rids]
    after = [i for i in s_steps if i > failed]
    gaps = [b - a - 1 for a, b in zip([failed] + after, after)]
    assert max(gaps) <= 3, (gaps, log[failed:after[-1] + 1])
    g_steps = [i for i, (kind, rids) in enumerate(log) if kind == "step" and rids == ["g"]]
    assert g_steps and g_steps[-1] < after[-1]  # the good one ran beside the stream, and finished


def test_health_generate_is_admitted_like_any_request(target):
    """With the queue full, /health_generate is 503 with Retry-After like a /generate (it had
    skipped admission and waited behind the queue); once the queue drains it answers OK."""
    eng = gated(target)
    with server(eng, max_batch=1, max_queue=1) as srv:
        eng.open.clear()
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(client.generate, srv.url, input_ids=[5, 6],
                                sampling_params=GREEDY, timeout=GUARD_S)
            assert eng.held.wait(GUARD_S)
            second = pool.submit(client.generate, srv.url, input_ids=[5, 7],
                                 sampling_params=GREEDY, timeout=GUARD_S)
            wait_until(lambda: srv.server_info()["admitted"] == 1, "the queue to fill")
            probe = pool.submit(raw_request, srv,
                                b"GET /health_generate HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = probe.result(timeout=20)
            assert status == 503 and int(headers["retry-after"]) >= 1
            assert "--max-queue 1" in json.loads(body)["error"]["message"]
            eng.open.set()
            assert first.result() and second.result()
        status, _, body = raw_request(srv, b"GET /health_generate HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and body == b"OK"
        assert srv.server_info()["admitted"] == 0


# --------------------------------------------------------------------------------------------
# request limits: stop lists, max_new_tokens; stop strings on the tail
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("params, needle", [
    ({"stop": [f"s{i}" for i in range(33)]}, "at most 32"),
    ({"stop": ["x" * 257]}, "257 characters"),
    ({"stop_token_ids": list(range(1025))}, "at most 1024"),
    ({"max_new_tokens": 10**400}, "a 401-digit number"),
    ({"max_new_tokens": 65}, "context is 64 tokens"),
    # a prompt that fits, with a budget that runs past the context: refused as a lone oversized
    # budget is (it had been served, cut at the context with finish "length" before the budget)
    ({"max_new_tokens": 63}, "so 62 new tokens fit: lower max_new_tokens to at most 62"),
    ({}, "is 128 and the prompt has 2 tokens"),  # the default budget, under the same rule
])
def test_request_limits_are_400(target, params, needle):
    with server(gated(target, max_context=64)) as srv:
        status, _, body = raw_request(srv, post("/generate", {"input_ids": [5, 6],
                                                              "sampling_params": params}))
        assert status == 400 and needle in json.loads(body)["error"]["message"], body
        # at the caps: served, the whole budget (prompt + max_new_tokens = the context)
        ok = {"stop": [f"s{i}" for i in range(32)], "stop_token_ids": list(range(300, 1024)),
              "max_new_tokens": 62, "temperature": 0, "ignore_eos": True}
        out = client.generate(srv.url, input_ids=[5, 6], sampling_params=ok)
        assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
        if out["meta_info"]["finish_reason"]["type"] == "length":
            assert out["meta_info"]["completion_tokens"] == 62
        assert srv.server_info()["requests_failed"] == 1


def test_stop_strings_are_checked_on_the_tail(target):
    """A stop string late in a 300-token output cuts it where a check of the whole text does
    (the shortest output whose text holds it), while no cycle decodes more than the tail."""
    from fastmtp_sglang.decode.engine import ReferenceEngine, Request
    from fastmtp_sglang.decode.sampling import SamplingParams

    tok = target.tokenizer
    # sampled (seeded): the tiny model's greedy text repeats itself
    base = {"temperature": 1.0, "sampling_seed": 7, "max_new_tokens": 300, "ignore_eos": True}
    full = alone(target, [5, 6, 7], base)
    text = tok.decode(full, skip_special_tokens=True)
    # a 6-character stop string that first occurs near the end of the text
    k = next(k for k in range(len(text) - 40, 0, -1)
             if text.find(text[k:k + 6]) == k and text[k:k + 6].strip())
    stop = text[k:k + 6]
    n = next(n for n in range(1, len(full) + 1)
             if stop in tok.decode(full[:n], skip_special_tokens=True))
    eng = ReferenceEngine(target, None, 0, CONTEXT)
    sizes = []
    real = eng._decode
    eng._decode = lambda ids: (sizes.append(len(ids)), real(ids))[1]
    [res] = eng.generate([Request([5, 6, 7], SamplingParams.from_dict({**base, "stop": [stop]}))])
    assert res.output_ids == full[:n] and n > 100
    assert res.finish_reason == {"type": "stop", "matched": stop, "matched_str": stop}
    cut = tok.decode(full[:n], skip_special_tokens=True)
    assert res.text == cut[: cut.find(stop)]
    *cycles, last = sizes  # the last decode is the result's text, once
    assert last == n and max(cycles) <= 64, max(cycles)


def test_serve_flags_reach_the_server(llama_target):
    """`fastmtp serve --write-timeout --max-connections` set the server's limits; 0 is refused."""
    from fastmtp_sglang.cli import build_parser
    from fastmtp_sglang.cli.serve import build_reference_server
    from fastmtp_sglang.core.errors import FastMTPError

    def args(*extra):
        return build_parser().parse_args(
            ["serve", "--engine", "reference", "--target", str(llama_target.path), "--steps", "0",
             "--dtype", "float32", "--port", "0", *extra])

    srv = build_reference_server(args("--write-timeout", "2.5", "--max-connections", "7"))
    try:
        assert srv.options.write_timeout_s == 2.5 and srv.server_info()["max_connections"] == 7
    finally:
        srv.shutdown()
    with pytest.raises(FastMTPError, match="--max-connections must be >= 1"):
        build_reference_server(args("--max-connections", "0"))
