"""What the SGLang and the vLLM draft classes share: one implementation, two engines.

``fastmtp_sglang.models.fastmtp`` (SGLang) and ``fastmtp_sglang.vllm_models.fastmtp`` (vLLM)
build the same head from their engine's layers. What does not depend on the engine lives here:

- :func:`head_config_of`: the pure-torch head's config from the draft's HF config, strictly
  (a config without a ``fastmtp`` block is not a draft directory);
- :func:`split_heads`: the query / KV heads one tensor-parallel rank keeps;
- :func:`add_input_projection` and :func:`fuse_inputs`: the layout's input projection, under
  ``FastMTPHead``'s parameter names;
- :func:`block_forward` and :func:`mlp_forward`: the dense block's sums over the engine's layers;
- :func:`load_draft_weights`: the strict loader (names and shapes checked before anything is
  copied; q/k/v and gate/up shards into the engine's fused parameters).

Torch and ``fastmtp_sglang.core`` only: SGLang's external-model loader imports every module of
``fastmtp_sglang.models`` (this one defines no ``EntryClass``), and the vLLM class imports this
one without importing SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fastmtp_sglang.core.draft_dir import check_tensors, expected_shapes
from fastmtp_sglang.core.errors import DraftFormatError
from fastmtp_sglang.core.head import HeadConfig

# checkpoint shard name -> (fused parameter, shard id): the draft directory stores q/k/v and
# gate/up separately (FastMTPHead's names); both engines fuse them for one GEMM each
STACKED_PARAMS_MAPPING = (
    # (param_name, shard_name, shard_id)
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


def head_config_of(hf_config: Any) -> HeadConfig:
    """The pure-torch head's config (layout, block, biases) for an engine-loaded draft config.

    ``hf_config``: a ``transformers.PretrainedConfig`` (anything with ``to_dict()``) or a dict.
    Raises DraftFormatError when it has no ``fastmtp`` block.
    """
    cfg = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    if "fastmtp" not in cfg:
        raise DraftFormatError("the draft's config.json has no 'fastmtp' block: not a FastMTP "
                               "draft directory (make one with `fastmtp convert` or `init-head`)")
    return HeadConfig.from_dict(dict(cfg))


def split_heads(cfg: HeadConfig, tp_size: int, tp_flag: str) -> tuple[int, int]:
    """(query heads, KV heads) on one of ``tp_size`` ranks.

    With fewer KV heads than ranks each rank keeps a replica of one. ``tp_flag`` names the
    engine's setting in the error (ValueError) when ``tp_size`` does not split the heads.
    """
    q_heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if q_heads % tp_size or (kv_heads % tp_size and tp_size % kv_heads):
        raise ValueError(
            f"{tp_flag} {tp_size} does not split the draft's {q_heads} query / {kv_heads} KV "
            "heads; pick a tp size that divides both (or that the KV heads divide)")
    return q_heads // tp_size, max(1, kv_heads // tp_size)


def add_input_projection(model: nn.Module, layout: str, hidden_size: int,
                         proj: Callable[[str, int], nn.Module]) -> None:
    """Register the layout's input projection on ``model`` under FastMTPHead's names.

    ``proj(name, n_in)`` builds one engine linear from ``n_in`` features to ``hidden_size``
    (2H -> H is small next to the block: both engines replicate it, no collective).
    """
    h = hidden_size
    model.layout = layout
    if layout == "mimo":  # input_proj(cat[hnorm(h), enorm(e)])
        model.input_proj = proj("input_proj", 2 * h)
    elif layout == "deepseek":  # eh_proj(cat[enorm(e), hnorm(h)])
        model.eh_proj = proj("eh_proj", 2 * h)
    else:  # split: e_proj(enorm(e)) + h_proj(hnorm(h))
        model.e_proj = proj("e_proj", h)
        model.h_proj = proj("h_proj", h)


def fuse_inputs(model: nn.Module,
                hidden: torch.Tensor,  # [T, H] the previous hidden state h_i
                embeds: torch.Tensor,  # [T, H] the embedding of x_{i+1}
                ) -> torch.Tensor:  # [T, H]
    """The layout's input projection on ``model`` (built by :func:`add_input_projection`, with
    ``hnorm`` and ``enorm``). The engines' linears return ``(output, bias)``: ``[0]`` is the
    output."""
    h, e = model.hnorm(hidden), model.enorm(embeds)
    if model.layout == "mimo":
        return model.input_proj(torch.cat([h, e], dim=-1))[0]
    if model.layout == "deepseek":
        return model.eh_proj(torch.cat([e, h], dim=-1))[0]
    return model.e_proj(e)[0] + model.h_proj(h)[0]


def mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
    """down(act(gate) * up) over the engine's fused ``gate_up_proj``, its ``act_fn`` (SiLU and
    multiply) and ``down_proj``."""
    gate_up, _ = mlp.gate_up_proj(x)
    x, _ = mlp.down_proj(mlp.act_fn(gate_up))
    return x


def block_forward(layer: nn.Module,
                  positions: torch.Tensor,  # [T]
                  hidden_states: torch.Tensor,  # [T, H]
                  *attn_args: Any,  # what the engine's attention takes after (positions, x)
                  ) -> torch.Tensor:  # [T, H]
    """One dense pre-norm block that completes its own residual sums (one layer, no stages):
    ``h + attn(norm1(h))``, then that plus ``mlp(norm2(.))``."""
    residual = hidden_states
    hidden_states = layer.self_attn(positions, layer.input_layernorm(hidden_states), *attn_args)
    # fused: residual <- residual + attn_out, hidden <- norm(residual)
    hidden_states, residual = layer.post_attention_layernorm(hidden_states, residual)
    return residual + layer.mlp(hidden_states)


def load_draft_weights(
    model: nn.Module,
    cfg: HeadConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    default_weight_loader: Callable[[torch.Tensor, torch.Tensor], None],
    shared: Iterable[str] = (),
) -> set[str]:
    """Load a draft directory's tensors into ``model`` (whose head sits under ``model.``),
    strictly.

    The names and (unsharded) shapes must be exactly ``FastMTPHead``'s for ``cfg``
    (``draft_dir.expected_shapes``): one DraftFormatError names every missing, unexpected and
    mis-shaped tensor, before anything is copied. A parameter's own ``weight_loader`` copies
    it (the engine's sharding), else ``default_weight_loader`` (the engine's plain copy).
    ``shared``: parameter names that are the target's (embedding, lm_head), not loaded here.
    Returns the names of the parameters loaded: every parameter but ``shared``.
    """
    tensors = dict(weights)
    check_tensors(
        expected_shapes(cfg),
        {name: tuple(t.shape) for name, t in tensors.items()},
        f"the draft weights for a {cfg.layout}/{cfg.block} FastMTP head",
    )
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors.items():
        target = "model." + name
        for param_name, shard_name, shard_id in STACKED_PARAMS_MAPPING:
            if shard_name in target:
                fused = target.replace(shard_name, param_name)
                param = params[fused]
                param.weight_loader(param, tensor, shard_id)
                loaded.add(fused)
                break
        else:
            param = params[target]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
    expected = set(params) - set(shared)
    assert loaded == expected, sorted(expected ^ loaded)
    return loaded
