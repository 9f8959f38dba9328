"""A standard-library client for SGLang's native ``/generate`` API.

It speaks to ``fastmtp serve --engine reference`` and to a real SGLang server alike (same request
and response shapes)::

    from fastmtp_sglang.serving import client
    client.wait_for_health("http://127.0.0.1:30000", timeout=120)
    out = client.generate("http://127.0.0.1:30000", text="Hello",
                          sampling_params={"temperature": 0, "max_new_tokens": 32})
    out["text"], out["meta_info"]["spec_accept_length"]
    for chunk in client.stream_generate(url, text="Hello", rid="r1"):  # cumulative text
        print(chunk["text"])
    client.abort_request(url, "r1")  # from elsewhere: r1's stream ends with finish_reason abort

Note SGLang samples at temperature 1.0 when ``sampling_params`` has no ``temperature``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

from fastmtp_sglang.core.errors import FastMTPError

__all__ = ["ServerError", "generate", "stream_generate", "abort_request", "server_info",
           "model_info", "avg_spec_accept_length", "wait_for_health"]


class ServerError(FastMTPError):
    """The server answered with an error; ``status`` is the HTTP status (0 inside a stream).

    ``retry_after`` is the server's Retry-After in seconds (a 503 from a full queue or a server
    shutting down), else None."""

    def __init__(self, url: str, status: int, message: str, retry_after: float | None = None):
        self.url, self.status, self.message = url, status, message
        self.retry_after = retry_after
        where = f"HTTP {status}" if status else "error in stream"
        super().__init__(f"{url}: {where}: {message}")


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # the HTTP-date form: not sent by SGLang or the reference server
        return None


def _base(url: str) -> str:
    return url.rstrip("/")


def _error_message(body: bytes) -> str:
    """The message of SGLang's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``, or raw text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "detail" in obj:
            return str(obj["detail"])
        if "message" in obj:
            return str(obj["message"])
    return text


def _open(url: str, payload: dict[str, Any] | None, timeout: float):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read()
        except OSError:
            body = b""
        finally:
            exc.close()
        raise ServerError(url, exc.code, _error_message(body),
                          _retry_after(exc.headers.get("Retry-After"))) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FastMTPError(f"cannot reach {url}: {reason}; is the server running "
                           "(`fastmtp serve ...`)?") from None


def _get_json(url: str, timeout: float) -> dict[str, Any]:
    with _open(url, None, timeout) as resp:
        return json.loads(resp.read())


def _payload(text, input_ids, sampling_params, stream, rid) -> dict[str, Any]:
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text= or input_ids=")
    p: dict[str, Any] = {"sampling_params": dict(sampling_params or {}), "stream": stream}
    if text is not None:
        p["text"] = text
    else:
        p["input_ids"] = list(input_ids)
    if rid is not None:
        p["rid"] = rid
    return p


def generate(url: str, *, text: str | None = None, input_ids: list[int] | None = None,
             sampling_params: dict[str, Any] | None = None, stream: bool = False,
             rid: str | None = None, timeout: float = 600,
             return_hidden_states: bool = False) -> dict[str, Any]:
    """POST /generate for one prompt; returns ``{"text", "output_ids", "meta_info"}``.

    With ``stream=True`` the reply is read as a stream and its last chunk (the complete result)
    returned. ``return_hidden_states``: SGLang's field of that name (the server must run with
    ``--enable-return-hidden-states``); the rows come in ``meta_info["hidden_states"]``. Raises
    ServerError (a FastMTPError) with the server's message on an HTTP error.
    """
    if stream:
        last = None
        for last in stream_generate(url, text=text, input_ids=input_ids,
                                    sampling_params=sampling_params, rid=rid, timeout=timeout):
            pass
        if last is None:
            raise ServerError(_base(url) + "/generate", 0, "the stream ended without a result")
        return last
    if return_hidden_states and stream:
        raise ValueError("return_hidden_states is read from the complete reply: stream=False")
    endpoint = _base(url) + "/generate"
    payload = _payload(text, input_ids, sampling_params, False, rid)
    if return_hidden_states:
        payload["return_hidden_states"] = True
    with _open(endpoint, payload, timeout) as resp:
        return json.loads(resp.read())


def stream_generate(url: str, *, text: str | None = None, input_ids: list[int] | None = None,
                    sampling_params: dict[str, Any] | None = None, rid: str | None = None,
                    timeout: float = 600) -> Iterator[dict[str, Any]]:
    """POST /generate with ``stream: true``; yields each server-sent chunk as a dict.

    Each chunk holds the cumulative ``text`` and ``output_ids`` so far; the last one carries
    ``meta_info.finish_reason``. ``timeout`` bounds each read, not the whole stream. An error
    event inside the stream raises ServerError with status 0.
    """
    endpoint = _base(url) + "/generate"
    with _open(endpoint, _payload(text, input_ids, sampling_params, True, rid), timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if isinstance(chunk, dict) and "error" in chunk:
                raise ServerError(endpoint, 0, _error_message(data.encode()))
            yield chunk


def abort_request(url: str, rid: str | None = None, *, abort_all: bool = False,
                  timeout: float = 30) -> None:
    """POST /abort_request (SGLang's): end the request ``rid``, or every one with
    ``abort_all``. The aborted request answers with ``finish_reason {"type": "abort"}``."""
    if not rid and not abort_all:
        raise ValueError("give rid= or abort_all=True")
    payload = {"abort_all": True} if abort_all else {"rid": rid}
    with _open(_base(url) + "/abort_request", payload, timeout) as resp:
        resp.read()


def server_info(url: str, timeout: float = 30) -> dict[str, Any]:
    """GET /server_info (SGLang >= 0.4.x), falling back to the older /get_server_info."""
    try:
        return _get_json(_base(url) + "/server_info", timeout)
    except ServerError as exc:
        if exc.status != 404:
            raise
    return _get_json(_base(url) + "/get_server_info", timeout)


def model_info(url: str, timeout: float = 30) -> dict[str, Any]:
    """GET /get_model_info."""
    return _get_json(_base(url) + "/get_model_info", timeout)


def avg_spec_accept_length(info: dict[str, Any]) -> float | None:
    """``avg_spec_accept_length`` from a server_info dict: top level (ours) or SGLang's
    ``internal_states[0]``; None when the server reports none (no speculative decoding)."""
    if "avg_spec_accept_length" in info:
        return info["avg_spec_accept_length"]
    for state in info.get("internal_states") or []:
        if isinstance(state, dict) and "avg_spec_accept_length" in state:
            return state["avg_spec_accept_length"]
    return None


def wait_for_health(url: str, timeout: float = 120, *, interval: float = 0.25,
                    process=None) -> None:
    """Poll GET /health until it answers 200.

    Parameters
    ----------
    timeout : seconds to wait in all
    process : optional ``subprocess.Popen`` of the server; if it exits, fail at once

    Raises
    ------
    FastMTPError
        When the server is not healthy within ``timeout`` or its process exited.
    """
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        if process is not None and process.poll() is not None:
            raise FastMTPError(f"the server process exited with code {process.returncode} "
                               f"before {url} became healthy")
        try:
            with _open(_base(url) + "/health", None, timeout=max(1.0, interval * 4)) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except FastMTPError as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            raise FastMTPError(f"{url} was not healthy after {timeout:g} s (last: {last})")
        time.sleep(interval)
