"""The reference server's protocol: SGLang's native HTTP API as the reference server speaks it,
parsing and checking a /generate body, and the refusals (400, HTTPError) (the limits and their
defaults: fastmtp_sglang.serving.options).

The HTTP side is fastmtp_sglang.serving.app; the engine worker and its batching,
fastmtp_sglang.serving.worker.

Endpoints (the shapes of SGLang's native API, so one client serves both):

- ``POST /generate``: ``{"text": str | "input_ids": [int], "sampling_params": {...},
  "stream": bool, "rid": str}`` -> ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "spec_verify_ct", "spec_accept_length",
  "e2e_latency", ...}}``. ``meta_info`` also carries our own acceptance metrics: ``tau``
  (emitted tokens per verification, prefill token excluded), ``A_k``, ``a_k``, ``accept_hist``,
  K (``steps``: an int, or ``"auto"`` when the server picks K per cycle, with ``steps_range``
  and ``mean_drafted``, the drafts its cycles verified on average) and the time split
  (``prefill_s``, ``decode_s``, ``draft_s``, ``verify_s``, ``decode_tokens_per_s``). With ``"stream": true`` the reply is server-sent events, one
  ``data: {json}\\n\\n`` per verification cycle with the *cumulative* text and output ids (SGLang's
  default), the last one carrying the finish reason and metrics, then ``data: [DONE]\\n\\n``.
  ``"return_hidden_states": true`` (a server started with ``--enable-return-hidden-states``; not
  with ``stream``) adds ``meta_info["hidden_states"]`` in SGLang 0.5.23's shape
  (fastmtp_sglang.serving.hidden_states); without the flag it is refused with SGLang's 400.
- ``POST /abort_request`` ``{"rid": str}`` or ``{"abort_all": true}``: as SGLang's. The request
  ends at once with ``finish_reason {"type": "abort", "message": ...}`` and what it had generated
  (a stream gets that as its last event); an unknown rid is not an error.
- ``GET /health`` (``OK``; 503 while shutting down), ``GET /health_generate`` (runs a one-token
  generation), ``GET /server_info`` (alias ``/get_server_info``: the options, the state, every
  counter, and ``metric_definitions``, what each acceptance figure means), ``GET /get_model_info``.

SGLang compatibility decisions:

- Text is tokenized as SGLang's tokenizer manager does it: ``tokenizer(text)`` with the
  tokenizer's defaults, so a BOS is added when the tokenizer adds one. No chat template is
  applied: clients do that.
- ``sampling_params`` without ``temperature`` (or with ``null``) samples at temperature 1.0, as
  SGLang does; send ``"temperature": 0`` for greedy. A temperature below 1e-6 is greedy, as in
  SGLang (dividing float32 logits by 1e-45 gives inf and NaN probabilities).
- ``spec_accept_length`` is ``completion_tokens / spec_verify_ct`` as SGLang computes it (the
  prefill token counts in the numerator, so it sits slightly above ``tau``); 0 when no
  verification ran. ``avg_spec_accept_length`` in ``/server_info`` is pooled over every
  verification cycle served (accepted + 1 per cycle), as SGLang's scheduler counts it: the
  pooled ``tau``, which ``/server_info`` also reports under that name.
- One rule for the context, SGLang's: prompt + ``max_new_tokens`` must fit it (a prompt needs
  room for one new token), else 400 with a message that says how many new tokens fit. Nothing is
  cut short silently: a finish reason ``length`` means ``max_new_tokens`` was reached.
  ``max_new_tokens`` is 128 when a request gives none (SGLang's default), under the same rule.
- A client that disconnects aborts its request (SGLang does the same): its row leaves the batch
  at the next verification cycle.

Errors: every error is JSON ``{"error": {"message": ...}}``. 400: malformed or too deeply nested
JSON, a bad field, a sampling parameter outside what the engine's float32 / int64 tensors hold, a
lone surrogate in ``text``, a prompt longer than the context (checked from its length in
characters before tokenizing when that already proves it), prompt + ``max_new_tokens`` over the
context, more than MAX_STOP_STRINGS stop strings, one longer than MAX_STOP_CHARS, more than
MAX_STOP_TOKEN_IDS stop token ids. 404 / 405: unknown route or method. 408: the body did not
arrive within ``read_timeout_s``. 413: a body over ``max_body_bytes``, refused from its
Content-Length before any of it is read. 503 + ``Retry-After``: the queue is full (checked once
the body has arrived), the server has ``max_connections`` connections open (answered as the
connection opens, then closed), or the server is shutting down. 500: the engine failed on this
request.

Connections: each request's headers must arrive within ``read_timeout_s`` of the connection
opening or of the previous response (else the connection is closed); a client that leaves what
the server sent unread for ``write_timeout_s`` is cut off and its request aborted (the log says
so).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from fastmtp_sglang.decode.sampling import SamplingParams

# Top-level /generate fields we act on; SGLang has many more. Fields that only change logging or
# scheduling are ignored whatever their value; fields that would change the reply are accepted
# only at SGLang's default (null / false / 0 / empty, or the value listed), so a request never
# silently loses a feature it asked for. Anything else is refused with 400.
GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "rid", "return_hidden_states")
IGNORED_FIELDS = ("log_metrics", "priority", "background", "extra_key", "data_parallel_rank",
                  "bootstrap_host", "bootstrap_port", "bootstrap_room", "return_text_in_logprobs")
DEFAULT_ONLY_FIELDS = {
    "return_logprob": None, "logprob_start_len": -1, "top_logprobs_num": None,
    "token_ids_logprob": None, "lora_path": None, "image_data": None, "audio_data": None,
    "video_data": None, "modalities": None, "session_params": None,
    "custom_logit_processor": None, "input_embeds": None,
    "require_reasoning": None,
}
SGLANG_DEFAULT_TEMPERATURE = 1.0
SGLANG_SAMPLING_EPS = 1e-6  # SGLang samples greedily below this temperature (sampling_params.py)
F32 = torch.finfo(torch.float32)
INT64_MAX = 2**63 - 1

# The server's limits that `fastmtp serve` exposes, and their defaults, are ServerOptions'
# (fastmtp_sglang.serving.options); these are fixed.
ABORT_BODY_BYTES = 64 << 10
DISCARD_BYTES = 256 << 20  # an oversized body up to this is drained unread before the 413
# Stop lists: every cycle decodes each row's last tokens, as many as the longest stop string has
# UTF-8 bytes, and looks for every stop string in that text; these caps bound that work
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message says what to fix."""


