"""`fastmtp curve` end to end on the toy target: prefixes, shared feature cache, held-out and
served tau per point, resumable, JSON + Markdown + PNG."""

from __future__ import annotations

import json

import pytest
import torch

from fastmtp_sglang.cli.curve import parse_arm
from fastmtp_sglang.training.curve import prefix_rows
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.data import Example
from test_train import one_thread, toy  # noqa: F401  (fixtures)

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_prefix_rows_and_arms():
    ex = [Example(torch.zeros(10, dtype=torch.long), 4) for _ in range(10)]  # 6 response tokens each
    rows, avail = prefix_rows(ex, heldout_rows=2, tokens=[6, 13, 48, 49])
    assert rows == {6: 1, 13: 3, 48: 8} and avail == 48  # 49 > the 8 trainable rows hold
    assert parse_arm("kl=--loss kl --kl-topk 8").flags == ["--loss", "kl", "--kl-topk", "8"]
    assert parse_arm("fastmtp=").flags == []
    with pytest.raises(FastMTPError):
        parse_arm("bad name=--vanilla")


def _setup(llama_target, tmp_path, tiny_tokenizer):
    """The conftest Llama target saved as a model directory (its vocabulary covers the tokenizer,
    so dev prompts run), its greedy continuations of random prompts as data, a random init."""
    import copy

    from fastmtp_sglang.core.draft_dir import make_draft_config, save_draft_dir
    from fastmtp_sglang.core.target import Target
    from test_train import greedy, random_head

    model = llama_target.model
    t = Target(model, None, llama_target.config, "llama-tiny")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        seqs = greedy(t, torch.randint(1, 300, (20, 6), generator=g), 16)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": s[:6].tolist(), "response_ids": s[6:].tolist()})
                            + "\n" for s in seqs))
    init = tmp_path / "init"
    head = random_head(t, "deepseek", seed=2)
    save_draft_dir(init, make_draft_config(llama_target.config, "deepseek", dtype="float32"),
                   {k: 0.5 * v for k, v in head.state_dict().items()})
    tdir = tmp_path / "target"
    model.save_pretrained(str(tdir))
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT
    tok.save_pretrained(str(tdir))
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"id": f"d{i}", "prompt": t}) + "\n"
                           for i, t in enumerate(["a list of values", "the quick fox"])))
    return tdir, init, data, dev, seqs


def test_curve_cli_end_to_end(llama_target, tmp_path, run_cli, tiny_tokenizer):
    tdir, init, data, dev, _ = _setup(llama_target, tmp_path, tiny_tokenizer)
    out = tmp_path / "curve"
    args = ["curve", "--target", tdir, "--init", init, "--data", data, "--out", out,
            "--tokens", "40,150", "--arm", "fastmtp=", "--arm", "vanilla=--vanilla",
            "--heldout-rows", "4", "--serve-steps", "1,3", "--dev-prompts", dev,
            "--dev-max-new-tokens", "8", "--no-progress", "--", "--epochs", "1", "--batch-size", "4",
            "--max-len", "64", "--lr", "3e-3", "--eval-every", "1"]
    rc, stdout, err = run_cli(*args)
    assert rc == 0, err
    res = json.loads((out / "curve.json").read_text())
    pts = {(p["arm"], p["tokens"]): p for p in res["points"]}
    for p in pts.values():  # the curve in optimizer steps: one score per step, the last the point's
        sc = p["step_curve"]
        assert [r["step"] for r in sc] == list(range(1, p["optimizer_steps"] + 1))
        assert sc[-1]["tau_walk"] == pytest.approx(p["heldout"]["tau_walk"], abs=1e-9)
    assert set(pts) == {("fastmtp", 40), ("fastmtp", 150), ("vanilla", 40), ("vanilla", 150)}
    assert pts[("fastmtp", 40)]["rows"] < pts[("fastmtp", 150)]["rows"] <= 16
    for p in pts.values():
        assert 1.0 <= p["heldout"]["tau_walk"] <= 4.0 and set(p["served_tau"]) == {"1", "3"}
    # each point's served tau is what its saved head gets when served again (fp32: exactly)
    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.core.prompts import load_prompt_ids
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.training.curve import served_tau

    target = load_target(tdir, "float32")
    ids = [x for *_, x in load_prompt_ids(target.tokenizer, [str(dev)], 1, None, True)]
    for arm in ("fastmtp", "vanilla"):
        head = load_head(out / arm / "150", target.embed, target.lm_head)
        again = served_tau(target, head, ids, [1, 3], 8)
        assert {str(k): v for k, v in again.items()} == pts[(arm, 150)]["served_tau"]
    assert (out / "curve.md").read_text().count("| fastmtp |") == 2 and (out / "curve.png").is_file()
    assert "held-out score in optimizer steps" in (out / "curve.md").read_text()
    assert (out / "curve_steps.png").is_file()
    assert len(list((out / "features").glob("shard-*.safetensors"))) >= 1  # one cache for all points
    # a rerun has nothing left to do
    rc, _, err = run_cli(*args)
    assert rc == 0 and "curve: arm" not in err


