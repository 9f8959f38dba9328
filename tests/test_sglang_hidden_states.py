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

from types import SimpleNamespace

import pytest
import torch

import sglang_cpu
from sglang_cpu import sglang_on_cpu

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def sgl():
    with sglang_on_cpu(LlamaForCausalLM="llama:LlamaForCausalLM") as ns:
        yield ns


def sglang_llama(sgl, path):
    mc = sgl.ModelConfig(model_path=str(path))
    model = sgl.LlamaForCausalLM(mc.hf_config)
    model.load_weights(sgl.weights(sorted(str(f) for f in path.glob("*.safetensors"))))
    return model.eval(), mc.hf_config


def extend(sgl, model, hf, ids: list[torch.Tensor]):
    """One EXTEND of fresh requests, capturing every position's hidden state."""
    return sglang_cpu.extend(sgl, model, ids, hf.num_key_value_heads, hf.head_dim,
                             hf.num_hidden_layers)


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
