"""The cost curve that decides whether speculation pays on this machine.

Measured through the reference engine's own calls (the target forward plus its lm_head over n new
tokens, the head's draft step plus its projection, the head's draft extend over n positions), at
batch 1 after a ``context``-token cache, with warm-up, the order of the shapes rotated between
repeats, and medians. Beside every cost stands its memory-bound floor: the bytes of weights the
call must read once, divided by this machine's measured read bandwidth (a large fp32 sum).

The cost model of docs/design.md section 2 reads off it: a cycle at K costs about
``verify(K + 1) + K * draft_step + extend`` (the first draft needs only the projection, so this
slightly overestimates) and emits ``1 + accepted`` tokens; fastmtp_sglang.decode.auto uses it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fastmtp_sglang.core.hardware import REPORTED_FLAGS, cpu_flags, cpu_model
from fastmtp_sglang.cpu_kernels.packed_linear import is_packed, pack_for_inference, unpack_linears
from fastmtp_sglang.decode.batch import sample_draft
from fastmtp_sglang.decode.lean_forward import lean_forward_for
from fastmtp_sglang.decode.lean_head import LeanHead
from fastmtp_sglang.decode.sampling import SamplingParams, logits_to_probs, sample, sample_rows


def cpu_description() -> dict[str, Any]:
    """The CPU's model name, the flags that decide which kernels are fast, and torch's threads."""
    flags = cpu_flags()
    return {"model": cpu_model(), "flags": [f for f in REPORTED_FLAGS if f in flags],
            "threads": torch.get_num_threads()}


def read_bandwidth(mib: int = 512, repeats: int = 7) -> float:
    """Bytes per second of one core team reading a ``mib`` MiB fp32 buffer (median of repeats)."""
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()  # first touch
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def weight_bytes(module: torch.nn.Module, exclude: torch.nn.Module | None = None) -> int:
    """Bytes of the distinct parameter tensors of ``module`` (tied weights counted once), without
    those of ``exclude``."""
    skip = {p.data_ptr() for p in exclude.parameters()} if exclude is not None else set()
    seen, total = set(), 0
    for p in module.parameters():
        ptr = p.data_ptr()
        if ptr in seen or ptr in skip:
            continue
        seen.add(ptr)
        total += p.numel() * p.element_size()
    return total


@dataclass
class CostCurve:
    """Milliseconds per call at batch ``batch`` (1 unless said), and each call's memory-bound
    floor (ms; the weights are read once per call whatever the batch)."""
    cpu: dict[str, Any]
    dtype: str
    context: int
    bandwidth_gbs: float
    target_weight_mb: float
    verify_ms: dict[int, float]                 # n new tokens -> target forward + lm_head
    verify_floor_ms: float
    draft_step_ms: float | None = None          # head step + projection (+ argmax)
    draft_floor_ms: float | None = None
    extend_ms: dict[int, float] = field(default_factory=dict)   # head over n target positions
    spread: dict[str, float] = field(default_factory=dict)      # (max - min) / median per shape
    batch: int = 1                              # rows per call
    lean_forward: bool = False                  # the target ran through decode/lean_forward.py
    packed_linear: bool = False                 # linear layers on prepared oneDNN weights
    # the same calls when the request samples (temperature 1, no top-k/top-p): the plain step's
    # token drawn from the softmax, the draft step's drawn over its table with q for verification
    plain_sampled_ms: float | None = None
    draft_step_sampled_ms: float | None = None

    @property
    def plain_ms(self) -> float:
        return self.verify_ms[1]

    def verify_ratio(self, n: int) -> float:
        """verify(n) / plain step: 1.0 means verifying n tokens is free."""
        return self.verify_ms[n] / self.plain_ms

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["plain_ms"] = self.plain_ms
        d["plain_over_floor"] = self.plain_ms / self.verify_floor_ms
        d["verify_ratio"] = {n: self.verify_ratio(n) for n in self.verify_ms}
        return d


def interleaved_ms(calls: dict[str, Any], repeats: int, warmup: int = 3) -> dict[str, list[float]]:
    """Milliseconds of every call in ``calls`` (name -> function), ``repeats`` times each, the
    calls interleaved and their order rotated from round to round so slow drift of the machine
    hits every call alike; ``warmup`` untimed rounds first."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


