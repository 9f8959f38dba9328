"""`fastmtp features --reuse`: rows an older cache holds are copied, not recomputed, and the cache
that results equals one built from scratch; an old cache that cannot serve is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.data import load_examples
from fastmtp_sglang.training.features import FeatureStore, build_features, make_key
from fastmtp_sglang.training.features_reuse import reusable_rows
from test_features import saved  # noqa: F401  (fixture)
from test_train import toy  # noqa: F401  (fixture)


def _split(data: Path, root: Path) -> tuple[Path, Path]:
    """(old: the first 14 lines, bad ones included; new: 5 of the old lines in another order, a
    repeated one, and the rest of the file)."""
    lines = data.read_text().splitlines(keepends=True)
    old, new = root / "old.jsonl", root / "new.jsonl"
    old.write_text("".join(lines[:14]))
    new.write_text("".join([lines[12], lines[0], lines[9], lines[1], lines[12], lines[10]] + lines[14:]))
    return old, new


def _examples(t, data, max_len=64):
    return load_examples(data, None, int(t.config["vocab_size"]), max_len)[0]


def test_reused_rows_equal_a_build_from_scratch(saved, tmp_path, run_cli):
    t, tdir, data, _ = saved
    old, new = _split(Path(data), tmp_path)
    rc, _, err = run_cli("features", "--target", tdir, "--data", old, "--out", tmp_path / "old.f",
                         "--max-len", "64", "--topk", "5", "--feature-dtype", "float32", "--no-progress")
    assert rc == 0, err
    rc, _, err = run_cli("features", "--target", tdir, "--data", new, "--out", tmp_path / "new.f",
                         "--max-len", "64", "--topk", "3", "--feature-dtype", "float32", "--no-progress",
                         "--reuse", tmp_path / "old.f")
    assert rc == 0, err
    ex = _examples(t, new)
    # the 6 lines taken from the old file are 6 rows; the target runs over the rest only
    assert f"6 of {len(ex)} sequences" in err
    got = FeatureStore(tmp_path / "new.f")
    ref = build_features(t, ex, tmp_path / "ref.f", make_key(t, tdir, new, 64, None, "float32", 3),
                         batch_tokens=90, progress=False)
    assert len(got) == len(ref) == len(ex)
    for i in range(len(ex)):
        torch.testing.assert_close(got(i, ex[i].ids), ref(i), rtol=1e-5, atol=1e-5)
        ids, logp = got.topk(i)
        assert ids.shape[1] == 3 and torch.equal(ids, ref.topk(i)[0])  # 3 of the old 5 columns
        torch.testing.assert_close(logp, ref.topk(i)[1], rtol=1e-3, atol=1e-3)


def test_an_old_cache_that_cannot_serve_is_refused(saved, tmp_path):
    t, tdir, data, _ = saved
    old, new = _split(Path(data), tmp_path)
    vocab = int(t.config["vocab_size"])
    build_features(t, _examples(t, old), tmp_path / "bf16", make_key(t, tdir, old, 64, None, "bfloat16", 2),
                   progress=False, data=old)
    want = _examples(t, new)
    key = make_key(t, tdir, new, 64, None, "float32", 2)
    with pytest.raises(FastMTPError, match="dtype: cache 'bfloat16', now 'float32'"):
        reusable_rows([tmp_path / "bf16"], key, want, None, vocab, lambda s: None)
    key = make_key(t, tdir, new, 64, None, "bfloat16", 4)
    with pytest.raises(FastMTPError, match="topk: cache 2, need 4"):
        reusable_rows([tmp_path / "bf16"], key, want, None, vocab, lambda s: None)
    key = make_key(t, tdir, new, 48, None, "bfloat16", 2)  # max_len only picks rows: served
    assert len(reusable_rows([tmp_path / "bf16"], key, want, None, vocab, lambda s: None)) == 6
    # the old data file changed since: its rows can no longer be matched
    old.write_text(old.read_text() + json.dumps({"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}) + "\n")
    with pytest.raises(FastMTPError, match="missing or has changed"):
        reusable_rows([tmp_path / "bf16"], key, want, None, vocab, lambda s: None)
    # a cache that recorded no data file (built without data=)
    build_features(t, _examples(t, new), tmp_path / "nodata", make_key(t, tdir, new, 64, None, "bfloat16", 2),
                   progress=False)
    with pytest.raises(FastMTPError, match="records no data file"):
        reusable_rows([tmp_path / "nodata"], key, want, None, vocab, lambda s: None)
