"""`fastmtp distill --target T --with-features F`: the in-process engine keeps each sample's states
and top-k log-probabilities as it generates, and F equals what `fastmtp features` computes from
the data file afterwards (fp32); samples written before without features are covered later by
`fastmtp features --reuse F`, which runs the target over those only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.distill import DistillConfig, distill
from fastmtp_sglang.training.features import FeatureStore, make_key, open_or_build
from test_distill_features import MAX_LEN, PROMPTS, prompt_file, target_dir  # noqa: F401  (fixture)

TOPK = 5


def cfg_local(target_dir: Path, tmp: Path, **kw) -> DistillConfig:
    base = dict(url=None, target=str(target_dir), dtype="float32", batch_size=3,
                prompts=[str(prompt_file(tmp))], out=str(tmp / "data.jsonl"), n=2,
                temperature=(0.0, 0.7), max_new_tokens=12, progress=False,
                with_features=str(tmp / "data.features"), feature_dtype="float32",
                feature_topk=TOPK, max_len=MAX_LEN)
    base.update(kw)
    return DistillConfig(**base)


def reference(target_dir: Path, data: Path, out: Path):
    """`fastmtp features` on ``data`` (fp32, top-k), its examples, and the trainer's key."""
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.training.data import load_examples

    target = load_target(target_dir, "float32")
    examples, _ = load_examples(data, target.tokenizer, int(target.config["vocab_size"]), MAX_LEN, 1)
    store = open_or_build(target, target_dir, data, examples, out, MAX_LEN, None, "float32", TOPK,
                          progress=False, log=lambda s: None)
    return store, examples, make_key(target, target_dir, data, MAX_LEN, None, "float32", TOPK)


def assert_same_rows(got: FeatureStore, ref: FeatureStore, examples, data: Path) -> None:
    lines = data.read_text().splitlines()
    cut = [len(r["prompt_ids"]) + len(r["response_ids"]) > MAX_LEN
           for r in (json.loads(lines[e.line - 1]) for e in examples)]
    assert any(cut) and not all(cut)  # rows cut at max_len and whole rows are both exercised
    for i, e in enumerate(examples):
        # a whole row's last position is never fed (no loss reads it): compare the others
        n = len(e.ids) if cut[i] else len(e.ids) - 1
        torch.testing.assert_close(got(i, e.ids)[:n], ref(i)[:n], atol=1e-5, rtol=1e-5)
        (gi, gl), (ri, rl) = got.topk(i), ref.topk(i)
        torch.testing.assert_close(gl[:n], rl[:n], atol=2e-3, rtol=2e-3)
        assert torch.equal(gi[:n], ri[:n])


def test_in_process_features_equal_fastmtp_features(target_dir, tmp_path):
    stats = distill(cfg_local(target_dir, tmp_path), log=lambda s: None)
    assert stats.written == 2 * len(PROMPTS) and stats.feature_tokens > 0
    ref, examples, key = reference(target_dir, tmp_path / "data.jsonl", tmp_path / "ref.features")
    got = FeatureStore(tmp_path / "data.features", key)  # the trainer's key opens it
    assert len(got) == len(examples) and "partial" not in got.index
    assert got.index["data"] == str((tmp_path / "data.jsonl").resolve())
    assert_same_rows(got, ref, examples, tmp_path / "data.jsonl")


def test_rows_written_without_features_are_filled_in_by_reuse(target_dir, tmp_path, run_cli):
    distill(cfg_local(target_dir, tmp_path, with_features=None, limit=2), log=lambda s: None)
    said: list[str] = []
    distill(cfg_local(target_dir, tmp_path), log=said.append)  # the other 3 prompts, with features
    assert any("4 samples already in" in s and "--reuse" in s for s in said)
    part = FeatureStore(tmp_path / "data.features")
    assert part.index["partial"]["rows"] == len(part) == 6 and part.index["partial"]["of"] == 10
    data = tmp_path / "data.jsonl"
    rc, _, err = run_cli("features", "--target", target_dir, "--data", data, "--out", tmp_path / "all",
                         "--max-len", MAX_LEN, "--topk", TOPK, "--feature-dtype", "float32",
                         "--no-progress", "--reuse", tmp_path / "data.features")
    assert rc == 0, err
    assert "6 of 10 sequences" in err  # the target ran over the 4 older rows only
    ref, examples, key = reference(target_dir, data, tmp_path / "ref.features")
    assert_same_rows(FeatureStore(tmp_path / "all", key), ref, examples, data)


def test_a_resumed_run_continues_the_cache(target_dir, tmp_path):
    distill(cfg_local(target_dir, tmp_path, limit=2), log=lambda s: None)
    assert len(FeatureStore(tmp_path / "data.features")) == 4  # a complete cache in between
    distill(cfg_local(target_dir, tmp_path), log=lambda s: None)  # reopens it, top-k files too
    ref, examples, key = reference(target_dir, tmp_path / "data.jsonl", tmp_path / "ref.features")
    got = FeatureStore(tmp_path / "data.features", key)
    assert len(got) == 10 and "partial" not in got.index
    assert_same_rows(got, ref, examples, tmp_path / "data.jsonl")


def test_top_k_needs_the_engine_in_this_process(tmp_path):
    with pytest.raises(FastMTPError, match="returns hidden states but no top-k"):
        DistillConfig(url="http://127.0.0.1:1", prompts=["p.jsonl"], out=str(tmp_path / "o.jsonl"),
                      with_features=str(tmp_path / "f"), feature_topk=4)
    assert DistillConfig(url="http://127.0.0.1:1", prompts=["p.jsonl"], out="o.jsonl").feature_topk == 0
    assert DistillConfig(url=None, target="T", prompts=["p.jsonl"], out="o.jsonl").feature_topk == 32


def test_a_stopped_run_publishes_the_cache_of_its_lines(target_dir, tmp_path):
    """Ctrl-C / SIGTERM (KeyboardInterrupt on the main thread, where the engine computes) still
    publishes the features of every line written, equal to `fastmtp features` on them, then
    stops; the rerun continues that cache to the whole file's. (A stopped run had left them in
    its staging directory, where `train --features` and `features --reuse` cannot open them.)"""
    from fastmtp_sglang.decode.engine import ReferenceEngine

    real, calls = ReferenceEngine.step, {"n": 0}

    def step(self, *a, **k):  # stop once some rows are written, others in flight
        calls["n"] += 1
        if calls["n"] == 16:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    ReferenceEngine.step = step
    try:
        with pytest.raises(KeyboardInterrupt):
            distill(cfg_local(target_dir, tmp_path, batch_size=2), log=lambda s: None)
    finally:
        ReferenceEngine.step = real
    data = tmp_path / "data.jsonl"
    written = len(data.read_text().splitlines())
    assert 0 < written < 2 * len(PROMPTS)
    got = FeatureStore(tmp_path / "data.features")
    assert len(got) == written and "partial" not in got.index
    distill(cfg_local(target_dir, tmp_path, batch_size=2), log=lambda s: None)
    ref, examples, key = reference(target_dir, data, tmp_path / "ref.features")
    got = FeatureStore(tmp_path / "data.features", key)
    assert len(got) == len(examples) == 2 * len(PROMPTS)
    assert_same_rows(got, ref, examples, data)
