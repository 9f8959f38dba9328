"""Drafts and targets that do not belong together: `serve` and `train` refuse a draft whose
recorded base model (config hash, tokenizer hash) is another target's, naming the mismatch,
unless `--allow-base-mismatch`; a draft whose config.json is not a JSON object is a clean error
in every command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastmtp_sglang.core.errors import MismatchError


class OtherTokenizer:
    """Just enough of a tokenizer for target_identity: a vocabulary that is not the target's."""

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(300)}

    def __len__(self) -> int:
        return 300


def _draft(root: Path, name: str, target_config: dict, base: dict) -> Path:
    from fastmtp_sglang.core.draft_dir import expected_shapes, make_draft_config, save_draft_dir
    from fastmtp_sglang.core.head import HeadConfig

    cfg = make_draft_config(target_config, "deepseek", dtype="float32", base_model=base)
    sd = {k: 0.02 * torch.randn(s) for k, s in expected_shapes(HeadConfig.from_dict(cfg)).items()}
    return save_draft_dir(root / name, cfg, sd)


@pytest.fixture(scope="module")
def drafts(llama_target, tiny_tokenizer, tmp_path_factory):
    """(own, other config, other tokenizer, list config) drafts for the Llama test target."""
    from fastmtp_sglang.core.identity import target_identity

    root = tmp_path_factory.mktemp("fit")
    cfg = llama_target.config
    own = _draft(root, "own", cfg, target_identity("llama-tiny", cfg, tiny_tokenizer))
    deeper = {**cfg, "num_hidden_layers": 4}  # same width and vocabulary: the head would run
    other_cfg = _draft(root, "other-config", cfg, target_identity("llama-deeper", deeper,
                                                                   tiny_tokenizer))
    other_tok = _draft(root, "other-tokenizer", cfg, target_identity("llama-tiny", cfg,
                                                                      OtherTokenizer()))
    listed = root / "listed"
    listed.mkdir()
    (listed / "config.json").write_text(json.dumps([cfg]))
    return own, other_cfg, other_tok, listed


def _serve_args(target, draft, *extra):
    from fastmtp_sglang.cli import build_parser

    return build_parser().parse_args(["serve", "--engine", "reference", "--target", str(target),
                                      "--draft", str(draft), "--steps", "1", "--port", "0",
                                      *extra])


def test_require_fits_names_the_mismatch(llama_target, tiny_tokenizer, drafts):
    from fastmtp_sglang.core.draft_dir import read_config
    from fastmtp_sglang.core.target import require_fits

    own, other_cfg, other_tok, _ = drafts
    cfg = llama_target.config
    assert require_fits(read_config(own), cfg, tiny_tokenizer) == []
    with pytest.raises(MismatchError, match=r"made for another target: base config hash: draft "
                       r"made for 'llama-deeper' \(config hash \w+; this target's is \w+"):
        require_fits(read_config(other_cfg), cfg, tiny_tokenizer)
    with pytest.raises(MismatchError, match="tokenizer hash: the draft was made with another "
                       "tokenizer.*--allow-base-mismatch"):
        require_fits(read_config(other_tok), cfg, tiny_tokenizer)
    allowed = require_fits(read_config(other_cfg), cfg, tiny_tokenizer, allow_base_mismatch=True)
    assert len(allowed) == 1 and allowed[0].startswith("base config hash")
    # a head that cannot run is refused whatever the flag says
    narrow = {**cfg, "hidden_size": 48}
    with pytest.raises(MismatchError, match="does not fit"):
        require_fits(read_config(own), narrow, allow_base_mismatch=True)


def test_serve_refuses_a_foreign_draft_unless_allowed(llama_target, drafts, run_cli, capsys):
    from fastmtp_sglang.cli.serve import build_reference_server

    own, other_cfg, other_tok, _ = drafts
    for draft, needle in ((other_cfg, "base config hash"), (other_tok, "tokenizer hash")):
        rc, out, err = run_cli("serve", "--engine", "reference", "--target", llama_target.path,
                               "--draft", draft, "--steps", "1", "--port", "0")
        assert rc == 1 and "made for another target" in err and needle in err, err
        assert "--allow-base-mismatch" in err and "Traceback" not in err
    server = build_reference_server(_serve_args(llama_target.path, other_cfg,
                                                "--allow-base-mismatch"))
    try:
        assert "warning" in capsys.readouterr().out
    finally:
        server.shutdown()
    build_reference_server(_serve_args(llama_target.path, own)).shutdown()


def test_train_refuses_a_foreign_draft_unless_allowed(llama_target, drafts, run_cli, tmp_path):
    _, other_cfg, _, _ = drafts
    data = tmp_path / "data.jsonl"
    data.write_text("")
    args = ["train", "--target", llama_target.path, "--init", other_cfg, "--data", data,
            "--out", tmp_path / "out", "--no-progress", "--device", "cpu"]
    rc, _, err = run_cli(*args)
    assert rc == 1 and "made for another target" in err and "--allow-base-mismatch" in err, err
    rc, _, err = run_cli(*args, "--allow-base-mismatch")
    assert "made for another target" not in err  # it goes on (and stops at the empty data)


@pytest.mark.parametrize("command", ["serve", "inspect", "convert", "train"])
def test_a_config_that_is_a_json_list_is_a_clean_error(llama_target, drafts, run_cli, tmp_path,
                                                       command):
    listed = drafts[3]
    data = tmp_path / "data.jsonl"
    data.write_text("")
    argv = {
        "serve": ["serve", "--engine", "reference", "--target", llama_target.path, "--draft",
                  listed, "--steps", "1", "--port", "0"],
        "inspect": ["inspect", listed],
        "convert": ["convert", listed, tmp_path / "out"],
        "train": ["train", "--target", llama_target.path, "--init", listed, "--data", data,
                  "--out", tmp_path / "out", "--no-progress", "--device", "cpu"],
    }[command]
    rc, _, err = run_cli(*argv)
    assert rc == 1 and "Traceback" not in err and "AttributeError" not in err, err
    if command != "convert":  # convert: "not a draft directory", as before
        assert "holds a JSON list, not an object" in err, err
