"""FastMTPForCausalLM: a FastMTP draft head served by SGLang's EAGLE worker.

One draft step (docs/design.md section 1.1), on SGLang's own layers::

    e      = embed(x_{i+1})                       # the target's embedding, shared
    x      = proj(hnorm(h_i), enorm(e))           # layout mimo / deepseek / split
    x      = block(x)                             # one dense Llama / Qwen2 decoder layer
    g_i    = final_norm(x)                        # stored by the LogitsProcessor, fed back
    logits = lm_head(g_i)                         # the target's lm_head, shared

The previous hidden state ``h_i`` arrives in ``forward_batch.spec_info.hidden_states`` (the
target's post-norm hidden state at draft extend, this head's own ``g`` at the recursive steps
of ``EagleDraftWorker.draft_forward``), so the stock worker runs one head K times
(``--speculative-eagle-topk 1``). The forward has no host syncs and no data-dependent shapes,
so it is CUDA-graph capturable.

Registration: ``SGLANG_EXTERNAL_MODEL_PACKAGE=fastmtp_sglang.models`` (this module's
``EntryClass``), or the ``sglang.srt.plugins`` entry point :func:`register_with_sglang`.

Weights come from a draft directory (docs/design.md section 4): exactly the tensors of
``fastmtp_sglang.core.head.FastMTPHead.state_dict()``; embedding and lm_head come from the target
through :meth:`FastMTPForCausalLM.set_embed_and_head`.

Compressed vocabulary: when the draft directory lists vocab tables (``fastmtp.vocab_tables``),
``load_weights`` installs a :class:`~fastmtp_sglang.models.compressed_projection.CompressedProjection`
in place of the lm_head: per request, logits over its language's table only, scattered into a
full-width row of -inf (``$FASTMTP_SGLANG_VOCAB=full`` turns it off).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Tuple

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.dp_attention import is_dp_attention_enabled
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.platforms import current_platform
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix
from sglang.srt.utils.hf_transformers import get_rope_config

from fastmtp_sglang.core.errors import DraftFormatError
from fastmtp_sglang.core.head import HeadConfig
from fastmtp_sglang.models.compressed_projection import projection_for_draft
from fastmtp_sglang.models import draft_common

logger = logging.getLogger(__name__)


class FastMTPAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, cfg: HeadConfig,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "") -> None:
        super().__init__()
        self.total_num_heads = cfg.num_attention_heads
        self.total_num_kv_heads = cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads = draft_common.split_heads(
            cfg, get_parallel().tp_size, "--tp-size"
        )
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=cfg.qkv_bias,
            quant_config=quant_config,
            prefix=add_prefix("qkv_proj", prefix),
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            cfg.hidden_size,
            bias=cfg.o_bias,
            quant_config=quant_config,
            prefix=add_prefix("o_proj", prefix),
        )

        rope_theta, rope_scaling = get_rope_config(config)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)  # get_rope caches on it: leave the config's alone
            if getattr(config, "original_max_position_embeddings", None):
                rope_scaling.setdefault(
                    "original_max_position_embeddings", config.original_max_position_embeddings
                )
        partial = getattr(config, "partial_rotary_factor", None) or 1.0
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=int(self.head_dim * partial),
            max_position=cfg.max_position_embeddings,
            base=rope_theta,
            rope_scaling=rope_scaling,
            is_neox_style=True,
        )
        # layer_id 0: the draft owns a one-layer KV pool (num_nextn_predict_layers = 1)
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            layer_id=0,
            quant_config=quant_config,
            prefix=add_prefix("attn", prefix),
        )

    def forward(self, positions: torch.Tensor,  # [T]
                hidden_states: torch.Tensor,  # [T, H]
                forward_batch: ForwardBatch) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, forward_batch)
        output, _ = self.o_proj(attn_output)
        return output


class FastMTPMLP(nn.Module):
    def __init__(self, cfg: HeadConfig, quant_config: Optional[QuantizationConfig] = None,
                 prefix: str = "") -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise DraftFormatError(
                f"hidden_act={cfg.hidden_act!r}: the SGLang draft class supports silu only"
            )
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size] * 2,
            bias=cfg.mlp_bias,
            quant_config=quant_config,
            prefix=add_prefix("gate_up_proj", prefix),
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size,
            cfg.hidden_size,
            bias=cfg.mlp_bias,
            quant_config=quant_config,
            prefix=add_prefix("down_proj", prefix),
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return draft_common.mlp_forward(self, x)


class FastMTPDecoderLayer(nn.Module):
    """One dense pre-norm block; it completes its own residual sums (one layer, no stages)."""

    def __init__(self, config: PretrainedConfig, cfg: HeadConfig,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = FastMTPAttention(
            config, cfg, quant_config, prefix=add_prefix("self_attn", prefix)
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = FastMTPMLP(cfg, quant_config, prefix=add_prefix("mlp", prefix))

    def forward(self, positions: torch.Tensor,  # [T]
                hidden_states: torch.Tensor,  # [T, H]
                forward_batch: ForwardBatch) -> torch.Tensor:
        return draft_common.block_forward(self, positions, hidden_states, forward_batch)


class FastMTPModel(nn.Module):
    """Input fusion + block + final norm; returns the hidden state the worker feeds back."""

    def __init__(self, config: PretrainedConfig, cfg: HeadConfig,
                 quant_config: Optional[QuantizationConfig] = None, prefix: str = "") -> None:
        super().__init__()
        h = cfg.hidden_size
        # placeholder until set_embed_and_head binds the target's (same vocab-parallel layout)
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size,
            h,
            use_attn_tp_group=is_dp_attention_enabled(),
            prefix=add_prefix("embed_tokens", prefix),
        )
        self.enorm = RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, eps=cfg.rms_norm_eps)

        def proj(name: str, n_in: int) -> ReplicatedLinear:  # small: replicated, no collective
            return ReplicatedLinear(n_in, h, bias=False, prefix=add_prefix(name, prefix))

        draft_common.add_input_projection(self, cfg.layout, h, proj)
        self.layer = FastMTPDecoderLayer(
            config, cfg, quant_config, prefix=add_prefix("layer", prefix)
        )
        self.final_norm = RMSNorm(h, eps=cfg.rms_norm_eps)

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The layout's input projection. hidden, embeds: [T, H] -> [T, H]."""
        return draft_common.fuse_inputs(self, hidden, embeds)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,  # [T, H]
    ) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        hidden = forward_batch.spec_info.hidden_states  # [T, H] target's or this head's g
        x = self.fuse(hidden.to(embeds.dtype), embeds)
        x = self.layer(positions, x, forward_batch)
        return self.final_norm(x)  # [T, H]


