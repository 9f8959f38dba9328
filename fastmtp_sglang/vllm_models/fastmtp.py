"""FastMTPForCausalLM for vLLM: a FastMTP draft head served by vLLM's EAGLE proposer.

One draft step (docs/design.md section 1.1), on vLLM's own layers::

    e      = embed(x_{i+1})                       # the target's embedding, shared
    x      = proj(hnorm(h_i), enorm(e))           # layout mimo / deepseek / split
    x      = block(x)                             # one dense Llama / Qwen2 decoder layer
    g_i    = final_norm(x)                        # returned, fed back at the next step
    logits = lm_head(g_i)                         # the target's lm_head, shared

How vLLM runs it (vllm 0.32, ``speculative_config={"method": "eagle", "model": DRAFT_DIR,
"num_speculative_tokens": K}``; ``fastmtp_sglang.serving.vllm_launch`` builds it):

- ``SpeculativeConfig`` wraps the draft's HF config in an ``EAGLEConfig``, which renames the
  architecture ``FastMTPForCausalLM`` to ``EagleFastMTPForCausalLM``; both names are registered
  (:func:`fastmtp_sglang.vllm_models.register`, the ``vllm.general_plugins`` entry point).
- ``EagleProposer`` calls ``forward(input_ids, positions, hidden_states)`` with ``input_ids``
  shifted by one and the target's positions (pair (h_i, x_{i+1}) at position i, as our
  reference engine and SGLang's EAGLE worker do), ``hidden_states`` the target's post-norm
  hidden states at the first pass and this head's own output at the K-1 recursive ones: one
  head, reused K times. The proposer takes a pair (what ``compute_logits`` projects, what is
  fed back); for a FastMTP head both are g_i, so ``forward`` returns ``(g, g)``.
- ``has_own_embed_tokens = has_own_lm_head = False``: the proposer's ``load_model`` binds the
  target's ``embed_tokens`` and ``lm_head`` modules in place of the placeholders (which hold no
  weights, so ``named_parameters()`` is exactly the head and vLLM's loaded-weights check is
  strict without any help).

The ``method="mtp"`` route cannot take a separate FastMTP directory: vLLM 0.32 accepts it only
for the ``model_type`` values of its in-tree MTP models (``MTPModelTypes``), and ours is the
target family's (``llama`` / ``qwen2``), as the draft-directory contract requires.

Compressed vocabulary: vLLM's ``compute_logits(hidden_states)`` carries no request identity, so
the per-request tables of the SGLang class cannot be chosen here. One global table can:
``$FASTMTP_VLLM_VOCAB=<table>`` (``fastmtp serve --engine vllm --vocab TABLE``) drafts over that
table's rows only and scatters them into a full-width row of -inf (the proposer's argmax and the
rejection sampler see the usual ``[N, V]`` logits). Unset or ``full``: the full vocabulary. Two
or more tables, ``auto`` or tensor parallelism with a table are refused with a message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix

from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError
from fastmtp_sglang.core.head import HeadConfig
from fastmtp_sglang.models import draft_common

logger = logging.getLogger(__name__)

VOCAB_ENV = "FASTMTP_VLLM_VOCAB"
FULL_VOCAB = ("", "full", "none")


def draft_hf_config(vllm_config: VllmConfig):
    """The draft directory's own HF config (unwrapped from vLLM's ``EAGLEConfig``)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        raise FastMTPError("FastMTPForCausalLM is a draft model: load it through a "
                           "speculative_config (method 'eagle'), not as the served model")
    cfg = spec.draft_model_config.hf_config
    return getattr(cfg, "model", None) or cfg


class _TargetPart(nn.Module):
    """Stand-in for the target's embedding / lm_head until the proposer binds the real one.

    Holds an empty ``[0, H]`` buffer as ``weight`` (vLLM's sharing code reads its width), no
    parameter, so the draft never allocates or reports a ``[V, H]`` tensor of its own.
    """

    def __init__(self, hidden_size: int, what: str):
        super().__init__()
        self.what = what
        self.register_buffer("weight", torch.empty(0, hidden_size), persistent=False)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"the draft's {self.what} is the target's and has not been bound: "
                           "load FastMTPForCausalLM through vLLM's EAGLE proposer")


