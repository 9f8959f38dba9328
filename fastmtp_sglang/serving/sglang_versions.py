"""The SGLang versions we support, and every difference between them that our code meets.

Two releases are supported and tested (CPU: the model class, the launch flags, the argument
resolution; GPU: ``launch/gpu_e2e.sh``):

* **0.5.23** (torch 2.14.1, transformers 5.19.0): the pin of the ``sglang`` extra;
* **0.5.17** (torch 2.11.0, transformers 5.12.1): the newest release that runs on a torch 2.11
  image such as the lent H200's (``launch/gpu_bundle.py`` carries it there).

What differs, and is answered here and nowhere else:

* SGLang's built-in ``--speculative-adaptive`` tiers: batch size 1 switches among K = 1, 3, 5, 7
  in 0.5.23 and 1, 3, 7 in 0.5.17; our start K must be one of them (:func:`adaptive_candidates`);
* the full argument resolution: 0.5.23 resolves in ``ServerArgs.resolve_once()``, 0.5.17 already
  in ``__post_init__`` (:func:`resolve_server_args`);
* the one-process distributed group that SGLang's layers need on CPU:
  ``sglang.test.layer_ut_utils.init_single_process_dist`` exists only in 0.5.23
  (:func:`init_single_process_dist`);
* ``forward_context(ctx, forward_batch=fb)``: 0.5.17 takes the context alone
  (:func:`forward_context`).

A version outside the two is refused by :func:`check_supported` with the versions we test.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from importlib import metadata
from typing import Any, Iterator

from fastmtp_sglang.core.errors import FastMTPError

SUPPORTED = ("0.5.17", "0.5.23")
PINNED = "0.5.23"  # the `sglang` extra of pyproject.toml

# The offline bundle's route on the lent H200 (launch/gpu_bundle.py): flashinfer is a stand-in, so
# attention (target and draft) runs on SGLang's triton backend and sampling in pytorch; no grammar
# backend (xgrammar's library is trimmed). tests/test_sglang_versions.py parses these with each
# version's own ServerArgs.
BUNDLE_ROUTE_ARGS = ["--attention-backend", "triton", "--speculative-draft-attention-backend", "triton",
                     "--sampling-backend", "pytorch", "--grammar-backend", "none"]
BUNDLE_ROUTE_ENV = {"SGLANG_IS_FLASHINFER_AVAILABLE": "false"}

# K that each version's built-in adaptive tiers hold (0 = no speculation, at large batches),
# read from sglang.srt.speculative.adaptive_spec_params.DEFAULT_ADAPTIVE_CONFIG of each release
# (tests/test_sglang_versions.py checks the installed one against this table).
_ADAPTIVE_CANDIDATES = {"0.5.17": (0, 1, 3, 7), "0.5.23": (0, 1, 3, 5, 7)}


def installed_version() -> str | None:
    """The installed sglang's version, without importing it (an import takes 9-12 s); None
    where sglang is not installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_supported(version: str | None = None) -> str:
    """``version`` (default: the installed one) if we support it, else a FastMTPError naming the
    versions we test and how to install one."""
    version = version or installed_version()
    if version is None:
        raise FastMTPError("sglang is not installed: pip install -e '.[sglang]' (sglang "
                           f"{PINNED}), or sglang 0.5.17 with torch 2.11.0")
    if version not in SUPPORTED:
        raise FastMTPError(f"sglang {version} is not a version fastmtp-sglang supports "
                           f"({', '.join(SUPPORTED)}); install one of them")
    return version


def adaptive_candidates(version: str | None = None) -> tuple[int, ...]:
    """All K that SGLang's built-in adaptive tiers hold in ``version`` (default: the installed
    sglang, else the pinned one), 0 first."""
    version = version or installed_version() or PINNED
    if version not in _ADAPTIVE_CANDIDATES:
        version = PINNED
    return _ADAPTIVE_CANDIDATES[version]


def resolve_server_args(server_args: Any) -> Any:
    """Run SGLang's full argument resolution on a parsed ``ServerArgs`` (what the server does at
    start-up), in place; returns it."""
    resolve = getattr(server_args, "resolve_once", None)
    if resolve is not None:  # 0.5.23; 0.5.17 resolved in __post_init__
        resolve()
    return server_args


def init_single_process_dist(master_port: int, backend: str = "gloo") -> None:
    """A world-size-1 process group and SGLang's model-parallel groups, which its layers need
    even at TP=1 (the CPU test recipe, docs/design.md section 5.7)."""
    try:
        from sglang.test.layer_ut_utils import init_single_process_dist as init  # 0.5.23
    except ImportError:
        init = None
    if init is not None:
        init(master_port=master_port, backend=backend)
        return
    import torch
    from sglang.srt.distributed.parallel_state import (init_distributed_environment,
                                                       initialize_model_parallel,
                                                       model_parallel_is_initialized)

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(master_port)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend=backend)
    if not model_parallel_is_initialized():
        # the layers read their config from the runtime context: publish a TP=1 ServerArgs, as
        # 0.5.23's helper does (sglang.test.test_utils.publish_build_topology)
        from sglang.srt.runtime_context import publish, reset_context
        from sglang.srt.server_args import ServerArgs

        reset_context()
        publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test")
        initialize_model_parallel(backend=backend)


@contextlib.contextmanager
def forward_context(attn_backend: Any, forward_batch: Any) -> Iterator[None]:
    """SGLang's forward context around a model call: RadixAttention finds its backend there."""
    from sglang.srt.model_executor import forward_context as fc

    ctx = fc.ForwardContext(attn_backend=attn_backend)
    if "forward_batch" in inspect.signature(fc.forward_context).parameters:  # 0.5.23
        with fc.forward_context(ctx, forward_batch=forward_batch):
            yield
    else:
        with fc.forward_context(ctx):
            yield
