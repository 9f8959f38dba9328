"""The reference server's bookkeeping of requests in flight: a place in the bounded queue
(``_Slot``), one /generate request from submission to its final event (``_Job``), and the
server's lifetime counters (``ServerStats``) that the worker loop (fastmtp_sglang.serving.worker)
and the HTTP side report with."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from fastmtp_sglang.decode.engine import Request
from fastmtp_sglang.serving.protocol import GenerateInput


# ----------------------------------------------------------------------------------------------
# requests in flight
# ----------------------------------------------------------------------------------------------

class _Slot:
    """One place in the bounded queue; released once, by whoever gets there first (``free``:
    the queue's own bookkeeping, called at that release)."""

    def __init__(self, free: Callable[[], None]):
        self._free, self._held, self._lock = free, True, threading.Lock()

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._free()


@dataclass(eq=False)
class _Job:
    """One /generate request from submission to its final event.

    Events go to the HTTP side through ``emit`` (thread-safe, never blocks): ``accepted`` (it
    joined a batch), ``chunk`` (stream: new output is ready, no payload; at most one is on its
    way at a time, ``chunk_pending``, and the HTTP side takes the output when it can send it, so
    a client that reads slowly holds one cumulative chunk, not one per cycle), then exactly one
    final event: ``done`` (the result), ``error`` ((status, message)) or ``aborted`` ((status,
    partial result)). ``lock`` orders the worker's events against an abort from the HTTP side,
    so nothing follows a final event."""

    inp: GenerateInput
    input_ids: list[int]
    received: float  # time.time() when the request arrived
    emit: Callable[[str, Any], None]
    slot: _Slot | None = None
    internal: bool = False  # a /health_generate probe: kept out of the statistics
    req: Request | None = None  # the engine request of the current run
    prefix: list[int] = field(default_factory=list)         # a resumed run starts after these
    out_ids: list[int] = field(default_factory=list)        # this run's tokens so far
    # a stream's output so far, as the client sees it (sent, or ready to be sent): a re-run
    # after a fault resumes after it
    streamed_ids: list[int] = field(default_factory=list)
    stream_text: str = ""            # its text, detokenized incrementally
    text_offsets: tuple[int, int] = (0, 0)  # (prefix, read) offsets of that detokenizer
    chunk_pending: bool = False      # a ``chunk`` event not yet taken by the HTTP side (lock)
    queued: bool = False             # in the worker's wait queue (the worker's _cond)
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
        self.batches = 0             # prefills that started or joined a running batch
        self.largest_batch = 0       # most rows the running batch held
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.generated_tokens = 0    # every token the engine emitted, aborted and re-run ones too
        self.cycles = 0
        self.accepted = 0
        self.connections_refused = 0  # over max_connections: 503 as they opened
        self.header_timeouts = 0     # connections closed waiting for a request's headers
        self.write_timeouts = 0      # connections cut off: the client left what was sent unread
        self.body_timeouts = 0       # 408: a request body that did not arrive within read_timeout_s
        self.bodies_too_large = 0    # 413: a body over max_body_bytes

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
                "connections_refused": self.connections_refused,
                "header_timeouts": self.header_timeouts,
                "write_timeouts": self.write_timeouts,
                "body_timeouts": self.body_timeouts,
                "bodies_too_large": self.bodies_too_large,
            }


def _rss_bytes() -> int:
    """Resident memory of this process now (peak on systems without /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
