"""The target-feature cache: what it stores equals the target, a stale cache is refused, a broken
build resumes, training from it equals training without it, and the top-k KL behaves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastmtp_sglang.training import features as feat
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.features import FeatureStore, build_features, make_key
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.training.checkpoints import load_trainer_state
from fastmtp_sglang.training.data import load_examples
from fastmtp_sglang.training.objective import kl_topk_terms
from fastmtp_sglang.training.train import train
from test_train import K, one_thread, small_cfg, toy  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def saved(toy, tmp_path_factory, tiny_tokenizer):
    """The toy target saved as a model directory (the cache key hashes its weight files)."""
    target, data, init, root, _ = toy
    tdir = tmp_path_factory.mktemp("feat") / "target"
    target.model.save_pretrained(str(tdir))
    tiny_tokenizer.save_pretrained(str(tdir))
    t = load_target(tdir, dtype="float32")
    t.model.requires_grad_(False)
    return t, tdir, data, init


def _examples(t, data, max_len=64):
    return load_examples(data, None, int(t.config["vocab_size"]), max_len)[0]


def test_cache_holds_the_targets_hidden_states_and_topk(saved, tmp_path):
    t, tdir, data, _ = saved
    ex = _examples(t, data)
    key = make_key(t, tdir, data, 64, None, "float32", 5)
    store = build_features(t, ex, tmp_path / "f", key, batch_tokens=100, progress=False, data=data)
    assert len(store) == len(ex)
    assert store.index["data"] == str(Path(data).resolve())  # where its sample ids can be read
    with torch.no_grad():
        for i in (0, 7, len(ex) - 1):
            h = t.model.model(input_ids=ex[i].ids[None]).last_hidden_state[0]
            torch.testing.assert_close(store(i, ex[i].ids), h, rtol=1e-5, atol=1e-5)
            ids, logp = store.topk(i)
            ref = torch.log_softmax(t.lm_head(h).float(), -1).topk(5, -1)
            assert torch.equal(ids, ref.indices)
            torch.testing.assert_close(logp, ref.values, rtol=2e-3, atol=2e-3)  # stored in fp16
    assert not list(tmp_path.glob(".*partial*"))  # renamed into place, nothing left beside it


def test_stale_cache_is_refused_naming_what_changed(saved, tmp_path):
    t, tdir, data, _ = saved
    ex = _examples(t, data)
    path = tmp_path / "f"
    build_features(t, ex, path, make_key(t, tdir, data, 64, None, "bfloat16", 0), progress=False)
    with pytest.raises(FastMTPError, match="max_len: cache 64, now 48"):
        FeatureStore(path, make_key(t, tdir, data, 48, None, "bfloat16", 0))
    changed = tmp_path / "data2.jsonl"
    changed.write_text(Path(data).read_text() + "\n")
    with pytest.raises(FastMTPError, match="data_sha256"):
        FeatureStore(path, make_key(t, tdir, changed, 64, None, "bfloat16", 0))
    with pytest.raises(FastMTPError, match="topk: cache 0, need 4"):
        FeatureStore(path, make_key(t, tdir, data, 64, None, "bfloat16", 4))
    with pytest.raises(FastMTPError, match="not a feature cache"):
        FeatureStore(tmp_path)


def interrupt_after_shards(monkeypatch, n: int):
    """Make a feature build raise Ctrl-C's KeyboardInterrupt right after its n-th shard is
    recorded in progress.json; returns the real writer (to put back)."""
    calls = {"n": 0}
    real = feat._write_json

    def write(path, obj):
        real(path, obj)
        if path.name == "progress.json":
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt
    monkeypatch.setattr(feat, "_write_json", write)
    return real


def test_interrupted_build_resumes_from_its_last_shard(saved, tmp_path, monkeypatch):
    t, tdir, data, _ = saved
    ex = _examples(t, data)
    key = make_key(t, tdir, data, 64, None, "float32", 0)
    monkeypatch.setattr(feat, "SHARD_TOKENS", 120)  # several shards
    real = interrupt_after_shards(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        build_features(t, ex, tmp_path / "f", key, batch_tokens=64, progress=False)
    assert not (tmp_path / "f").exists() and (tmp_path / ".f.partial" / "progress.json").is_file()
    monkeypatch.setattr(feat, "_write_json", real)
    logs = []
    store = build_features(t, ex, tmp_path / "f", key, batch_tokens=64, progress=False, log=logs.append)
    assert any("2 shards done" in m for m in logs)
    with torch.no_grad():
        for i in range(len(ex)):
            h = t.model.model(input_ids=ex[i].ids[None]).last_hidden_state[0]
            torch.testing.assert_close(store(i), h, rtol=1e-5, atol=1e-5)


def test_training_from_the_cache_equals_training_without(saved, tmp_path, monkeypatch):
    """fp32 cache: same losses as recomputing the target; resume reuses the cache, never rebuilds."""
    t, tdir, data, init = saved
    cfg = small_cfg(epochs=2, batch_size=4)
    plain = train(cfg, t, data, tmp_path / "plain", init=init, progress=False)
    cached = train(cfg, t, data, tmp_path / "cached", init=init, progress=False,
                   features=tmp_path / "fc", target_dir=tdir, feature_dtype="float32")
    la = [r["loss"] for r in plain.log if r["event"] == "step"]
    lb = [r["loss"] for r in cached.log if r["event"] == "step"]
    assert la == pytest.approx(lb, rel=1e-4)
    assert plain.last_eval["tau_train"] == pytest.approx(cached.last_eval["tau_train"])
    assert load_trainer_state(tmp_path / "cached")["features"] == str(tmp_path / "fc")
    # halt + resume without --features: the checkpoint's cache is opened, not rebuilt
    half = train(small_cfg(epochs=2, batch_size=4, halt_after_steps=2), t, data, tmp_path / "h",
                 init=init, progress=False, features=tmp_path / "fc", target_dir=tdir,
                 feature_dtype="float32")
    assert half.global_step == 2

    def no_build(*a, **k):
        raise AssertionError("the cache was rebuilt on resume")
    monkeypatch.setattr(feat, "build_features", no_build)
    done = train(cfg, t, data, tmp_path / "h", resume=tmp_path / "h", progress=False, target_dir=tdir)
    assert done.finished


@pytest.mark.parametrize("loss", ["ce+kl", "acc"])
def test_kl_topk_training_runs_and_needs_a_cache(saved, tmp_path, loss):
    t, tdir, data, init = saved
    cfg = small_cfg(epochs=1, batch_size=4, loss=loss, kl_topk=4)
    with pytest.raises(FastMTPError, match="--features"):
        train(cfg, t, data, tmp_path / "x", init=init, progress=False)
    res = train(cfg, t, data, tmp_path / "k", init=init, progress=False, features=tmp_path / "fk",
                target_dir=tdir)
    assert res.finished and json.loads((tmp_path / "fk" / "index.json").read_text())["key"]["topk"] == 4


def test_kl_topk_is_exact_with_all_tokens_and_a_lower_bound_otherwise():
    g = torch.Generator().manual_seed(0)
    logits_p = 3 * torch.randn(6, 40, generator=g)
    logits_q = 3 * torch.randn(6, 40, generator=g)
    logp, logq = F.log_softmax(logits_p, -1), F.log_softmax(logits_q, -1)
    exact = (logp.exp() * (logp - logq)).sum(-1)
    full = logp.topk(40, -1)
    torch.testing.assert_close(kl_topk_terms(logq, full.indices, full.values), exact, rtol=1e-4, atol=1e-4)
    for k in (1, 5, 20):
        top = logp.topk(k, -1)
        approx = kl_topk_terms(logq, top.indices, top.values)
        assert (approx <= exact + 1e-5).all() and (approx >= -1e-6).all()
    # a compressed table that lacks some top-k tokens: they join "the rest", still finite
    cols = full.indices.clone()
    cols[:, 1] = -1
    assert torch.isfinite(kl_topk_terms(logq, cols, full.values)).all()


def test_features_cli(saved, tmp_path, run_cli):
    t, tdir, data, _ = saved
    out = tmp_path / "cli"
    rc, stdout, err = run_cli("features", "--target", tdir, "--data", data, "--out", out,
                              "--max-len", "64", "--topk", "3", "--device", "cpu", "--no-progress")
    assert rc == 0, err
    assert "sequences" in stdout and (out / "index.json").is_file()
    rc, stdout, err = run_cli("features", "--target", tdir, "--data", data, "--out", out,
                              "--max-len", "64", "--topk", "3", "--no-progress")
    assert rc == 0  # reopened, not rebuilt
    rc, _, err = run_cli("features", "--target", tdir, "--data", data, "--out", out,
                         "--max-len", "50", "--no-progress")
    assert rc == 1 and "max_len" in err


# ------------------------------------------------------------------------------------------------
# training from a complete cache reads only the target's embedding and lm_head
# ------------------------------------------------------------------------------------------------

def _tied_target_dir(root: Path, tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=97,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    d = root / "tied"
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    tokenizer.save_pretrained(str(d))
    return d


def test_embedding_and_lm_head_read_from_safetensors(saved, tmp_path, tiny_tokenizer):
    from fastmtp_sglang.core.target import load_embed_and_head

    t, tdir, _, _ = saved
    sharded = tmp_path / "sharded"
    t.model.save_pretrained(str(sharded), max_shard_size="20KB")
    tiny_tokenizer.save_pretrained(str(sharded))
    assert (sharded / "model.safetensors.index.json").is_file()
    for d in (tdir, sharded):
        parts = load_embed_and_head(d)
        assert torch.equal(parts.embed.weight, t.embed.weight)
        assert torch.equal(parts.lm_head.weight, t.lm_head.weight)
        assert sum(p.numel() for p in parts.model.parameters()) == 2 * t.embed.weight.numel()
        assert parts.config == t.config and parts.tokenizer is not None
    tied = _tied_target_dir(tmp_path, tiny_tokenizer)
    parts, full = load_embed_and_head(tied), load_target(tied)
    assert parts.lm_head.weight is parts.embed.weight
    assert torch.equal(parts.lm_head.weight, full.lm_head.weight)
    # not safetensors: None, and the trainer loads the whole model
    bin_dir = tmp_path / "bin"
    t.model.save_pretrained(str(bin_dir), safe_serialization=False)
    if not list(bin_dir.glob("*.safetensors")):
        assert load_embed_and_head(bin_dir) is None


def test_train_cli_from_a_complete_cache_loads_no_layers(saved, tmp_path, run_cli):
    """The first run builds the cache with the whole target; the second reads only the embedding
    and lm_head and trains the same head, bit for bit."""
    from safetensors.torch import load_file

    t, tdir, data, init = saved
    args = ["train", "--target", tdir, "--init", init, "--data", data, "--features", tmp_path / "f",
            "--steps", str(K), "--epochs", "1", "--batch-size", "4", "--max-len", "64",
            "--loss", "ce+kl", "--kl-topk", "3", "--heldout-fraction", "0", "--no-progress",
            "--overwrite"]
    rc, _, err = run_cli(*args, "--out", tmp_path / "full")
    assert rc == 0, err
    assert "embedding and lm_head only" not in err
    rc, _, err = run_cli(*args, "--out", tmp_path / "parts")
    assert rc == 0, err
    assert "embedding and lm_head only" in err
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "parts" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
