"""fastmtp_sglang.models.draft_common: what the SGLang and vLLM draft classes share, checked
without either engine (tests/test_sglang_model.py runs it inside SGLang's class).

- ``head_config_of`` refuses a config without a ``fastmtp`` block (both engines now do) and reads
  the layout from it, from a dict or from a ``PretrainedConfig``;
- ``split_heads`` over a grid of tp sizes, and the error naming the engine's flag;
- ``add_input_projection`` + ``fuse_inputs`` equal ``FastMTPHead.fuse`` for every layout, on
  linears that return ``(output, bias)`` as the engines' do;
- ``load_draft_weights`` into a stand-in engine module with fused q/k/v and gate/up parameters:
  every tensor lands in its shard, ``shared`` names are left alone, and a bad tensor set is one
  DraftFormatError before anything is copied.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from fastmtp_sglang.core.draft_dir import expected_shapes, make_draft_config
from fastmtp_sglang.core.errors import DraftFormatError
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig
from fastmtp_sglang.models import draft_common

TARGET = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def head_cfg(layout: str = "deepseek", **over) -> HeadConfig:
    return HeadConfig.from_dict(make_draft_config({**TARGET, **over}, layout, dtype="float32"))


# ---------------------------------------------------------------------------------------------
# head_config_of
# ---------------------------------------------------------------------------------------------

def test_head_config_of_reads_the_fastmtp_block():
    cfg = make_draft_config(TARGET, "split", dtype="float32")
    assert draft_common.head_config_of(cfg).layout == "split"
    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    got = draft_common.head_config_of(hf)  # what the engines hand over: a PretrainedConfig
    assert (got.layout, got.block, got.hidden_size) == ("split", "llama", 16)


def test_head_config_of_refuses_a_config_without_fastmtp_block():
    cfg = make_draft_config(TARGET, "mimo", dtype="float32")
    del cfg["fastmtp"]
    with pytest.raises(DraftFormatError, match="no 'fastmtp' block"):
        draft_common.head_config_of(cfg)
    with pytest.raises(DraftFormatError, match="no 'fastmtp' block"):
        draft_common.head_config_of(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))


# ---------------------------------------------------------------------------------------------
# split_heads
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q,kv,tp,want", [
    (4, 2, 1, (4, 2)), (4, 2, 2, (2, 1)), (4, 2, 4, (1, 1)),   # 4 ranks: each keeps a KV replica
    (8, 8, 8, (1, 1)), (12, 4, 2, (6, 2)), (16, 1, 4, (4, 1)),
])
def test_split_heads(q, kv, tp, want):
    cfg = HeadConfig(hidden_size=4 * q, intermediate_size=8, num_attention_heads=q,
                     num_key_value_heads=kv, vocab_size=10)
    assert draft_common.split_heads(cfg, tp, "--tp-size") == want


@pytest.mark.parametrize("q,kv,tp", [(4, 2, 3), (6, 3, 4), (12, 4, 8)])
def test_split_heads_refuses_what_does_not_split(q, kv, tp):
    cfg = HeadConfig(hidden_size=4 * q, intermediate_size=8, num_attention_heads=q,
                     num_key_value_heads=kv, vocab_size=10)
    with pytest.raises(ValueError, match=rf"--tp-size {tp} does not split .* {q} query / {kv} KV"):
        draft_common.split_heads(cfg, tp, "--tp-size")


# ---------------------------------------------------------------------------------------------
# the input projection
# ---------------------------------------------------------------------------------------------

class _EngineLinear(nn.Linear):
    """An engine linear: returns (output, bias) like SGLang's and vLLM's ReplicatedLinear."""

    def forward(self, x):
        return super().forward(x), None


@pytest.mark.parametrize("layout", ["mimo", "deepseek", "split"])
def test_fuse_inputs_equals_the_torch_head(layout):
    cfg = head_cfg(layout)
    torch.manual_seed(0)
    head = FastMTPHead(cfg)
    model = nn.Module()
    model.enorm, model.hnorm = head.enorm, head.hnorm
    draft_common.add_input_projection(
        model, layout, cfg.hidden_size, lambda name, n_in: _EngineLinear(n_in, cfg.hidden_size, bias=False))
    assert model.layout == layout
    own = {n: p for n, p in model.named_parameters() if "norm" not in n}
    top_level_projections = {n: s for n, s in expected_shapes(cfg).items()
                             if n.endswith("_proj.weight") and n.count(".") == 1}
    assert {n: tuple(p.shape) for n, p in own.items()} == top_level_projections
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(head.state_dict()[name])
    h, e = torch.randn(5, cfg.hidden_size), torch.randn(5, cfg.hidden_size)
    torch.testing.assert_close(draft_common.fuse_inputs(model, h, e), head.fuse(h, e))


# ---------------------------------------------------------------------------------------------
# load_draft_weights
# ---------------------------------------------------------------------------------------------

def _fused(shards: dict, in_features: int) -> nn.Parameter:
    """A fused parameter whose weight_loader copies a shard into its rows (the engines' way)."""
    offsets, start = {}, 0
    for shard_id, rows in shards.items():
        offsets[shard_id] = (start, rows)
        start += rows
    shape = (start, in_features) if in_features else (start,)
    param = nn.Parameter(torch.zeros(shape), requires_grad=False)

    def loader(p, tensor, shard_id):
        lo, n = offsets[shard_id]
        p.data[lo:lo + n].copy_(tensor)

    param.weight_loader = loader
    return param


def _engine_model(cfg: HeadConfig, with_shared: bool) -> nn.Module:
    """Parameters named as an engine's draft class names them: ``model.`` + the head's names,
    q/k/v and gate/up fused; optionally the target's embedding and lm_head."""
    shapes = expected_shapes(cfg)
    root = nn.Module()
    params = {}
    for name, shape in shapes.items():
        fused = name
        for param_name, shard_name, _ in draft_common.STACKED_PARAMS_MAPPING:
            fused = fused.replace(shard_name, param_name)
        if fused == name:
            params[name] = nn.Parameter(torch.zeros(shape), requires_grad=False)
    for fused_prefix, parts in ((".qkv_proj", ("q", "k", "v")), (".gate_up_proj", ("gate", "up"))):
        for suffix in ("weight", "bias"):
            names = {part: n for n in shapes for part in parts
                     if n.endswith(f".{part}_proj.{suffix}")}
            if not names:
                continue
            first = next(iter(names.values()))
            ids = {"q": "q", "k": "k", "v": "v", "gate": 0, "up": 1}
            width = shapes[first][1] if suffix == "weight" else 0
            params[first.replace(f".{parts[0]}_proj.", f"{fused_prefix}.")] = _fused(
                {ids[p]: shapes[names[p]][0] for p in parts}, width)
    if with_shared:
        params["embed_tokens.weight"] = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
    holder = nn.Module()
    for name, p in params.items():
        mod = holder
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, p)
    root.add_module("model", holder)
    return root


