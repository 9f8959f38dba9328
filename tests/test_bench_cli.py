"""`fastmtp bench` in-process on the tiny Llama target: the head at several K and prompt lookup in
one run and one report, warm-up and rotation on, greedy outputs identical to K=0 (fp32)."""

from __future__ import annotations

import json

import torch

from fastmtp_sglang.benchmark.concurrency import request_budgets
from fastmtp_sglang.core.draft_dir import make_draft_config, save_draft_dir
from fastmtp_sglang.decode.auto_setup import AUTO_CEILING


def _random_draft(llama_target, tmp_path):
    from fastmtp_sglang.core.head import FastMTPHead, HeadConfig

    cfg = make_draft_config(llama_target.config, "deepseek", dtype="float32")
    torch.manual_seed(0)
    head = FastMTPHead(HeadConfig.from_dict(cfg), llama_target.model.get_input_embeddings(),
                       llama_target.model.get_output_embeddings())
    return save_draft_dir(tmp_path / "draft", cfg, head.state_dict())


def _prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in
                         enumerate(["a list is a list is a list", "the value of the value",
                                    "return the value"])))
    return p


def test_bench_head_and_prompt_lookup_one_report(llama_target, tmp_path, run_cli):
    draft = _random_draft(llama_target, tmp_path)
    prompts = _prompts(tmp_path)
    out = tmp_path / "r"
    rc, stdout, err = run_cli("bench", "--target", llama_target.path, "--draft", draft, "--prompts",
                              prompts, "--raw", "--steps", "0,2", "--ngram-steps", "2", "--repeats",
                              "2", "--max-new-tokens", "6", "--dtype", "float32", "--vocab", "full",
                              "--out", out, "--no-progress")
    assert rc == 0, err
    res = json.loads((out / "results.json").read_text())
    r = res["results"]
    assert set(r["overall"]) == {"0", "2"} and set(r["ngram"]["overall"]) == {"2"}
    assert r["overall"]["2"]["same_output_as_k0"] == "6/6"
    assert r["ngram"]["overall"]["2"]["same_output_as_k0"] == "6/6"  # lossless, fp32 (3 prompts x 2 repeats)
    assert len(r["overall"]["0"]["tokens_per_s_repeats"]) == 2
    assert "timing_check" in r and isinstance(r["timing_check"]["problems"], list)
    md = (out / "results.md").read_text()
    assert "| prompt lookup 2 |" in md and "lookup 2 |" in md.split("Per category")[1]
    assert md.startswith("# llama-tiny + draft: K=0,2, greedy")
    # a run with 3 arms x 3 prompts x 2 repeats + 3 warm-up runs
    assert len(res["samples"]) == 3 * 3 * 2


def test_bench_auto_arm_is_keyed_auto_and_lossless(llama_target, tmp_path, run_cli):
    """`--steps 0,1,2,auto`: one more arm, K chosen per cycle from the cost curve measured in the
    run; keyed `auto` in results.json, greedy outputs identical to K=0 in fp32, the K it chose
    reported as mean_k."""
    draft = _random_draft(llama_target, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in
                               enumerate(["a list is a list is a list", "return the value"])))
    out = tmp_path / "r"
    rc, stdout, err = run_cli("bench", "--target", llama_target.path, "--draft", draft, "--prompts",
                              prompts, "--raw", "--steps", "0,1,2,auto", "--repeats", "2",
                              "--max-new-tokens", "8", "--dtype", "float32", "--vocab", "full",
                              "--out", out, "--no-progress")
    assert rc == 0, err
    payload = json.loads((out / "results.json").read_text())
    r = payload["results"]
    (kmax,) = r["auto"]["overall"]  # K in 0..kmax: the deepest that pays on this machine's costs
    assert 1 <= int(kmax) <= AUTO_CEILING and payload["meta"]["config"]["auto_steps"] == int(kmax)
    a = r["auto"]["overall"][kmax]
    assert a["same_output_as_k0"] == "4/4" and 0.0 <= a["mean_k"] <= int(kmax)
    assert f"auto (K<={kmax}" in (out / "results.md").read_text()
    assert f"auto (K<={kmax}" in stdout  # the report printed says the range it ran
    # --auto-max-steps fixes the range
    rc, _, err = run_cli("bench", "--target", llama_target.path, "--draft", draft, "--prompts",
                         prompts, "--raw", "--steps", "0,auto", "--auto-max-steps", "2", "--repeats", "1",
                         "--max-new-tokens", "4", "--dtype", "float32", "--vocab", "full",
                         "--out", tmp_path / "fixed", "--no-progress")
    assert rc == 0, err
    assert set(json.loads((tmp_path / "fixed" / "results.json").read_text())["results"]["auto"]["overall"]) == {"2"}
    rc, _, err = run_cli("bench", "--url", "http://127.0.0.1:9", "--target", llama_target.path,
                         "--prompts", prompts, "--steps", "0,auto", "--out", tmp_path / "u")
    assert rc == 1 and "add --concurrency" in err


