"""The target's KV cache in the reference engine: slots written in place, and attention that
reads grouped key/value heads where they are.

transformers' ``DynamicCache`` grows by ``torch.cat``: every forward copies each layer's whole
cache to append the new slots. Then the ``sdpa`` attention of a grouped-query model
(SmolLM2-135M: 9 query heads, 3 key/value heads) copies the keys and values once more,
``repeat_kv`` times the group size, because its kernel is asked for GQA only without a mask and
the engine always passes one. Per layer and forward that is ~4 reads and writes of the whole
cache, where attention itself reads it once.

- :class:`SlotCache` / :class:`SlotLayer`: keys and values live in buffers with room to grow
  (:data:`SLACK` slots, doubled when full); an update writes the new slots in place, a crop
  (the engine's rollback) only moves the end. ``keys`` / ``values`` are views of the filled
  part; assigning them (the batch's row removal, merge and repack build new tensors) copies
  into a fresh buffer with the same slack.
- :func:`gqa_sdpa`, registered as the ``"fastmtp_sdpa"`` attention implementation: the same
  ``scaled_dot_product_attention`` call with ``enable_gqa=True`` and the mask, instead of
  repeated keys. On CPU (torch 2.14) its outputs are bit-identical to the repeated form, in
  fp32 and bf16 (tests/test_slot_cache.py checks it on the engine's shapes).

Both change no number the engine computes; they remove copies.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

SLACK = 256          # free slots a buffer starts with (a verify appends K+1, a prefill the prompt)
ATTN_NAME = "fastmtp_sdpa"


class SlotLayer(DynamicLayer):
    """One layer's keys and values, [B, n_kv, slots, D] views of buffers with free slots."""

    def __init__(self, **kwargs):
        self._k = self._v = None
        self._n = 0
        super().__init__(**kwargs)

    # the filled part; assigning replaces the buffers (a copy with SLACK free slots)
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self._n]

    @keys.setter
    def keys(self, x: torch.Tensor | None) -> None:
        self._k = _with_room(x)
        if x is not None:
            self._n = x.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self._n]

    @values.setter
    def values(self, x: torch.Tensor | None) -> None:
        self._v = _with_room(x)
        if x is not None:
            self._n = x.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states`` / ``value_states`` [B, n_kv, S, D] after the filled slots;
        returns the filled keys and values (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, s = self._n, key_states.shape[-2]
        if self._k is None:
            self._k = _with_room(key_states[..., :0, :])
            self._v = _with_room(value_states[..., :0, :])
            n = self._n = 0
        if n + s > self._k.shape[-2]:
            self._k = _grow(self._k, n, n + s)
            self._v = _grow(self._v, n, n + s)
        self._k[:, :, n: n + s] = key_states
        self._v[:, :, n: n + s] = value_states
        self._n = n + s
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n if self._k is not None else 0

    def crop(self, tokens_to_remove: int) -> None:
        """``tokens_to_remove`` < 0: drop that many trailing slots (the engine's rollback);
        >= 0: keep that many (transformers' legacy form)."""
        n = self._n
        keep = n + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, n)
        self._n = max(keep, 0)

    def reset(self) -> None:
        self._k = self._v = None
        self._n = 0
        self.is_initialized = False


class SlotCache(DynamicCache):
    """A ``DynamicCache`` of :class:`SlotLayer` (one per decoder layer, created on first use)."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=SlotLayer)


def _with_room(x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None:
        return None
    buf = x.new_empty(*x.shape[:-2], x.shape[-2] + SLACK, x.shape[-1])
    buf[..., : x.shape[-2], :] = x
    return buf


def _grow(buf: torch.Tensor, filled: int, need: int) -> torch.Tensor:
    new = buf.new_empty(*buf.shape[:-2], max(need + SLACK, 2 * buf.shape[-2]), buf.shape[-1])
    new[..., :filled, :] = buf[..., :filled, :]
    return new


def gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0,
             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' sdpa attention with grouped key/value heads read in place.

    query [B, n_heads, S, D]; key, value [B, n_kv, T, D]; attention_mask bool or additive
    [B, 1, S, T] or None. Returns ([B, S, n_heads, D], None) as transformers expects. Anything
    this does not cover (attention weights, position biases, paged caches) goes to the stock
    function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (kwargs.get("output_attentions") or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or query.device.type != "cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=causal, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`gqa_sdpa` (and sdpa's mask) under :data:`ATTN_NAME`; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, gqa_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


def use_gqa_sdpa(model) -> bool:
    """Switch a transformers model from ``sdpa`` to :func:`gqa_sdpa` (CPU only; other
    implementations are left alone). Returns whether it switched."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    if next(model.parameters()).device.type != "cpu":
        return False
    name = register()
    model.set_attn_implementation(name)
    return True
