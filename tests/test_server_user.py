"""What a user of the reference server meets: K reported as it runs (``--steps auto`` as auto),
the acceptance figures defined where they are reported, every refusal counted, and a missing
target or a taken port refused before anything loads.

In-process servers on 127.0.0.1 over tiny random targets (no tokenizer: prompts are token ids).
Nothing races the clock: the one timeout here is set small and the test waits for its answer
(a hang guard of a minute, never a measured duration).
"""

from __future__ import annotations

import socket

import pytest

from fastmtp_sglang.serving import client
from fastmtp_sglang.serving.options import ServerOptions
from test_engine import random_head, tiny_target
from test_server_hostile import GUARD_S, addr, post, read_response

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def world():
    t = tiny_target("llama", seed=3)
    return t, random_head(t, "deepseek", seed=4)


def serve(engine, **options):
    from fastmtp_sglang.serving.app import ReferenceServer

    return ReferenceServer(engine, ServerOptions(port=0, **options))


def test_auto_is_reported_as_auto_with_its_range_and_the_metrics_are_defined(world):
    """--steps auto: /server_info, /get_model_info and each answer say "auto" and K's range, not
    the largest K as if it were fixed; each answer says how many drafts its cycles verified on
    average; tau and spec_accept_length are defined in /server_info and relate as defined."""
    from fastmtp_sglang.decode.auto import AutoK, StepCosts
    from fastmtp_sglang.decode.engine import ReferenceEngine

    t, head = world
    flat = StepCosts({1: 50.0, 2: 51.0, 4: 53.0}, draft_step=3.0, extend=2.0)
    eng = ReferenceEngine(t, head, 3, max_context=64, auto=AutoK(flat, 3, calibrate=False))
    with serve(eng) as srv:
        out = client.generate(srv.url, input_ids=[1, 5, 7, 9], sampling_params=GREEDY)
        info, model = client.server_info(srv.url), client.model_info(srv.url)
    mi = out["meta_info"]
    assert info["steps"] == "auto" and info["steps_range"] == [0, 3]
    assert info["speculative_adaptive"] is True and info["speculative_num_steps"] == 3
    assert model["steps"] == "auto" and model["steps_range"] == [0, 3]
    assert mi["steps"] == "auto" and mi["steps_range"] == [0, 3]
    assert 0.0 <= mi["mean_drafted"] <= 3.0
    defs = info["metric_definitions"]
    assert {"tau", "spec_accept_length", "avg_spec_accept_length", "steps"} <= set(defs)
    assert "prefill" in defs["tau"] and "completion_tokens / spec_verify_ct" in \
        defs["spec_accept_length"]
    # as defined: SGLang's per-request figure counts the prefill's token, tau does not
    ct = mi["spec_verify_ct"]
    assert mi["spec_accept_length"] == pytest.approx(mi["completion_tokens"] / ct)
    assert mi["tau"] <= mi["spec_accept_length"]
    # the server figure is the pooled tau, under both names
    assert info["tau"] == info["avg_spec_accept_length"] == pytest.approx(mi["tau"])


def test_fixed_k_is_reported_as_a_number(world):
    from fastmtp_sglang.decode.engine import ReferenceEngine

    t, head = world
    with serve(ReferenceEngine(t, head, 2, max_context=64)) as srv:
        mi = client.generate(srv.url, input_ids=[1, 5, 7], sampling_params=GREEDY)["meta_info"]
        info = srv.server_info()
    assert info["steps"] == 2 and info["steps_range"] == [2, 2]
    assert mi["steps"] == 2 and mi["mean_drafted"] == pytest.approx(2.0)


def test_body_timeouts_and_oversized_bodies_are_counted(world):
    """A body that stalls gets 408 and one over the limit 413; /server_info counts both, as it
    counts every other refusal, and the server keeps serving."""
    from fastmtp_sglang.decode.engine import ReferenceEngine

    t, _ = world
    with serve(ReferenceEngine(t, None, 0, max_context=64), read_timeout_s=0.2,
               max_body_bytes=1024) as srv:
        with socket.create_connection(addr(srv), timeout=GUARD_S) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"in")
            status, _, body = read_response(s)
        assert status == 408 and b"did not arrive" in body
        with socket.create_connection(addr(srv), timeout=GUARD_S) as s:
            s.sendall(post("/generate", {"input_ids": [5] * 600}))
            status, _, _ = read_response(s)
        assert status == 413
        info = srv.server_info()
        assert info["body_timeouts"] == 1 and info["bodies_too_large"] == 1, info
        assert client.generate(srv.url, input_ids=[5, 6], sampling_params=GREEDY)["output_ids"]