def test_curve_trains_scores_and_serves_with_the_vocab_table(llama_target, tmp_path, run_cli,
                                                             tiny_tokenizer):
    """``--vocab`` after ``--`` reaches training, the held-out score and the served drafts: with a
    table that holds none of the data's response tokens every target is out of the table (counted
    in the log) and no held-out draft can be accepted (tau_walk exactly 1)."""
    from transformers import AutoTokenizer

    from fastmtp_sglang.vocab.tables import save_table, tokenizer_identity

    tdir, init, data, dev, seqs = _setup(llama_target, tmp_path, tiny_tokenizer)
    vocab = int(llama_target.config["vocab_size"])
    used = set(seqs[:, 6:].reshape(-1).tolist())
    ids = torch.tensor([i for i in range(vocab) if i not in used])
    tok = AutoTokenizer.from_pretrained(str(tdir))
    table = save_table(tmp_path / "en-x.pt", ids, {"lang": "en", "tokenizer": tokenizer_identity(tok)})
    out = tmp_path / "curve"
    rc, _, err = run_cli("curve", "--target", tdir, "--init", init, "--data", data, "--out", out,
                         "--tokens", "40", "--heldout-rows", "4", "--serve-steps", "2",
                         "--dev-prompts", dev, "--dev-max-new-tokens", "8", "--no-progress", "--",
                         "--epochs", "1", "--batch-size", "4", "--max-len", "64", "--vocab", table,
                         "--device", "cpu")
    assert rc == 0, err
    assert json.loads((out / "curve.json").read_text())["meta"]["device"] == "cpu"
    (p,) = json.loads((out / "curve.json").read_text())["points"]
    assert p["heldout"]["tau_walk"] == 1.0 and 1.0 <= p["served_tau"]["2"] <= 3.0
    steps = [json.loads(x) for x in (out / "fastmtp" / "40" / "train_log.jsonl").read_text().splitlines()]
    steps = [x for x in steps if x.get("event") == "step"]
    assert steps and all(x["targets"] > 0 and x["out_of_table"] == [x["targets"]] * 3 for x in steps)


def test_curve_with_no_trainable_point_is_an_error(llama_target, tmp_path, run_cli, tiny_tokenizer):
    """Every --tokens value beyond the data: a non-zero exit that says so, no curve.json."""
    tdir, init, data, _, _ = _setup(llama_target, tmp_path, tiny_tokenizer)
    out = tmp_path / "curve"
    rc, _, err = run_cli("curve", "--target", tdir, "--init", init, "--data", data, "--out", out,
                         "--tokens", "100000", "--heldout-rows", "4", "--no-progress", "--",
                         "--epochs", "1", "--batch-size", "4", "--max-len", "64")
    assert rc != 0 and "no point to train" in err and "smaller --tokens" in err
    assert not (out / "curve.json").exists()


def test_curve_arms_on_two_devices_is_an_error(llama_target, tmp_path, run_cli, tiny_tokenizer):
    """--device reaches the curve (the target loads there); arms that disagree are refused
    before anything loads."""
    tdir, init, data, _, _ = _setup(llama_target, tmp_path, tiny_tokenizer)
    out = tmp_path / "curve"
    rc, _, err = run_cli("curve", "--target", tdir, "--init", init, "--data", data, "--out", out,
                         "--tokens", "40", "--arm", "a=--device cpu", "--arm", "b=--device cuda",
                         "--heldout-rows", "4", "--no-progress", "--", "--epochs", "1")
    assert rc != 0 and "same --device" in err
    assert not (out / "curve.json").exists()
