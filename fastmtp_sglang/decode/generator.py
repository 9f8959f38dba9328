"""Generation for many requests through the serving engine, fed from a queue: what
``fastmtp distill`` runs in-process (self-distillation), with no second batcher.

A :class:`QueueGenerator` keeps up to ``slots`` requests decoding together in one
``ReferenceEngine`` batch (continuous batching: ``start`` / ``join`` / ``step``, the calls the
server's worker makes), so distillation gets every speed-up the engine gets (prepared bf16
weights, the lean forward, AMX tiles where the CPU has them) and the engine's finish rules (EOS,
stop ids and strings, ``max_new_tokens``, the context). What distillation relies on:

- **per-request seeds**: every row samples with its own generator (``Row.gen``), through
  ``sampling.sample_rows`` at K=0: a seed gives the same tokens whatever else is batched (fp32;
  in bf16 the logits of a row can differ in the last bits with the batch's shape, docs/design.md
  section 6.3). With ``steps > 0`` the engine's speculation is lossless for sampling too (same
  distribution), but a seed's draws then depend on the cycle's K;
- **n samples of a prompt share one prefill**: the engine reads a prompt once for all its
  copies admitted together (``ReferenceEngine._prefill``), and requests are admitted in groups
  of at least ``join_min`` (or all that wait, or whatever fits), so the n consecutive samples of
  a prompt usually join together;
- **top-k sampling without a sort of the vocabulary** (``sampling.sample_rows``).

The loop runs on the thread that calls :meth:`GenWorker.run` (the main thread on CPU: see
:class:`GenWorker`); requests come from any thread through :meth:`GenWorker.submit`.
"""

from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.sampling import SamplingParams


class GenerationCancelled(RuntimeError):
    """The owner cancelled the run (GenWorker.cancel): requests not finished get this."""


@dataclass
class GenRequest:
    input_ids: list[int]
    params: SamplingParams
    tag: Any = None  # returned with the result, untouched
    features: int | None = None  # engine.Request.features: keep what training reads (top-k)


@dataclass
class GenResult:
    output_ids: list[int]
    finish_reason: dict[str, Any]
    tag: Any = None
    prompt_tokens: int = 0
    features: tuple | None = None  # engine.Result.features


def kv_cache_bytes(config, slots: int, max_len: int, element_size: int) -> int:
    """Bytes of K and V caches holding ``slots`` rows of ``max_len`` positions (transformers
    config): what a batch of distillation requests needs at least."""
    heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * slots * n_kv * max_len * hd * element_size