@torch.inference_mode()
def measure(target, head=None, draft_vocab=None, ns: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8),
            context: int = 200, repeats: int = 15, warmup: int = 3, bandwidth_mib: int = 512,
            batch: int = 1, stock: bool = False, fuse: bool = True, lean: bool = True,
            sampled: bool = False) -> CostCurve:
    """Time the calls of one speculative cycle at batch ``batch`` (see the module docstring).

    ``target``: fastmtp_sglang.core.target.Target; ``head``: FastMTPHead or None (then only the
    target's costs); ``draft_vocab``: the DraftVocab the engine drafts over, or None (full
    vocabulary). ``ns``: the numbers of new tokens per target forward (1 = a plain step);
    ``bandwidth_mib``: size of the buffer the read bandwidth is measured on; ``batch``: rows
    per call (every row a ``context``-token cache, as a batch of that many requests);
    ``stock``: time transformers' own DynamicCache, sdpa attention and linear layers instead of
    the engine's in-place slots, GQA attention (decode/slot_cache.py) and prepared bf16 weights
    (cpu_kernels/packed_linear.py), for a side-by-side comparison; ``fuse`` False: prepared weights
    without the fused q/k/v and gate/up products; ``lean`` False: the target's forward through
    transformers' model instead of the engine's lean forward (decode/lean_forward.py; ``stock``
    implies it); ``sampled``: also time the plain step and the draft step when the request
    samples at temperature 1 (``plain_sampled_ms``, ``draft_step_sampled_ms``)."""
    from transformers import DynamicCache

    from fastmtp_sglang.decode.slot_cache import ATTN_NAME, SlotCache, use_gqa_sdpa

    model = target.model
    prev_attn = model.config._attn_implementation
    was_packed = is_packed(model)
    if stock:
        if prev_attn == ATTN_NAME:
            model.set_attn_implementation("sdpa")
        for m in (model, head):
            if m is not None:
                unpack_linears(m)
    else:
        use_gqa_sdpa(model)
        if not fuse:
            for m in (model, head):
                if m is not None:
                    unpack_linears(m)
        pack_for_inference(model, head, fuse=fuse)
    try:
        fwd = lean_forward_for(model, "auto" if lean and not stock else "off")
        return _measure(target, head, draft_vocab, ns, context, repeats, warmup, bandwidth_mib,
                        batch, DynamicCache() if stock else SlotCache(), fwd, sampled)
    finally:
        if model.config._attn_implementation != prev_attn:
            model.set_attn_implementation(prev_attn)
        if (stock or not fuse) and was_packed:
            for m in (model, head):
                if m is not None:
                    unpack_linears(m)
            pack_for_inference(model, head, "on")


