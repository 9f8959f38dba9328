"""The target's KV cache in the reference engine: slots written in place, and attention that
reads grouped key/value heads where they are.

transformers' ``DynamicCache`` grows by ``torch.cat``: every forward copies each layer's whole
cache to append the new slots. Then the ``sdpa`` attention of a grouped-query model
(SmolLM2-135M: 9 query heads, 3 key/value heads) copies the keys and values once more,
``repeat_kv`` times the group size, because its kernel is asked for GQA only without a mask and
the engine always passes one. Per layer and forward that is ~4 reads and writes of the whole
cache, where attention itself reads it once.

- :class:`SlotCache` / :class:`SlotLayer`: keys and values live in buffers with room to grow
  (:data:`SLACK` slots, doubled when full, and rows beyond the batch's); an update writes the
  new slots in place, a crop (the engine's rollback) only moves the end. ``keys`` / ``values``
  are views of the filled part. Continuous batching's row operations work in place too: a
  leave moves the last rows into the holes (``move_rows``), a join writes the new rows into
  free rows (``append``), a repack gathers each row's live slots to the front (``repack``), so
  none copies the rows that stay (a 16-row batch had copied ~370 MB per join and leave).
- :func:`gqa_sdpa`, registered as the ``"fastmtp_sdpa"`` attention implementation:
  :func:`grouped_attention` (the query heads of a key/value head folded into its query rows)
  instead of repeated keys. The same maths; outputs within the last bit of the repeated form
  (tests/test_slot_cache.py checks it on the engine's shapes), and exactly what the engine's
  lean forward computes (decode/lean_forward.py calls the same function).

The cache changes no number; both remove copies, and the folded attention a slow kernel path.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from fastmtp_sglang.core.attention import grouped_attention

SLACK = 256          # free slots a buffer starts with (a verify appends K+1, a prefill the prompt)
ATTN_NAME = "fastmtp_sdpa"


class SlotLayer(DynamicLayer):
    """One layer's keys and values, [B, n_kv, slots, D] views of buffers with free rows and
    slots: the first ``B`` rows of the buffers are the batch's, the rest are a pool that rows
    joining later are written into (:meth:`append_rows`), and rows leaving are replaced by moving
    the last rows into their place (:meth:`move_rows`), so neither copies the rows that stay."""

    def __init__(self, rows: int = 0, slots: int = 0, **kwargs):
        self._k = self._v = None
        self._n = 0   # filled slots of every row
        self._b = 0   # rows of the batch (the buffers may hold more)
        self._first = (rows, slots)  # the room the first write allocates, at least
        super().__init__(**kwargs)

    # the filled part; assigning replaces the buffers (a copy with SLACK free slots)
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[: self._b, :, : self._n]

    @keys.setter
    def keys(self, x: torch.Tensor | None) -> None:
        self._k = _with_room(x)
        if x is not None:
            self._b, self._n = x.shape[0], x.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[: self._b, :, : self._n]

    @values.setter
    def values(self, x: torch.Tensor | None) -> None:
        self._v = _with_room(x)
        if x is not None:
            self._b, self._n = x.shape[0], x.shape[-2]

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
            rows, slots = self._first
            b, h, _, d = key_states.shape
            shape = (max(b, rows), h, max(s + SLACK, slots), d)
            self._k, self._v = key_states.new_zeros(shape), value_states.new_zeros(shape)
            n = self._n = 0
            self._b = b
        if key_states.shape[0] != self._b:
            raise ValueError(f"{key_states.shape[0]} rows written into a cache of {self._b}")
        self.reserve(self._b, n + s)
        self._k[: self._b, :, n: n + s] = key_states
        self._v[: self._b, :, n: n + s] = value_states
        self._n = n + s
        return self.keys, self.values

    def reserve(self, rows: int, slots: int) -> None:
        """Buffers with at least ``rows`` rows and ``slots`` slots (grown with SLACK slots and
        doubling; the filled part is kept, new room is zeros)."""
        R, S = self._k.shape[0], self._k.shape[-2]
        if rows <= R and slots <= S:
            return
        R2 = R if rows <= R else max(rows, 2 * R)
        S2 = S if slots <= S else max(slots + SLACK, 2 * S)
        self._k = _regrow(self._k, self._b, self._n, R2, S2)
        self._v = _regrow(self._v, self._b, self._n, R2, S2)

    def move_rows(self, dst: list[int], src: list[int], rows: int) -> None:
        """Row ``dst[i]`` takes row ``src[i]``'s slots (rows leaving are overwritten by rows
        kept), then the batch is the first ``rows`` rows. Copies only the moved rows."""
        if dst:
            n = self._n
            d = torch.tensor(dst, device=self._k.device)
            s = torch.tensor(src, device=self._k.device)
            self._k[d, :, :n] = self._k[s, :, :n]
            self._v[d, :, :n] = self._v[s, :, :n]
        self._b = rows

    def take_rows(self, index: torch.Tensor) -> None:
        """The batch becomes rows ``index`` [m] of this one (a row may be taken several times:
        copies of one prompt share its prefill); grows the buffers' rows if m needs it."""
        m = int(index.shape[0])
        k, v = self._k[: self._b][index], self._v[: self._b][index]   # (gathered first: copies)
        if m > self._k.shape[0]:
            self._k = self._k.new_zeros(m, *self._k.shape[1:])
            self._v = self._v.new_zeros(m, *self._v.shape[1:])
        self._k[:m], self._v[:m] = k, v
        self._b = m

    def prepare_append(self, other: "SlotLayer", rows: int = 0, slots: int = 0) -> None:
        """Room for ``other``'s rows after this batch's (allocates; changes no filled slot).
        Buffers that must grow grow to at least ``rows`` rows / ``slots`` slots (a hint: the
        most rows the batch will hold), so a batch filling up copies itself once, not at
        every doubling."""
        R, S = self._k.shape[0], self._k.shape[-2]
        need_r, need_s = self._b + other._b, max(self._n, other._n)
        self.reserve(need_r if need_r <= R else max(need_r, rows),
                     need_s if need_s <= S else max(need_s, slots))

    def append_rows(self, other: "SlotLayer") -> None:
        """Write ``other``'s rows after this batch's, padded to the wider of the two with zero
        (hidden) slots; :meth:`prepare_append` first (this one does not allocate)."""
        b, n, m, s = self._b, self._n, other._b, other._n
        if s > n:  # slots the rows already here never wrote: zeros (masked, but must be finite)
            self._k[:b, :, n:s].zero_()
            self._v[:b, :, n:s].zero_()
        self._k[b: b + m, :, :s] = other.keys
        self._v[b: b + m, :, :s] = other.values
        if s < n:
            self._k[b: b + m, :, s:n].zero_()
            self._v[b: b + m, :, s:n].zero_()
        self._b, self._n = b + m, max(n, s)

    def gathered(self, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's slots in ``order`` [B, width] (new tensors; see :meth:`SlotCache.repack`)."""
        b, w = order.shape
        h, d = self._k.shape[1], self._k.shape[-1]
        idx = order[:, None, :, None].expand(b, h, w, d)
        return self.keys.gather(2, idx), self.values.gather(2, idx)

    def set_slots(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The batch's slots become ``k`` / ``v`` [B, n_kv, width, D], written in place."""
        w = k.shape[-2]
        self._k[: self._b, :, :w] = k
        self._v[: self._b, :, :w] = v
        self._n = w

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
        self._n = self._b = 0
        self.is_initialized = False


class SlotCache(DynamicCache):
    """A ``DynamicCache`` of :class:`SlotLayer` (one per decoder layer, created on first use),
    with the row operations of continuous batching done in place: rows leave
    (:meth:`move_rows`) and join (:meth:`append`) without copying the rows that stay."""

    def __init__(self, rows: int = 0, slots: int = 0):
        """``rows`` / ``slots``: room every layer's first write allocates at least (a batch
        that will grow to that size by merges copies nothing to get there)."""
        Cache.__init__(self, layer_class_to_replicate=functools.partial(SlotLayer, rows, slots))

    def _slot_layers(self) -> list[SlotLayer]:
        if any(not isinstance(l, SlotLayer) or l._k is None for l in self.layers):
            raise TypeError("row operations need every layer of a SlotCache filled")
        return self.layers

    def move_rows(self, dst: list[int], src: list[int], rows: int) -> None:
        """Row ``dst[i]`` of every layer takes row ``src[i]``; the batch keeps ``rows`` rows.
        Only rows that leave may be destinations, so a failure part-way through changes no
        row that stays."""
        if not all(d < rows <= s for d, s in zip(dst, src)):
            raise ValueError("move_rows moves rows from past the kept ones into holes before them")
        for layer in self._slot_layers():
            layer.move_rows(dst, src, rows)

    def append(self, other: "SlotCache", rows: int = 0, slots: int = 0) -> None:
        """Append ``other``'s rows (a freshly prefilled batch; ``other`` is not changed). All or
        nothing: the buffers are grown first (to at least ``rows`` rows and ``slots`` slots when
        they must grow), then written where no row of this batch reads."""
        mine, theirs = self._slot_layers(), other._slot_layers()
        if len(mine) != len(theirs):
            raise ValueError(f"caches of {len(mine)} and {len(theirs)} layers")
        for a, b in zip(mine, theirs):
            a.prepare_append(b, rows, slots)
        for a, b in zip(mine, theirs):
            a.append_rows(b)

    def take_rows(self, index: torch.Tensor) -> None:
        """Every layer's batch becomes its rows ``index`` [m] (repeats allowed)."""
        for layer in self._slot_layers():
            layer.take_rows(index)

    def repack(self, order: torch.Tensor) -> None:
        """Each row's slots become its slots in ``order`` [B, width] (gathered for every layer
        first, then written in place)."""
        layers = self._slot_layers()
        moved = [layer.gathered(order) for layer in layers]
        for layer, (k, v) in zip(layers, moved):
            layer.set_slots(k, v)


def _with_room(x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None:
        return None
    buf = x.new_zeros(*x.shape[:-2], x.shape[-2] + SLACK, x.shape[-1])
    buf[..., : x.shape[-2], :] = x
    return buf


def _regrow(buf: torch.Tensor, rows: int, filled: int, R: int, S: int) -> torch.Tensor:
    """A zero buffer of R rows and S slots holding ``buf``'s first ``rows`` rows' ``filled`` slots."""
    new = buf.new_zeros(R, *buf.shape[1:-2], S, buf.shape[-1])
    new[:rows, ..., :filled, :] = buf[:rows, ..., :filled, :]
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
    if dropout:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            is_causal=causal, enable_gqa=groups > 1)
    else:
        out = grouped_attention(query, key, value, attention_mask, scaling, causal)
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
