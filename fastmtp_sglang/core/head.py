"""FastMTPHead: one multi-token-prediction module in pure PyTorch, run recursively K times.

One step (docs/design.md section 1.1)::

    e   = embed(x_{i+1})                              # the target's embedding, shared
    h_i = fc(cat[anorm_1(a_1), .., anorm_n(a_n), h_i])  # only with aux layers, only at step 1
    x   = proj(hnorm(h_i), enorm(e))                  # layout-dependent, see LAYOUTS
    x   = block(x)                                    # one dense Llama / Qwen2 decoder layer
    g_i = final_norm(x)                               # fed back as h at the next recursive step
    logits = lm_head(g_i)                             # the target's lm_head, shared (or compressed)

**Aux layers** (EAGLE-3's multi-layer features, for targets without an MTP layer): with
``aux_hidden_states`` set, the head's input from the target is the concatenation of the residual
streams a_1..a_n of some of its middle layers and its post-norm last hidden state, [B, S, (n+1) H];
each a_i gets its own RMSNorm (residual streams are not normalised and their scales differ by
orders of magnitude) and ``fc`` maps the concatenation to H. The recursion feeds back the head's
own output (width H), which skips ``fc``: the input width tells the two apart. A new ``fc`` is
[0 .. 0 | I], so a fused head starts as exactly the last-layer head it was made from.

The embedding and lm_head belong to the target: they are held by reference, outside the module
tree, so ``state_dict()`` holds exactly the tensors a draft directory stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastmtp_sglang.core.attention import grouped_attention
from fastmtp_sglang.core.errors import DraftFormatError

LAYOUTS = ("mimo", "deepseek", "split")
BLOCKS = ("llama", "qwen2")
# model_type values of checkpoints whose dense block is one of ours
MODEL_TYPE_TO_BLOCK = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama", "mimo": "qwen2"}


@dataclass
class HeadConfig:
    """Shape and maths of one head; built from a draft directory's ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    layout: str = "deepseek"
    block: str = "llama"
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # llama only: bias on q, k, v and o (qwen2: q, k, v always)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # indices into transformers' ``output_hidden_states`` tuple of the target (i = the residual
    # stream leaving decoder layer i-1, 1 <= i < num_layers) fused with its last hidden state
    aux_hidden_states: tuple[int, ...] = ()
    # the HF config dict the rotary embedding is built from (rope_theta / rope_scaling / ...)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise DraftFormatError(f"unknown layout {self.layout!r}; expected one of {LAYOUTS}")
        if self.block not in BLOCKS:
            raise DraftFormatError(f"unknown block {self.block!r}; expected one of {BLOCKS}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.aux_hidden_states = tuple(int(i) for i in self.aux_hidden_states)
        if any(i < 1 for i in self.aux_hidden_states) or len(set(self.aux_hidden_states)) != len(
                self.aux_hidden_states):
            raise DraftFormatError(f"aux_hidden_states must be distinct layer indices >= 1, got "
                                   f"{list(self.aux_hidden_states)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftFormatError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def qkv_bias(self) -> bool:
        return True if self.block == "qwen2" else self.attention_bias

    @property
    def o_bias(self) -> bool:
        return False if self.block == "qwen2" else self.attention_bias

    @property
    def input_width(self) -> int:
        """Width of the hidden input the head takes from the target (step 1, draft extend)."""
        return self.hidden_size * (len(self.aux_hidden_states) + 1)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "HeadConfig":
        """From a draft directory's config.json (the ``fastmtp`` block gives the layout)."""
        meta = cfg.get("fastmtp") or {}
        model_type = cfg.get("model_type", "llama")
        block = meta.get("block") or MODEL_TYPE_TO_BLOCK.get(model_type)
        if block is None:
            raise DraftFormatError(
                f"model_type {model_type!r} has no dense block we know; expected llama or qwen2"
            )
        try:
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_attention_heads=int(cfg["num_attention_heads"]),
                num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                vocab_size=int(cfg["vocab_size"]),
                layout=meta.get("layout", "deepseek"),
                block=block,
                head_dim=cfg.get("head_dim"),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                hidden_act=cfg.get("hidden_act", "silu"),
                aux_hidden_states=tuple(meta.get("aux_hidden_states") or ()),
                hf_config=dict(cfg),
            )
        except KeyError as exc:
            raise DraftFormatError(f"config.json lacks the key {exc.args[0]!r}") from None


def head_input(out, aux: tuple[int, ...]) -> torch.Tensor:
    """The head's input from a transformers base-model output: its ``last_hidden_state``
    [B, S, H], or with aux layers (the forward ran with ``output_hidden_states=True``)
    cat[hidden_states[i] for i in aux] + [last_hidden_state]: [B, S, (n+1) H]."""
    if not aux:
        return out.last_hidden_state
    hs = out.hidden_states
    return torch.cat([hs[i] for i in aux] + [out.last_hidden_state], dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as Llama / Qwen2 do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotary(cfg: HeadConfig) -> nn.Module:
    """The target family's own rotary embedding, so every rope_scaling variant matches it."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
            "partial_rotary_factor")
    kw = {k: cfg.hf_config[k] for k in keys if cfg.hf_config.get(k) is not None}
    if "rope_parameters" in kw:  # transformers 5 form wins over the legacy keys
        kw.pop("rope_theta", None)
        kw.pop("rope_scaling", None)
    hf = AutoConfig.for_model(
        cfg.block,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        **kw,
    )
    return (Qwen2RotaryEmbedding if cfg.block == "qwen2" else LlamaRotaryEmbedding)(hf)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class HeadKVCache:
    """The head's own KV cache, indexed by position: slot t holds the key of position t.

    A step writes its keys at its positions and its queries read every key at a position <= the
    query's. Stale keys beyond a row's current end are harmless: they are overwritten before any
    query can reach them, which is what makes rollback free (docs/design.md section 1.6, draft extend).

    Positions run up to ``max_len``, but the buffers hold only as many as have been written
    (grown in steps of at least ``GROW`` positions, doubling): a batch whose rows leave and join
    copies what it uses, not ``max_len`` positions per row (8,197 for the demo target, 6 MB a row
    in bf16: at 16 rows every join and leave had copied ~100 MB).
    """

    GROW = 256

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 0):
        shape = (batch_size, num_kv_heads, min(capacity, max_len), head_dim)
        # the buffers may hold more rows than the batch (free rows that joins write into, as the
        # target's SlotCache does): the batch is the first ``_b`` rows
        self._k = torch.zeros(shape, dtype=dtype, device=device)  # [R, n_kv, capacity, D]
        self._v = torch.zeros(shape, dtype=dtype, device=device)  # [R, n_kv, capacity, D]
        self._b = batch_size
        self.max_len = max_len

    @property
    def k(self) -> torch.Tensor:
        """The batch's keys [B, n_kv, capacity, D] (a view: writes go to the cache)."""
        return self._k[: self._b]

    @property
    def v(self) -> torch.Tensor:
        return self._v[: self._b]

    @property
    def capacity(self) -> int:
        """Positions the buffers hold now (0 <= capacity <= max_len)."""
        return self._k.shape[2]

    def reserve(self, need: int, rows: int = 0) -> None:
        """Room for positions [0, need) (zeros past what was written, which nothing reads), and
        for ``rows`` rows in all (growing keeps the batch's rows; free rows are zeros)."""
        R = self._k.shape[0]
        if need <= self.capacity and rows <= R:
            return
        if need > self.max_len:
            raise IndexError(f"position {need - 1} is beyond the head cache's {self.max_len} positions")
        cap = self.capacity if need <= self.capacity else \
            min(self.max_len, max(need, 2 * self.capacity, self.GROW))
        R2, b = max(R, rows), self._b

        def grow(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(R2, x.shape[1], cap, x.shape[3])
            out[:b, :, : x.shape[2]] = x[:b]
            return out
        self._k, self._v = grow(self._k), grow(self._v)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """positions [B, S]; k, v [B, n_kv, S, D]."""
        if self._k.device.type == "cpu" and positions.shape[0] == 1:
            # one row at consecutive positions (every draft step and extend the engine runs):
            # a slice copy instead of a scatter (host reads are free on CPU)
            p0, s = int(positions[0, 0]), positions.shape[1]
            if s == 1 or torch.equal(positions[0], torch.arange(p0, p0 + s)):
                self.reserve(p0 + s)
                self.k[:, :, p0:p0 + s] = k
                self.v[:, :, p0:p0 + s] = v
                return
        self.reserve(int(positions.max()) + 1)
        idx = positions[:, None, :, None].expand_as(k)
        self.k.scatter_(2, idx, k.to(self._k.dtype))
        self.v.scatter_(2, idx, v.to(self._v.dtype))

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (finished requests leave the batch; a copy)."""
        self._k, self._v = self.k[rows], self.v[rows]
        self._b = self._k.shape[0]

    def move_rows(self, dst: list[int], src: list[int], rows: int) -> None:
        """Row ``dst[i]`` takes row ``src[i]`` (rows leaving are overwritten by rows kept), then
        the batch is the first ``rows`` rows. Copies only the moved rows (a leave at 16 rows had
        copied the whole cache)."""
        if dst:
            d = torch.tensor(dst, device=self._k.device)
            s = torch.tensor(src, device=self._k.device)
            self._k[d] = self._k[s]
            self._v[d] = self._v[s]
        self._b = rows

    def prepare_append(self, other: "HeadKVCache", rows: int = 0) -> None:
        """Room for ``other``'s rows after this batch's (allocates; changes no row of the batch).
        Rows grow to at least ``rows`` (a hint: the most the batch will hold) when they must."""
        if other.max_len != self.max_len:
            raise ValueError(f"head caches of {self.max_len} and {other.max_len} positions")
        need = self._b + other._b
        self.reserve(max(self.capacity, other.capacity),
                     need if need <= self._k.shape[0] else max(need, rows))

    def append_rows(self, other: "HeadKVCache") -> None:
        """Write ``other``'s rows after this batch's (:meth:`prepare_append` first; this one does
        not allocate). Positions ``other`` never wrote are zeros, like a fresh cache's."""
        b, m, c = self._b, other._b, other.capacity
        self._k[b: b + m, :, :c] = other.k
        self._v[b: b + m, :, :c] = other.v
        self._k[b: b + m, :, c:].zero_()
        self._v[b: b + m, :, c:].zero_()
        self._b = b + m


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_bias)

    def _q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] -> rotated q [B, n_heads, S, D]."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, H] -> rotated k and v [B, n_kv, S, D]."""
        b, s, _ = x.shape
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return k * cos + _rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, cache: HeadKVCache | None,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, (k, v) = self._q(x, cos, sin), self._kv(x, cos, sin)
        rep = self.n_heads // self.n_kv
        if cache is not None:
            cache.write(positions, k, v)
            # keys [0, n): the furthest query position bounds what any row can see
            n = int(positions.max()) + 1
            k, v = cache.k[:, :, :n], cache.v[:, :, :n]
            if attn_mask is None and b == 1 and s == 1:
                # a draft step: one query at the last key sees every key. No mask, and the
                # query heads sharing a key/value head become that head's query rows (no copy
                # of the cache per query head): same maths, less work at batch 1
                qg = q.reshape(1, self.n_kv, rep, self.head_dim)
                out = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype))
                return self.o_proj(out.reshape(1, 1, -1))
            key_pos = torch.arange(n, device=x.device)
            mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, S, n]
        else:
            mask = positions[:, None, None, :] <= positions[:, None, :, None]  # [B, 1, S, S]
        if attn_mask is not None:
            mask = attn_mask if attn_mask.dim() == 4 else attn_mask[:, None]
        # query heads folded onto their key/value head (no repeated keys; core/attention.py)
        out = grouped_attention(q, k.to(q.dtype), v.to(q.dtype), mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward_train(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      past: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
                      queries: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention over explicit key blocks ``[*past, own]`` (training; no cache).

        x [B, S, H]; cos, sin [B, S, D]; past: (k, v) pairs, each [B, n_kv, S_i, D], already
        rotated; ``queries`` [B, A] (optional): the indices of the S inputs whose outputs are
        wanted (default all: A = S); mask: bool [A, sum S_i + S] or [B, 1, A, sum S_i + S].
        Returns the output [B, A, H] and this call's own rotated (k, v) at all S inputs, each
        [B, n_kv, S, D].
        """
        b = x.shape[0]
        k, v = self._kv(x, cos, sin)
        if queries is not None:
            x, cos, sin = (rows_at(t, queries) for t in (x, cos, sin))
        a = x.shape[1]
        q = self._q(x, cos, sin)
        keys = torch.cat([pk for pk, _ in past] + [k], dim=2) if past else k
        vals = torch.cat([pv for _, pv in past] + [v], dim=2) if past else v
        rep = self.n_heads // self.n_kv
        if rep > 1:
            keys = keys.repeat_interleave(rep, dim=1)
            vals = vals.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, a, -1)), (k, v)


def rows_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...] -> x[b, index[b, a]] as [B, A, ...]."""
    b = torch.arange(x.shape[0], device=x.device)[:, None]
    return x[b, index]


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, positions, cache, attn_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_train(self, x, cos, sin, past, mask, queries=None):
        a, kv = self.self_attn.forward_train(self.input_layernorm(x), cos, sin, past, mask, queries)
        x = (x if queries is None else rows_at(x, queries)) + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class _Shared:
    """The target's embedding and lm_head, held by reference and never registered as children."""

    def __init__(self, embed: nn.Module, lm_head: nn.Module):
        self.embed, self.lm_head = embed, lm_head


class FastMTPHead(nn.Module):
    """One MTP module; call it once per draft step.

    Parameters
    ----------
    cfg : HeadConfig
    embed : nn.Module
        The target's token embedding (``[V, H]``), shared.
    lm_head : nn.Module
        The target's output projection (``[V, H]``), shared. ``projection`` (a callable
        ``hidden [..., H] -> logits [..., V']``) replaces it when set: the seam where a compressed
        vocabulary plugs in.
    """

    def __init__(self, cfg: HeadConfig, embed: nn.Module | None = None, lm_head: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.layout == "mimo":
            self.input_proj = nn.Linear(2 * h, h, bias=False)  # cat[hnorm(h), enorm(e)]
        elif cfg.layout == "deepseek":
            self.eh_proj = nn.Linear(2 * h, h, bias=False)  # cat[enorm(e), hnorm(h)]
        else:
            self.e_proj = nn.Linear(h, h, bias=False)
            self.h_proj = nn.Linear(h, h, bias=False)
        if cfg.aux_hidden_states:
            n = len(cfg.aux_hidden_states)
            self.aux_norms = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in range(n))
            self.fc = nn.Linear((n + 1) * h, h, bias=False)
            with torch.no_grad():  # [0 .. 0 | I]: starts as the last-layer head
                self.fc.weight.zero_()
                self.fc.weight[:, n * h:].copy_(torch.eye(h))
        self.layer = DecoderLayer(cfg)
        self.final_norm = RMSNorm(h, cfg.rms_norm_eps)
        # kept outside the module tree so .to(bf16) leaves inv_freq in fp32, as the target has it
        self._rotary = [_rotary(cfg)]
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # serving on CPU
        self._shared = _Shared(embed, lm_head)
        self.projection: Callable[[torch.Tensor], torch.Tensor] | None = None

    # -- the target's parts -------------------------------------------------------------
    def set_embed_and_head(self, embed: nn.Module, lm_head: nn.Module) -> None:
        self._shared = _Shared(embed, lm_head)

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared.embed

    @property
    def lm_head(self) -> nn.Module:
        return self._shared.lm_head

    @property
    def rotary(self) -> nn.Module:
        rot = self._rotary[0]
        if rot.inv_freq.device != self.enorm.weight.device:
            self._rotary[0] = rot = rot.to(self.enorm.weight.device)
        return rot

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, capacity: int = 0) -> HeadKVCache:
        """A cache for positions [0, max_len), holding ``capacity`` of them until more are
        written (HeadKVCache grows on write)."""
        p = self.enorm.weight
        return HeadKVCache(batch_size, max_len, self.cfg.num_key_value_heads, self.cfg.head_dim,
                           dtype or p.dtype, device or p.device, capacity)

    # -- maths ----------------------------------------------------------------------------
    def fuse_aux(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's [B, S, (n+1) H] (aux layers, then the last hidden state) -> [B, S, H];
        a hidden state of width H (the head's own, at recursive steps) passes unchanged."""
        h = self.cfg.hidden_size
        if hidden.shape[-1] == h:
            return hidden
        if not self.cfg.aux_hidden_states or hidden.shape[-1] != self.cfg.input_width:
            raise ValueError(f"hidden input of width {hidden.shape[-1]}; this head takes {h} or "
                             f"{self.cfg.input_width} (aux layers {list(self.cfg.aux_hidden_states)})")
        parts = list(hidden.split(h, dim=-1))
        parts = [norm(a) for norm, a in zip(self.aux_norms, parts[:-1])] + [parts[-1]]
        return self.fc(torch.cat(parts, dim=-1))

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The layout's input projection. hidden [B, S, H] (or the target's [B, S, (n+1) H] with
        aux layers), embeds [B, S, H] -> [B, S, H]."""
        h, e = self.hnorm(self.fuse_aux(hidden)), self.enorm(embeds)
        if self.cfg.layout == "mimo":
            return self.input_proj(torch.cat([h, e], dim=-1))
        if self.cfg.layout == "deepseek":
            return self.eh_proj(torch.cat([e, h], dim=-1))
        return self.e_proj(e) + self.h_proj(h)

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos/sin at ``positions`` ([B, S, D] each, x's dtype). Serving on CPU reads
        them from a table the rotary module filled once (the same values: each entry is one
        product and one cos/sin, whatever else is computed beside it); training, GPUs (CUDA
        graphs want no host reads) and rope types that depend on the sequence length call the
        module every step."""
        rot = self.rotary
        rope = str(getattr(rot, "rope_type", "default"))
        if (x.device.type != "cpu" or torch.is_grad_enabled() or "dynamic" in rope
                or "longrope" in rope):
            return rot(x, positions)
        need = int(positions.max()) + 1
        tab = self._rope_table
        if tab is None or tab[0].shape[0] < need or tab[0].dtype != x.dtype:
            n = max(need, 2 * tab[0].shape[0] if tab is not None else 512)
            cos, sin = rot(x[:1, :1], torch.arange(n, device=x.device)[None])
            tab = self._rope_table = (cos[0], sin[0])
        return tab[0][positions], tab[1][positions]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from output hidden states; the compressed-vocabulary seam."""
        if self.projection is not None:
            return self.projection(hidden)
        if self.lm_head is None:
            raise RuntimeError("FastMTPHead has no lm_head: call set_embed_and_head first")
        w = getattr(self.lm_head, "weight", None)
        if w is not None and w.dtype != hidden.dtype:  # e.g. a bf16 head on an fp32 target
            hidden = hidden.to(w.dtype)
        return self.lm_head(hidden)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: HeadKVCache | None = None, attn_mask: torch.Tensor | None = None,
                return_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step.

        Parameters
        ----------
        hidden : [B, S, H] previous hidden: the target's post-norm hidden state, or this head's
            own output of the previous recursive step.
        input_ids : [B, S] the token after the one ``hidden`` was computed at.
        positions : [B, S] int64 positions of the step (where its keys are written).
        cache : the head's KV cache; ``None`` = attention only within these S inputs.
        attn_mask : optional bool mask [B, S, T] or [B, 1, S, T] over the keys attention sees
            (T = cache length in use, or S without cache); overrides the positional causal mask.
            Training uses it for the train-as-you-serve pattern.

        Returns
        -------
        out_hidden : [B, S, H] after the final norm (fed back at the next step).
        logits : [B, S, V] (or the projection's width), or None when ``return_logits`` is False.
        """
        if self.embed_tokens is None:
            raise RuntimeError("FastMTPHead has no embedding: call set_embed_and_head first")
        dtype = self.enorm.weight.dtype
        embeds = self.embed_tokens(input_ids).to(dtype)
        x = self.fuse(hidden.to(dtype), embeds)
        cos, sin = self._cos_sin(x, positions)
        x = self.layer(x, cos, sin, positions, cache, attn_mask)
        out = self.final_norm(x)
        return out, (self.project(out) if return_logits else None)

    def forward_train_step(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                           past_kv: list[tuple[torch.Tensor, torch.Tensor]], attn_mask: torch.Tensor,
                           queries: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One recursive step over a whole sequence, attending to explicit earlier key blocks.

        Training runs every anchor of a sequence at once: step k's S inputs see the key blocks of
        steps 1..k-1 (``past_kv``) and their own, through ``attn_mask``; this is how the
        train-as-you-serve pattern (``fastmtp_sglang.training.objective``) reproduces what the serving KV cache
        holds. The maths per token is :meth:`forward`'s.

        Parameters
        ----------
        hidden : [B, S, H] the target's hidden states (step 1) or this head's previous outputs.
        input_ids : [B, S] the tokens paired with ``hidden``.
        positions : [B, S] int64 rotary positions of these queries and keys.
        past_kv : earlier steps' rotated (k, v), each [B, n_kv, S_i, D]; [] for step 1.
        attn_mask : bool [A, sum S_i + S] or [B, 1, A, sum S_i + S]; True = may attend.
        queries : optional [B, A] indices of the S inputs whose outputs are wanted (default all,
            A = S): the others only add their keys, and skip the query, the output projection
            and the MLP.

        Returns
        -------
        out_hidden : [B, A, H] after the final norm (no logits: the loss projects in chunks).
        kv : this step's rotated (k, v) at all S inputs, each [B, n_kv, S, D], for the next
            steps' ``past_kv``.
        """
        if self.embed_tokens is None:
            raise RuntimeError("FastMTPHead has no embedding: call set_embed_and_head first")
        dtype = self.enorm.weight.dtype
        x = self.fuse(hidden.to(dtype), self.embed_tokens(input_ids).to(dtype))
        cos, sin = self.rotary(x, positions)
        x, kv = self.layer.forward_train(x, cos, sin, past_kv, attn_mask, queries)
        return self.final_norm(x), kv
