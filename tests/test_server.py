"""`fastmtp serve --engine reference` as a real process on loopback, plus its parts in-process.

The server under test is ``fastmtp serve --engine reference`` started once per module on
127.0.0.1 (``--port 0``; the URL is read from its log), over a tiny random Llama target with a
real BPE tokenizer that adds a BOS, and a random FastMTP draft at K=3. Greedy output is
checked against a hand-written greedy loop over the transformers model (fp32, so batched and
sequential runs must agree token for token).

No test races the clock (docs/STYLE.md, habit 13): where a request must still be running, or
several must be waiting together, the engine is held by a gate (``Gate`` in-process, a gated
prefill in the server process) that the test opens once what it needs has happened; timeouts
on waits are hang guards (``HANG_S``), not part of what is tested. Each test passes alone and
in any order (none reads what an earlier test left in the module's server).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import HANG_S, gated_prefill, reference_server_process
from fastmtp_sglang.serving import client
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.serving.options import ServerOptions
from fastmtp_sglang.serving.protocol import BadRequest, parse_generate

STEPS = 3
MAX_CONTEXT = 64
N_NEW = 16
GREEDY = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "Python is a programming language",
           "Hello", "A list is a sequence of values"]
STARTUP_S = 90  # imports + model load of the server process (about 5 s on 2 cores)
GATE = [9, 9, 9, 9]  # the module server's prefill of a prompt starting with these waits (gated_prefill)


# --------------------------------------------------------------------------------------------
# fixtures: tokenizer, target, draft, the server process
# --------------------------------------------------------------------------------------------

def _tokenizer():
    """A 300-entry byte-level BPE trained on Python's own docs, with <s> prepended by default
    (so raw text gets a BOS the way SGLang's tokenizer call gives it one)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([topics[k] for k in sorted(topics)][:30], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(target dir, draft dir, tokenizer, transformers model) on disk in a temp directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastmtp_sglang.core.draft_dir import make_draft_config, save_draft_dir
    from fastmtp_sglang.core.head import FastMTPHead, HeadConfig

    root = tmp_path_factory.mktemp("serve")
    tok = _tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, initializer_range=0.1,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    target = root / "target"
    model.save_pretrained(str(target))
    tok.save_pretrained(str(target))
    tcfg = json.loads((target / "config.json").read_text())
    dcfg = make_draft_config(tcfg, "deepseek", dtype="float32")
    torch.manual_seed(1)
    head = FastMTPHead(HeadConfig.from_dict(dcfg))
    draft = save_draft_dir(root / "draft", dcfg, head.state_dict())
    return target, draft, tok, model


def greedy_oracle(model, ids: list[int], n: int = N_NEW) -> list[int]:
    """Plain greedy decoding, no cache, one token at a time (ignoring EOS)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(x).logits[0, -1].argmax()
            x = torch.cat([x, nxt.view(1, 1)], dim=1)
    return x[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def gate_flag(tmp_path_factory):
    """The file whose creation lets the module server's GATE prefill go on."""
    return tmp_path_factory.mktemp("serve_gate") / "open"


@pytest.fixture(scope="module")
def server(world, gate_flag, tmp_path_factory):
    """The URL of a `fastmtp serve --engine reference` subprocess (its prefill of a GATE prompt
    held until ``gate_flag`` exists); stopped at teardown."""
    target, draft, _, _ = world
    log_path = tmp_path_factory.mktemp("serve_log") / "server.log"
    args = ["--target", str(target), "--draft", str(draft), "--steps", str(STEPS),
            "--max-context", str(MAX_CONTEXT), "--max-batch", "8", "--batch-window-ms", "100"]
    with reference_server_process(args, log_path, STARTUP_S,
                                  prelude=gated_prefill(GATE, gate_flag)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def local_target(world):
    """The target loaded in this process, as the server loads it."""
    from fastmtp_sglang.core.target import load_target

    return load_target(world[0], "float32")


def post_raw(url: str, body: bytes, path: str = "/generate") -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


# --------------------------------------------------------------------------------------------
# the server process
# --------------------------------------------------------------------------------------------

def test_health_and_info(server):
    with urllib.request.urlopen(server + "/health", timeout=10) as resp:
        assert resp.status == 200 and resp.read() == b"OK"
    with urllib.request.urlopen(server + "/health_generate", timeout=60) as resp:
        assert resp.status == 200
    info = client.model_info(server)
    assert info["is_generation"] and info["steps"] == STEPS and info["draft_model_path"]
    si = client.server_info(server)
    assert si["speculative_num_steps"] == STEPS and si["max_batch"] == 8
    assert si["context_length"] == MAX_CONTEXT


def test_generate_text_matches_greedy_target(server, world):
    _, _, tok, model = world
    text = PROMPTS[0]
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id  # the server must tokenize the same way: BOS included
    out = client.generate(server, text=text, sampling_params=GREEDY, rid="r-text")
    meta = out["meta_info"]
    assert out["output_ids"] == greedy_oracle(model, ids)
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    assert meta["id"] == "r-text"
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == N_NEW
    assert meta["finish_reason"] == {"type": "length", "length": N_NEW}
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == pytest.approx(N_NEW / meta["spec_verify_ct"])
    # every token after the prefill's came from a cycle of at most STEPS + 1 (the last one
    # possibly cut at max_new_tokens): tau * cycles is the emitted count, within STEPS of it
    emitted = meta["tau"] * meta["spec_verify_ct"]
    assert N_NEW - 1 <= emitted + 1e-9 and emitted <= N_NEW - 1 + STEPS + 1e-9
    assert len(meta["A_k"]) == STEPS and sum(meta["accept_hist"]) == meta["spec_verify_ct"]
    assert meta["tau"] == pytest.approx(1 + sum(meta["A_k"]))
    assert meta["e2e_latency"] > 0


def test_generate_input_ids_matches_in_process_engine(server, world, local_target):
    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.decode.engine import ReferenceEngine, Request
    from fastmtp_sglang.decode.sampling import SamplingParams

    _, draft_dir, tok, _ = world
    target = local_target
    head = load_head(draft_dir, target.embed, target.lm_head)
    engine = ReferenceEngine(target, head, STEPS, MAX_CONTEXT)
    ids = tok(PROMPTS[1], add_special_tokens=False)["input_ids"]  # no BOS: ids go in as given
    [ref] = engine.generate([Request(ids, SamplingParams.from_dict(GREEDY))])
    out = client.generate(server, input_ids=ids, sampling_params=GREEDY)
    assert out["output_ids"] == ref.output_ids
    assert out["text"] == ref.text
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["meta_info"]["spec_verify_ct"] == ref.metrics.verify_ct
    s = ref.metrics.summary()  # served acceptance == the engine's, cycle for cycle (fp32)
    assert out["meta_info"]["accept_hist"] == s["accept_hist"] and out["meta_info"]["tau"] == s["tau"]


def test_concurrent_generates_are_batched_and_correct(server, world, gate_flag):
    """Requests waiting together join one engine batch, and each gets its own greedy answer:
    they are sent while a GATE request is held in its prefill (so all of them are queued, whatever
    the machine's speed), then the gate opens and they join its batch at once."""
    _, _, tok, model = world
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    expected = [greedy_oracle(model, ids) for ids in prompts]
    before = client.server_info(server)
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        gate = pool.submit(client.generate, server, input_ids=GATE + [5], sampling_params=GREEDY)
        try:
            wait_until(lambda: (i := client.server_info(server))["queued"] == 0
                       and i["requests_in_flight"] == before["requests_in_flight"] + 1)  # in its prefill
            futures = [pool.submit(client.generate, server, input_ids=ids, sampling_params=GREEDY)
                       for ids in prompts]
            wait_until(lambda: client.server_info(server)["queued"] == len(prompts))
        finally:
            gate_flag.touch()
        outs = [f.result() for f in futures]
        assert gate.result()["meta_info"]["completion_tokens"] == N_NEW
    assert [o["output_ids"] for o in outs] == expected
    assert len({o["meta_info"]["id"] for o in outs}) == len(prompts)
    # all four joined the gate's batch in one go (no test of this module runs batches as large)
    assert client.server_info(server)["largest_batch"] >= len(prompts) + 1


def test_streaming_matches_non_streaming(server):
    plain = client.generate(server, text=PROMPTS[2], sampling_params=GREEDY)
    chunks = list(client.stream_generate(server, text=PROMPTS[2], sampling_params=GREEDY))
    assert len(chunks) >= 2
    final = chunks[-1]
    assert final["text"] == plain["text"]
    assert final["output_ids"] == plain["output_ids"]
    assert final["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for a, b in zip(chunks, chunks[1:]):  # cumulative, as SGLang streams by default
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    via = client.generate(server, text=PROMPTS[2], sampling_params=GREEDY, stream=True)
    assert via["output_ids"] == plain["output_ids"] and via["text"] == plain["text"]


def test_stream_wire_format(server):
    body = json.dumps({"text": "Hi", "stream": True,
                       "sampling_params": {"temperature": 0, "max_new_tokens": 4}}).encode()
    req = urllib.request.Request(server + "/generate", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_default_temperature_is_sglangs(server):
    """No temperature means SGLang's 1.0, not greedy: equal to an explicit 1.0 with one seed."""
    base = {"max_new_tokens": N_NEW, "ignore_eos": True, "sampling_seed": 7}
    implicit = client.generate(server, input_ids=[5, 6, 7], sampling_params=base)
    explicit = client.generate(server, input_ids=[5, 6, 7],
                               sampling_params={**base, "temperature": 1.0})
    greedy = client.generate(server, input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert implicit["output_ids"] == explicit["output_ids"]
    assert implicit["output_ids"] != greedy["output_ids"]


TOO_LONG = list(range(3, 3 + MAX_CONTEXT + 6))
BAD = [
    ("malformed json", b'{"text": "hi", ', "not valid JSON"),
    ("not an object", b'["hi"]', "JSON object"),
    ("no prompt", b'{"sampling_params": {}}', "exactly one of"),
    ("both prompts", b'{"text": "hi", "input_ids": [1]}', "got both"),
    ("batch of texts", b'{"text": ["a", "b"]}', "one prompt per request"),
    ("unknown sampling key", b'{"text": "hi", "sampling_params": {"temprature": 0.5}}', "temprature"),
    ("negative max_new_tokens", b'{"text": "hi", "sampling_params": {"max_new_tokens": -1}}',
     "max_new_tokens"),
    ("bad stream", b'{"text": "hi", "stream": "yes"}', "stream"),
    ("unsupported feature", b'{"text": "hi", "return_logprob": true}', "return_logprob"),
    ("token out of vocabulary", b'{"input_ids": [1, 99999]}', "input_ids must lie in"),
    ("empty prompt", b'{"input_ids": []}', "empty"),
    ("too long", json.dumps({"input_ids": TOO_LONG}).encode(), "context"),
    ("too long, streamed", json.dumps({"input_ids": TOO_LONG, "stream": True}).encode(), "context"),
    # values the engine's float32 / int64 tensors cannot hold (they used to fail the whole batch)
    ("top_k over int64", b'{"text": "hi", "sampling_params": {"top_k": 100000000000000000000}}',
     "int64"),
    ("temperature over float32", b'{"text": "hi", "sampling_params": {"temperature": 1e308}}',
     "float32"),
    ("top_p under float32", b'{"text": "hi", "sampling_params": {"top_p": 1e-300}}', "float32"),
    ("lone surrogate", b'{"text": "ab\\ud800cd"}', "lone surrogate (U+D800) at character 2"),
    ("nested 100k deep", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("a 5000-digit token id", b'{"input_ids": [1' + b"0" * 5000 + b"]}", "4300 digits"),
    ("lone low surrogate", b'{"text": "\\udc00", "rid": "\\ud800"}', "U+DC00"),
]


@pytest.mark.parametrize("body,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_400_and_server_keeps_serving(server, body, needle):
    status, obj = post_raw(server, body)
    assert status == 400
    assert needle in obj["error"]["message"]


@pytest.mark.parametrize("method", ["PUT", "DELETE", "HEAD", "GET", "PATCH"])
def test_wrong_method_is_json_405(server, method):
    req = urllib.request.Request(server + "/generate", data=b"{}" if method != "GET" else None,
                                 method=method)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    with err.value as resp:
        assert resp.code == 405 and resp.headers["Allow"] == "POST"
        body = resp.read()
    if method != "HEAD":  # HEAD replies have no body
        assert resp.headers["Content-Type"] == "application/json"
        assert "use POST" in json.loads(body)["error"]["message"]
    req = urllib.request.Request(server + "/health", method="HEAD")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_errors_then_still_serving(server):
    status, obj = post_raw(server, b"{}", path="/nowhere")
    assert status == 404 and "no route" in obj["error"]["message"]
    with pytest.raises(client.ServerError) as err:
        client.generate(server, text="hi", sampling_params={"top_p": 2})
    assert err.value.status == 400 and "top_p" in err.value.message
    # SGLang fields at their defaults are accepted and ignored
    status, obj = post_raw(server, json.dumps({"text": "hi", "return_logprob": False,
                                               "sampling_params": GREEDY}).encode())
    assert status == 200 and obj["meta_info"]["completion_tokens"] == N_NEW
    with urllib.request.urlopen(server + "/health", timeout=10) as resp:
        assert resp.status == 200
    assert client.generate(server, text="hi", sampling_params=GREEDY)["output_ids"]


def test_server_info_reports_acceptance(server):
    before = client.server_info(server)
    assert post_raw(server, b'{"text": ')[0] == 400  # a refused request counts as failed
    client.generate(server, text=PROMPTS[3], sampling_params=GREEDY)
    # the worker counts a request before its answer leaves: /server_info never lags an answer
    info = client.server_info(server)
    assert info["requests_served"] == before["requests_served"] + 1
    assert info["spec_verify_ct"] > before["spec_verify_ct"]
    assert 1.0 <= info["avg_spec_accept_length"] <= STEPS + 1
    assert client.avg_spec_accept_length(info) == info["avg_spec_accept_length"]
    assert info["internal_states"][0]["avg_spec_accept_length"] == info["avg_spec_accept_length"]
    assert info["requests_failed"] == before["requests_failed"] + 1


# --------------------------------------------------------------------------------------------
# in-process: parsing, engine failures, CLI errors
# --------------------------------------------------------------------------------------------

def test_parse_generate_defaults():
    g = parse_generate(b'{"text": "hi"}')
    assert g.text == "hi" and g.input_ids is None and not g.stream and g.rid
    assert g.params.temperature == 1.0 and g.params.max_new_tokens == 128
    g = parse_generate(b'{"input_ids": [1, 2], "sampling_params": {"temperature": null}, "rid": "x"}')
    assert g.params.temperature == 1.0 and g.rid == "x"
    with pytest.raises(BadRequest, match="sampling_params"):
        parse_generate(b'{"text": "hi", "sampling_params": [1]}')
    with pytest.raises(BadRequest, match="input_ids"):
        parse_generate(b'{"input_ids": [[1, 2]]}')
    # SGLang's other fields: logging / scheduling ones ignored, output-changing ones at defaults only
    parse_generate(b'{"text": "hi", "log_metrics": true, "logprob_start_len": -1, "lora_path": null}')
    with pytest.raises(BadRequest, match="lora_path"):
        parse_generate(b'{"text": "hi", "lora_path": "adapter"}')
    with pytest.raises(BadRequest, match="frobnicate"):
        parse_generate(b'{"text": "hi", "frobnicate": 1}')


def test_engine_failure_fails_the_batch_with_500_then_recovers(world, local_target):
    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.serving.app import ReferenceServer

    engine = ReferenceEngine(local_target, None, 0, MAX_CONTEXT)
    real = engine.start
    calls = []

    def flaky(reqs, keys, on_tokens=None):  # fails in the batch, and again when run alone
        calls.append(len(reqs))
        if len(calls) <= 2:
            raise RuntimeError("boom")
        return real(reqs, keys, on_tokens)

    engine.start = flaky
    with ReferenceServer(engine, ServerOptions(port=0), model_path=str(world[0])) as srv:
        with pytest.raises(client.ServerError) as err:
            client.generate(srv.url, input_ids=[5, 6], sampling_params=GREEDY)
        assert err.value.status == 500 and "boom" in err.value.message
        out = client.generate(srv.url, input_ids=[5, 6], sampling_params=GREEDY)
        assert out["output_ids"] == greedy_oracle(world[3], [5, 6])
        assert out["meta_info"]["spec_verify_ct"] == N_NEW - 1  # K=0: one verify per decode token
        # (a hang guard: the worker counts a request, and drops it from in-flight, before its
        # answer leaves, so this holds at once)
        wait_until(lambda: srv.server_info()["requests_served"] == 1)
        info = srv.server_info()
        assert info["requests_failed"] == 1 and info["requests_served"] == 1
        assert info["speculative_algorithm"] is None


def test_client_reports_unreachable_server():
    with pytest.raises(FastMTPError, match="cannot reach"):
        client.generate("http://127.0.0.1:9", text="hi", timeout=5)
    with pytest.raises(FastMTPError, match="not healthy"):
        client.wait_for_health("http://127.0.0.1:9", timeout=0.3, interval=0.1)


def test_cli_refuses_steps_without_draft(world, run_cli):
    rc, _, err = run_cli("serve", "--engine", "reference", "--target", world[0], "--steps", "2")
    assert rc == 1 and "needs --draft" in err


def test_serve_without_a_draft_serves_plain_decoding_and_says_so(world, tmp_path):
    """`fastmtp serve --target T`: no --draft, no --steps: plain decoding (K=0) in one line, the
    engine loop on the process's main thread, SIGTERM still a clean exit 0."""
    from conftest import reference_server_process

    _, _, tok, model = world
    ids = tok(PROMPTS[0])["input_ids"]
    log = tmp_path / "serve.log"
    with reference_server_process(["--target", str(world[0]), "--max-context", str(MAX_CONTEXT)],
                                  log) as (url, proc):
        out = client.generate(url, input_ids=ids, sampling_params=GREEDY)
        assert out["output_ids"] == greedy_oracle(model, ids)
        assert client.server_info(url)["speculative_algorithm"] is None
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert "no --draft: plain decoding (K=0)" in text and "Traceback" not in text


@pytest.mark.slow
def test_serve_without_a_draft_picks_the_shipped_head_for_the_demo_target(capsys):
    """The demo target without --draft gets the head shipped for it, at K=3."""
    import argparse

    from fastmtp_sglang.cli.demo import shipped_head
    from fastmtp_sglang.cli.serve import default_draft
    from fastmtp_sglang.core.demo_target import materialize_smollm2

    if shipped_head() is None:
        pytest.skip("no head ships with this checkout")
    args = argparse.Namespace(target=str(materialize_smollm2()), draft=None, steps=None)
    default_draft(args)
    assert args.draft == str(shipped_head()) and args.steps == 3
    assert "serving the head shipped for this target" in capsys.readouterr().out


def test_cli_refuses_a_draft_that_does_not_fit(world, llama_target, run_cli):
    rc, _, err = run_cli("serve", "--engine", "reference", "--target", llama_target.path,
                         "--draft", world[1], "--steps", "1")
    assert rc == 1 and "does not fit" in err


def test_cli_refuses_sglang_args_for_reference(world, run_cli):
    rc, _, err = run_cli("serve", "--engine", "reference", "--target", world[0], "--steps", "0",
                         "--", "--tp", "2")
    assert rc == 1 and "no SGLang arguments" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choice")
def test_auto_engine_is_reference_without_cuda():
    from fastmtp_sglang.cli.serve import pick_engine

    engine, why = pick_engine("auto")
    assert engine == "reference" and "CUDA" in why


def test_cli_sglang_engine_runs_the_launch_command(world, run_cli, monkeypatch):
    """--engine sglang builds SGLang's command (flags after `--` passed through) and runs it."""
    from fastmtp_sglang.cli import serve
    from fastmtp_sglang.serving import launch

    launched = {}

    class FakePopen:
        def __init__(self, cmd, env):
            launched.update(cmd=cmd, env=env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(serve, "cuda_available", lambda: True)
    monkeypatch.setattr(serve, "check_sglang_can_run", lambda: None)
    rc, out, err = run_cli("serve", "--engine", "sglang", "--target", world[0], "--draft", world[1],
                           "--steps", "3", "--port", "31234", "--", "--mem-fraction-static", "0.5")
    assert rc == 0, err
    cmd = launched["cmd"]
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[-2:] == ["--mem-fraction-static", "0.5"]
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "4"
    assert launched["env"]["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "fastmtp_sglang.models"
    assert "sglang.launch_server" in out and "31234" in out


def test_cli_reference_refuses_a_missing_vocab_table(world, run_cli, tmp_path):
    rc, _, err = run_cli("serve", "--engine", "reference", "--target", world[0], "--draft",
                         world[1], "--steps", "2", "--vocab", str(tmp_path / "nope.pt"))
    assert rc == 1 and "nope.pt" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_sglang_engine_without_cuda_is_one_line(world, run_cli, monkeypatch):
    """No CUDA: one line that says so and points at --engine reference; nothing starts."""
    import subprocess
    import sys

    from fastmtp_sglang.serving import launch

    def no_popen(*args, **kwargs):
        raise AssertionError("nothing may be started without CUDA")

    monkeypatch.setattr(launch.subprocess, "Popen", no_popen)
    rc, out, err = run_cli("serve", "--engine", "sglang", "--target", world[0], "--draft",
                           world[1], "--steps", "3")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "CUDA" in err and "--engine reference" in err
    monkeypatch.undo()  # (launch.subprocess is the subprocess module itself)
    # the real console: exit 1, one line on stderr, no traceback
    proc = subprocess.run([sys.executable, "-m", "fastmtp_sglang", "serve", "--engine", "sglang",
                           "--target", str(world[0]), "--draft", str(world[1])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc
    lines = [ln for ln in proc.stderr.splitlines() if "Warning" not in ln and ln.strip()]
    assert len(lines) == 1 and "--engine reference" in lines[0], proc.stderr


# --------------------------------------------------------------------------------------------
# in-process servers: isolation, cancellation, back-pressure, limits
# --------------------------------------------------------------------------------------------

POISON = [7, 7, 7, 7]  # a prompt starting with these makes the faulty engine below raise


class Gate:
    """Holds an engine's target forwards after the first ``free`` until the test lets them pass:
    ``allow(n)`` lets n more through, ``open()`` (or leaving a ``with gate:`` block) all of them
    from then on; ``wait_held()`` returns once a forward waits at the gate. The test decides how
    far the engine gets while it checks something, instead of racing it with sleeps. (A forward
    still passes after HANG_S, so a failing test ends instead of hanging.)"""

    def __init__(self, free: int = 1):
        self.free, self.passed, self.held, self.permits, self.opened = free, 0, 0, 0, False
        self._cond = threading.Condition()

    def __call__(self) -> None:  # in the engine's forward, on the engine's thread
        with self._cond:
            if self.passed >= self.free and not self.opened:
                self.held += 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: self.opened or self.permits > 0, HANG_S)
                self.held -= 1
                if not self.opened and self.permits > 0:
                    self.permits -= 1
            self.passed += 1

    def allow(self, n: int = 1) -> None:
        with self._cond:
            self.permits += n
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self.opened = True
            self._cond.notify_all()

    def wait_held(self) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.held > 0, HANG_S), "the engine never reached the gate"

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc) -> None:
        self.open()


def faulty_engine(target, fail_after: int | None = None, gate: Gate | None = None):
    """A K=0 ReferenceEngine whose target forward passes ``gate`` first (when given), and which
    raises on any batch holding a POISON prompt: at its prefill, or (``fail_after``) once that
    many tokens were emitted in cycles of batches holding it, when the other rows have already
    streamed."""
    from fastmtp_sglang.decode.engine import ReferenceEngine

    class Faulty(ReferenceEngine):
        def _target(self, *args, **kwargs):
            if gate is not None:
                gate()
            return super()._target(*args, **kwargs)

        def _prefill(self, requests, keys, on_tokens, *room):
            if fail_after is None and any(list(r.input_ids[:4]) == POISON for r in requests):
                raise RuntimeError("poisoned")
            return super()._prefill(requests, keys, on_tokens, *room)

        def step(self, b, on_tokens=None):
            if fail_after is None or not any(list(r.req.input_ids[:4]) == POISON for r in b.rows):
                return super().step(b, on_tokens)

            def counting(key, ids):
                on_tokens(key, ids)
                calls.append(key)
                if len(calls) >= fail_after:
                    raise RuntimeError("poisoned mid-generation")

            return super().step(b, counting)

    calls: list = []
    return Faulty(target, None, 0, MAX_CONTEXT)


def wait_until(cond, timeout: float = HANG_S) -> None:
    """Poll ``cond()`` until it holds (an event the test waits for; ``timeout`` is a hang guard)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_poisoned_request_fails_alone(world, local_target):
    """The engine raises mid-generation on a batch of 5: the poisoned request gets 500, the
    other four (two of them streams that had already sent tokens) get their exact answers."""
    from fastmtp_sglang.serving.app import ReferenceServer

    _, _, tok, model = world
    goods = [tok(p)["input_ids"] for p in PROMPTS]
    want = [greedy_oracle(model, ids) for ids in goods]
    engine = faulty_engine(local_target, fail_after=7)
    # the batch runs once all 5 are in: the window waits for max_batch requests, and it is
    # longer than any run of this test (a hang guard only)
    with ReferenceServer(engine, ServerOptions(port=0, max_batch=5, batch_window_s=HANG_S)) as srv:
        def stream(ids):
            return list(client.stream_generate(srv.url, input_ids=ids, sampling_params=GREEDY))

        with ThreadPoolExecutor(5) as pool:
            plain = [pool.submit(client.generate, srv.url, input_ids=ids, sampling_params=GREEDY)
                     for ids in goods[:2]]
            streams = [pool.submit(stream, ids) for ids in goods[2:]]
            poisoned = pool.submit(client.generate, srv.url, input_ids=POISON + [5],
                                   sampling_params=GREEDY)
            with pytest.raises(client.ServerError) as err:
                poisoned.result()
            assert err.value.status == 500 and "poisoned mid-generation" in err.value.message
            assert [f.result()["output_ids"] for f in plain] == want[:2]
            for fut, expected in zip(streams, want[2:]):
                chunks = fut.result()
                assert chunks[-1]["output_ids"] == expected
                for a, b in zip(chunks, chunks[1:]):  # never re-sent, never taken back
                    assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
                    assert len(b["output_ids"]) >= len(a["output_ids"])
        # (a hang guard: the worker counts a request, and drops it from in-flight, before its
        # answer leaves, so this holds at once)
        wait_until(lambda: (i := srv.server_info())["requests_served"] + i["requests_failed"] >= 5)
        info = srv.server_info()
        assert info["largest_batch"] == 5 and info["batches_retried"] >= 1
        assert info["requests_failed"] == 1 and info["requests_served"] == 4
        assert info["requests_in_flight"] == 0 and info["admitted"] == 0


def test_a_stream_rerun_after_a_fault_resumes_from_what_it_sent(world, local_target):
    """The engine fails mid-generation on a batch holding a stream that has already sent
    tokens: the stream's re-run starts from its prompt plus the tokens it sent (so a re-run
    that would decode differently, as bf16 may, cannot contradict them), its events only ever
    grow, and its answer is the whole output."""
    from fastmtp_sglang.serving.app import ReferenceServer

    _, _, tok, model = world
    ids = tok(PROMPTS[1])["input_ids"]
    want = greedy_oracle(model, ids)
    engine = faulty_engine(local_target, fail_after=6)
    prefills = []
    real = engine._prefill

    def recording(requests, keys, on_tokens, *room):
        prefills.append([list(r.input_ids) for r in requests])
        return real(requests, keys, on_tokens, *room)

    engine._prefill = recording
    # both in one batch: the window waits for max_batch requests (HANG_S is a hang guard)
    with ReferenceServer(engine, ServerOptions(port=0, max_batch=2, batch_window_s=HANG_S)) as srv:
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(lambda: list(client.stream_generate(
                srv.url, input_ids=ids, sampling_params=GREEDY)))
            poisoned = pool.submit(client.generate, srv.url, input_ids=POISON + [5],
                                   sampling_params=GREEDY)
            with pytest.raises(client.ServerError):
                poisoned.result()
            chunks = stream.result()
    assert chunks[-1]["output_ids"] == want
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    resumed = [p for run in prefills[1:] for p in run if p[: len(ids)] == ids]
    assert resumed and len(resumed[0]) > len(ids), prefills  # it resumed after what it had sent
    assert resumed[0] == ids + want[: len(resumed[0]) - len(ids)]


def _stream_then_leave(url: str, body: dict, n_events: int, on_event=None) -> int:
    """Read ``n_events`` events of a stream, then close the connection; ``on_event(n)`` runs
    after the n-th event is read, for each but the last. Returns the events read."""
    import http.client
    import socket

    host, port = url.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_S)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    seen = 0
    for line in resp:
        if not line.startswith(b"data:"):
            continue
        seen += 1
        if seen >= n_events:
            break
        if on_event is not None:
            on_event(seen)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return seen


def test_client_disconnect_aborts_generation(world, local_target):
    """A stream that leaves after 2 events, and a plain request that leaves while it waits,
    stop generating (the engine would otherwise make 60 tokens for each). The engine is held at
    a gate before each cycle: the stream's second token is allowed once the client has read its
    first, and nothing more until the server has aborted the request (the HTTP side notices the
    disconnect without the engine); then the cycle it was held in may finish, and no other."""
    import socket

    from fastmtp_sglang.serving.app import ReferenceServer

    long = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    gate = Gate(free=1)  # the prefill's forward passes, every cycle's waits
    with ReferenceServer(faulty_engine(local_target, gate=gate),
                         ServerOptions(port=0, max_batch=4)) as srv, gate:
        assert _stream_then_leave(srv.url, {"input_ids": [5, 6, 7], "stream": True, "sampling_params": long},
                                  2, on_event=lambda n: gate.allow()) == 2
        wait_until(lambda: srv.server_info()["requests_aborted"] == 1)
    info = srv.server_info()  # (the server has stopped: its engine makes no more tokens)
    # the two the client read, and the one of the cycle that was held when the abort came
    assert info["requests_aborted"] == 1 and info["generated_tokens"] <= 3, info
    assert info["requests_in_flight"] == 0 and info["requests_served"] == 0

    gate = Gate(free=1)
    with ReferenceServer(faulty_engine(local_target, gate=gate),
                         ServerOptions(port=0, max_batch=4)) as srv, gate:
        host, port = srv.url.rsplit("/", 1)[1].split(":")
        body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": long}).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
            gate.wait_held()  # its prefill made a token, its first cycle waits
        wait_until(lambda: srv.server_info()["requests_aborted"] == 1)
    after = srv.server_info()
    assert after["requests_aborted"] == 1 and after["requests_served"] == 0
    assert after["generated_tokens"] <= 2, after  # the prefill's token and the held cycle's


def test_abort_request_like_sglang(world, local_target):
    """/abort_request of one rid (a stream that has sent its first token) and of all (two plain
    requests waiting behind it), as SGLang answers them. The engine is held before the stream's
    first cycle until the end, so what each request had when it was aborted is known exactly."""
    from fastmtp_sglang.serving.app import ReferenceServer

    long = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    gate = Gate(free=1)  # the stream's prefill passes; its first cycle waits
    engine = faulty_engine(local_target, gate=gate)
    first_chunk = threading.Event()

    def stream():
        chunks = []
        for chunk in client.stream_generate(srv.url, input_ids=[5, 6, 7], sampling_params=long,
                                            rid="s1"):
            chunks.append(chunk)
            first_chunk.set()
        return chunks

    with ReferenceServer(engine, ServerOptions(port=0, max_batch=4)) as srv, gate:
        with ThreadPoolExecutor(3) as pool:
            s1 = pool.submit(stream)
            assert first_chunk.wait(HANG_S)
            n1 = pool.submit(client.generate, srv.url, input_ids=[8, 9], sampling_params=long,
                             rid="n1")
            wait_until(lambda: srv.server_info()["requests_in_flight"] == 2)
            client.abort_request(srv.url, "s1")
            client.abort_request(srv.url, "no-such-rid")  # SGLang: not an error
            chunks = s1.result()
            fr = chunks[-1]["meta_info"]["finish_reason"]
            assert fr["type"] == "abort" and "abort_request" in fr["message"]
            assert len(chunks[-1]["output_ids"]) == 1  # what it had sent: its prefill's token
            n3 = pool.submit(client.generate, srv.url, input_ids=[10, 11], sampling_params=long)
            wait_until(lambda: srv.server_info()["requests_in_flight"] == 2)
            client.abort_request(srv.url, abort_all=True)
            for fut in (n1, n3):  # non-streaming: 200 with what it had (here nothing), as SGLang
                out = fut.result()
                assert out["meta_info"]["finish_reason"]["type"] == "abort"
                assert out["output_ids"] == []
        status, obj = post_raw(srv.url, b'{"rid": 5}', path="/abort_request")
        assert status == 400 and "'rid'" in obj["error"]["message"]
        status, obj = post_raw(srv.url, b"{}", path="/abort_request")
        assert status == 400 and "abort_all" in obj["error"]["message"]
        assert srv.server_info()["requests_aborted"] == 3


def test_full_queue_is_503_with_retry_after(world, local_target):
    """One request runs (held at a gate before its first cycle), two may wait (--max-queue 2),
    the other seven of a burst get 503 with Retry-After; once the gate opens the three are
    answered alike, and the server takes requests again."""
    from fastmtp_sglang.serving.app import ReferenceServer

    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    gate = Gate(free=1)
    engine = faulty_engine(local_target, gate=gate)
    with ReferenceServer(engine, ServerOptions(port=0, max_batch=1, max_queue=2)) as srv, gate:
        def one(i):
            try:
                return client.generate(srv.url, input_ids=[5, 6, 7], sampling_params=params)
            except client.ServerError as exc:
                return exc

        with ThreadPoolExecutor(10) as pool:
            first = pool.submit(one, 0)
            gate.wait_held()  # running: its queue place is free again
            rest = [pool.submit(one, i) for i in range(1, 10)]
            wait_until(lambda: (i := srv.server_info())["requests_busy"] == 7 and i["queued"] == 2)
            gate.open()
            outs = [first.result()] + [f.result() for f in rest]
        busy = [o for o in outs if isinstance(o, client.ServerError)]
        done = [o for o in outs if not isinstance(o, client.ServerError)]
        assert len(busy) == 7 and len(done) == 3, outs
        assert all(e.status == 503 and e.retry_after >= 1 and "--max-queue 2" in e.message
                   for e in busy)
        assert len({tuple(o["output_ids"]) for o in done}) == 1  # all answered, all the same
        assert srv.server_info()["requests_busy"] == len(busy)
        assert client.generate(srv.url, input_ids=[5, 6, 7], sampling_params=params)  # recovered


def test_body_limits_timeouts_and_tokenizer_thread(world, local_target):
    """413 before the body is read, a cheap length check before tokenizing, tokenizing on its
    own thread, 408 for a body that stalls, and a connection closed when headers stall."""
    import socket
    import threading

    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.serving.app import ReferenceServer

    calls = []

    class SpyTokenizer:
        def __init__(self, tok):
            self.tok = tok

        def __call__(self, text, **kwargs):
            calls.append((threading.current_thread().name, len(text)))
            return self.tok(text, **kwargs)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    engine = ReferenceEngine(local_target, None, 0, MAX_CONTEXT)
    # (a read timeout that no request here may meet, whatever the machine's load; the one of
    # 1 s is tested on a server of its own below)
    with ReferenceServer(engine, ServerOptions(port=0, max_body_bytes=1 << 20,
                                                  read_timeout_s=HANG_S)) as srv:
        srv.worker.tokenizer = SpyTokenizer(srv.worker.tokenizer)
        host, port = srv.url.rsplit("/", 1)[1].split(":")
        # a 2 MB body from a client that sends it all before reading: 413, not a reset
        status, obj = post_raw(srv.url, json.dumps({"text": "x" * (2 << 20)}).encode())
        assert status == 413 and "at most 1048576" in obj["error"]["message"]
        # 50 MB announced with Expect: 100-continue: refused before a byte of it is sent (a server
        # that waited for the body would answer 408 after the read timeout, not 413)
        with socket.create_connection((host, int(port)), timeout=HANG_S) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                      b"Content-Length: 52428800\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 413 ")
        # 900 KB of text cannot fit 64 tokens: refused from its length, never tokenized
        status, obj = post_raw(srv.url, json.dumps({"text": "abc " * 230_000}).encode())
        assert status == 400 and "characters" in obj["error"]["message"] and not calls
        out = client.generate(srv.url, text="Hello", sampling_params=GREEDY)
        assert out["meta_info"]["completion_tokens"] == N_NEW
        assert calls == [("fastmtp-tokenize_0", 5)]
        assert srv.server_info()["admitted"] == 0

    with ReferenceServer(engine, ServerOptions(port=0, read_timeout_s=1.0)) as srv:
        host, port = srv.url.rsplit("/", 1)[1].split(":")
        # a body that stops half-way: 408 after the read timeout (the sockets' HANG_S timeouts
        # are hang guards; the replies say which timeout fired)
        t0 = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=HANG_S) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"te")
            reply = b""
            while chunk := s.recv(1000):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in reply
        # headers that never end: the connection is closed after the read timeout
        with socket.create_connection((host, int(port)), timeout=HANG_S) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            assert s.recv(1000) == b""
        assert time.monotonic() - t0 > 1.5  # two timeouts of 1 s, neither fired early
        assert client.generate(srv.url, input_ids=[5, 6], sampling_params=GREEDY)["output_ids"]
        assert srv.server_info()["admitted"] == 0


def test_in_process_shutdown_answers_streams_in_flight(world, local_target):
    """shutdown() with a stream in flight and shutdown_timeout_s 0.3: the stream ends with an
    abort event and [DONE]; a request waiting behind it gets 503 + Retry-After. The stream is
    held at a gate after its second token, so it cannot finish on its own: only the drain's
    timeout can end it; the gate opens once both answers are in, and the worker then stops."""
    from fastmtp_sglang.serving.app import ReferenceServer

    long = {"temperature": 0, "max_new_tokens": 50, "ignore_eos": True}
    gate = Gate(free=2)  # the prefill and the first cycle pass
    engine = faulty_engine(local_target, gate=gate)
    srv = ReferenceServer(engine, ServerOptions(port=0, max_batch=1, shutdown_timeout_s=0.3)).start()
    with ThreadPoolExecutor(3) as pool, gate:
        streamed = pool.submit(lambda: list(client.stream_generate(srv.url, input_ids=[5, 6],
                                                                   sampling_params=long)))
        gate.wait_held()
        waiting = pool.submit(client.generate, srv.url, input_ids=[7, 8], sampling_params=long)
        wait_until(lambda: srv.server_info()["requests_in_flight"] == 2)
        stopped = pool.submit(srv.shutdown)
        chunks = streamed.result(timeout=HANG_S)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(chunks[-1]["output_ids"]) == 2  # what it had when it was held
        with pytest.raises(client.ServerError) as err:
            waiting.result(timeout=HANG_S)
        assert err.value.status == 503 and err.value.retry_after >= 1
        gate.open()
        stopped.result(timeout=HANG_S)
    assert not srv.worker.alive


def test_connection_burst_is_not_reset(world, local_target):
    """128 clients connecting at once (the old server's listen backlog was 5)."""
    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.serving.app import ReferenceServer

    def health(_):
        with urllib.request.urlopen(srv.url + "/health", timeout=60) as resp:
            return resp.status

    engine = ReferenceEngine(local_target, None, 0, MAX_CONTEXT)
    with ReferenceServer(engine, ServerOptions(port=0)) as srv:
        with ThreadPoolExecutor(128) as pool:
            assert list(pool.map(health, range(128))) == [200] * 128


def test_serve_steps_auto_reference_and_sglang_flags(world, tmp_path, capsys):
    """`--steps auto`: the reference server measures its costs at start and picks K per cycle
    (lossless: greedy output == the oracle); on SGLang it becomes --speculative-adaptive at a K
    SGLang's built-in tiers hold, checked by SGLang 0.5.23's own resolution when installed."""
    from fastmtp_sglang.cli import build_parser
    from fastmtp_sglang.cli.serve import build_reference_server, default_draft, sglang_auto_args

    target, draft, tok, model = world
    args = build_parser().parse_args(["serve", "--engine", "reference", "--target", str(target),
                                      "--draft", str(draft), "--steps", "auto", "--auto-max-steps",
                                      "3", "--port", "0", "--max-batch", "2",
                                      "--dtype", "float32"])
    srv = build_reference_server(args)
    try:
        assert srv.engine.auto is not None and srv.engine.steps == 3 and srv.engine.hybrid
        assert set(srv.engine.auto.costs.by_batch) == {2}
        assert srv.server_info()["speculative_adaptive"] is True
        srv.start()
        ids = tok(PROMPTS[0])["input_ids"]
        assert client.generate(srv.url, input_ids=ids, sampling_params=GREEDY)["output_ids"] == \
            greedy_oracle(model, ids)
    finally:
        srv.shutdown()
    assert "--steps auto: K in 0..3 per cycle" in capsys.readouterr().out

    def sg(*extra):
        a = build_parser().parse_args(["serve", "--engine", "sglang", "--target", str(target),
                                       "--draft", str(draft), *extra])
        default_draft(a)
        return a, sglang_auto_args(a)

    a, flags = sg("--steps", "auto")
    assert a.steps == 3 and flags == ["--speculative-adaptive"]
    with pytest.raises(FastMTPError, match="built-in adaptive tiers do not hold"):
        sg("--steps", "auto", "--auto-max-steps", "4")
    cfg = tmp_path / "tiers.json"
    cfg.write_text('{"1": {"candidate_steps": [2, 4]}}')
    a, flags = sg("--steps", "auto", "--auto-max-steps", "4", "--adaptive-config", str(cfg))
    assert flags == ["--speculative-adaptive", "--speculative-adaptive-config", str(cfg.resolve())]
    with pytest.raises(FastMTPError, match="goes with --steps auto"):
        sg("--steps", "3", "--adaptive-config", str(cfg))
    with pytest.raises(FastMTPError, match="integers K >= 0"):
        sg("--steps", "three")
    sgl = pytest.importorskip("sglang.srt.server_args")
    from fastmtp_sglang.serving.sglang_launch import build_launch_command
    from fastmtp_sglang.serving.sglang_versions import resolve_server_args

    a, flags = sg("--steps", "auto")
    argv, _ = build_launch_command(target, draft, a.steps, 30000, "127.0.0.1",
                                   flags + ["--device", "cpu"])
    server_args = sgl.prepare_server_args(argv[3:])
    resolve_server_args(server_args)
    assert server_args.speculative_adaptive is True and server_args.speculative_num_steps == 3


def test_rows_done_before_a_fault_keep_their_answers(world, local_target):
    """A row that finished at its prefill is returned by a step that runs no cycle (so a cycle
    that raises cannot lose it); a stream whose sent output is already complete is answered
    from it after a fault, never extended; a join that fails is re-run apart and the joiner,
    innocent, gets its exact answer while the running batch goes on."""
    from fastmtp_sglang.decode.engine import ReferenceEngine, Request
    from fastmtp_sglang.decode.sampling import SamplingParams
    from fastmtp_sglang.serving.app import ReferenceServer
    from fastmtp_sglang.serving.protocol import GenerateInput
    from fastmtp_sglang.serving.jobs import _Job
    from fastmtp_sglang.serving.worker import EngineWorker

    _, _, tok, model = world
    eng = ReferenceEngine(local_target, None, 0, MAX_CONTEXT)
    b = eng.start([Request([5, 6], SamplingParams(max_new_tokens=1)),
                   Request([5, 6, 7], SamplingParams(max_new_tokens=8))], ["one", "long"])
    done = eng.step(b)
    assert [k for k, _ in done] == ["one"] and len(b.rows[0].out) == 1  # no cycle ran yet

    events = []
    worker = EngineWorker(eng)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    job = _Job(GenerateInput(None, [5, 6], params, True, "r1"), [5, 6], time.time(),
               lambda kind, payload: events.append((kind, payload)))
    job.streamed_ids = [11, 12, 13]  # all three tokens were sent before the fault
    assert worker._needs_engine(job) is False
    [(kind, out)] = events
    assert kind == "done" and out["output_ids"] == [11, 12, 13]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}

    ids = tok(PROMPTS[0])["input_ids"]
    eng2 = ReferenceEngine(local_target, None, 0, MAX_CONTEXT)
    real_join, calls = eng2.join, []

    def flaky_join(b, reqs, keys, on_tokens=None):
        calls.append(len(reqs))
        if len(calls) == 1:
            raise RuntimeError("join failed")
        return real_join(b, reqs, keys, on_tokens)

    eng2.join = flaky_join
    gate = Gate(free=2)  # the first's prefill and first cycle pass, then it is held
    eng2._target = lambda *a, _t=eng2._target, **k: (gate(), _t(*a, **k))[1]
    with ReferenceServer(eng2, ServerOptions(port=0, max_batch=4)) as srv, gate:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.generate, srv.url, input_ids=ids, sampling_params=GREEDY)
            gate.wait_held()  # the first is decoding, held between two cycles
            second = pool.submit(client.generate, srv.url, input_ids=[5, 6], sampling_params=GREEDY)
            wait_until(lambda: srv.server_info()["queued"] == 1)
            gate.open()  # the held cycle ends, and the second joins the first's batch
            assert first.result()["output_ids"] == greedy_oracle(model, ids)
            assert second.result()["output_ids"] == greedy_oracle(model, [5, 6])
        assert calls == [1] and srv.server_info()["requests_failed"] == 0


def test_serve_with_leaves_matches_greedy_target(world, tmp_path):
    """`fastmtp serve --steps 2 --draft-width 3`: a real server drafting with leaves answers
    with the target's own greedy tokens (fp32)."""
    from conftest import reference_server_process

    target, draft, tok, model = world
    ids = tok(PROMPTS[0])["input_ids"]
    args = ["--target", str(target), "--draft", str(draft), "--steps", "2", "--draft-width", "3",
            "--max-context", str(MAX_CONTEXT)]
    with reference_server_process(args, tmp_path / "serve.log") as (url, _):
        assert client.generate(url, input_ids=ids, sampling_params=GREEDY)["output_ids"] == greedy_oracle(model, ids)


def test_cli_refuses_draft_width_without_a_fixed_k(world, run_cli):
    rc, _, err = run_cli("serve", "--engine", "reference", "--target", world[0], "--draft", world[1],
                         "--steps", "auto", "--draft-width", "3")
    assert rc == 1 and "--auto-width" in err