class QueueGenerator:
    """Run queued requests through ``engine``, at most ``slots`` at once.

    Parameters
    ----------
    engine : ReferenceEngine
        Usually at K=0 (plain decoding: distillation's fastest path when the head is weak);
        any engine the server could run works.
    slots : int
        Rows decoding together (the batch size).
    join_min : int, optional
        Free rows to wait for before admitting waiting requests into a running batch (default
        ``max(1, slots // 8)``): one prefill per group instead of one per finished row, and the
        n samples of a prompt admitted together share their prefill. A batch with no rows
        admits at once.
    """

    def __init__(self, engine: ReferenceEngine, slots: int, join_min: int | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.engine, self.slots = engine, slots
        self.join_min = max(1, slots // 8) if join_min is None else max(1, int(join_min))
        engine.rows_hint = max(engine.rows_hint, slots)  # the batch's cache is sized once
        self.generated_tokens = 0
        self.cycles = 0
        self.cancelled = False  # set from another thread: the loop drops everything and returns
        self._futs: dict[int, tuple[Future, GenRequest]] = {}  # row key -> its request
        self._admitting: list[Future] = []
        self._waiting: collections.deque = collections.deque()  # taken from the inbox, not admitted

    def in_flight(self) -> list[Future]:
        """Futures of the requests taken from the inbox and not finished (failed when the loop
        dies)."""
        return ([f for f, _ in self._futs.values()] + list(self._admitting)
                + [f for _, f in self._waiting])

    def serve(self, inbox: "queue.Queue[tuple[GenRequest, Future] | None]") -> None:
        """Run requests from ``inbox`` until a ``None`` arrives and every row has finished.
        A request the engine refuses (too long, bad ids) fails alone with the engine's
        ``RequestError`` (a ValueError); an engine fault propagates."""
        with torch.inference_mode():
            self._serve(inbox)

    def _serve(self, inbox) -> None:
        waiting = self._waiting
        batch = None
        closing = False
        next_key = 0
        while True:
            if self.cancelled:
                raise GenerationCancelled("generation cancelled")
            running = batch is not None and len(batch) > 0
            # take what has arrived; block only when there is nothing else to do
            while not closing:
                try:
                    item = inbox.get(block=not running and not waiting)
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                if item[1].set_running_or_notify_cancel():
                    waiting.append(item)
            if self.cancelled:
                raise GenerationCancelled("generation cancelled")
            free = self.slots - (len(batch) if running else 0)
            if waiting and free > 0 and (not running or free >= min(self.join_min, len(waiting))):
                admit = []
                while waiting and len(admit) < free:
                    req, fut = waiting.popleft()
                    r = Request(req.input_ids, req.params, features=req.features)
                    try:
                        self.engine.validate(r)
                        if req.params.max_new_tokens < 1:
                            raise ValueError("max_new_tokens must be >= 1")
                    except ValueError as exc:  # this request's fault: it alone fails
                        fut.set_exception(exc)
                        continue
                    admit.append((r, next_key, req, fut))
                    next_key += 1
                if admit:
                    self._admitting = [a[3] for a in admit]
                    reqs, keys = [a[0] for a in admit], [a[1] for a in admit]
                    if running:
                        self.engine.join(batch, reqs, keys)
                    else:
                        batch = self.engine.start(reqs, keys)
                    for _, key, req, fut in admit:
                        self._futs[key] = (fut, req)
                    self._admitting = []
                    running = True
            if not running:
                if closing and not waiting:
                    return
                continue
            done = self.engine.step(batch)
            self.cycles += 1
            for key, res in done:
                fut, req = self._futs.pop(key)
                self.generated_tokens += len(res.output_ids)
                fut.set_result(GenResult(res.output_ids, res.finish_reason, req.tag,
                                         len(req.input_ids), res.features))

    def worker(self) -> "GenWorker":
        """A GenWorker whose ``run()`` the caller makes on its own (usually the main) thread."""
        return GenWorker(self, thread=False)

    def start(self) -> "GenWorker":
        """The generator on a background thread (see GenWorker for why the calling thread is
        the faster place to run it)."""
        return GenWorker(self)


class GenWorker:
    """A QueueGenerator fed through a queue: ``submit`` returns a Future of GenResult.

    With ``thread=True`` the generator runs on a background thread at once; with ``thread=False``
    the owner calls ``run()`` on the thread it chooses, normally the main thread, and submits
    from another one (or submits everything first, then ``close(wait=False)`` and ``run()``).
    Why it matters on CPU: with PyTorch's OpenMP backend (libgomp), once the main thread has run
    a parallel region (loading a model does), the same ops issued from another thread run
    slower (docs/design.md section 6.6). Heavy loops belong on the thread that loaded the model.
    """

    def __init__(self, gen: QueueGenerator, thread: bool = True):
        self.gen = gen
        self.inbox: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = None
        if thread:
            self.thread = threading.Thread(target=self._run, name="queue-generator", daemon=True)
            self.thread.start()

    def run(self) -> None:
        """Serve on the calling thread until ``close()``'s marker and the last row are done.
        An engine fault (or KeyboardInterrupt) fails every request still queued or in flight,
        then propagates; a cancel returns quietly."""
        if self.thread is not None:
            raise RuntimeError("this worker already runs on its own thread")
        try:
            self._run(reraise=True)
        except GenerationCancelled:
            pass

    def _run(self, reraise: bool = False) -> None:
        try:
            self.gen.serve(self.inbox)
        except BaseException as exc:  # an engine fault: fail everything still waiting
            self.error = exc
            err = exc if isinstance(exc, Exception) else RuntimeError(f"generation stopped: {exc!r}")
            for fut in self.gen.in_flight():
                if not fut.done():
                    fut.set_exception(err)
            while True:
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[1].set_running_or_notify_cancel():
                    item[1].set_exception(err)
            if reraise:
                raise

    def submit(self, req: GenRequest) -> Future:
        if self.error is not None:
            raise RuntimeError(f"the generator stopped: {self.error}") from self.error
        fut: Future = Future()
        self.inbox.put((req, fut))
        return fut

    def cancel(self) -> None:
        """Stop at the next cycle: unfinished requests fail with GenerationCancelled."""
        self.gen.cancelled = True
        self.inbox.put(None)  # wakes a loop blocked on an empty inbox

    def close(self, wait: bool = True) -> None:
        """No more requests: the rows in flight finish, then the generator returns (and with a
        background thread and ``wait``, that thread is joined)."""
        self.inbox.put(None)
        if wait and self.thread is not None:
            self.thread.join()


def generate_all(engine: ReferenceEngine, requests: list[GenRequest], slots: int,
                 join_min: int | None = None) -> list[GenResult]:
    """Run a list of requests to completion on the calling thread; results in request order
    (a refused request raises its error here)."""
    w = QueueGenerator(engine, slots, join_min).worker()
    futs = [w.submit(r) for r in requests]
    w.close()
    w.run()
    return [f.result() for f in futs]