class FastMTPAttention(nn.Module):
    def __init__(self, hf_config, cfg: HeadConfig, vllm_config: VllmConfig,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.total_num_heads = cfg.num_attention_heads
        self.total_num_kv_heads = cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads = draft_common.split_heads(
            cfg, get_tensor_model_parallel_world_size(), "tensor parallel size")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size=cfg.hidden_size, head_size=self.head_dim,
            total_num_heads=self.total_num_heads, total_num_kv_heads=self.total_num_kv_heads,
            bias=cfg.qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(
            input_size=self.total_num_heads * self.head_dim, output_size=cfg.hidden_size,
            bias=cfg.o_bias, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        # the target family's rope (transformers 5 normalises rope_theta / rope_scaling into it)
        self.rotary_emb = get_rope(
            self.head_dim, max_position=cfg.max_position_embeddings,
            rope_parameters=getattr(hf_config, "rope_parameters", None), is_neox_style=True)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config, quant_config=quant_config,
            prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor,  # [T]
                hidden_states: torch.Tensor,  # [T, H]
                ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out

    def can_write_kv_only(self) -> bool:
        """Does this attention layer write its KV cache apart from attending (as vLLM's CPU
        backend does), with a cache of its own? Then :meth:`write_kv` can run alone."""
        attn = self.attn
        return (not attn.attn_backend.forward_includes_kv_cache_update
                and attn.kv_sharing_target_layer_name is None)

    def write_kv(self, positions: torch.Tensor,  # [T]
                 hidden_states: torch.Tensor,  # [T, H], normed
                 ) -> None:
        """Only the KV-cache write of :meth:`forward` (vLLM at K=0, vllm_models/k0.py): the
        same keys and values, through the call vLLM's ``Attention.forward`` makes before it
        attends."""
        from vllm.model_executor.layers.attention import attention as vattn

        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        _, k = self.rotary_emb(positions, q, k)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.attn.use_direct_call:
            vattn.unified_kv_cache_update(k, v, self.attn.layer_name)
        else:
            torch.ops.vllm.unified_kv_cache_update(k, v, vattn._encode_layer_name(self.attn.layer_name))


class FastMTPMLP(nn.Module):
    def __init__(self, cfg: HeadConfig, quant_config: QuantizationConfig | None, prefix: str):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise DraftFormatError(
                f"hidden_act={cfg.hidden_act!r}: the vLLM draft class supports silu only")
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
            quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return draft_common.mlp_forward(self, x)


class FastMTPDecoderLayer(nn.Module):
    """One dense pre-norm block; it completes its own residual sums (one layer, no stages)."""

    def __init__(self, hf_config, cfg: HeadConfig, vllm_config: VllmConfig,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = FastMTPAttention(hf_config, cfg, vllm_config, quant_config,
                                          prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = FastMTPMLP(cfg, quant_config, prefix=f"{prefix}.mlp")

    def write_kv(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """The block's KV-cache write alone (FastMTPAttention.write_kv)."""
        self.self_attn.write_kv(positions, self.input_layernorm(hidden_states))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return draft_common.block_forward(self, positions, hidden_states)


class FastMTPModel(nn.Module):
    """Input fusion + block + final norm; returns g, the hidden state the proposer feeds back."""

    def __init__(self, hf_config, cfg: HeadConfig, vllm_config: VllmConfig,
                 quant_config: QuantizationConfig | None, prefix: str, layer_id: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.embed_tokens = _TargetPart(h, "embedding")
        self.enorm = RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, eps=cfg.rms_norm_eps)

        def proj(name: str, n_in: int) -> ReplicatedLinear:  # small: replicated, no collective
            return ReplicatedLinear(n_in, h, bias=False, prefix=maybe_prefix(prefix, name))

        draft_common.add_input_projection(self, cfg.layout, h, proj)
        # The attention layer registers in vLLM's forward context under its prefix, which must
        # not collide with the target's layers and must carry a layer index: layers.{N} with N
        # the target's layer count, as vLLM's own EAGLE heads do.
        self.layer = FastMTPDecoderLayer(hf_config, cfg, vllm_config, quant_config,
                                         prefix=maybe_prefix(prefix, f"layers.{layer_id}"))
        self.final_norm = RMSNorm(h, eps=cfg.rms_norm_eps)

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The layout's input projection. hidden, embeds: [T, H] -> [T, H]."""
        return draft_common.fuse_inputs(self, hidden, embeds)

    def forward(self, input_ids: torch.Tensor | None,  # [T]
                positions: torch.Tensor,  # [T]
                hidden_states: torch.Tensor,  # [T, H] the target's post-norm h, or our own g
                inputs_embeds: torch.Tensor | None = None,  # [T, H]
                ) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = self.fuse(hidden_states.to(embeds.dtype), embeds)
        x = self.layer(positions, x)
        return self.final_norm(x)  # [T, H]

    def write_kv(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                 hidden_states: torch.Tensor, inputs_embeds: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """Input fusion and the block's KV-cache write, nothing after: returns the fused
        input [T, H] (a stand-in for g that the proposer only indexes at K=0)."""
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = self.fuse(hidden_states.to(embeds.dtype), embeds)
        self.layer.write_kv(positions, x)
        return x


class FastMTPForCausalLM(nn.Module):
    """The vLLM draft model class for a FastMTP draft directory (method ``eagle``)."""

    # the proposer binds the target's embedding and lm_head (llm_base_proposer._maybe_share_*)
    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = draft_hf_config(vllm_config)
        self.head_config = cfg = draft_common.head_config_of(self.config)
        self.draft_path = vllm_config.speculative_config.model
        quant_config = get_draft_quant_config(vllm_config)
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = FastMTPModel(self.config, cfg, vllm_config, quant_config,
                                  prefix=maybe_prefix(prefix, "model"), layer_id=target_layers)
        self.lm_head = _TargetPart(cfg.hidden_size, "lm_head")
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        self.vocab = resolve_vocab_table(self.draft_path, self.config.to_dict(), cfg.vocab_size)
        if self.vocab is not None and get_tensor_model_parallel_world_size() > 1:
            raise FastMTPError(f"{VOCAB_ENV}: a compressed draft vocabulary needs tensor "
                               "parallel size 1 in vLLM (the lm_head is vocabulary-sharded); "
                               "unset it to draft over the full vocabulary")
        self._table_rows: torch.Tensor | None = None  # [V', H] rows of the target's lm_head
        self._table_key: tuple | None = None
        # set by vllm_models/k0.py around a K=0 step of vLLM's proposer: write the KV cache only
        self.kv_only = False

    def can_write_kv_only(self) -> bool:
        """Can a K=0 step write this draft's KV cache without the rest of its forward?"""
        return self.model.layer.self_attn.can_write_kv_only()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None,  # [T]
                positions: torch.Tensor,  # [T]
                hidden_states: torch.Tensor,  # [T, H]
                inputs_embeds: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over T tokens.

        Returns ``(g, g)``, each [T, H]: the EAGLE proposer takes a pair (what ``compute_logits``
        projects, what is fed back at the next step), and for a FastMTP head both are g.
        """
        if self.kv_only:  # vLLM at K=0 (vllm_models/k0.py): only the KV cache is kept
            x = self.model.write_kv(input_ids, positions, hidden_states, inputs_embeds)
            return x, x
        g = self.model(input_ids, positions, hidden_states, inputs_embeds)
        return g, g

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        if self.vocab is None:
            return self.logits_processor(self.lm_head, hidden_states)
        ids = self.vocab  # [V'] int64, full-vocabulary ids of the one global table
        weight = self.lm_head.weight
        key = (weight.data_ptr(), weight.dtype, weight.device)
        if self._table_key != key:  # the target's head is frozen: gather its table rows once
            self._table_rows = weight[ids.to(weight.device)].contiguous()
            self._table_key = key
        part = torch.nn.functional.linear(hidden_states.to(weight.dtype), self._table_rows)
        logits = torch.full((hidden_states.shape[0], self.head_config.vocab_size),
                            float("-inf"), dtype=part.dtype, device=part.device)
        logits[:, ids.to(part.device)] = part
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a draft directory's tensors, strictly.

        Names and (unsharded) shapes must be exactly ``FastMTPHead``'s for this config
        (``draft_dir.expected_shapes``): one ``DraftFormatError`` names every missing,
        unexpected and mis-shaped tensor, before anything is copied. Returns the names of the
        parameters loaded: all of them (the target's embedding and lm_head are not parameters
        of this module; the proposer binds them after loading). q/k/v and gate/up go into
        vLLM's fused parameters (``draft_common.STACKED_PARAMS_MAPPING``).
        """
        return draft_common.load_draft_weights(self, self.head_config, weights,
                                               default_weight_loader)


def resolve_vocab_table(draft_path: str | os.PathLike | None, draft_config: dict,
                        vocab_size: int) -> torch.Tensor | None:
    """The one global draft table ``$FASTMTP_VLLM_VOCAB`` asks for, as ids [V'] (None: full).

    Raises FastMTPError for what vLLM cannot do: several tables or ``auto`` (per request), an id
    outside the vocabulary.
    """
    spec = os.environ.get(VOCAB_ENV, "").strip()
    listed = (draft_config.get("fastmtp") or {}).get("vocab_tables") or []
    if spec.lower() in FULL_VOCAB:
        if listed:
            logger.info("fastmtp: the draft lists per-request vocab tables %s; vLLM's drafter "
                        "has no request identity at compute_logits, so it drafts over the full "
                        "vocabulary (%s=<one table> for one global table)", listed, VOCAB_ENV)
        return None
    refs = [r.strip() for r in spec.split(",") if r.strip()]
    if spec.lower() == "auto" or len(refs) != 1:
        raise FastMTPError(
            f"{VOCAB_ENV}={spec!r}: vLLM can draft over one global table, not per-request tables "
            "(its compute_logits sees no request); give exactly one table, or `full`")
    from fastmtp_sglang.vocab.tables import load_table, resolve_table_ref

    base = Path(draft_path) if draft_path and Path(draft_path).is_dir() else None
    table = load_table(resolve_table_ref(refs[0], base_dir=base))
    ids = torch.as_tensor(table.ids, dtype=torch.long)
    if ids.numel() == 0 or int(ids.max()) >= vocab_size or int(ids.min()) < 0:
        raise FastMTPError(f"{VOCAB_ENV}: table {refs[0]} has ids outside [0, {vocab_size})")
    logger.info("fastmtp: drafting over the global vocab table %s (%d of %d ids)",
                refs[0], ids.numel(), vocab_size)
    return ids
