"""What the reference server sends back for a request (serving/worker.py decides when): the
/generate answer of a finished request in SGLang's shape with our acceptance figures beside it,
a stream's cumulative events and the text its newest tokens add, and the result of a stream
re-run after an engine failure (what was sent, then what followed)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from fastmtp_sglang.serving.jobs import _Job
from fastmtp_sglang.serving.protocol import public_finish_reason

Decode = Callable[[list[int]], str]


def resumed_result(job: _Job, res, decode: Decode):
    """A resumed stream's result: ``job.prefix`` (the tokens the client had) + the re-run's
    output, its text cut at the stop string the resumed part matched, a length finish counting
    both."""
    ids = job.prefix + res.output_ids
    text, stop = decode(ids), res.finish_reason.get("matched_str")
    if stop:
        cut = text.find(stop, max(len(decode(job.prefix)) - len(stop) + 1, 0))
        text = text[:cut] if cut >= 0 else text
    finish = dict(res.finish_reason)
    if finish.get("type") == "length":
        finish["length"] = len(ids)
    return dataclasses.replace(res, output_ids=ids, text=text, finish_reason=finish)


def text_delta(job: _Job, decode: Decode) -> str:
    """The text that the stream's newest tokens add, decoded from a few tokens back (the
    offsets SGLang's detokenizer and TGI keep): each cycle decodes the last chunk and the
    new tokens, not the whole output. Nothing while the text ends in an incomplete UTF-8
    sequence (it waits for the next tokens)."""
    ids = job.streamed_ids
    lo, mid = job.text_offsets
    before, after = decode(ids[lo:mid]), decode(ids[lo:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        job.text_offsets = (mid, len(ids))
        return after[len(before):]
    return ""


def stream_event(job: _Job) -> dict[str, Any] | None:
    """The cumulative event of a stream's output so far; None once the job has ended (its
    final event follows). Clears ``chunk_pending``: the next tokens may ask for another."""
    with job.lock:
        job.chunk_pending = False
        if job.closed:
            return None
        ids, text = list(job.streamed_ids), job.stream_text
    return {"text": text, "output_ids": ids,
            "meta_info": {"id": job.inp.rid, "finish_reason": None,
                          "prompt_tokens": len(job.input_ids),
                          "completion_tokens": len(ids), "cached_tokens": 0}}


def generate_response(job: _Job, res, auto: bool = False) -> dict[str, Any]:
    """/generate's answer: SGLang's fields (``spec_verify_ct``, ``spec_accept_length``: its
    completion_tokens / spec_verify_ct, the prefill's token counted) and ours: acceptance as
    docs/design.md section 2 defines it (``tau``: emitted tokens per cycle, the prefill's token
    not counted), K (``steps``: "auto" when the engine picks it per cycle (``auto``), with
    ``steps_range`` and ``mean_drafted``, the drafts its cycles verified on average), and the
    time split."""
    m = res.metrics
    s = m.summary()
    n, ct = len(res.output_ids), m.verify_ct
    drafted = [c.drafted if c.drafted is not None else m.steps for c in m.cycles]
    meta = {
        "id": job.inp.rid,
        "finish_reason": public_finish_reason(res.finish_reason),
        "prompt_tokens": len(job.input_ids),
        "completion_tokens": n,
        "cached_tokens": 0,
        "spec_verify_ct": ct,
        "spec_accept_length": n / ct if ct else 0.0,
        "e2e_latency": time.time() - job.received,
        "tau": s["tau"],
        "A_k": s["A_k"],
        "a_k": s["a_k"],
        "accept_hist": s["accept_hist"],
        "steps": "auto" if auto else m.steps,
        "steps_range": [0, m.steps] if auto else [m.steps, m.steps],
        "mean_drafted": sum(drafted) / len(drafted) if drafted else 0.0,
        "prefill_s": s["prefill_s"],
        "decode_s": s["decode_s"],
        "draft_s": s["draft_s"],
        "verify_s": s["verify_s"],
        "decode_tokens_per_s": s["decode_tokens_per_s"],
    }
    return {"text": res.text if res.text is not None else "", "output_ids": list(res.output_ids),
            "meta_info": meta}
