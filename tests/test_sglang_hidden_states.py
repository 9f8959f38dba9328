"""What SGLang 0.5.23 captures for ``return_hidden_states``, checked on its own classes on CPU
(docs/design.md section 5.7's recipe; docs/scale.md section 5.1 states the facts).

SGLang's ``LlamaForCausalLM`` runs an EXTEND over two prompts of a tiny 4-layer Llama with
``CaptureHiddenMode.FULL``: the rows its logits processor keeps (what the scheduler turns into
``meta_info["hidden_states"]``) are transformers' ``last_hidden_state``, the final norm's output,
at every position, not the norm's input. With EAGLE3 aux capture on layer ids ``a - 1`` (what
``--return-aux-hidden-state-layer-ids`` sets) the rows are transformers' ``hidden_states[a]``
instead, and the post-norm state is not among them.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def sgl():
    pytest.importorskip("sglang")
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch,
                                                              ForwardMode)
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.runtime_context import reset_context
    from sglang.test.layer_ut_utils import init_single_process_dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ours = not parallel_state.model_parallel_is_initialized()  # another module may hold it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rotary_base, "_is_cpu", True)  # else the rotary layer imports a vLLM op
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(k, raising=False)
        init_single_process_dist(master_port=port, backend="gloo")
        yield SimpleNamespace(
            ModelConfig=ModelConfig, LlamaForCausalLM=LlamaForCausalLM,
            ReqToTokenPool=ReqToTokenPool, MHATokenToKVPool=MHATokenToKVPool,
            TorchNativeAttnBackend=TorchNativeAttnBackend, ForwardBatch=ForwardBatch,
            ForwardMode=ForwardMode, CaptureHiddenMode=CaptureHiddenMode,
            ForwardContext=ForwardContext, forward_context=forward_context,
            weights=safetensors_weights_iterator)
        if ours:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
            reset_context()


def sglang_llama(sgl, path):
    mc = sgl.ModelConfig(model_path=str(path))
    model = sgl.LlamaForCausalLM(mc.hf_config)
    model.load_weights(sgl.weights(sorted(str(f) for f in path.glob("*.safetensors"))))
    return model.eval(), mc.hf_config


def extend(sgl, model, hf, ids: list[torch.Tensor]):
    """One EXTEND of fresh requests through SGLang's CPU KV pool (row 0 is padding), capturing
    every position's hidden state."""
    n = [len(x) for x in ids]
    req_pool = sgl.ReqToTokenPool(size=len(n), max_context_len=64, device="cpu",
                                  enable_memory_saver=False)
    kv_pool = sgl.MHATokenToKVPool(size=128, page_size=1, dtype=torch.float32,
                                   head_num=hf.num_key_value_heads, head_dim=hf.head_dim,
                                   layer_num=hf.num_hidden_layers, device="cpu",
                                   enable_memory_saver=False, enable_alt_stream=False)
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
    fb = sgl.ForwardBatch(
        forward_mode=sgl.ForwardMode.EXTEND, capture_hidden_mode=sgl.CaptureHiddenMode.FULL,
        batch_size=len(n), input_ids=torch.cat(ids), req_pool_indices=rows, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens, seq_lens_sum=int(seq_lens.sum()), out_cache_loc=torch.cat(slots),
        positions=torch.cat([torch.arange(k) for k in n]),
        extend_num_tokens=sum(n), extend_seq_lens=seq_lens,
        extend_prefix_lens=torch.zeros_like(seq_lens),
        extend_start_loc=torch.tensor([0] + n[:-1]).cumsum(0), extend_seq_lens_cpu=n,
        extend_prefix_lens_cpu=[0] * len(n))
    backend.init_forward_metadata(fb)
    with torch.no_grad(), sgl.forward_context(sgl.ForwardContext(attn_backend=backend),
                                              forward_batch=fb):
        return model(fb.input_ids, fb.positions, fb)


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """A 4-layer Llama (aux layers need layers to choose from) with random norm weights, so the
    states before and after the final norm differ."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("sgl_llama") / "llama-4"
    model.save_pretrained(str(path))
    return SimpleNamespace(path=path, model=model)


def hf_states(target, ids: list[torch.Tensor]):
    """transformers' per-position states over the prompts (concatenated): the output of the final
    norm, its input, and ``hidden_states`` (entry i: the stream entering layer i)."""
    post, layers, seen = [], [], []
    hook = target.model.model.norm.register_forward_hook(lambda m, a, o: seen.append(a[0][0]))
    try:
        with torch.no_grad():
            for x in ids:
                o = target.model.model(input_ids=x[None], output_hidden_states=True)
                post.append(o.last_hidden_state[0])
                layers.append([h[0] for h in o.hidden_states])
    finally:
        hook.remove()
    by_layer = [torch.cat([ls[i] for ls in layers]) for i in range(len(layers[0]))]
    return torch.cat(post), torch.cat(seen), by_layer


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 300, (k,), generator=g) for k in (7, 4)]


def test_full_capture_is_the_post_norm_last_state(sgl, deep_llama):
    model, hf = sglang_llama(sgl, deep_llama.path)
    ids = prompts()
    out = extend(sgl, model, hf, ids)
    post, pre, _ = hf_states(deep_llama, ids)
    assert out.hidden_states.shape == (sum(len(x) for x in ids), hf.hidden_size)
    torch.testing.assert_close(out.hidden_states, post, atol=1e-5, rtol=1e-5)
    assert (out.hidden_states - pre).abs().max() > 1e-1  # not the state before the norm


def test_aux_capture_replaces_the_last_state(sgl, deep_llama):
    """EAGLE3 layer id L captures the residual stream entering layer L + 1: transformers'
    hidden_states[L + 1]; the rows are the aux layers alone, without the post-norm state."""
    model, hf = sglang_llama(sgl, deep_llama.path)
    aux = (1, 3)  # our --aux-layers (hidden_states indices); the server's ids are a - 1
    model.set_eagle3_layers_to_capture([a - 1 for a in aux])
    ids = prompts()
    out = extend(sgl, model, hf, ids)
    post, _, layers = hf_states(deep_llama, ids)
    H = hf.hidden_size
    assert out.hidden_states.shape == (sum(len(x) for x in ids), len(aux) * H)
    for j, a in enumerate(aux):
        got = out.hidden_states[:, j * H:(j + 1) * H]
        torch.testing.assert_close(got, layers[a], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, layers[a + 1], atol=1e-3)  # one layer off is caught
        assert not torch.allclose(got, post, atol=1e-3)
