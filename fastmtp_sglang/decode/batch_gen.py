"""Continuous-batching generation on CPU for self-distillation: a static KV cache whose slots are
refilled as rows finish.

``fastmtp distill --engine reference`` generates through this in-process, without HTTP. The
reference server batches whole requests (a batch runs until its longest row ends, so a batch of
16 spends most of its steps on a few long answers: 38 tok/s measured) and transformers'
``generate`` has no per-row seeds. Here:

- one preallocated KV cache per layer, ``[slots, n_kv, max_len, head_dim]``: a decode step runs
  every slot at its own position (keys beyond a row's length are masked), no per-step concat;
- a row that finishes frees its slot at once; the next waiting request is prefilled into it
  (alone, batch 1; consecutive requests with the same prompt, the n samples of one prompt, share
  one prefill) and joins the next decode step;
- each request samples with its own ``torch.Generator`` seeded with its seed, from exactly the
  distribution the reference engine samples from (``logits_to_probs``: temperature, top-k,
  top-p); with a top-k (distill's default, 20) the draw runs over the top-k logits only, which
  takes one batched ``topk`` instead of a sort of the vocabulary per step. A seed reproduces a
  request's tokens whatever else is batched with it; greedy output equals the target's own.

The forward reuses the target's own modules (norms, projections, MLP, rotary embedding) and only
replaces the cache and the attention call, so any Llama / Qwen2-family target that
``fastmtp_sglang.core.target.load_target`` accepts runs unchanged. Output equals the target's own
forward (fp32, tests: logits to 1e-5, greedy tokens identical to ``generate``).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from fastmtp_sglang.core.attention import grouped_attention
from fastmtp_sglang.decode.sampling import SamplingParams, logits_to_probs, sample


TOPK_FAST = 1024  # top-k at most this: sample from the top-k logits only (see SlotGenerator._pick)


class GenerationCancelled(RuntimeError):
    """The owner cancelled the run (GenWorker.cancel): requests not finished get this."""


class PromptTooLong(ValueError):
    """The prompt leaves no room in the slot's cache for even one new token."""


@dataclass
class GenRequest:
    input_ids: list[int]
    params: SamplingParams
    tag: Any = None  # returned with the result, untouched


@dataclass
class GenResult:
    output_ids: list[int]
    finish_reason: dict[str, Any]
    tag: Any = None
    prompt_tokens: int = 0


@dataclass
class _Slot:
    req: GenRequest
    fut: Future
    gen: torch.Generator
    out: list[int] = field(default_factory=list)