class HTTPError(Exception):
    """A refusal with a status other than 400 (408, 413, 503, ...) and optional headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


# ----------------------------------------------------------------------------------------------
# parsing a /generate body
# ----------------------------------------------------------------------------------------------

@dataclass
class GenerateInput:
    """A parsed /generate body: exactly one of ``text`` / ``input_ids`` is set."""

    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    stream: bool
    rid: str
    return_hidden_states: bool = False  # SGLang's field: rows in meta_info["hidden_states"]


def _check_engine_dtypes(params: SamplingParams) -> None:
    """Refuse values the engine's tensors cannot hold (temperature, top_p: float32; top_k:
    int64): they passed SamplingParams' range checks but raise inside ``generate``."""
    if params.temperature > F32.max:
        raise BadRequest(f"sampling_params['temperature']: {params.temperature:g} overflows float32, "
                         f"the engine's dtype (largest {F32.max:.3g})")
    if 0 < params.temperature < SGLANG_SAMPLING_EPS:
        params.temperature = 0.0  # greedy, as SGLang; 1e-45 would make inf logits and NaN probs
    if params.top_p < F32.tiny:
        raise BadRequest(f"sampling_params['top_p']: {params.top_p:g} is below float32's smallest "
                         f"normal number ({F32.tiny:.3g}), the engine's dtype; a top_p that small "
                         "keeps only the most likely token: send 1e-6 for that")
    if params.top_k > INT64_MAX:
        raise BadRequest(f"sampling_params['top_k']: {params.top_k} overflows int64, the engine's "
                         "dtype; -1 disables top-k")


