"""The two supported SGLang versions and what differs between them (serving/sglang_versions.py).

Run under each version: ``make test`` (0.5.23) and ``make test-sglang-0517`` (0.5.17).
"""

from __future__ import annotations

import json

import pytest

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.serving import sglang_versions as sv


def test_supported_versions_and_their_tiers():
    assert sv.check_supported("0.5.17") == "0.5.17" and sv.check_supported("0.5.23") == "0.5.23"
    with pytest.raises(FastMTPError, match=r"0\.5\.20 is not a version .*0\.5\.17, 0\.5\.23"):
        sv.check_supported("0.5.20")
    assert sv.adaptive_candidates("0.5.17") == (0, 1, 3, 7)
    assert sv.adaptive_candidates("0.5.23") == (0, 1, 3, 5, 7)
    assert sv.adaptive_candidates("9.9.9") == sv.adaptive_candidates(sv.PINNED)


@pytest.mark.sglang
def test_installed_version_is_supported():
    pytest.importorskip("sglang")
    assert sv.check_supported() in sv.SUPPORTED


@pytest.mark.sglang
def test_bundle_route_flags_resolve_in_the_installed_sglang(tmp_path):
    """The H200 run's command (our EAGLE flags + the no-flashinfer route) goes through the
    installed SGLang's own parser and full resolution, and keeps the backends it names."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    from fastmtp_sglang.core.draft_dir import make_draft_config
    from fastmtp_sglang.serving.sglang_launch import build_launch_command

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 320,
           "max_position_embeddings": 256, "tie_word_embeddings": True, "torch_dtype": "float32"}
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    draft.mkdir()
    (target / "config.json").write_text(json.dumps(cfg))
    (draft / "config.json").write_text(json.dumps(make_draft_config(cfg, "deepseek")))
    argv, env = build_launch_command(target, draft, 3, 30000, "127.0.0.1",
                                     sv.BUNDLE_ROUTE_ARGS + ["--dtype", "float32", "--device", "cpu"])
    sa = sv.resolve_server_args(server_args.prepare_server_args(argv[3:]))
    assert (sa.attention_backend, sa.speculative_draft_attention_backend, sa.sampling_backend,
            sa.grammar_backend) == ("triton", "triton", "pytorch", "none")
    assert sa.speculative_num_steps == 3 and sa.speculative_eagle_topk == 1
    assert sa.speculative_num_draft_tokens == 4
