"""`fastmtp serve --engine reference` under load from hostile and careless clients, as a real
process behind nothing but the loopback interface.

One server process (tiny Llama target, random FastMTP draft at K=3) gets three rounds of 64
concurrent clients: good ones (greedy and seeded-sampled, plain and streaming), bad ones (400 /
405 / 413), streaming clients that disconnect after two tokens, clients that stall half-way
through their body, and one *poisoned* request that makes ``engine.generate`` raise (a fault
injected into the server process, since the server's validation now refuses every known poison).
The checks: no connection is reset, every good request gets exactly the answer it gets alone,
bad ones get their 4xx, the poisoned one alone gets 500, disconnected requests are aborted, and
memory does not grow from round 2 to round 3. In the rounds the poisoned request may join a
running batch alone (then it fails alone at once), so a fourth poisoned request is held to join
with a good one (a gated prefill in the server): the engine fails on the pair, the pair is re-run
in halves, the good one gets its answer and only the poisoned one the 500. Then a last round is
cut by SIGTERM: every client gets a final answer (a finished result, a stream ending in a final
event and [DONE], or 503) and the process exits 0. A second server checks that Ctrl-C twice
aborts at once and still exits 0.

Nothing here races the clock (docs/STYLE.md, habit 13). Requests that must still be running
when something happens to them (a client leaving, the drain ending, a second Ctrl-C) start
with HOLD: such a row holds its batch once it has emitted two tokens until it is aborted, so
it cannot finish on its own. The drain after SIGTERM ends when the test says so (the server's
shutdown timer waits for a flag file, DRAIN_PRELUDE), once a request has finished in it.
Timeouts on the test's waits are hang guards (HANG_S), not part of what is tested.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import HANG_S, gated_prefill, reference_server_process
from fastmtp_sglang.serving import client

STEPS = 3
MAX_CONTEXT = 160
N_NEW = 12
LONG_NEW = 120            # disconnecting and SIGTERM-round clients ask for this many tokens
POISON = [299, 299, 299, 299]
GATE = [298, 298, 298, 298]  # a prefill of a prompt starting with these waits for a flag file
HOLD = [297, 297, 297, 297]  # a row of a prompt starting with these holds its batch (HOLD_PRELUDE)
# the headers and body of a request must arrive within this: the stalled clients wait it out
# each round (408), and no good client of 64 on a loaded machine may ever meet it (2 s was met)
READ_TIMEOUT_S = 10.0
N_CLIENTS = 64
GREEDY = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
PROMPTS = ["def add(a, b):", "The list is a sequence", "Hello there", "import os\nprint("]

# Run in the server process before the CLI: the poisoned request makes its prefill raise (as a
# bug in the engine would), and each target forward sleeps 5 ms so that batches overlap.
PRELUDE = f"""
import time
from fastmtp_sglang.decode import engine as _engine

_prefill, _target = _engine.ReferenceEngine._prefill, _engine.ReferenceEngine._target

def prefill(self, requests, keys, on_tokens, *room):
    # a slow prefill, so requests queue behind it and join in groups (the poisoned one among
    # others: its batch must be split to find it)
    time.sleep(0.05)
    if any(list(r.input_ids[:4]) == {POISON!r} for r in requests):
        raise RuntimeError("injected fault: a poisoned request")
    return _prefill(self, requests, keys, on_tokens, *room)

def target(self, *args, **kwargs):
    time.sleep(0.005)
    return _target(self, *args, **kwargs)

_engine.ReferenceEngine._prefill, _engine.ReferenceEngine._target = prefill, target
"""

# Added to PRELUDE: a cycle of a batch holding a HOLD row that has emitted two tokens waits until
# that row is aborted (the worker's abort sets its max_new_tokens to 0): its client leaving, the
# end of the drain, a second Ctrl-C. Such a request cannot finish on its own, whatever the speed
# of the machine; its client gets its two tokens first, since they were emitted before the hold.
HOLD_PRELUDE = f"""
_unheld = _engine.ReferenceEngine.step

def held(self, b, on_tokens=None):
    deadline = time.monotonic() + {HANG_S!r}
    while time.monotonic() < deadline and any(
            list(r.req.input_ids[:4]) == {HOLD!r} and len(r.out) >= 2 and r.finish is None
            and r.req.params.max_new_tokens > 0 for r in b.rows):
        time.sleep(0.01)
    return _unheld(self, b, on_tokens)

