"""SGLang's own model classes (0.5.17 or 0.5.23) run on CPU in the test process (docs/design.md section 5.7):
a one-process gloo group, the rotary layer kept off its vLLM op, and one EXTEND pass of fresh
requests through SGLang's CPU KV pool with every position's hidden state captured.

Used by tests/test_sglang_model.py and tests/test_sglang_compressed.py (our model class),
tests/test_export_native.py (MiMoMTP serves our export) and tests/test_sglang_hidden_states.py
(what ``return_hidden_states`` captures)."""

from __future__ import annotations

import contextlib
import os
import socket
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch


@contextlib.contextmanager
def sglang_on_cpu(**models) -> Iterator[SimpleNamespace]:
    """SGLang's classes for an EXTEND on CPU, plus ``models`` (name -> "module:Class" under
    ``sglang.srt.models``), while a one-process distributed group is up (torn down on exit unless
    another module had started it). The version differences (0.5.17 / 0.5.23) are
    fastmtp_sglang.serving.sglang_versions'."""
    pytest.importorskip("sglang")
    import importlib

    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch,
                                                              ForwardMode)
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs

    from fastmtp_sglang.serving import sglang_versions

    classes = {}
    for name, where in models.items():
        module, cls = where.split(":")
        classes[name] = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls)
    dist_keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved_env = {k: os.environ.get(k) for k in dist_keys}
    ours = not parallel_state.model_parallel_is_initialized()  # another module may hold it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rotary_base, "_is_cpu", True)  # else the rotary layer imports a vLLM op
        mp.delenv("FASTMTP_SGLANG_VOCAB", raising=False)
        if ours:
            for k in dist_keys:
                mp.delenv(k, raising=False)
            sglang_versions.init_single_process_dist(master_port=free_port(), backend="gloo")
        from fastmtp_sglang.models import compressed_projection, fastmtp

        yield SimpleNamespace(
            ModelConfig=ModelConfig, ReqToTokenPool=ReqToTokenPool,
            MHATokenToKVPool=MHATokenToKVPool, TorchNativeAttnBackend=TorchNativeAttnBackend,
            ForwardBatch=ForwardBatch, ForwardMode=ForwardMode,
            CaptureHiddenMode=CaptureHiddenMode, forward_context=sglang_versions.forward_context,
            weights=safetensors_weights_iterator,
            safetensors_weights_iterator=safetensors_weights_iterator, ServerArgs=ServerArgs,
            fastmtp=fastmtp, cp=compressed_projection, **classes)
        if ours:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
            reset_context()
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extend(sgl: SimpleNamespace, model, ids: list[torch.Tensor], kv_heads: int, head_dim: int,
           layers: int, hidden: torch.Tensor | None = None, max_context: int = 64):
    """One EXTEND of fresh requests ``ids`` through SGLang's CPU KV pool (row 0 is padding),
    capturing every position's hidden state; ``hidden`` is a draft model's input
    (``spec_info.hidden_states``). Returns the model's output."""
    n = [len(x) for x in ids]
    req_pool = sgl.ReqToTokenPool(size=len(n), max_context_len=max_context, device="cpu",
                                  enable_memory_saver=False)
    kv_pool = sgl.MHATokenToKVPool(size=2 * max_context, page_size=1, dtype=torch.float32,
                                   head_num=kv_heads, head_dim=head_dim, layer_num=layers,
                                   device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    backend = sgl.TorchNativeAttnBackend(SimpleNamespace(
        device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=kv_pool))
    rows = torch.arange(1, len(n) + 1)
    slots, start = [], 1
    for r, k in enumerate(n):
        s = torch.arange(start, start + k)
        start += k
        req_pool.req_to_token[rows[r], :k] = s.to(torch.int32)
        slots.append(s)
    seq_lens = torch.tensor(n)
    extra = {} if hidden is None else {"spec_info": SimpleNamespace(hidden_states=hidden)}
    fb = sgl.ForwardBatch(
        forward_mode=sgl.ForwardMode.EXTEND, capture_hidden_mode=sgl.CaptureHiddenMode.FULL,
        batch_size=len(n), input_ids=torch.cat(ids), req_pool_indices=rows, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens, seq_lens_sum=int(seq_lens.sum()), out_cache_loc=torch.cat(slots),
        positions=torch.cat([torch.arange(k) for k in n]),
        extend_num_tokens=sum(n), extend_seq_lens=seq_lens,
        extend_prefix_lens=torch.zeros_like(seq_lens),
        extend_start_loc=torch.tensor([0] + n[:-1]).cumsum(0), extend_seq_lens_cpu=n,
        extend_prefix_lens_cpu=[0] * len(n), **extra)
    backend.init_forward_metadata(fb)
    with torch.no_grad(), sgl.forward_context(backend, fb):
        return model(fb.input_ids, fb.positions, fb)