def _check_stop_lists(params: SamplingParams) -> None:
    """Refuse stop lists past MAX_STOP_STRINGS / MAX_STOP_CHARS / MAX_STOP_TOKEN_IDS: each cycle
    checks every stop string against each row's last tokens (as many as the longest string has
    bytes), so their count and length set the per-cycle cost of every request in the batch."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"sampling_params['stop'] has {len(params.stop)} strings; this server "
                         f"takes at most {MAX_STOP_STRINGS}")
    longest = max(params.stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise BadRequest(f"sampling_params['stop'] has a string of {len(longest)} characters "
                         f"({longest[:20]!r}...); this server takes at most {MAX_STOP_CHARS}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"sampling_params['stop_token_ids'] has {len(params.stop_token_ids)} ids; "
                         f"this server takes at most {MAX_STOP_TOKEN_IDS}")


def parse_generate(body: bytes | str) -> GenerateInput:
    """Parse and check a /generate request body (SGLang's ``GenerateReqInput``, one prompt).

    Raises
    ------
    BadRequest
        On malformed or too deeply nested JSON, a missing / doubled / mistyped field, a batch of
        prompts, an unknown field, a lone surrogate in ``text``, or a bad sampling parameter
        (including one the engine's dtypes cannot hold, and stop lists past the caps above);
        the message names the field.
    """
    try:
        obj = json.loads(body)
    except RecursionError:
        raise BadRequest("the request body is JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int over 4300 digits
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(k for k in obj if k not in GENERATE_FIELDS and k not in IGNORED_FIELDS
                     and not (k in DEFAULT_ONLY_FIELDS
                              and (not obj[k] or obj[k] == DEFAULT_ONLY_FIELDS[k])))
    if unknown:
        raise BadRequest(f"unsupported field(s) {unknown}: the reference server takes "
                         f"{list(GENERATE_FIELDS)} (SGLang's other fields only at their defaults)")
    text, ids = obj.get("text"), obj.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text' (a string) or 'input_ids' (a list of ints)"
                         + ("; got both" if text is not None else ""))
    if text is not None:
        if not isinstance(text, str):
            what = "a batch of prompts" if isinstance(text, list) else type(text).__name__
            raise BadRequest(f"'text' must be one string, got {what}: the reference server takes "
                             "one prompt per request (send concurrent requests; they are batched)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON's "\ud800" escape decodes to a lone surrogate
            raise BadRequest(f"'text' is not valid Unicode: a lone surrogate "
                             f"(U+{ord(text[exc.start]):04X}) at character {exc.start}") from None
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in ids):
            what = ("a batch of prompts" if isinstance(ids, list) and ids and isinstance(ids[0], list)
                    else repr(ids)[:80])
            raise BadRequest(f"'input_ids' must be one list of ints, got {what}")
    sp = obj.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"'sampling_params' must be a JSON object, got {type(sp).__name__}")
    sp = dict(sp)
    if sp.get("temperature") is None:
        sp["temperature"] = SGLANG_DEFAULT_TEMPERATURE
    try:
        params = SamplingParams.from_dict(sp)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    _check_engine_dtypes(params)
    _check_stop_lists(params)
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}")
    rid = obj.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise BadRequest(f"'rid' must be a non-empty string, got {rid!r}")
    hidden = obj.get("return_hidden_states")
    if hidden is None:
        hidden = False
    if not isinstance(hidden, bool):  # SGLang's HTTP schema takes a bool (a list: one per prompt)
        raise BadRequest(f"'return_hidden_states' must be true or false, got {hidden!r}")
    if hidden and stream:
        raise BadRequest("'return_hidden_states' with 'stream': the reference server returns "
                         "hidden states in the complete reply only; send stream false")
    return GenerateInput(text, ids, params, stream, rid, hidden)


def public_finish_reason(fr: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's finish reason in SGLang's shape (drops internal keys)."""
    if fr is None:
        return None
    return {k: v for k, v in fr.items() if k != "matched_str"}


def max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry, in characters (0 = unknown).

    A token covers at most as many characters of text as its entry has (byte-level BPE spells
    each byte as one character; SentencePiece spells text as it is, byte-fallback entries are
    longer than the byte they stand for), so ``len(text) / (2 * this)`` tokens is a safe floor
    (the 2 allows for normalisers that merge characters, NFKC's e + U+0301 -> é)."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without get_vocab: no cheap check, tokenize everything
        return 0
