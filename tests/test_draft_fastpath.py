"""The batch-1 CPU fast paths of a draft step compute what the general paths compute: the
attention of one query at the last key (no mask, grouped query heads, slice cache writes), the
rotary table, and the compressed-vocabulary argmax."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.kernels.compressed_head import compressed_head_torch
from fastmtp_sglang.vocab.draft_vocab import DraftVocab
from test_engine import random_head, tiny_target
from test_engine_vocab import make_vocab


@pytest.mark.parametrize("layout", ["deepseek", "mimo"])
def test_cached_steps_equal_one_uncached_pass(layout):
    """Prefill 0..n-1 through the cache, then single steps (fast path) and a 3-position extend
    (slice write, masked attention): every output equals the uncached causal pass over the whole
    sequence (fp32, 4 query heads over 2 key/value heads)."""
    t = tiny_target("llama", seed=3)
    head = random_head(t, layout, seed=4)
    g = torch.Generator().manual_seed(5)
    L, H = 24, head.cfg.hidden_size
    hid = torch.randn(1, L, H, generator=g)
    ids = torch.randint(0, 97, (1, L), generator=g)
    pos = torch.arange(L)[None]
    with torch.inference_mode():
        ref, _ = head(hid, ids, pos, None, return_logits=False)
        cache = head.new_cache(1, L + 4)
        a, _ = head(hid[:, :10], ids[:, :10], pos[:, :10], cache, return_logits=False)
        outs = [a]
        for j in range(10, 14):  # draft steps: b = 1, s = 1
            o, _ = head(hid[:, j:j + 1], ids[:, j:j + 1], pos[:, j:j + 1], cache, return_logits=False)
            outs.append(o)
        e, _ = head(hid[:, 14:17], ids[:, 14:17], pos[:, 14:17], cache, return_logits=False)
        outs.append(e)
        for j in range(17, L):
            o, _ = head(hid[:, j:j + 1], ids[:, j:j + 1], pos[:, j:j + 1], cache, return_logits=False)
            outs.append(o)
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_scatter_path_still_serves_batches_and_gaps():
    """Two rows, or one row at non-consecutive positions: the general scatter write."""
    t = tiny_target("llama", seed=6)
    head = random_head(t, "deepseek", seed=7)
    c1 = head.new_cache(1, 16)
    c2 = head.new_cache(1, 16)
    k = torch.randn(1, head.cfg.num_key_value_heads, 3, head.cfg.head_dim)
    v = torch.randn_like(k)
    gap = torch.tensor([[2, 5, 9]])
    c1.write(gap, k, v)
    c2.reserve(16)  # the raw buffers hold only what was written: make room, as write does
    idx = gap[:, None, :, None].expand_as(k)
    c2.k.scatter_(2, idx, k)
    c2.v.scatter_(2, idx, v)
    assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_equals_the_module(dtype):
    t = tiny_target("llama", seed=8)  # linear rope scaling
    head = random_head(t, "deepseek", seed=9).to(dtype)
    x = torch.randn(1, 5, head.cfg.hidden_size, dtype=dtype)
    for positions in (torch.tensor([[0, 1, 2, 3, 4]]), torch.tensor([[700, 3, 511, 512, 1000]])):
        with torch.inference_mode():
            cos, sin = head._cos_sin(x, positions)
        rc, rs = head.rotary(x, positions)
        assert cos.dtype == dtype and torch.equal(cos, rc) and torch.equal(sin, rs)


def test_batch_one_greedy_equals_the_kernel_reference():
    t = tiny_target("llama", seed=10)
    vocab: DraftVocab = make_vocab(t, [list(range(0, 97, 2)), list(range(5, 90))], ["en", "zh"])
    g = torch.Generator().manual_seed(11)
    for trial in range(40):
        h = torch.randn(1, t.lm_head.weight.shape[1], generator=g)
        if trial % 4 == 0:  # exact ties between table rows: the first maximum wins in both
            h = torch.zeros_like(h)
        idx = torch.tensor([trial % 2])
        fast = vocab.greedy(h, idx, None)
        ref, _, _ = compressed_head_torch(h, vocab.weight, vocab.tables.tables, vocab.tables.lens,
                                          idx, None, table_weight=vocab.table_weight)
        assert torch.equal(fast, ref), trial


@pytest.mark.skipif(not amx.available(), reason=f"cpu kernels: {amx.unavailable_reason()}")
@pytest.mark.usefixtures("amx_build")
def test_batch_one_greedy_on_tiles_keeps_following_the_table_weight():
    """bf16 on AMX: from a table's second step on, the pick skips the checks and goes straight to
    the tiles kept for it; it still equals the first maximum of the table's bf16 products, for
    each table, and an in-place change of the table weight (or new storage) is seen at once."""
    t = tiny_target("llama", seed=12)
    vocab = make_vocab(t, [list(range(0, 97, 2)), list(range(5, 90))], ["en", "zh"])
    vocab = dataclasses.replace(vocab, weight=vocab.weight.to(torch.bfloat16),
                                table_weight=vocab.table_weight.to(torch.bfloat16))
    g = torch.Generator().manual_seed(13)

    def want(h, i):
        n = int(vocab.tables.lens[i])
        w = amx.pack(vocab.table_weight[i, :n].contiguous())
        return vocab.tables.tables[i, :n][amx.linear(h, w).max(-1).indices]

    with torch.inference_mode():
        for trial in range(24):
            if trial == 12:   # in place: the same storage, a new version
                vocab.table_weight[:, :3] *= -1
            if trial == 18:   # new storage
                vocab.table_weight = vocab.table_weight.flip(1).contiguous()
            h = torch.randn(1, t.lm_head.weight.shape[1], generator=g).to(torch.bfloat16)
            i = trial % 2
            got = vocab.greedy(h, torch.tensor([i]), None)
            assert torch.equal(got, want(h, i)), trial
    assert set(vocab._tiled) == {0, 1}
