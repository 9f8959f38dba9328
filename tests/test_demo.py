"""`fastmtp demo` end to end on the real embedded model (slow: materialises SmolLM2 once)."""

from __future__ import annotations

import json

import pytest

from fastmtp_sglang.cli import main
from fastmtp_sglang.cli.demo import shipped_head


def test_a_trained_head_ships():
    head = shipped_head()
    assert head is not None, "fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3 is missing"
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["FastMTPForCausalLM"] and cfg["fastmtp"]["trained_steps"] == 3


@pytest.mark.slow
def test_demo_runs_and_writes_results(tmp_path, capsys):
    rc = main(["demo", "--steps", "0,2", "--prompts", "2", "--max-new-tokens", "8",
               "--out", str(tmp_path / "r")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| K | tau" in out and "trained FastMTP head" in out
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    # the shipped head is accepted: measured 1.875 on these 2 prompts x 8 tokens (bf16 on an
    # AMX CPU; an untrained head sits near 1.0), so 1.3 is a floor with room for fp32 / bf16
    assert res["results"]["overall"]["2"]["tau"] >= 1.3
    assert (tmp_path / "r" / "results.png").is_file()