# --------------------------------------------------------------------------------------------
# `fastmtp serve`: a missing target and a taken port are refused before anything loads
# --------------------------------------------------------------------------------------------

@pytest.fixture
def no_loading(monkeypatch):
    """Make any weight load fail the test: the refusals below must come before one."""
    import fastmtp_sglang.core.target as target_mod

    def load_target(*args, **kwargs):
        raise AssertionError("the target's weights were loaded before the refusal")

    monkeypatch.setattr(target_mod, "load_target", load_target)


def test_serve_refuses_a_missing_target_before_loading(run_cli, tmp_path, no_loading):
    missing = tmp_path / "no-such-model"
    rc, out, err = run_cli("serve", "--engine", "reference", "--target", missing, "--steps", "0",
                           "--port", "0")
    assert rc != 0 and f"--target {missing}: no such directory" in err
    assert "local Hugging Face model directory" in err and "Traceback" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run_cli("serve", "--engine", "reference", "--target", empty, "--steps", "0",
                         "--port", "0")
    assert rc != 0 and "has no config.json" in err


def test_serve_refuses_a_taken_port_before_loading(run_cli, llama_target, no_loading):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        rc, out, err = run_cli("serve", "--engine", "reference", "--target", llama_target.path,
                               "--steps", "0", "--dtype", "float32", "--port", port)
    assert rc != 0 and f"cannot listen on 127.0.0.1:{port}" in err
    assert "pick another --port" in err and "Traceback" not in err


def test_sglang_and_vllm_refuse_a_missing_local_target_before_launching(tmp_path):
    """Hub ids (org/name) pass to the engine; a path that does not exist is refused here."""
    from fastmtp_sglang.core.errors import FastMTPError
    from fastmtp_sglang.serving.launch import require_free_port, require_target

    require_target("Qwen/Qwen2.5-7B-Instruct")
    for path in (tmp_path / "gone", "./gone", "~/gone", "a/b/c"):
        with pytest.raises(FastMTPError, match="no such directory"):
            require_target(path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        with pytest.raises(FastMTPError, match="cannot listen on"):
            require_free_port("127.0.0.1", holder.getsockname()[1])


def test_bench_url_against_one_auto_server_says_everything_it_needs_at_once(world, run_cli,
                                                                           tmp_path):
    """`fastmtp bench --url` with only a --steps auto server: one refusal that names both needs
    (a K=0 server; --steps auto --concurrency), whatever --steps was given, and --help says so."""
    from fastmtp_sglang.decode.auto import AutoK, StepCosts
    from fastmtp_sglang.decode.engine import ReferenceEngine

    t, head = world
    flat = StepCosts({1: 50.0, 2: 51.0, 4: 53.0}, draft_step=3.0, extend=2.0)
    eng = ReferenceEngine(t, head, 3, max_context=64, auto=AutoK(flat, 3, calibrate=False))
    with serve(eng) as srv:
        for steps in ([], ["--steps", "auto"], ["--steps", "auto", "--concurrency", "1,2"]):
            rc, _, err = run_cli("bench", "--url", srv.url, "--target", tmp_path, "--prompts",
                                 tmp_path / "p.jsonl", "--out", tmp_path / "out", *steps)
            assert rc == 1 and "a server at K=0" in err and "--steps 0" in err, err
            if "--concurrency" not in steps:
                assert "--steps auto --concurrency" in err, err
    rc, out, _ = run_cli("bench", "--help")
    assert rc == 0 and "always one at K=0" in " ".join(out.split())


def test_memory_stays_flat_over_sequential_requests_after_a_warm_one(world):
    """The first request grows the process once (the target's KV cache for every --max-batch
    row); later requests of the same size reuse that memory: 40 more add less than what 5 of
    those caches would take (a cache kept per request would add 40)."""
    from fastmtp_sglang.decode.engine import ReferenceEngine

    t, _ = world
    prompt = [(7 * i) % 90 + 1 for i in range(120)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    cfg = t.config
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * \
        (cfg["hidden_size"] // cfg["num_attention_heads"]) * 4  # fp32
    cache = 8 * (len(prompt) + 256) * per_token  # --max-batch 8 rows of prompt + SLACK slots
    with serve(ReferenceEngine(t, None, 0, max_context=256), max_batch=8) as srv:
        client.generate(srv.url, input_ids=prompt, sampling_params=params)  # the warm one
        before = srv.server_info()["rss_bytes"]
        for _ in range(40):
            out = client.generate(srv.url, input_ids=prompt, sampling_params=params)
            assert out["meta_info"]["completion_tokens"] == 8
        grown = srv.server_info()["rss_bytes"] - before
    assert grown < max(5 * cache, 8 << 20), (grown, cache)
