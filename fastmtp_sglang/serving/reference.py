"""The reference engine and its HTTP server, built from a target and a draft
(``fastmtp serve --engine reference``): load both, check the draft fits the target, pick the
draft vocabulary, and bind the server's socket (not started).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastmtp_sglang.core.errors import FastMTPError

if TYPE_CHECKING:
    from fastmtp_sglang.serving.app import ReferenceServer


def load_reference_server(target: str | os.PathLike, draft: str | os.PathLike | None, steps: int,
                          *, host: str, port: int, vocab: str | None = None,
                          auto: bool = False, auto_drafter: str = "hybrid",
                          dtype: str = "float32", device: str = "cpu",
                          max_context: int | None = None, allow_base_mismatch: bool = False,
                          **server_options: Any) -> "ReferenceServer":
    """Load target + head, check they fit, and build (not start) the ReferenceServer.

    Parameters
    ----------
    target : the target model directory (Hugging Face format)
    draft : a FastMTP draft directory, or None (plain decoding, ``steps`` 0)
    steps : K, tokens drafted per verification (with ``auto``: the largest K it may pick)
    auto, auto_drafter : K chosen every cycle from this machine's costs, measured here at batch 1
        and at the server's largest batch (fastmtp_sglang.decode.auto); hybrid = the head and
        prompt lookup per request and cycle
    host, port : where the server listens (port 0: any free port)
    vocab : the draft vocabulary (``fastmtp serve --vocab``; see
        fastmtp_sglang.vocab.draft_vocab.resolve_vocab)
    dtype, device : the weights' dtype name and the torch device
    max_context : tokens a request may use (None: the target's max_position_embeddings)
    allow_base_mismatch : serve a draft whose recorded base model is not this target's
    server_options : passed to ReferenceServer (max_batch, batch_window_s, log_requests,
        max_queue, max_body_bytes, read_timeout_s, shutdown_timeout_s, write_timeout_s,
        max_connections, enable_return_hidden_states)

    Raises
    ------
    FastMTPError
        A draft that does not fit (or was made for another target), a bad vocabulary, or a
        port it cannot listen on.
    """
    from fastmtp_sglang.core.draft_dir import load_head, read_config
    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.serving.app import ReferenceServer
    from fastmtp_sglang.core.target import load_target, parse_dtype, require_fits

    dtype = parse_dtype(dtype, device)
    target_model = load_target(target, dtype, device)
    head = None
    if draft is not None:
        foreign = require_fits(read_config(draft), target_model.config, target_model.tokenizer,
                               where=f"draft {draft}",
                               allow_base_mismatch=allow_base_mismatch)
        if foreign:
            print(f"fastmtp serve: warning: draft {draft} was made for another target "
                  f"({'; '.join(foreign)}); serving it anyway (--allow-base-mismatch)", flush=True)
        head = load_head(draft, target_model.embed, target_model.lm_head, dtype=dtype, device=device)
    draft_vocab = None
    if head is not None:
        from fastmtp_sglang.vocab.draft_vocab import resolve_vocab

        draft_vocab = resolve_vocab(vocab, target_model.tokenizer, target_model.lm_head, "none", draft)
        if draft_vocab is not None:
            print(f"fastmtp serve: draft vocabulary {', '.join(draft_vocab.tables.names)}, picked per "
                  "request from the prompt's script", flush=True)
    if auto:
        engine = _auto_engine(target_model, head, steps, max_context, draft_vocab, auto_drafter,
                              int(server_options.get("max_batch", 8)))
    else:
        engine = ReferenceEngine(target_model, head, steps, max_context, draft_vocab=draft_vocab)
    try:
        return ReferenceServer(engine, host, port, model_path=str(target),
                               draft_path=None if draft is None else str(draft),
                               **server_options)
    except OSError as exc:
        raise FastMTPError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                           "pick another --port (0 = any free port)") from None


def _auto_engine(target, head, kmax: int, max_context, draft_vocab, drafter: str, max_batch: int):
    """``--steps auto``: measure this machine's cycle costs at batch 1, 4 and ``max_batch``
    (a few seconds each), then build the engine that picks K from them."""
    import time

    from fastmtp_sglang.decode.auto import auto_engine, measure_auto_costs

    if head is None:
        raise FastMTPError("--steps auto drafts with a head: give --draft DIR")
    t = time.perf_counter()
    sizes = sorted({1, min(4, max_batch), max_batch})
    curves = [measure_auto_costs(target, head, kmax, draft_vocab, batch=b) for b in sizes]
    c = curves[0]
    print(f"fastmtp serve: --steps auto: K in 0..{kmax} per cycle, costs measured in "
          f"{time.perf_counter() - t:.0f} s at batch {', '.join(map(str, sizes))} (plain step "
          f"{c.plain_ms:.1f} ms, verify {kmax + 1} tokens {c.verify_ratio(kmax + 1):.2f}x, draft "
          f"step {c.draft_step_ms:.1f} ms at batch 1), drafter {drafter}", flush=True)
    return auto_engine(target, head, kmax, c, max_context, draft_vocab, drafter,
                       batched_curves=curves[1:])
