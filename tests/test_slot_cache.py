"""The engine's KV cache and attention (decode/slot_cache.py): in-place slots behave as
transformers' DynamicCache under every operation the engine performs, and the GQA attention gives
bit-identical outputs to the stock sdpa path, so the engine's numbers do not change."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from fastmtp_sglang.decode import slot_cache
from fastmtp_sglang.decode.slot_cache import SLACK, SlotCache, SlotLayer, use_gqa_sdpa


def _gqa_model(seed: int = 0, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=72, intermediate_size=96, num_attention_heads=9,
                      num_key_value_heads=3, num_hidden_layers=2, vocab_size=101,
                      max_position_embeddings=512, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval().to(dtype)


def test_slot_layer_follows_dynamic_layer_through_the_engines_operations():
    g = torch.Generator().manual_seed(0)
    a, b = SlotLayer(), DynamicLayerRef()
    rows = 3

    def kv(s):
        return torch.randn(rows, 2, s, 4, generator=g), torch.randn(rows, 2, s, 4, generator=g)

    for step, (op, arg) in enumerate([("update", 7), ("update", 4), ("crop", -2), ("update", 1),
                                      ("update", SLACK + 5), ("crop", -1), ("select", [0, 2]),
                                      ("update", 3), ("assign", 9), ("update", 2), ("crop", 5)]):
        if op == "update":
            k, v = kv(arg)
            ka, va = a.update(k, v)
            kb, vb = b.update(k, v)
            assert torch.equal(ka, kb) and torch.equal(va, vb), step
        elif op == "crop":
            a.crop(arg)
            b.crop(arg)
        elif op == "select":  # Batch.remove assigns the selected rows
            sel = torch.tensor(arg)
            a.keys, a.values = a.keys[sel], a.values[sel]
            b.keys, b.values = b.keys[sel], b.values[sel]
            rows = len(arg)
        else:  # Batch.merge / repack assign new tensors of another width
            k, v = kv(arg)
            a.keys, a.values = k, v
            b.keys, b.values = k, v
        assert a.get_seq_length() == b.get_seq_length(), step
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), step
    # room to grow: a buffer keeps free slots after the filled ones
    assert a._k.shape[-2] >= a.get_seq_length()


class DynamicLayerRef:
    """transformers' DynamicLayer behaviour, with the engine's operations."""

    def __init__(self):
        from transformers.cache_utils import DynamicLayer

        self.layer = DynamicLayer()

    def update(self, k, v):
        return self.layer.update(k, v)

    def crop(self, n):
        # n > 0 keeps the first n tokens; transformers >= 5.25 takes only the count to drop (< 0)
        self.layer.crop(n - self.layer.get_seq_length() if n > 0 else n)

    def get_seq_length(self):
        return self.layer.get_seq_length()

    @property
    def keys(self):
        return self.layer.keys

    @keys.setter
    def keys(self, x):
        self.layer.keys = x

    @property
    def values(self):
        return self.layer.values

    @values.setter
    def values(self, x):
        self.layer.values = x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_cache_and_gqa_attention_give_the_stock_numbers(dtype):
    """Prefill, then verify-like forwards of 4 tokens with a rollback of 2, a padded row and a
    masked slot: the logits are bit-identical to DynamicCache + stock sdpa."""
    stock, lean = _gqa_model(dtype=dtype), _gqa_model(dtype=dtype)
    assert use_gqa_sdpa(lean) and lean.config._attn_implementation == slot_cache.ATTN_NAME
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 40), generator=g)
    valid = torch.ones(2, 20, dtype=torch.long)
    valid[1, 15:] = 0  # row 1's prompt is shorter: right padding hidden by the mask
    caches = {"stock": DynamicCache(), "lean": SlotCache()}
    outs = {}
    for name, model in (("stock", stock), ("lean", lean)):
        c, m = caches[name], valid.clone()
        pos = torch.arange(20)[None].expand(2, 20)
        logits = [model(input_ids=ids[:, :20], position_ids=pos, attention_mask=m,
                        past_key_values=c, use_cache=True).logits]
        at = torch.tensor([20, 15])
        for cyc in range(4):
            m = torch.cat([m, torch.ones(2, 4, dtype=torch.long)], dim=1)
            p = at[:, None] + torch.arange(4)[None]
            logits.append(model(input_ids=ids[:, 20 + 4 * cyc: 24 + 4 * cyc], position_ids=p,
                                attention_mask=m, past_key_values=c, use_cache=True).logits)
            m[:, -2:] = 0 if cyc % 2 else m[:, -2:]  # every other cycle: 2 rejected slots hidden
            if cyc == 2:                             # ... and once cropped away
                c.crop(-2)
                m = m[:, :-2]
            at = at + (4 if cyc % 2 == 0 else 2)
        outs[name] = logits
    for a, b in zip(outs["stock"], outs["lean"]):
        assert torch.equal(a, b)


def test_only_cpu_sdpa_models_switch():
    m = _gqa_model()
    m.set_attn_implementation("eager")
    assert not use_gqa_sdpa(m) and m.config._attn_implementation == "eager"


def _filled_cache(rows: int, slots: int, g: torch.Generator, layers: int = 2) -> SlotCache:
    c = SlotCache()
    for li in range(layers):
        c.update(torch.randn(rows, 2, slots, 4, generator=g), torch.randn(rows, 2, slots, 4, generator=g), li)
    return c


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[-2]))


def test_rows_join_leave_and_repack_in_place_like_cat_and_select():
    """Continuous batching's row operations (Batch.merge / remove / repack) give the tensors the
    copying forms give (cat of zero-padded rows, index select, gather), write into the same
    buffers, and never touch a row that stays when others leave."""
    g = torch.Generator().manual_seed(3)
    c = _filled_cache(3, 10, g)
    ref = [(l.keys.clone(), l.values.clone()) for l in c.layers]
    # a narrower batch joins, then a wider one (every layer padded with zero slots)
    for rows, slots in ((2, 6), (1, 14)):
        other = _filled_cache(rows, slots, g)
        w = max(ref[0][0].shape[-2], slots)
        ref = [(torch.cat([_pad(k, w), _pad(lo.keys, w)]), torch.cat([_pad(v, w), _pad(lo.values, w)]))
               for (k, v), lo in zip(ref, other.layers)]
        c.append(other)
        for l, (k, v) in zip(c.layers, ref):
            assert torch.equal(l.keys, k) and torch.equal(l.values, v)
    buf = c.layers[0]._k.data_ptr()
    # rows 1 and 3 leave; the last row kept (5) moves into 1, the one after (4) into 3
    kept = c.layers[0].keys[[0, 2, 4]].clone()
    c.move_rows([1, 3], [5, 4], 4)
    order = [0, 5, 2, 4]
    ref = [(k[order], v[order]) for k, v in ref]
    for l, (k, v) in zip(c.layers, ref):
        assert torch.equal(l.keys, k) and torch.equal(l.values, v)
    assert torch.equal(c.layers[0].keys[[0, 2]], kept[:2]) and c.layers[0]._k.data_ptr() == buf
    # more steps, then a repack that keeps each row's odd slots
    k1, v1 = torch.randn(4, 2, 3, 4, generator=g), torch.randn(4, 2, 3, 4, generator=g)
    for li, l in enumerate(c.layers):
        c.update(k1, v1, li)
    ref = [(torch.cat([k, k1], 2), torch.cat([v, v1], 2)) for k, v in ref]
    order_slots = torch.arange(1, 17, 2)[None].expand(4, 8)
    c.repack(order_slots)
    for l, (k, v) in zip(c.layers, ref):
        assert torch.equal(l.keys, k[:, :, 1:17:2]) and torch.equal(l.values, v[:, :, 1:17:2])
    with pytest.raises(ValueError, match="holes before them"):
        c.move_rows([3], [0], 3)  # a row kept may not be overwritten


def test_rows_that_join_a_grown_buffer_read_finite_zero_padding():
    """A row written narrower than the batch reads zeros in its hidden slots (never stale or
    uninitialised memory, which could be NaN and poison attention despite the mask)."""
    g = torch.Generator().manual_seed(4)
    c = _filled_cache(2, 20, g)
    c.move_rows([], [], 1)                  # row 1 leaves: its slots stay in the pool
    c.append(_filled_cache(1, 5, g))        # a short row takes its place
    assert torch.equal(c.layers[0].keys[1, :, 5:], torch.zeros(2, 15, 4))
    c.append(_filled_cache(3, 30, g))       # wider: the old rows' new slots are zeros too
    assert torch.equal(c.layers[1].values[:2, :, 20:], torch.zeros(2, 2, 10, 4))
    assert torch.isfinite(c.layers[0].keys).all()
