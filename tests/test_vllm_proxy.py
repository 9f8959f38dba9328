"""The SGLang-API adapter for vLLM servers (fastmtp_sglang.serving.vllm_proxy): pure, no vLLM needed.

A fake vLLM (OpenAI /v1/completions + Prometheus /metrics) on loopback stands in for the server;
the real one is exercised by bench/pipelines/vllm_serve_bench.sh.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fastmtp_sglang.serving import client
from fastmtp_sglang.serving.vllm_proxy import VLLMAdapter, accept_hist, parse_spec_metrics, serve

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}.0
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {dtok}.0
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {acc}.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="2"}} {p2}.0
vllm:num_requests_running{{engine="0",model_name="m"}} 0.0
"""


def _metrics(drafts, p0, p1, p2):
    return METRICS.format(drafts=drafts, dtok=3 * drafts, acc=p0 + p1 + p2, p0=p0, p1=p1, p2=p2)


def test_parse_metrics_and_histogram():
    m = parse_spec_metrics(_metrics(38, 8, 1, 0))
    assert m == {"drafts": 38, "draft_tokens": 114, "accepted": 9, "per_pos": [8, 1, 0]}
    assert parse_spec_metrics("vllm:num_requests_running 0.0")["per_pos"] == []
    # 38 cycles: 30 accepted none, 7 exactly one, 1 exactly two, 0 all three
    hist = accept_hist(38, [8, 1, 0], 3)
    assert hist == [30, 7, 1, 0]
    assert sum(a * n for a, n in enumerate(hist)) == 9 and sum(hist) == 38
    assert accept_hist(0, [], 2) == [0, 0, 0]


class _FakeVLLM(BaseHTTPRequestHandler):
    state = {"n": 0}

    def _send(self, obj, ctype="application/json"):
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        n = self.state["n"]
        if self.path == "/metrics":
            self._send(_metrics(10 * n, 6 * n, 2 * n, n).encode(), "text/plain")
        elif self.path == "/v1/models":
            self._send({"data": [{"id": "tiny"}]})
        else:
            self._send({})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "tiny" and body["return_token_ids"] is True
        self.state["n"] += 1  # each request: 10 cycles, accepted per position 6/2/1
        self.state["last"] = body
        self._send({"id": "cmpl-1", "choices": [{"text": " hi", "token_ids": [5, 6, 7],
                                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 3}})

    def log_message(self, *args):
        pass


@pytest.fixture()
def adapter_url():
    fake = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    proxy = serve(VLLMAdapter(f"http://127.0.0.1:{fake.server_address[1]}", steps=3),
                  "127.0.0.1", 0)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}"
    proxy.shutdown()
    fake.shutdown()


def test_generate_maps_response_and_counters(adapter_url):
    client.wait_for_health(adapter_url, timeout=10)
    out = client.generate(adapter_url, input_ids=[1, 2, 3, 4],
                          sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert out["text"] == " hi" and out["output_ids"] == [5, 6, 7]
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 3 and meta["spec_verify_ct"] == 10
    assert meta["accept_hist"] == [4, 4, 1, 1]
    assert meta["spec_accept_length"] == pytest.approx(1.9)
    assert _FakeVLLM.state["last"]["temperature"] == 0.0
    assert _FakeVLLM.state["last"]["max_tokens"] == 3
    info = client.server_info(adapter_url)
    assert info["speculative_num_steps"] == 3 and info["steps"] == 3
    assert client.avg_spec_accept_length(info) == pytest.approx(1.9)


def test_stream_refused_with_400(adapter_url):
    with pytest.raises(client.ServerError) as exc:
        next(client.stream_generate(adapter_url, text="x"))
    assert exc.value.status == 400 and "does not stream" in exc.value.message


class _FakeStreamingVLLM(_FakeVLLM):
    """Streams /v1/completions as vLLM does (SSE chunks, a final usage chunk, [DONE]); every
    request advances the speculation counters by 10 drafts, 9 accepted tokens."""

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "tiny" and isinstance(body["prompt"], list)
        self.state["n"] += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": f" t{i}"}]}).encode() + b"\n\n")
        self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {
            "prompt_tokens": len(body["prompt"]), "completion_tokens": n}}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


def test_concurrency_loads_vllm_through_its_own_api():
    from fastmtp_sglang.benchmark.concurrency import closed_loop_openai

    _FakeStreamingVLLM.state = {"n": 0}
    fake = ThreadingHTTPServer(("127.0.0.1", 0), _FakeStreamingVLLM)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    try:
        bodies = [{"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
                  for _ in range(5)]
        wall, records, spec = closed_loop_openai(f"http://127.0.0.1:{fake.server_address[1]}",
                                                 bodies, 3)
    finally:
        fake.shutdown()
    assert len(records) == 5 and all(r.tokens == 4 for r in records)
    assert all(0 < r.ttft_s <= r.e2e_s <= wall for r in records)
    # the fake's counters: 10 drafts and 6 + 2 + 1 accepted per request
    assert spec == {"drafts": 50, "accepted": 45}


def test_adaptive_server_is_benched_as_auto():
    """A vLLM server with a K-per-batch-size table behind the adapter (--adaptive) reports
    speculative_adaptive, so `fastmtp bench --url` names it arm auto, beside K=0 and K=3."""
    from fastmtp_sglang.benchmark.sweep import servers_by_k

    fake = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    vllm = f"http://127.0.0.1:{fake.server_address[1]}"
    proxies = [serve(VLLMAdapter(vllm, steps=k, adaptive=a), "127.0.0.1", 0)
               for k, a in ((0, False), (3, False), (3, True))]
    for p in proxies:
        threading.Thread(target=p.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{p.server_address[1]}" for p in proxies]
    try:
        by_k, _ = servers_by_k(urls)
        assert by_k == {0: urls[0], 3: urls[1], "auto": urls[2]}
        assert client.server_info(urls[2])["speculative_adaptive"] is True
    finally:
        for p in proxies:
            p.shutdown()
        fake.shutdown()
