"""Checkpoint names and layouts of an MTP layer: which tensors a head has under which name in a
MiMo, DeepSeek or split (DeepSeek-V4 style) checkpoint, and the exact change of layout between
them (columns move, no arithmetic). Shared by conversion (core/convert.py), native export
(core/export_native.py) and the Speculators format (core/speculators_format.py)."""

from __future__ import annotations

from typing import Any

import torch

BLOCK_NAMES = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
    "self_attn.v_proj.bias", "self_attn.o_proj.bias",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias",
]
OWN_NAMES = {
    "mimo": {"token_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight",
             "input_proj.weight": "input_proj.weight", "final_layernorm.weight": "final_norm.weight"},
    "deepseek": {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                 "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "final_norm.weight"},
    "split": {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
              "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight",
              "shared_head.norm.weight": "final_norm.weight"},
}
# the target's own tensors that some checkpoints repeat under the MTP prefix: never stored twice
SHARED_NAMES = ("embed_tokens.weight", "shared_head.head.weight", "lm_head.weight")


def source_prefix(fmt: str, config: dict[str, Any], mtp_index: int) -> str:
    if fmt == "mimo":
        return f"model.mtp_layers.{mtp_index}."
    return f"model.layers.{int(config['num_hidden_layers']) + mtp_index}."


def source_name_map(fmt: str, prefix: str) -> dict[str, str]:
    """Checkpoint name -> draft-directory name, for every tensor the head may have."""
    m = {prefix + k: v for k, v in OWN_NAMES[fmt].items()}
    m.update({prefix + k: "layer." + k for k in BLOCK_NAMES})
    return m


def split_projection(sd: dict[str, torch.Tensor], layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_e, W_h): the columns of the input projection that see the embedding / the hidden."""
    if layout == "mimo":
        w = sd["input_proj.weight"]
        h = w.shape[1] // 2
        return w[:, h:], w[:, :h]
    if layout == "deepseek":
        w = sd["eh_proj.weight"]
        h = w.shape[1] // 2
        return w[:, :h], w[:, h:]
    return sd["e_proj.weight"], sd["h_proj.weight"]


def change_layout(sd: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """Exact layout change: columns move, no arithmetic touches a value."""
    if src == dst:
        return dict(sd)
    we, wh = split_projection(sd, src)
    out = {k: v for k, v in sd.items()
           if k not in ("input_proj.weight", "eh_proj.weight", "e_proj.weight", "h_proj.weight")}
    if dst == "mimo":
        out["input_proj.weight"] = torch.cat([wh, we], dim=1).contiguous()
    elif dst == "deepseek":
        out["eh_proj.weight"] = torch.cat([we, wh], dim=1).contiguous()
    else:
        out["e_proj.weight"], out["h_proj.weight"] = we.contiguous(), wh.contiguous()
    return out