_engine.ReferenceEngine.step = held
"""

# Formatted with a flag file's path: the drain after a stop signal ends (its requests still in
# flight are aborted, as when --shutdown-timeout passes) once the test creates the file, or after
# the shutdown timeout as without this. The timer's own callback does the aborting.
DRAIN_PRELUDE = """
import os as _dos, threading as _dthreading
from fastmtp_sglang.serving import worker as _worker
_begin = _worker.EngineWorker.drain

def _begin_shutdown(self):
    first = not self.draining
    _begin(self)
    timer = self._abort_timer
    if first and timer is not None:
        timer.cancel()

        def expire():
            deadline = time.monotonic() + timer.interval
            while not _dos.path.exists({flag!r}) and time.monotonic() < deadline:
                time.sleep(0.01)
            timer.function(*timer.args, **timer.kwargs)
        _dthreading.Thread(target=expire, name="fastmtp-drain-flag", daemon=True).start()

_worker.EngineWorker.drain = _begin_shutdown
"""


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_dir(llama_target, tmp_path_factory):
    from fastmtp_sglang.core.draft_dir import make_draft_config, save_draft_dir
    from fastmtp_sglang.core.head import FastMTPHead, HeadConfig
    from fastmtp_sglang.core.identity import target_identity
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_target.path))
    dcfg = make_draft_config(llama_target.config, "deepseek", dtype="float32",
                             base_model=target_identity("llama-tiny", llama_target.config, tok))
    torch.manual_seed(11)
    head = FastMTPHead(HeadConfig.from_dict(dcfg))
    return save_draft_dir(tmp_path_factory.mktemp("load") / "draft", dcfg, head.state_dict())


def server_args(target: Path, draft: Path, shutdown_timeout: float) -> list[str]:
    return ["--target", str(target), "--draft", str(draft), "--steps", str(STEPS),
            "--max-context", str(MAX_CONTEXT), "--max-batch", "8", "--batch-window-ms", "20",
            "--max-queue", "128", "--max-body-mb", "1", "--read-timeout", str(READ_TIMEOUT_S),
            "--shutdown-timeout", str(shutdown_timeout)]


@pytest.fixture(scope="module")
def tokenized(llama_target) -> dict[str, list[int]]:
    """PROMPTS as the server tokenizes them (for requests sent as input_ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_target.path))
    TOKENIZED.update({p: tok(p)["input_ids"] for p in PROMPTS})
    return TOKENIZED