def _measure(target, head, draft_vocab, ns, context, repeats, warmup, bandwidth_mib, batch,
             cache, fwd=None, sampled=False) -> CostCurve:
    model, dev = target.model, next(target.model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = int(target.lm_head.weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    B = batch
    ids = torch.randint(0, vocab, (B, context + max(ns)), generator=gen).to(dev)
    out = model.model(input_ids=ids[:, :context],
                      position_ids=torch.arange(context, device=dev)[None].expand(B, -1),
                      attention_mask=torch.ones(B, context, dtype=torch.long, device=dev),
                      past_key_values=cache, use_cache=True)
    hidden = out.last_hidden_state                                              # [B, context, H]

    def verify(n: int, sampled: bool = False):
        pos = torch.arange(context, context + n, device=dev)[None].expand(B, -1)
        mask = torch.ones(B, context + n, dtype=torch.long, device=dev)
        if fwd is not None:  # the engine's own forward (decode/lean_forward.py)
            h = fwd(ids[:, context:context + n], pos, mask, cache)[0]
        else:
            h = model.model(input_ids=ids[:, context:context + n], position_ids=pos, attention_mask=mask,
                            past_key_values=cache, use_cache=True).last_hidden_state
        logits = target.lm_head(h).float()
        if sampled:  # as ReferenceEngine samples a K=0 cycle's token (Batch.sample)
            sample_rows(logits[:, -1], t1_params, gens)
        else:
            logits.argmax(-1)
        cache.crop(-n)

    t1_params = [SamplingParams(temperature=1.0)] * B
    gens = [torch.Generator(device=dev).manual_seed(i) for i in range(B)]
    calls: dict[str, Any] = {f"verify{n}": (lambda n=n: verify(n)) for n in ns}
    if sampled and 1 in ns:
        calls["plain_sampled"] = lambda: verify(1, sampled=True)
    if head is not None:
        # as the engine does (ReferenceEngine._head)
        run_head = (LeanHead(head).run if fwd is not None
                    else lambda h, i, p, c: head(h, i, p, c, return_logits=False)[0])

        dcache = head.new_cache(B, context + max(ns) + 2, device=dev)
        run_head(hidden, ids[:, 1:context + 1], torch.arange(context, device=dev)[None].expand(B, -1),
                 dcache)
        g0 = hidden[:, -1]
        tok = ids[:, context:context + 1]
        step_pos = torch.full((B, 1), context, device=dev)

        tidx = torch.zeros(B, dtype=torch.long, device=dev)
        ones, no_k = torch.ones(B, device=dev), torch.full((B,), -1, device=dev)

        def draft_step(sampled: bool = False):
            g = run_head(g0[:, None], tok, step_pos, dcache)[:, 0]
            if draft_vocab is None:  # (as Batch.draft_pick / Batch.pick)
                logits = head.project(g).float()
                if sampled:
                    probs = logits_to_probs(logits, ones, ones, no_k)
                    [sample(probs[i:i + 1], gen) for i, gen in enumerate(gens)]
                else:
                    logits.argmax(-1)
            elif sampled:
                sample_draft(draft_vocab, g, tidx, None, ones, ones, no_k, gens)
            else:
                draft_vocab.greedy(g, tidx, None)

        def extend(n: int):
            pos = torch.arange(context, context + n, device=dev)[None].expand(B, -1)
            run_head(hidden[:, -n:], ids[:, context:context + n], pos, dcache)

        calls["draft_step"] = draft_step
        if sampled:
            calls["draft_step_sampled"] = lambda: draft_step(sampled=True)
        calls.update({f"extend{n}": (lambda n=n: extend(n)) for n in ns})
    times = interleaved_ms(calls, repeats, warmup)
    med = {n: statistics.median(v) for n, v in times.items()}
    spread = {n: (max(v) - min(v)) / med[n] for n, v in times.items()}
    bw = read_bandwidth(bandwidth_mib)
    tbytes = weight_bytes(model)
    curve = CostCurve(cpu=cpu_description(), dtype=str(dtype).replace("torch.", ""), context=context,
                      bandwidth_gbs=bw / 1e9, target_weight_mb=tbytes / 1e6,
                      verify_ms={n: med[f"verify{n}"] for n in ns}, verify_floor_ms=tbytes / bw * 1e3,
                      spread=spread, batch=B, packed_linear=is_packed(model),
                      lean_forward=fwd is not None, plain_sampled_ms=med.get("plain_sampled"))
    if head is not None:
        rows = (draft_vocab.table_weight[0].numel() * draft_vocab.table_weight.element_size()
                if draft_vocab is not None else target.lm_head.weight.numel() * target.lm_head.weight.element_size())
        hbytes = weight_bytes(head, exclude=target.model) + rows
        curve.draft_step_ms = med["draft_step"]
        curve.draft_step_sampled_ms = med.get("draft_step_sampled")
        curve.draft_floor_ms = hbytes / bw * 1e3
        curve.extend_ms = {n: med[f"extend{n}"] for n in ns}
    return curve


def markdown(curve: CostCurve) -> str:
    c = curve
    lines = [f"CPU: {c.cpu['model']} ({', '.join(c.cpu['flags']) or 'no avx2'}), {c.cpu['threads']} threads; "
             f"{c.dtype}{', packed linear layers' if c.packed_linear else ''}{', lean forward' if c.lean_forward else ''}; {c.context}-token cache; "
             f"read bandwidth {c.bandwidth_gbs:.1f} GB/s",
             "", "| call | ms | x plain step | memory floor ms | x floor |", "|---|---|---|---|---|"]
    for n, ms in c.verify_ms.items():
        what = "plain step (1 token)" if n == 1 else f"verify {n} tokens"
        lines.append(f"| {what} | {ms:.2f} | {ms / c.plain_ms:.2f} | {c.verify_floor_ms:.2f} | "
                     f"{ms / c.verify_floor_ms:.1f} |")
        if n == 1 and c.plain_sampled_ms is not None:
            ms = c.plain_sampled_ms
            lines.append(f"| plain step, sampled (T=1) | {ms:.2f} | {ms / c.plain_ms:.2f} | "
                         f"{c.verify_floor_ms:.2f} | {ms / c.verify_floor_ms:.1f} |")
    if c.draft_step_ms is not None:
        lines.append(f"| draft step | {c.draft_step_ms:.2f} | {c.draft_step_ms / c.plain_ms:.2f} | "
                     f"{c.draft_floor_ms:.2f} | {c.draft_step_ms / c.draft_floor_ms:.1f} |")
        if c.draft_step_sampled_ms is not None:
            ms = c.draft_step_sampled_ms
            lines.append(f"| draft step, sampled (T=1) | {ms:.2f} | {ms / c.plain_ms:.2f} | "
                         f"{c.draft_floor_ms:.2f} | {ms / c.draft_floor_ms:.1f} |")
        for n, ms in c.extend_ms.items():
            lines.append(f"| draft extend, {n} positions | {ms:.2f} | {ms / c.plain_ms:.2f} | | |")
    return "\n".join(lines) + "\n"
