"""SGLang's ``/generate`` API in front of a vLLM OpenAI-compatible server, for ``fastmtp bench``.

    python -m fastmtp_sglang.cli.vllm_proxy --vllm http://127.0.0.1:8000 --steps 3 --port 30001
    fastmtp bench --url http://127.0.0.1:30000 http://127.0.0.1:30001 ...   # K=0, K=3 adapters

``fastmtp bench --url`` speaks SGLang's native API. vLLM serves the OpenAI API, and what it
reports differs:

| fastmtp bench reads (SGLang) | vLLM 0.32 gives | mapping here |
|---|---|---|
| ``text``, ``output_ids`` | ``/v1/completions`` ``choices[0].text``, ``.token_ids`` (with ``return_token_ids``) | copied |
| ``meta_info.completion_tokens``, ``prompt_tokens`` | ``usage.completion_tokens``, ``prompt_tokens`` | copied |
| ``meta_info.finish_reason`` | ``choices[0].finish_reason`` ("stop"/"length") | ``{"type": ...}`` |
| ``meta_info.e2e_latency`` | nothing per request | wall time of the call, measured here |
| ``meta_info.spec_verify_ct``, ``spec_accept_length``, per-cycle counts | **nothing per request**; ``/metrics`` has server-wide counters ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}`` | deltas of those counters around the request (requests are serialised, so the delta is this request's); per-cycle histogram rebuilt from the per-position counts (a chain accepts a prefix: cycles with >= j accepted = accepted at position j) |
| ``/server_info`` (``speculative_num_steps``, ``avg_spec_accept_length``) | none (``/v1/models`` names the model) | K from ``--steps``; average from the cumulative counters |
| ``/health`` | ``/health`` | forwarded |

Requests are serialised (one at a time), which is what the benchmark does anyway; streaming is
not offered. vLLM's counters count drafts that were verified: vLLM's tau is
``1 + accepted / drafts``, the same cycle definition as ours (``fastmtp_sglang.decode.metrics``).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fastmtp_sglang.core.errors import FastMTPError

_METRIC = re.compile(r'^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$')
_POSITION = re.compile(r'position="(\d+)"')


def parse_spec_metrics(text: str) -> dict[str, Any]:
    """vLLM's Prometheus text -> {"drafts", "draft_tokens", "accepted", "per_pos": [...]}.

    Summed over engines (labels other than ``position`` are ignored); zeros when the server does
    no speculation.
    """
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", int(float(m.group(3)))
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] += value
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += value
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = _POSITION.search(labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0) + value
    out["per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def accept_hist(drafts: int, per_pos: list[int], steps: int) -> list[int]:
    """Per-cycle histogram [cycles with exactly a accepted, a = 0..K] from chain counts.

    In a chain, position j is accepted only if 1..j-1 were, so ``per_pos[j-1]`` is the number of
    cycles with at least j accepted: exactly a = at-least a - at-least a+1.
    """
    at_least = [drafts] + list(per_pos[:steps]) + [0] * (steps - len(per_pos[:steps])) + [0]
    return [max(at_least[a] - at_least[a + 1], 0) for a in range(steps + 1)]


def _request(url: str, payload: dict | None = None, timeout: float = 600) -> bytes:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


class VLLMAdapter:
    """Translate one SGLang ``/generate`` request into vLLM ``/v1/completions`` (+ /metrics)."""

    def __init__(self, vllm_url: str, steps: int, model: str | None = None,
                 draft: str | None = None, adaptive: bool = False):
        self.url = vllm_url.rstrip("/")
        self.steps = steps
        # the server runs a K per batch size (num_speculative_tokens_per_batch_size) up to steps:
        # reported as SGLang reports --speculative-adaptive, so `fastmtp bench` names it "auto"
        self.adaptive = adaptive
        self.model = model
        self.draft = draft  # reported in /server_info only (vLLM does not expose it)
        self.lock = threading.Lock()

    def model_name(self) -> str:
        if self.model is None:
            self.model = json.loads(_request(self.url + "/v1/models"))["data"][0]["id"]
        return self.model

    def metrics(self) -> dict[str, Any]:
        return parse_spec_metrics(_request(self.url + "/metrics").decode())

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("stream"):
            raise ValueError("the vLLM adapter does not stream; send stream: false")
        sp = dict(body.get("sampling_params") or {})
        prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
        if prompt is None:
            raise ValueError("give text or input_ids")
        req = {"model": self.model_name(), "prompt": prompt, "return_token_ids": True,
               "max_tokens": int(sp.pop("max_new_tokens", 128)),
               # SGLang's default temperature is 1.0; keep that meaning
               "temperature": float(sp.pop("temperature", 1.0))}
        for key in ("top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "ignore_eos"):
            if key in sp:
                req[key] = sp.pop(key)
        with self.lock:
            before = self.metrics() if self.steps else None
            t = time.perf_counter()
            out = json.loads(_request(self.url + "/v1/completions", req))
            dt = time.perf_counter() - t
            after = self.metrics() if self.steps else None
        choice, usage = out["choices"][0], out.get("usage") or {}
        ct = int(usage.get("completion_tokens", len(choice.get("token_ids") or [])))
        meta: dict[str, Any] = {"id": out.get("id"), "prompt_tokens": usage.get("prompt_tokens"),
                                "completion_tokens": ct, "e2e_latency": dt,
                                "finish_reason": {"type": choice.get("finish_reason")}}
        if self.steps:
            drafts = after["drafts"] - before["drafts"]
            per_pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0)
                       for i, a in enumerate(after["per_pos"])]
            hist = accept_hist(drafts, per_pos, self.steps)
            meta.update(spec_verify_ct=drafts, accept_hist=hist,
                        spec_accept_length=(1 + sum(per_pos) / drafts) if drafts else None)
        return {"text": choice.get("text", ""), "output_ids": list(choice.get("token_ids") or []),
                "meta_info": meta}

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"engine": "vllm", "vllm_url": self.url, "steps": self.steps,
                                "speculative_num_steps": self.steps,
                                "speculative_algorithm": "EAGLE" if self.steps else None,
                                "speculative_adaptive": self.adaptive,
                                "model_path": self.model_name()}
        if self.steps and self.draft:
            info["speculative_draft_model_path"] = self.draft
        if self.steps:
            m = self.metrics()
            info["avg_spec_accept_length"] = 1 + m["accepted"] / m["drafts"] if m["drafts"] else None
        return info


def serve(adapter: VLLMAdapter, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server (not started) exposing /generate, /health, /server_info."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _guard(self, fn) -> None:
            try:
                self._send(200, fn())
            except ValueError as exc:
                self._send(400, {"error": {"message": str(exc)}})
            except urllib.error.HTTPError as exc:
                self._send(exc.code, {"error": {"message": exc.read().decode("utf-8", "replace")}})
            except (urllib.error.URLError, OSError) as exc:
                self._send(502, {"error": {"message": f"vLLM at {adapter.url}: {exc}"}})

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._guard(lambda: (_request(adapter.url + "/health"), {})[1])
            elif self.path in ("/server_info", "/get_server_info"):
                self._guard(adapter.server_info)
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):  # noqa: N802
            if self.path != "/generate":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            n = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(n) or b"{}")
            except json.JSONDecodeError as exc:
                self._send(400, {"error": {"message": f"invalid JSON: {exc}"}})
                return
            self._guard(lambda: adapter.generate(body))

        def log_message(self, *args):  # quiet
            pass

    try:
        return ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise FastMTPError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None