@pytest.fixture(scope="module")
def expected(llama_target):
    """Greedy continuations of PROMPTS by the transformers model (fp32, no cache)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_target.path))
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            x = torch.tensor([tok(p)["input_ids"]])
            for _ in range(N_NEW):
                x = torch.cat([x, llama_target.model(x).logits[0, -1].argmax().view(1, 1)], 1)
            out[p] = x[0, -N_NEW:].tolist()
    return out


# --------------------------------------------------------------------------------------------
# raw HTTP clients (http.client, so resets and the wire format are visible)
# --------------------------------------------------------------------------------------------

@dataclass
class Reply:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None                                   # parsed JSON, or None
    events: list[Any] = field(default_factory=list)    # stream: parsed data events, "[DONE]" last
    error: str | None = None                           # a connection-level failure (reset, ...)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def request(url: str, body: bytes, method: str = "POST", path: str = "/generate",
            stop_after_tokens: int | None = None, timeout: float = HANG_S) -> Reply:
    """One request on a fresh connection. ``stop_after_tokens``: read stream events until one
    carries that many output tokens, then close the socket (a client that goes away)."""
    rep = Reply()
    conn = http.client.HTTPConnection("127.0.0.1", _port(url), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        rep.status, rep.headers = resp.status, {k.lower(): v for k, v in resp.getheaders()}
        if rep.headers.get("content-type", "").startswith("text/event-stream"):
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                rep.events.append(data if data == "[DONE]" else json.loads(data))
                if (stop_after_tokens is not None and isinstance(rep.events[-1], dict)
                        and len(rep.events[-1]["output_ids"]) >= stop_after_tokens):
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    break
        else:
            raw = resp.read()
            rep.body = json.loads(raw) if raw else None
    except (OSError, http.client.HTTPException) as exc:
        rep.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return rep


def stalled_body(url: str) -> Reply:
    """Headers promising 200 bytes, then 10 of them, then silence."""
    rep = Reply()
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=HANG_S) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n{\"text\": ")
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError as exc:
            rep.error = f"{type(exc).__name__}: {exc}"
    if data:
        rep.status = int(data.split(b" ", 2)[1])
        rep.body = json.loads(data.split(b"\r\n\r\n", 1)[1] or b"null")
    return rep


def gen_body(prompt: str | list[int], params: dict, stream: bool = False, **extra) -> bytes:
    key = "text" if isinstance(prompt, str) else "input_ids"
    return json.dumps({key: prompt, "sampling_params": params, "stream": stream, **extra}).encode()


# --------------------------------------------------------------------------------------------
# one round of mixed clients
# --------------------------------------------------------------------------------------------

BAD_400 = [
    (b'{"text": "hi", ', "not valid JSON"),
    (gen_body("hi", {"top_k": 10**20}), "int64"),
    (gen_body("hi", {"temperature": 1e308}), "float32"),
    (gen_body("hi", {"top_p": 1e-300}), "float32"),
    (b'{"text": "a \\ud800 b"}', "surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (gen_body("word " * 400, GREEDY), "context"),
    (gen_body("hi", {"temprature": 0.5}), "temprature"),
]


def make_round(seeded: dict[str, list[int]]) -> list[tuple[str, Any]]:
    """64 (kind, spec) clients in a fixed interleaved order."""
    good = [("good", (p, i % 2 == 0)) for i, p in enumerate(PROMPTS * 6)]        # 24
    streams = [("stream", p) for p in PROMPTS * 3]                                 # 12
    sampled = [("sampled", p) for p in seeded]                                     # 4
    bad = [("bad", b) for b in BAD_400]                                            # 8
    odd = [("too_large", None), ("put", None), ("stalled", None), ("stalled", None)]
    gone = [("disconnect", p) for p in PROMPTS + PROMPTS[:2]]                       # 6
    poison = [("poison", None)]
    clients = good + streams + sampled + bad + odd + gone + poison
    clients += [("good", (PROMPTS[0], True))] * (N_CLIENTS - len(clients))
    order = sorted(range(len(clients)), key=lambda i: (i * 37) % len(clients))
    return [clients[i] for i in order]


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": N_NEW,
           "ignore_eos": True}


def run_client(url: str, kind: str, spec: Any) -> Reply:
    if kind == "good":
        prompt, as_text = spec
        return request(url, gen_body(prompt if as_text else TOKENIZED[prompt], GREEDY))
    if kind == "stream":
        return request(url, gen_body(spec, GREEDY, stream=True))
    if kind == "sampled":
        return request(url, gen_body(spec, {**SAMPLED, "sampling_seed": SEEDS[spec]}))
    if kind == "bad":
        return request(url, spec[0])
    if kind == "too_large":
        return request(url, b" " * (2 << 20))
    if kind == "put":
        return request(url, b"{}", method="PUT")
    if kind == "stalled":
        return stalled_body(url)
    if kind == "disconnect":  # (HOLD: it cannot finish before its client has gone)
        params = {**GREEDY, "max_new_tokens": LONG_NEW}
        return request(url, gen_body(HOLD + TOKENIZED[spec], params, stream=True), stop_after_tokens=2)
    if kind == "poison":
        return request(url, gen_body(POISON + [5, 6], GREEDY))
    raise AssertionError(kind)


TOKENIZED: dict[str, list[int]] = {}
SEEDS = {p: 1000 + i for i, p in enumerate(PROMPTS)}


def check_round(clients, replies, expected, seeded) -> None:
    for (kind, spec), rep in zip(clients, replies):
        what = f"{kind} {spec!r:.60}: {rep}"
        assert rep.error is None or kind in ("disconnect", "stalled"), what  # no resets
        if kind == "good":
            assert rep.status == 200 and rep.body["output_ids"] == expected[spec[0]], what
        elif kind == "stream":
            assert rep.status == 200 and rep.events[-1] == "[DONE]", what
            final = rep.events[-2]
            assert final["output_ids"] == expected[spec], what
            assert final["meta_info"]["finish_reason"] == {"type": "length", "length": N_NEW}
        elif kind == "sampled":
            assert rep.status == 200 and rep.body["output_ids"] == seeded[spec], what
        elif kind == "bad":
            assert rep.status == 400 and spec[1] in rep.body["error"]["message"], what
        elif kind == "too_large":
            assert rep.status == 413 and "at most" in rep.body["error"]["message"], what
        elif kind == "put":
            assert rep.status == 405 and rep.headers["allow"] == "POST", what
        elif kind == "stalled":
            assert rep.status == 408 and "did not arrive" in rep.body["error"]["message"], what
        elif kind == "disconnect":  # it left after 2 tokens, before any final event
            assert rep.status == 200 and rep.events and "[DONE]" not in rep.events, what
            assert len(rep.events[-1]["output_ids"]) >= 2, what
        elif kind == "poison":
            assert rep.status == 500 and "injected fault" in rep.body["error"]["message"], what


def wait_for(cond, url: str, timeout: float = HANG_S) -> dict:
    """Poll /server_info until ``cond(info)`` holds (``timeout``: a hang guard)."""
    deadline = time.monotonic() + timeout
    while not cond(info := client.server_info(url)):
        assert time.monotonic() < deadline, info
        time.sleep(0.02)
    return info


def poisoned_in_company(url: str, flag: Path, expected: dict) -> None:
    """The poisoned request joins with a good one (held behind a gated prefill until both are
    queued): the engine fails on the pair, the batch is re-run in halves, the good one gets its
    greedy answer and only the poisoned one the 500."""
    before = client.server_info(url)
    prompt = PROMPTS[0]
    with ThreadPoolExecutor(3) as pool:
        gate = pool.submit(request, url, gen_body(GATE + [5, 6], GREEDY))
        wait_for(lambda i: i["requests_in_flight"] - before["requests_in_flight"] == 1
                 and i["queued"] == 0, url)  # the gate is in its prefill
        pair = [pool.submit(request, url, gen_body(POISON + [5, 6], GREEDY)),
                pool.submit(request, url, gen_body(TOKENIZED[prompt], GREEDY))]
        wait_for(lambda i: i["queued"] == 2, url)  # both wait behind the gate
        flag.touch()
        poisoned, good = (f.result() for f in pair)
        assert gate.result().status == 200, gate.result()
    assert poisoned.status == 500 and "injected fault" in poisoned.body["error"]["message"], poisoned
    assert good.status == 200 and good.body["output_ids"] == expected[prompt], good
    info = wait_for(lambda i: i["requests_in_flight"] == 0 and i["admitted"] == 0
                    and i["requests_failed"] > before["requests_failed"], url)
    assert info["batches_retried"] - before["batches_retried"] == 1, info  # the pair was split
    assert info["requests_failed"] - before["requests_failed"] == 1, info


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")




# --------------------------------------------------------------------------------------------
# the test
# --------------------------------------------------------------------------------------------

def test_mixed_load_then_sigterm(llama_target, draft_dir, expected, tokenized, tmp_path):
    log = tmp_path / "server.log"
    flag, drain_over = tmp_path / "gate-open", tmp_path / "drain-over"
    prelude = (PRELUDE + HOLD_PRELUDE + gated_prefill(GATE, flag)
               + DRAIN_PRELUDE.format(flag=str(drain_over)))
    # (the drain's own timeout is a hang guard here: the test ends it, DRAIN_PRELUDE)
    with reference_server_process(server_args(llama_target.path, draft_dir, HANG_S), log,
                                  prelude=prelude) as (url, proc):
        # what each seeded sampled request gives alone
        seeded = {p: request(url, gen_body(p, {**SAMPLED, "sampling_seed": SEEDS[p]})).body[
            "output_ids"] for p in PROMPTS}
        clients = make_round(seeded)
        rss = []
        for _ in range(3):
            before = client.server_info(url)
            with ThreadPoolExecutor(N_CLIENTS) as pool:
                replies = list(pool.map(lambda c: run_client(url, *c), clients))
            check_round(clients, replies, expected, seeded)
            n_gone = sum(k == "disconnect" for k, _ in clients)
            # (the worker counts a request just after answering it: /server_info may lag)
            info = wait_for(lambda i: i["requests_in_flight"] == 0 and i["admitted"] == 0
                            and i["requests_aborted"] - before["requests_aborted"] >= n_gone
                            and i["requests_failed"] - before["requests_failed"] >= len(BAD_400) + 1, url)
            assert info["queued"] == 0
            # every disconnected stream was aborted (HOLD: none could finish its LONG_NEW tokens)
            assert info["requests_aborted"] - before["requests_aborted"] == n_gone
            assert info["requests_failed"] - before["requests_failed"] == len(BAD_400) + 1
            rss.append(rss_bytes(proc.pid))
        # (in the rounds the poison may join a running batch alone, and then fails alone at once)
        poisoned_in_company(url, flag, expected)
        # memory: round 3 costs nothing round 2 did not (allowing allocator noise)
        assert rss[2] - rss[1] < 24 << 20, [r >> 20 for r in rss]

        # -- SIGTERM with 24 requests in flight: 8 short ones first, then 16 long ones --------
        # that cannot finish (HOLD); the drain lets a short one finish, then the test ends it
        long = {**GREEDY, "max_new_tokens": LONG_NEW}
        specs = [(p, i % 2 == 0, GREEDY) if i < 8 else (HOLD + tokenized[p], i % 2 == 0, long)
                 for i, p in enumerate(PROMPTS * 6)]
        served = client.server_info(url)["requests_served"]

        def submitted(i: dict) -> int:
            return i["requests_in_flight"] + i["requests_served"] - served

        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(request, url, gen_body(p, sp, stream=s)) for p, s, sp in specs[:8]]
            wait_for(lambda i: submitted(i) == 8, url)
            futures += [pool.submit(request, url, gen_body(p, sp, stream=s))
                        for p, s, sp in specs[8:]]
            wait_for(lambda i: submitted(i) == len(specs), url)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # the short ones fill the batch (max 8) before any long one joins, so one finishes
            # before a long one holds the batch
            try:
                done, _ = wait(futures[:8], timeout=HANG_S, return_when=FIRST_COMPLETED)
            finally:
                drain_over.touch()  # the drain's end: what is still in flight is aborted
            assert done, "no request finished in the drain"
            replies = [f.result() for f in futures]
        answered = time.monotonic() - t0
        assert proc.wait(timeout=HANG_S) == 0
        elapsed = time.monotonic() - t0
        print(f"answered after {answered:.1f} s, exited after {elapsed:.1f} s")
    outcomes = {"finished": 0, "aborted": 0, "503": 0}
    for (p, stream, _), rep in zip(specs, replies):
        assert rep.error is None, rep
        if rep.status == 503:  # aborted before anything was sent: retry elsewhere
            assert "shutting down" in rep.body["error"]["message"]
            assert int(rep.headers["retry-after"]) >= 1
            outcomes["503"] += 1
            continue
        assert rep.status == 200, rep
        final = rep.events[-2] if stream else rep.body
        if stream:
            assert rep.events[-1] == "[DONE]", rep
        fr = final["meta_info"]["finish_reason"]
        assert fr is not None and fr["type"] in ("length", "abort"), rep
        assert fr["type"] == "abort" or p[:4] != HOLD, rep  # a HOLD request cannot finish
        outcomes["finished" if fr["type"] == "length" else "aborted"] += 1
    # short ones finish in the drain; the 16 long ones were cut when it ended
    assert outcomes["finished"] >= 1 and outcomes["aborted"] + outcomes["503"] >= 16, outcomes
    text = log.read_text()
    # the only tracebacks are the injected fault's, one per poisoned request (3 rounds, then
    # the one in company); none from the shutdown
    assert text.count("Traceback") == text.count("\nRuntimeError: injected fault") == 4, text
    assert "fastmtp serve: SIGTERM" in text and "fastmtp serve: stopped:" in text, text
    print(f"rss per round (MiB): {[r >> 20 for r in rss]}; SIGTERM round: {outcomes}, "
          f"exit after {elapsed:.1f} s")


def test_second_ctrl_c_aborts_at_once_and_exits_0(llama_target, draft_dir, tokenized, tmp_path):
    """Two streams that cannot finish (HOLD) and a drain that would last an hour: the first
    Ctrl-C starts the drain, the second (sent once the server has logged the first) aborts
    them at once, and the process exits 0."""
    log = tmp_path / "server.log"
    with reference_server_process(server_args(llama_target.path, draft_dir, 3600.0), log,
                                  prelude=PRELUDE + HOLD_PRELUDE) as (url, proc):
        long = {**GREEDY, "max_new_tokens": LONG_NEW}
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(request, url, gen_body(HOLD + tokenized[p], long, stream=True))
                       for p in PROMPTS[:2]]
            wait_for(lambda i: i["requests_in_flight"] == 2 and i["generated_tokens"] >= 2, url)
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + HANG_S
            while "fastmtp serve: SIGINT" not in log.read_text():  # the first one was handled
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            replies = [f.result() for f in futures]
        assert proc.wait(timeout=HANG_S) == 0  # (not the hour of the drain)
    for rep in replies:
        assert rep.error is None, rep
        if rep.status == 503:  # it had not joined the held batch: nothing was sent
            assert int(rep.headers["retry-after"]) >= 1, rep
            continue
        assert rep.status == 200 and rep.events[-1] == "[DONE]", rep
        assert rep.events[-2]["meta_info"]["finish_reason"]["type"] == "abort", rep
    assert any(rep.status == 200 for rep in replies)  # the one holding the batch was streaming
    assert "Traceback" not in log.read_text()