class FastMTPForCausalLM(nn.Module):
    """The SGLang draft model class named in a draft directory's ``architectures``."""

    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.head_config = draft_common.head_config_of(config)
        self.model = FastMTPModel(
            config, self.head_config, quant_config, prefix=add_prefix("model", prefix)
        )
        # placeholder until set_embed_and_head binds the target's (or a token-map slice of it)
        self.lm_head = ParallelLMHead(
            self.head_config.vocab_size,
            self.head_config.hidden_size,
            prefix=add_prefix("lm_head", prefix),
            use_attn_tp_group=get_parallel().enable_dp_lm_head,
        )
        self._full_head_rows = self.lm_head.weight.shape[0]  # padded vocab / tp
        self.logits_processor = LogitsProcessor(config)
        # Compressed-vocabulary seam (see set_draft_projection); None = full (or token-map) head.
        self.draft_projection: Optional[nn.Module] = None

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
    ) -> LogitsProcessorOutput:
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds)
        head = self.lm_head
        if self.draft_projection is not None:
            head = self.draft_projection
            prepare = getattr(head, "prepare", None)  # per-request table: update, select
            if prepare is not None:
                prepare(input_ids, forward_batch)
        return self.logits_processor(input_ids, hidden_states, head, forward_batch)

    # -- the target's embedding and lm_head ----------------------------------------------
    def get_embed_and_head(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Bind the target's tensors (never copied).

        ``head`` may be truncated to ``[T, H]`` rows by SGLang's ``--speculative-token-map``:
        the logits are then ``[N, T]`` and the worker maps their indices back through its
        ``hot_token_id``. The token map is the user's explicit choice: it replaces the
        per-request tables (the projection is removed, with a warning).
        """
        if head.shape[0] != self._full_head_rows and self.draft_projection is not None:
            logger.warning("fastmtp: --speculative-token-map given: its one global table replaces "
                           "the draft's per-request vocab tables")
            self.set_draft_projection(None)
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head
        current_platform.empty_cache()
        current_platform.synchronize()

    def set_draft_projection(self, projection: Optional[object]) -> None:
        """Install (or remove, with None) the compressed-vocabulary projection.

        The seam of docs/design.md section 5.5: ``projection`` is handed to SGLang's
        ``LogitsProcessor`` in place of ``lm_head``, so it must look like an lm_head to it:
        a ``weight`` attribute and a ``quant_method`` whose ``apply(layer, hidden [N, H],
        bias) -> logits [N, V_local]`` returns this rank's full vocabulary-shard width, -inf
        outside each row's table. Fixed width keeps the worker's argmax, the logits buffer and
        CUDA graphs as they are; the TP all-gather then assembles the full row. If it has a
        ``prepare(input_ids, forward_batch)`` method, the forward calls it first (the
        compressed projection picks each request's table there).
        """
        if projection is not None and self.lm_head.weight.shape[0] != self._full_head_rows:
            raise ValueError(
                "a compressed-vocabulary projection cannot be combined with "
                "--speculative-token-map (the lm_head is already truncated)"
            )
        # not a child module: it shares the target's head, which this model must not own
        self.__dict__["draft_projection"] = projection

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> set[str]:
        """Load a draft directory's tensors, strictly.

        The names and (unsharded) shapes must be exactly ``FastMTPHead``'s for this config
        (``draft_dir.expected_shapes``): one ``DraftFormatError`` names every missing,
        unexpected and mis-shaped tensor, before anything is copied. Returns the names of the
        parameters loaded (everything but the target's embedding and lm_head); q/k/v and
        gate/up go into SGLang's fused parameters (``draft_common.STACKED_PARAMS_MAPPING``).
        """
        loaded = draft_common.load_draft_weights(
            self, self.head_config, weights, default_weight_loader,
            shared=("model.embed_tokens.weight", "lm_head.weight"),
        )
        self.install_vocab_tables()
        return loaded

    def install_vocab_tables(self, **kwargs) -> None:
        """Install the compressed projection the draft's config (or ``$FASTMTP_SGLANG_VOCAB``)
        asks for; none when it lists no tables. ``kwargs`` go to ``projection_for_draft``.

        Not with DP attention: the logits processor then gathers other ranks' rows before the
        lm_head, which a per-request table cannot index (the full head is kept, with a warning).
        """
        projection = projection_for_draft(self.config, self.lm_head, **kwargs)
        if projection is not None and self.logits_processor.do_tensor_parallel_all_gather_dp_attn:
            logger.warning("fastmtp: per-request vocab tables are not supported with DP attention; "
                           "drafting over the full vocabulary")
            projection = None
        self.set_draft_projection(projection)


def register_with_sglang() -> None:
    """``sglang.srt.plugins`` entry point: add FastMTPForCausalLM to SGLang's model registry.

    SGLang runs general plugins in every server process (scheduler included) before a model
    loads; the environment variable route needs no plugin.
    """
    from sglang.srt.models.registry import ModelRegistry

    ModelRegistry.models[FastMTPForCausalLM.__name__] = FastMTPForCausalLM


EntryClass = FastMTPForCausalLM
