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
    from fastmtp_sglang.decode.auto_setup import AutoSpec
    from fastmtp_sglang.serving.options import ServerOptions


def load_reference_server(target: str | os.PathLike, draft: str | os.PathLike | None, steps: int,
                          options: "ServerOptions | None" = None, *, vocab: str | None = None,
                          auto: "AutoSpec | None" = None,
                          dtype: str = "float32", device: str = "cpu",
                          max_context: int | None = None, allow_base_mismatch: bool = False,
                          width: int = 1, **option_values: Any) -> "ReferenceServer":
    """Check the target directory and bind the port (so either fails before any weights load),
    then load target + head, check they fit, and build (not start) the ReferenceServer.

    Parameters
    ----------
    target : the target model directory (Hugging Face format)
    draft : a FastMTP draft directory, or None (plain decoding, ``steps`` 0)
    steps : K, tokens drafted per verification (unused with ``auto``)
    auto : AutoSpec (fastmtp_sglang.decode.auto_setup) or None: K chosen every cycle, in a range
        it fixes or leaves to this machine's costs, measured here at batch 1, 4 and the server's
        largest batch
    options : ServerOptions (fastmtp_sglang.serving.options): where the server listens and its
        limits; ``option_values`` (``port=0``, ...) replace fields of it (or of the defaults)
    vocab : the draft vocabulary (``fastmtp serve --vocab``; see
        fastmtp_sglang.vocab.draft_vocab.resolve_vocab)
    dtype, device : the weights' dtype name and the torch device
    max_context : tokens a request may use (None: the target's max_position_embeddings)
    allow_base_mismatch : serve a draft whose recorded base model is not this target's
    width : candidates per drafted position at a fixed K (decode/leaves.py; 1 = a chain)

    Raises
    ------
    FastMTPError
        A target that is not a model directory, a port it cannot listen on, a draft that does
        not fit (or was made for another target), a bad vocabulary.
    """
    import dataclasses

    from fastmtp_sglang.serving.app import ReferenceServer
    from fastmtp_sglang.serving.options import ServerOptions

    options = dataclasses.replace(options or ServerOptions(), **option_values)
    require_target_dir(target)
    sock = bind(options)  # before the weights load: a taken port fails in a second, not a minute
    try:
        engine = _load_engine(target, draft, steps, options, vocab, auto, dtype,
                              device, max_context, allow_base_mismatch, width)
    except BaseException:
        sock.close()
        raise
    return ReferenceServer(engine, options, model_path=str(target),
                           draft_path=None if draft is None else str(draft), sock=sock)


def _load_engine(target, draft, steps: int, options: "ServerOptions", vocab, auto: "AutoSpec | None",
                 dtype: str, device: str, max_context,
                 allow_base_mismatch: bool, width: int = 1):
    """The engine of ``load_reference_server`` (its parameters)."""
    from fastmtp_sglang.core.draft_dir import load_head, read_config
    from fastmtp_sglang.decode.engine import ReferenceEngine
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
    if auto is not None:
        engine = _auto_engine(auto, target_model, head, max_context, draft_vocab, options.max_batch)
    else:
        engine = ReferenceEngine(target_model, head, steps, max_context, draft_vocab=draft_vocab, width=width)
    return engine


def require_target_dir(target: str | os.PathLike) -> None:
    """Raise FastMTPError unless ``target`` is a local model directory (with config.json): the
    reference engine never downloads."""
    from pathlib import Path

    path = Path(target).expanduser()
    if not path.is_dir():
        raise FastMTPError(f"--target {target}: no such directory; give a local Hugging Face "
                           "model directory (the reference engine never downloads)")
    if not (path / "config.json").is_file():
        raise FastMTPError(f"--target {target} has no config.json: give the directory of a "
                           "Hugging Face model (config.json, weights, tokenizer)")


def bind(options: "ServerOptions"):
    """The server's listening socket, bound now; FastMTPError when the port cannot be had."""
    from fastmtp_sglang.serving.http_transport import listen

    try:
        return listen(options.host, options.port, options.backlog)
    except OSError as exc:
        raise FastMTPError(f"cannot listen on {options.host}:{options.port}: "
                           f"{exc.strerror or exc}; stop what holds it, or pick another --port "
                           "(0 = any free port)") from None


def _auto_engine(spec: "AutoSpec", target, head, max_context, draft_vocab, max_batch: int):
    """``--steps auto``: measure this machine's cycle costs at batch 1, 4 and ``max_batch``
    (a few seconds each), then build the engine that picks K from them (decode/auto_setup.py)."""
    import time

    from fastmtp_sglang.decode.auto_setup import build_auto_engine, describe, measure_costs

    if head is None:
        raise FastMTPError("--steps auto drafts with a head: give --draft DIR")
    t = time.perf_counter()
    sizes = sorted({1, min(4, max_batch), max_batch})
    curves = [measure_costs(spec, target, head, draft_vocab, batch=b) for b in sizes]
    c = curves[0]
    engine = build_auto_engine(spec, target, head, c, max_context, draft_vocab, curves[1:])
    k = engine.steps
    print(f"fastmtp serve: --steps auto: {describe(spec, k)}; costs measured in "
          f"{time.perf_counter() - t:.0f} s at batch {', '.join(map(str, sizes))} (plain step "
          f"{c.plain_ms:.1f} ms, verify {k + 1} tokens {engine.auto.costs.verify_ms(k + 1) / c.plain_ms:.2f}x, "
          f"draft step {c.draft_step_ms:.1f} ms at batch 1)", flush=True)
    return engine
