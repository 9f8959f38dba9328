"""Where a request's output ends: EOS, stop token ids, stop strings, the token budget.

One function, :func:`emit`, appends a cycle's accepted tokens to a row (``decode/batch.Row``) and
cuts them where the request ends. The engine calls it once per row and cycle.
"""

from __future__ import annotations

from typing import Any, Callable


def emit(r: Any, new: list[int], eos_ids: set[int], decode: Callable[[list[int]], str],
         on_tokens: Callable[[Any, list[int]], None] | None) -> None:
    """Append a cycle's tokens ``new`` to row ``r`` (``r.out``), cutting at EOS / stop token ids /
    stop strings / max_new_tokens and setting ``r.finish``; ``on_tokens(r.key, ids)`` gets what
    was kept. ``decode``: token ids -> text (for stop strings).

    Stop strings are looked for in the text of the new tokens and of enough tokens before
    them: a match that ends in the new tokens (an earlier one would have ended an earlier
    cycle) has at most ``longest - 1`` characters before them, so the window goes back until
    the earlier tokens' text has ``longest`` whole characters (one more: the first token of
    a window may decode short, a SentencePiece leading space dropped, a byte-level token cut
    mid-character into U+FFFD). It starts at as many tokens as the longest stop string has
    UTF-8 bytes (most tokens decode to a byte or more) and doubles while tokens that decode
    to nothing (special ones) leave it short. A cycle so decodes about K+1 tokens plus that
    window twice, not the whole output (which had made each cycle of a long request with a
    stop list cost O(its length))."""
    if r.finish is not None:
        return
    p = r.req.params
    if len(r.out) >= p.max_new_tokens:  # a budget already spent (an abort sets it to 0)
        r.finish = {"type": "length", "length": len(r.out)}
        return
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
    start = len(r.out)
    for tok in new:
        r.out.append(tok)
        if tok in stop_ids:
            r.finish = {"type": "stop", "matched": tok}
            break
        if len(r.out) >= p.max_new_tokens:
            r.finish = {"type": "length", "length": len(r.out)}
            break
    if p.stop and (r.finish is None or r.finish["type"] == "length") and len(r.out) > start:
        longest = max(len(s) for s in p.stop)
        w = max(0, start - max(len(s.encode("utf-8", "surrogatepass")) for s in p.stop))
        while w > 0 and len(decode(r.out[w:start]).lstrip("\ufffd")) < longest:
            w = max(0, start - 2 * (start - w))  # the window's start
        text = decode(r.out[w:])
        hit = [s for s in p.stop if s in text]
        if hit:
            # keep the shortest output whose text contains a stop string
            while len(r.out) > max(start, 1) and any(s in decode(r.out[w:-1]) for s in hit):
                r.out.pop()
            text = decode(r.out[w:])
            s = min(hit, key=lambda s: text.find(s) if s in text else len(text))
            r.finish = {"type": "stop", "matched": s, "matched_str": s}
    if on_tokens is not None and len(r.out) > start:
        on_tokens(r.key, r.out[start:])
