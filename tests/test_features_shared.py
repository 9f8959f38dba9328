"""The feature cache's shared-prompt path: n samples of one prompt run the prompt once and their
responses on its KV cache, and store what running every sequence whole stores."""

from __future__ import annotations

import json

import pytest
import torch

from fastmtp_sglang.training.data import load_examples
from fastmtp_sglang.training.features import (build_features, make_key, response_batches,
                                              shared_prompt_groups)
from test_engine import V, tiny_target
from test_features import interrupt_after_shards


def _data(path, seed=0):
    """Three prompts with 2-6 responses each (lengths 1..40, so the batches cut), two prompts
    alone, and one short prompt repeated (under the 8-token floor: run whole)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, V, (n,), generator=g).tolist()

    rows = []
    for plen, lens in ((9, (40, 1, 17, 23, 5, 39)), (30, (12, 12)), (16, (3, 28, 28, 7))):
        prompt = ids(plen)
        rows += [{"prompt_ids": prompt, "response_ids": ids(n)} for n in lens]
    rows += [{"prompt_ids": ids(12), "response_ids": ids(20)}, {"prompt_ids": ids(5), "response_ids": ids(9)}]
    short = ids(4)
    rows += [{"prompt_ids": short, "response_ids": ids(n)} for n in (6, 11)]
    order = torch.randperm(len(rows), generator=g).tolist()  # groups interleaved in the file
    path.write_text("".join(json.dumps(rows[i]) + "\n" for i in order))
    return path


@pytest.mark.parametrize("family,aux,topk", [("llama", (), 5), ("qwen2", (1,), 0)])
def test_shared_prompts_store_what_whole_sequences_store(tmp_path, family, aux, topk):
    t = tiny_target(family)
    tdir = tmp_path / "target"
    t.model.save_pretrained(str(tdir))
    data = _data(tmp_path / "d.jsonl")
    ex = load_examples(data, None, V, 64)[0]
    groups, rest = shared_prompt_groups(ex, list(range(len(ex))))
    assert sorted(len(g) for g in groups) == [2, 4, 6] and len(rest) == 4
    key = make_key(t, tdir, data, 64, None, "float32", topk, aux)
    whole = build_features(t, ex, tmp_path / "whole", key, batch_tokens=64, progress=False,
                           share_prompts=False)
    shared = build_features(t, ex, tmp_path / "shared", key, batch_tokens=64, progress=False)
    for i in range(len(ex)):
        torch.testing.assert_close(shared(i, ex[i].ids), whole(i), rtol=1e-5, atol=1e-5)
        if topk:
            a, b = shared.topk(i), whole.topk(i)
            assert torch.equal(a[0], b[0])
            torch.testing.assert_close(a[1], b[1], rtol=1e-3, atol=1e-3)


def test_shared_build_resumes_across_shards(tmp_path, monkeypatch):
    """Shards smaller than a group: a group's rows land in several shards, and a build stopped
    after the first shard ends equal to one that never stopped."""
    from fastmtp_sglang.training import features as feat

    t = tiny_target()
    tdir = tmp_path / "target"
    t.model.save_pretrained(str(tdir))
    data = _data(tmp_path / "d.jsonl", seed=1)
    ex = load_examples(data, None, V, 64)[0]
    key = make_key(t, tdir, data, 64, None, "float32", 0)
    ref = build_features(t, ex, tmp_path / "ref", key, progress=False, share_prompts=False)
    monkeypatch.setattr(feat, "SHARD_TOKENS", 90)
    real = interrupt_after_shards(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        build_features(t, ex, tmp_path / "f", key, batch_tokens=64, progress=False)
    monkeypatch.setattr(feat, "_write_json", real)
    store = build_features(t, ex, tmp_path / "f", key, batch_tokens=64, progress=False)
    assert len(store.index["shards"]) > 2
    for i in range(len(ex)):
        torch.testing.assert_close(store(i), ref(i), rtol=1e-5, atol=1e-5)


def test_response_batches_cut_on_padding_and_size():
    from fastmtp_sglang.training.data import Example

    p = 5
    ex = [Example(torch.zeros(p + n, dtype=torch.long), p) for n in (10, 10, 11, 40, 3, 12)]
    rows = list(range(len(ex)))
    # sorted by length: 3 | 10 10 11 12 (padding <= 25%) | 40
    assert response_batches(ex, rows, batch_tokens=1000) == [[4], [0, 1, 2, 5], [3]]
    # a padded size of at most 30 tokens: two of 11-12 a batch
    assert response_batches(ex, rows, batch_tokens=30) == [[4], [0, 1], [2, 5], [3]]
    assert sorted(r for b in response_batches(ex, rows, 8) for r in b) == rows


@pytest.mark.parametrize("topk", [5, 0])
def test_per_batch_staging_stores_what_per_row_staging_stores(tmp_path, monkeypatch, topk):
    """The GPU's way (a batch's positions scored in chunks that cut across rows, one copy to the
    host per chunk) stores the same states and top-k as scoring each row on its own."""
    from fastmtp_sglang.training import features as feat

    t = tiny_target()
    tdir = tmp_path / "target"
    t.model.save_pretrained(str(tdir))
    data = _data(tmp_path / "d.jsonl", seed=2)
    ex = load_examples(data, None, V, 64)[0]
    key = make_key(t, tdir, data, 64, None, "float32", topk)
    ref = build_features(t, ex, tmp_path / "row", key, batch_tokens=200, progress=False,
                         share_prompts=False, per_batch=False)
    monkeypatch.setattr(feat, "STAGE_CHUNK", 7)
    got = build_features(t, ex, tmp_path / "batch", key, batch_tokens=200, progress=False,
                         share_prompts=False, per_batch=True)
    assert got.index["tokens"] == ref.index["tokens"]
    for i in range(len(ex)):
        torch.testing.assert_close(got(i), ref(i), rtol=1e-5, atol=1e-5)
        if topk:
            a, b = got.topk(i), ref.topk(i)
            assert torch.equal(a[0], b[0])
            torch.testing.assert_close(a[1], b[1], rtol=1e-3, atol=1e-3)