def test_bench_concurrency_in_process_and_against_a_server(llama_target, tmp_path, run_cli):
    """`--concurrency 1,3`: every arm (K=0, the head at K=2, prompt lookup, auto) at every level
    in one report keyed by level then arm, each with output_tokens_per_s, latency percentiles,
    the accept length and the speedup over K=0 (1.0 for K=0 itself); then the same levels
    against a running server via --url."""
    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.serving.app import ReferenceServer
    from fastmtp_sglang.serving.options import ServerOptions

    draft = _random_draft(llama_target, tmp_path)
    prompts = _prompts(tmp_path)
    out = tmp_path / "r"
    rc, stdout, err = run_cli("bench", "--target", llama_target.path, "--draft", draft, "--prompts",
                              prompts, "--raw", "--steps", "0,2,auto", "--ngram-steps", "2",
                              "--repeats", "2", "--max-new-tokens", "6", "--dtype", "float32",
                              "--vocab", "full", "--concurrency", "1,3", "--out", out, "--no-progress")
    assert rc == 0, err
    res = json.loads((out / "results.json").read_text())
    table = res["results"]["concurrency"]
    assert set(table) == {"1", "3"}
    for level, arms in table.items():
        assert set(arms) == {"0", "2", "lookup2", "auto"}
        for arm, s in arms.items():
            assert s["output_tokens_per_s"] > 0 and s["requests"] == max(3, 2 * int(level))
            assert s["ttft_s_p50"] <= s["ttft_s_p90"] and s["tpot_s_p50"] <= s["tpot_s_p90"]
            assert 1.0 <= s["accept_length"] <= 3.0
        assert arms["0"]["speedup"] == 1.0 and arms["0"]["accept_length"] == 1.0
    # every request of every run answered with all its tokens (6 each, ignore_eos not set: <= 6)
    assert all(0 < q["tokens"] <= 6 for run in res["runs"] for q in run["requests"])
    assert len(res["runs"]) == 4 * 2 * 2  # arms x levels x repeats
    assert (out / "results.png").stat().st_size > 1000
    assert "| concurrency |" in (out / "results.md").read_text()
    # where each arm's cycles went: K=0 never drafts; the head's arm at K=2 only; every cycle
    # counted with its rows (at least one, at most the level's clients)
    cyc = res["meta"]["cycles"]
    assert set(cyc) == {"0", "2", "lookup2", "auto"} and all(set(v) == {"1", "3"} for v in cyc.values())
    assert all(set(cyc["0"][lv]) == {"0"} for lv in ("1", "3"))
    assert all(set(cyc["2"][lv]) <= {"0", "2"} and cyc["2"][lv]["2"][0] > 0 for lv in ("1", "3"))
    for arm, by_level in cyc.items():
        for lv, by_k in by_level.items():
            n = sum(c for c, _, _ in by_k.values())
            rows = sum(r for _, _, r in by_k.values())
            assert n > 0 and n <= rows <= n * int(lv) and all(s > 0 for _, s, _ in by_k.values())
    assert "share of time drafting" in (out / "results.md").read_text()

    target = load_target(llama_target.path, "float32")
    with ReferenceServer(ReferenceEngine(target, None, 0), ServerOptions(port=0, max_batch=4)) as srv:
        out2 = tmp_path / "r2"
        rc, _, err = run_cli("bench", "--url", srv.url, "--target", llama_target.path, "--prompts",
                             prompts, "--raw", "--steps", "0", "--repeats", "1", "--max-new-tokens",
                             "5", "--concurrency", "2", "--per-client", "3", "--no-warmup", "--out", out2,
                             "--no-progress", "--length-spread", "0.5", "--seed", "0")
        assert rc == 0, err
        rc, _, err = run_cli("bench", "--url", srv.url, "--target", llama_target.path, "--prompts",
                             prompts, "--raw", "--steps", "0", "--concurrency", "2", "--length-spread",
                             "1.5", "--out", tmp_path / "r4", "--no-progress")
        assert rc == 1 and "--length-spread must be in [0, 1)" in err
        rc, _, err = run_cli("bench", "--url", srv.url, "--target", llama_target.path, "--prompts",
                             prompts, "--raw", "--steps", "0", "--concurrency", "2", "--per-client",
                             "0", "--out", tmp_path / "r3", "--no-progress")
        assert rc == 1 and "--per-client must be >= 1" in err
    t2 = json.loads((out2 / "results.json").read_text())["results"]["concurrency"]
    # 3 prompts, 2 clients sending at least 3 each
    assert set(t2) == {"2"} and set(t2["2"]) == {"0"} and t2["2"]["0"]["requests"] == 6
    md2 = (out2 / "results.md").read_text()
    assert "6 requests per level and arm (at least 3 per client)" in md2
    # --length-spread 0.5 around 5 tokens: each request its own budget in 2..8 (EOS may end one early)
    assert "2-8 new tokens a request (uniform, mean 5)" in md2
    res2 = json.loads((out2 / "results.json").read_text())
    got = sorted(q["tokens"] for q in res2["runs"][0]["requests"])
    assert len(set(got)) > 1 and max(got) <= 8 and sum(got) <= sum(request_budgets(6, 5, 0.5))