def kv_cache_bytes(config, slots: int, max_len: int, element_size: int) -> int:
    """Bytes of the static K and V caches for a transformers config."""
    heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * slots * n_kv * max_len * hd * element_size


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class SlotGenerator:
    """Generate for many requests with ``slots`` rows decoding at once.

    Parameters
    ----------
    target : fastmtp_sglang.core.target.Target
        A Llama / Qwen2-family transformers model (``model.model.layers``, ``model.model.norm``,
        ``model.model.rotary_emb``) and its tokenizer/config.
    slots : int
        Rows decoded together (the batch size); each holds one request.
    max_len : int
        Positions per slot (prompt + response); capped at ``max_position_embeddings``. A row that
        reaches it finishes with ``length``.
    """

    def __init__(self, target, slots: int, max_len: int):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.target = target
        self.model = target.model
        self.inner = self.model.model
        cfg = self.model.config
        self.layers = list(self.inner.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scaling = self.head_dim ** -0.5
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the slot generator")
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_len = min(int(max_len), int(getattr(cfg, "max_position_embeddings", max_len)))
        self.slots = slots
        shape = (len(self.layers), slots, self.n_kv, self.max_len, self.head_dim)
        # the cache in the model's dtype; a decode step reads it through a [:T] view with SDPA
        # (measured, 2 idle cores, batch 64, 300 keys, per layer: SDPA on the bf16 view 1.1 ms,
        # two fp32 batched matmuls 1.6 ms, SDPA over a full-length contiguous cache 1.8 ms)
        self.cache_dtype = self.dtype
        self.k = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        self.lens = torch.zeros(slots, dtype=torch.long, device=self.device)  # tokens cached per slot
        self.eos = set(target.eos_ids)
        self.generated_tokens = 0
        self.steps = 0
        self._live: list[_Slot | None] = []
        self._admitting: Future | None = None  # the request being prefilled, not yet in a slot
        self.cancelled = False  # set from another thread: the loop drops everything and returns

    @property
    def cache_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    # -- the forward ----------------------------------------------------------------------------
    def _layers(self, x: torch.Tensor, pos: torch.Tensor, write, read, mask) -> torch.Tensor:
        """x [b, s, H] embeddings at positions pos [b, s] -> post-norm hidden [b, s, H].

        ``write(l, k, v)`` stores this call's rotated keys/values ([b, n_kv, s, D]) for layer l,
        ``read(l)`` returns the keys/values to attend to ([b, n_kv, T, D] each) and ``mask`` is
        bool [b, 1, s, T].
        """
        b, s, _ = x.shape
        cos, sin = self.inner.rotary_emb(x, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for li, layer in enumerate(self.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_proj(h).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
            k = att.k_proj(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
            v = att.v_proj(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            write(li, k, v)
            kk, vv = read(li)
            # the query heads that share a key/value head become that head's query rows, so
            # attention reads each cached key once with no GQA expansion (core/attention.py)
            o = grouped_attention(q, kk, vv, mask, self.scaling)
            x = x + att.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.inner.norm(x)

    @torch.inference_mode()
    def prefill(self, slot: int, input_ids: list[int]) -> torch.Tensor:
        """Fill ``slot`` with a prompt; returns the last position's logits [V] (float32)."""
        n = len(input_ids)
        if n + 1 > self.max_len:
            raise PromptTooLong(f"the prompt has {n} tokens; slots hold {self.max_len} positions")
        ids = torch.tensor([input_ids], device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def write(li, k, v):
            self.k[li, slot, :, :n] = k[0].to(self.cache_dtype)
            self.v[li, slot, :, :n] = v[0].to(self.cache_dtype)
            own[li] = (k, v)

        mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()[None, None]
        h = self._layers(self.inner.embed_tokens(ids), pos, write, lambda li: own[li], mask)
        self.lens[slot] = n
        return self.model.lm_head(h[:, -1]).float()[0]

    @torch.inference_mode()
    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """Give ``dst`` the first ``n`` cached positions of ``src`` (a prompt both share)."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lens[dst] = n

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """One step for every slot: ``tokens`` [slots] at positions ``lens`` -> logits [slots, V].

        Idle slots (``active`` [slots] bool False) compute too and their rows are ignored: a fixed
        batch shape keeps every step's matmuls the same size and costs less than gathering the
        live rows. Their lengths do not advance, and their writes land past any prompt they hold.
        """
        active = torch.ones(self.slots, dtype=torch.bool, device=self.device) if active is None else active
        pos = self.lens.clamp(max=self.max_len - 1)
        T = int(pos[active].max()) + 1 if bool(active.any()) else 1
        pos = torch.where(active, pos, pos.clamp(max=T - 1))
        # row (slot, kv head, pos) of a layer's cache viewed as [slots * n_kv * max_len, D]: one
        # single-index assignment per layer (in isolation 25 us vs 92 us for the two-index form
        # cache[rows, :, pos] at batch 64; inside a full decode step both cost ~0.3 ms, which is
        # not understood)
        flat = ((torch.arange(self.slots, device=self.device)[:, None] * self.n_kv
                 + torch.arange(self.n_kv, device=self.device)[None]) * self.max_len
                + pos[:, None]).reshape(-1)

        def write(li, k, v):  # k [slots, n_kv, 1, D]
            self.k[li].view(-1, self.head_dim)[flat] = k.reshape(-1, self.head_dim)
            self.v[li].view(-1, self.head_dim)[flat] = v.reshape(-1, self.head_dim)

        def read(li):
            return self.k[li, :, :, :T], self.v[li, :, :, :T]

        mask = (torch.arange(T, device=self.device)[None] <= pos[:, None])[:, None, None]
        h = self._layers(self.inner.embed_tokens(tokens[:, None]), pos[:, None], write, read, mask)
        self.lens = torch.where(active, pos + 1, self.lens)
        self.steps += 1
        return self.model.lm_head(h[:, 0]).float()

    # -- scheduling -------------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, slots: list[_Slot]) -> list[int]:
        """logits [n, V] of the given live slots -> one token each, greedy or seeded sampling.

        Rows with a top-k of at most ``TOPK_FAST`` (distill's default is 20) sample from their
        top-k logits only: one batched ``topk`` instead of a full-vocabulary sort, and a draw over
        k entries instead of V. The distribution is exactly ``logits_to_probs``'s (softmax at the
        temperature, top-k, then top-p over what top-k kept, renormalised); the random stream
        is the request's own generator, so a seed reproduces its tokens whatever the batch.
        Other rows go through ``logits_to_probs`` and ``sample`` (the reference engine's path).
        """
        toks = logits.argmax(-1).tolist()
        fast = [i for i, s in enumerate(slots)
                if not s.req.params.is_greedy and 0 < s.req.params.top_k <= TOPK_FAST]
        slow = [i for i, s in enumerate(slots)
                if not s.req.params.is_greedy and i not in set(fast)]
        if fast:
            ps = [slots[i].req.params for i in fast]
            kmax = min(max(p.top_k for p in ps), logits.shape[-1])
            vals, idx = logits[fast].float().topk(kmax, dim=-1)                 # [f, kmax] sorted
            temp = torch.tensor([p.temperature for p in ps])[:, None]
            rank = torch.arange(kmax)[None]
            keep = rank < torch.tensor([p.top_k for p in ps])[:, None]
            probs = torch.softmax(vals / temp, dim=-1) * keep
            cum = probs.cumsum(-1)
            before = cum - probs
            top_p = torch.tensor([p.top_p for p in ps])[:, None]
            probs = probs * ((before < top_p * cum[:, -1:]) | (top_p >= 1))
            for j, i in enumerate(fast):
                toks[i] = int(idx[j, int(torch.multinomial(probs[j], 1, generator=slots[i].gen))])
        if slow:
            ps = [slots[i].req.params for i in slow]
            probs = logits_to_probs(logits[slow], torch.tensor([p.temperature for p in ps]),
                                    torch.tensor([p.top_p for p in ps]),
                                    torch.tensor([p.top_k for p in ps]))
            for j, i in enumerate(slow):
                toks[i] = int(sample(probs[j:j + 1], slots[i].gen))
        return toks

    def serve(self, inbox: "queue.Queue[tuple[GenRequest, Future] | None]") -> None:
        """Run requests from ``inbox`` until a ``None`` arrives and every row has finished.

        Each request's Future gets a GenResult, or the exception that request caused
        (PromptTooLong, a bad parameter); the others go on.
        """
        with torch.inference_mode():
            self._serve(inbox)

    def in_flight(self) -> list[Future]:
        """Futures of the requests holding a slot (for failing them when the loop dies)."""
        futs = [s.fut for s in self._live if s is not None]
        return futs + ([self._admitting] if self._admitting is not None else [])

    def _serve(self, inbox) -> None:
        live: list[_Slot | None] = [None] * self.slots
        self._live = live
        last = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        # what each slot's cache positions [0, n) hold: a prompt is only ever overwritten by the
        # next prefill of that slot, so a sibling sample can copy it from any slot that has it
        held: list[tuple[int, ...] | None] = [None] * self.slots
        first: dict[int, torch.Tensor] = {}  # slot -> logits after its prompt
        closing = False
        while True:
            if self.cancelled:
                raise GenerationCancelled("generation cancelled")
            for i in range(self.slots):  # fill free slots; block only when nothing runs
                if live[i] is not None or closing:
                    continue
                try:
                    item = inbox.get(block=all(s is None for s in live))
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                req, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                self._admitting = fut
                try:
                    if req.params.stop:
                        raise ValueError("stop strings are not supported by the slot generator")
                    key = tuple(req.input_ids)
                    src = next((j for j in range(self.slots) if held[j] == key), None)
                    if src is None:
                        held[i] = None
                        first[i] = self.prefill(i, req.input_ids)
                    else:
                        self.copy_slot(src, i, len(key))
                        first[i] = first[src]
                    held[i] = key
                    g = torch.Generator(device=self.device)
                    g.manual_seed(req.params.seed if req.params.seed is not None
                                  else int(torch.randint(0, 2**62, (1,)).item()))
                    s = _Slot(req, fut, g)
                    tok = self._pick(first[i][None], [s])[0]
                except Exception as exc:  # this request's fault (too long, bad params): it alone fails
                    fut.set_exception(exc)
                    continue
                if not self._advance(s, tok, int(self.lens[i])):
                    live[i] = s
                    last[i] = tok
                else:
                    held[i] = None
                self._admitting = None
            idx = [i for i, s in enumerate(live) if s is not None]
            if not idx:
                if closing:
                    return
                continue
            act = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
            act[idx] = True
            logits = self.decode(last, act)
            toks = self._pick(logits[idx], [live[i] for i in idx])
            for i, tok in zip(idx, toks):
                last[i] = tok
                if self._advance(live[i], tok, int(self.lens[i])):
                    live[i] = None
                    held[i] = None  # idle slots write scratch keys (see decode): not a source

    def _advance(self, s: _Slot, tok: int, cached: int) -> bool:
        """Append a token; True (and the Future resolved) when the request is finished.
        ``cached``: positions in the slot's cache, i.e. where this token would be written."""
        s.out.append(tok)
        p = s.req.params
        why = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
            why = {"type": "stop", "matched": tok}
        elif len(s.out) >= p.max_new_tokens or cached >= self.max_len:
            why = {"type": "length", "length": len(s.out)}
        if why is None:
            return False
        self.generated_tokens += len(s.out)
        s.fut.set_result(GenResult(s.out, why, s.req.tag, len(s.req.input_ids)))
        return True

    def start(self) -> "GenWorker":
        """The generator on a background thread (see GenWorker for why the calling thread is
        the faster place to run it)."""
        return GenWorker(self)

    def worker(self) -> "GenWorker":
        """A GenWorker whose ``run()`` the caller makes on its own (usually the main) thread."""
        return GenWorker(self, thread=False)


class GenWorker:
    """A SlotGenerator fed through a queue: ``submit`` returns a Future of GenResult.

    With ``thread=True`` the generator runs on a background thread at once; with ``thread=False``
    the owner calls ``run()`` on the thread it chooses, normally the main thread, and submits
    from another one (or submits everything first, then ``close(wait=False)`` and ``run()``).
    Why it matters on CPU: with PyTorch's OpenMP backend (libgomp), once the main thread has run
    a parallel region (loading a model does), the same ops issued from another thread run
    ~1.5-1.8x slower on this 2-core machine (measured: a bf16 [64, 576] x [576, 1536] linear
    157 us on the main thread vs 266-295 us on a second one; a batch-64 decode step 170-190 ms vs
    260-290 ms). Heavy loops belong on the thread that loaded the model.
    """

    def __init__(self, gen: SlotGenerator, thread: bool = True):
        self.gen = gen
        self.inbox: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = None
        if thread:
            self.thread = threading.Thread(target=self._run, name="slot-generator", daemon=True)
            self.thread.start()

    def run(self) -> None:
        """Serve on the calling thread until ``close()``'s marker and the last row are done.
        An engine fault (or KeyboardInterrupt) fails every request still queued or in flight,
        then propagates."""
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
        """Stop at the next step: unfinished requests fail with GenerationCancelled."""
        self.gen.cancelled = True
        self.inbox.put(None)  # wakes a loop blocked on an empty inbox

    def close(self, wait: bool = True) -> None:
        """No more requests: the rows in flight finish, then the generator returns (and with a
        background thread and ``wait``, that thread is joined)."""
        self.inbox.put(None)
        if wait and self.thread is not None:
            self.thread.join()


def generate_all(target, requests: list[GenRequest], slots: int, max_len: int) -> list[GenResult]:
    """Convenience: run a list of requests to completion on the calling thread, results in
    request order."""
    w = SlotGenerator(target, slots, max_len).worker()
    futs = [w.submit(r) for r in requests]
    w.close()
    w.run()
    return [f.result() for f in futs]