@pytest.mark.parametrize("layout,over", [("deepseek", {}), ("split", {"model_type": "qwen2"})])
def test_load_draft_weights_fills_every_shard(layout, over):
    cfg = head_cfg(layout, **over)
    torch.manual_seed(1)
    sd = {n: torch.randn(t.shape) for n, t in FastMTPHead(cfg).state_dict().items()}
    model = _engine_model(cfg, with_shared=True)
    by_default = []

    def default_loader(param, tensor):  # the engine's plain copy, for unfused parameters
        by_default.append(tuple(tensor.shape))
        param.data.copy_(tensor)

    loaded = draft_common.load_draft_weights(model, cfg, sd.items(), default_loader,
                                             shared=("model.embed_tokens.weight",))
    params = dict(model.named_parameters())
    assert loaded == set(params) - {"model.embed_tokens.weight"}
    assert len(by_default) == len(params) - 1 - sum(hasattr(p, "weight_loader") for p in params.values())
    attn = "model.layer.self_attn."
    q, k, v = (sd[f"layer.self_attn.{x}_proj.weight"] for x in "qkv")
    torch.testing.assert_close(params[attn + "qkv_proj.weight"], torch.cat([q, k, v]))
    gate, up = sd["layer.mlp.gate_proj.weight"], sd["layer.mlp.up_proj.weight"]
    torch.testing.assert_close(params["model.layer.mlp.gate_up_proj.weight"], torch.cat([gate, up]))
    torch.testing.assert_close(params["model.final_norm.weight"], sd["final_norm.weight"])
    assert not params["model.embed_tokens.weight"].any()  # the target's: never written here


def test_load_draft_weights_refuses_before_copying():
    cfg = head_cfg("mimo")
    sd = {n: torch.ones(t.shape) for n, t in FastMTPHead(cfg).state_dict().items()}
    del sd["final_norm.weight"]
    sd["stray.weight"] = torch.ones(3)
    sd["enorm.weight"] = torch.ones(cfg.hidden_size + 1)
    model = _engine_model(cfg, with_shared=False)
    with pytest.raises(DraftFormatError) as err:
        draft_common.load_draft_weights(model, cfg, sd.items(), lambda p, t: p.data.copy_(t))
    for name in ("final_norm.weight", "stray.weight", "enorm.weight"):
        assert name in str(err.value)
    assert all(not p.any() for p in model.parameters())  # nothing copied
