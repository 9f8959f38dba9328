"""Bad input through the real `fastmtp` CLI: a clear message naming what is wrong, a non-zero exit,
no traceback, and nothing half-written.

Run: .venv/bin/pytest tests/test_cli_errors.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fastmtp_sglang.core.convert import convert
from fastmtp_sglang.core.draft_dir import load_draft_dir
from fastmtp_sglang.core.errors import DraftFormatError
from fastmtp_sglang.training.init_head import init_head

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def draft(tmp_path_factory, deepseek_ckpt) -> Path:
    """A good draft directory (deepseek layout, Llama block); tests copy it before breaking it."""
    return convert(deepseek_ckpt.path, tmp_path_factory.mktemp("good") / "draft", fmt="deepseek")


def broken_copy(draft: Path, dst: Path, edit) -> Path:
    shutil.copytree(draft, dst)
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def assert_clean_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 1, (rc, err)
    assert "Traceback" not in err, err
    assert err.startswith("fastmtp "), err
    for n in needles:
        assert n in err, (n, err)


# ----------------------------------------------------------------------------------------------
# strict loading of draft directories
# ----------------------------------------------------------------------------------------------

def test_missing_tensor_is_named(draft, tmp_path, run_cli):
    bad = broken_copy(draft, tmp_path / "bad", lambda t: t.pop("layer.mlp.up_proj.weight"))
    with pytest.raises(DraftFormatError, match=r"missing: layer\.mlp\.up_proj\.weight"):
        load_draft_dir(bad)
    rc, out, err = run_cli("inspect", bad)
    assert_clean_error(rc, err, "missing: layer.mlp.up_proj.weight")


def test_wrong_shape_is_named_with_both_shapes(draft, tmp_path, run_cli):
    def edit(t):
        t["layer.mlp.down_proj.weight"] = t["layer.mlp.down_proj.weight"][:, :-1].contiguous()

    bad = broken_copy(draft, tmp_path / "bad", edit)
    rc, _, err = run_cli("inspect", bad)
    assert_clean_error(rc, err, "wrong shape: layer.mlp.down_proj.weight: expected [64, 96], found [64, 95]")


def test_unexpected_tensor_is_named(draft, tmp_path, run_cli):
    def edit(t):
        t["embed_tokens.weight"] = torch.zeros(320, 64)  # a stored embedding is a contract breach

    bad = broken_copy(draft, tmp_path / "bad", edit)
    with pytest.raises(DraftFormatError, match=r"unexpected: embed_tokens\.weight"):
        load_draft_dir(bad)
    rc, _, err = run_cli("convert", bad, tmp_path / "out", "--layout", "split")
    assert_clean_error(rc, err, "unexpected: embed_tokens.weight")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_every_problem_in_one_message(draft, tmp_path):
    def edit(t):
        t.pop("enorm.weight")
        t.pop("final_norm.weight")
        t["layer.self_attn.q_proj.weight"] = torch.zeros(3, 3)
        t["bogus"] = torch.zeros(1)

    bad = broken_copy(draft, tmp_path / "bad", edit)
    with pytest.raises(DraftFormatError) as exc:
        load_draft_dir(bad)
    msg = str(exc.value)
    for needle in ("enorm.weight", "final_norm.weight", "layer.self_attn.q_proj.weight", "bogus"):
        assert needle in msg, msg


def test_not_a_draft_directory(draft, tmp_path, run_cli):
    rc, _, err = run_cli("inspect", tmp_path / "nowhere")
    assert_clean_error(rc, err, "not a directory")
    d = tmp_path / "no_meta"
    shutil.copytree(draft, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("fastmtp")
    (d / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli("inspect", d)
    assert_clean_error(rc, err, "'fastmtp'")
    (d / "config.json").write_text("{not json")
    rc, _, err = run_cli("inspect", d)
    assert_clean_error(rc, err, "not valid JSON")


def test_corrupt_weights_file(draft, tmp_path, run_cli):
    d = tmp_path / "corrupt"
    shutil.copytree(draft, d)
    (d / "model.safetensors").write_bytes(b"\x00" * 7)
    rc, _, err = run_cli("inspect", d)
    assert_clean_error(rc, err, "model.safetensors")


# ----------------------------------------------------------------------------------------------
# convert: bad sources and --format
# ----------------------------------------------------------------------------------------------

def test_missing_tensor_in_source_checkpoint(mimo_ckpt, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(mimo_ckpt.path, src)
    t = dict(mimo_ckpt.tensors)
    t.pop("model.mtp_layers.0.input_proj.weight")
    save_file(t, str(src / "model.safetensors"))
    for extra in ([], ["--layout", "deepseek"]):  # also when the layout changes on the way
        rc, _, err = run_cli("convert", "--format", "mimo", src, tmp_path / "out", *extra)
        assert_clean_error(rc, err, "missing: model.mtp_layers.0.input_proj.weight")
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_wrong_shape_in_source_checkpoint(deepseek_ckpt, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(deepseek_ckpt.path, src)
    t = dict(deepseek_ckpt.tensors)
    t["model.layers.2.eh_proj.weight"] = t["model.layers.2.eh_proj.weight"][:, :100].contiguous()
    save_file(t, str(src / "model.safetensors"))
    rc, _, err = run_cli("convert", "--format", "deepseek", src, tmp_path / "out", "--layout", "split")
    assert_clean_error(rc, err, "model.layers.2.eh_proj.weight: expected [64, 128], found [64, 100]")
    assert not (tmp_path / "out").exists()


def test_unknown_format_is_an_argparse_error(mimo_ckpt, tmp_path, run_cli):
    rc, _, err = run_cli("convert", "--format", "eagle3", mimo_ckpt.path, tmp_path / "out")
    assert rc == 2
    assert "invalid choice: 'eagle3'" in err and "mimo" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fixture,wrong,right", [
    ("mimo_ckpt", "deepseek", "mimo"),
    ("mimo_ckpt", "split", "mimo"),
    ("deepseek_ckpt", "mimo", "deepseek"),
    ("deepseek_ckpt", "split", "deepseek"),
    ("split_ckpt", "deepseek", "split"),
    ("split_ckpt", "mimo", "split"),
])
def test_format_that_does_not_match_suggests_the_right_one(fixture, wrong, right, request, tmp_path, run_cli):
    ckpt = request.getfixturevalue(fixture)
    rc, _, err = run_cli("convert", "--format", wrong, ckpt.path, tmp_path / "out")
    assert_clean_error(rc, err, f"--format {right}")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_format_on_a_draft_directory(draft, tmp_path, run_cli):
    rc, _, err = run_cli("convert", "--format", "mimo", draft, tmp_path / "out")
    assert_clean_error(rc, err, "draft directory")
    rc, _, err = run_cli("convert", tmp_path, tmp_path / "out")  # neither draft nor --format
    assert_clean_error(rc, err, "--format")


def test_moe_layer_is_refused(deepseek_ckpt, tmp_path, run_cli):
    src = tmp_path / "moe"
    shutil.copytree(deepseek_ckpt.path, src)
    t = dict(deepseek_ckpt.tensors)
    t["model.layers.2.mlp.experts.0.gate_proj.weight"] = torch.zeros(8, 64)
    save_file(t, str(src / "model.safetensors"))
    rc, _, err = run_cli("convert", "--format", "deepseek", src, tmp_path / "out")
    assert_clean_error(rc, err, "model.layers.2.mlp.experts.0.gate_proj.weight", "NextN")


def test_missing_shard(mimo_sharded, tmp_path, run_cli):
    src = tmp_path / "sharded"
    shutil.copytree(mimo_sharded.path, src)
    (src / "model-00004-of-00004.safetensors").unlink()
    rc, _, err = run_cli("convert", "--format", "mimo", src, tmp_path / "out")
    assert_clean_error(rc, err, "model-00004-of-00004.safetensors")
    assert not (tmp_path / "out").exists()


def test_corrupt_checkpoint_file(mimo_ckpt, mimo_sharded, tmp_path, run_cli):
    single = tmp_path / "single"
    shutil.copytree(mimo_ckpt.path, single)
    (single / "model.safetensors").write_bytes(b"garbage!!")
    sharded = tmp_path / "sharded"
    shutil.copytree(mimo_sharded.path, sharded)
    (sharded / "model-00003-of-00004.safetensors").write_bytes(b"garbage!!")
    for src, name in ((single, "model.safetensors"), (sharded, "model-00003-of-00004.safetensors")):
        rc, _, err = run_cli("convert", "--format", "mimo", src, tmp_path / "out")
        assert_clean_error(rc, err, name, "not a readable safetensors file")
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# inspect --target
# ----------------------------------------------------------------------------------------------

def test_inspect_fits_its_own_target(llama_target, tmp_path, run_cli):
    out = init_head(llama_target.path, tmp_path / "head", method="embed", evaluate=False)
    rc, text, err = run_cli("inspect", out, "--target", llama_target.path)
    assert rc == 0, err
    assert "layout           deepseek" in text and "fits target" in text and "yes" in text
    assert "MISMATCH" not in text
    rc, text, _ = run_cli("inspect", out, "--json")
    info = json.loads(text)
    assert info["hidden_size"] == 64 and info["fastmtp"]["init"]["method"] == "embed"


def test_inspect_hidden_size_mismatch(llama_target, qwen2_target, tmp_path, run_cli):
    out = init_head(llama_target.path, tmp_path / "head", method="hidden", evaluate=False)
    rc, text, err = run_cli("inspect", out, "--target", qwen2_target.path)
    assert_clean_error(rc, err, "does not fit")
    assert "[MISMATCH] hidden_size: draft 64, target 48" in text


# ----------------------------------------------------------------------------------------------
# output paths: unwritable, existing, overwrite
# ----------------------------------------------------------------------------------------------

def test_unwritable_output_under_a_file(mimo_ckpt, tmp_path, run_cli):
    blocker = tmp_path / "file.txt"
    blocker.write_text("a regular file, not a directory")
    for out in (blocker / "out", blocker / "deeper" / "out"):
        rc, _, err = run_cli("convert", "--format", "mimo", mimo_ckpt.path, out)
        assert_clean_error(rc, err, str(blocker))
        assert blocker.read_text() == "a regular file, not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_write_failure_midway_leaves_nothing(mimo_ckpt, tmp_path, run_cli, monkeypatch):
    import fastmtp_sglang.core.draft_dir as dd

    def disk_full(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dd, "save_file", disk_full)
    rc, _, err = run_cli("convert", "--format", "mimo", mimo_ckpt.path, tmp_path / "out")
    assert_clean_error(rc, err, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite(mimo_ckpt, tmp_path, run_cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = run_cli("convert", "--format", "mimo", mimo_ckpt.path, out)
    assert_clean_error(rc, err, "already exists", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_overwrite_replaces_atomically(mimo_ckpt, deepseek_ckpt, tmp_path, run_cli, monkeypatch):
    out = tmp_path / "out"
    assert run_cli("convert", "--format", "deepseek", deepseek_ckpt.path, out)[0] == 0
    (out / "stale.txt").write_text("from before")
    before = (out / "config.json").read_text()
    # a failed overwrite keeps the old directory whole
    import fastmtp_sglang.core.draft_dir as dd

    real = dd.save_file

    def fail(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(dd, "save_file", fail)
    rc, _, err = run_cli("convert", "--format", "mimo", mimo_ckpt.path, out, "--overwrite")
    assert_clean_error(rc, err, "Input/output error")
    assert (out / "config.json").read_text() == before and (out / "stale.txt").exists()
    assert leftovers(tmp_path) == []
    # a good overwrite replaces the whole directory: nothing of the old one survives
    monkeypatch.setattr(dd, "save_file", real)
    rc, _, err = run_cli("convert", "--format", "mimo", mimo_ckpt.path, out, "--overwrite")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["fastmtp"]["layout"] == "mimo"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ----------------------------------------------------------------------------------------------
# the real console entry point, in a subprocess
# ----------------------------------------------------------------------------------------------

def test_subprocess_exit_codes(mimo_ckpt, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    bad = subprocess.run([sys.executable, "-m", "fastmtp_sglang", "convert", "--format", "deepseek",
                          str(mimo_ckpt.path), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert "--format mimo" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "out").exists()
