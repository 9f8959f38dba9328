"""What the reference server says about itself beside its counters: K (or ``auto`` and its range),
the model, and what each acceptance figure means (``/server_info``, ``/get_model_info``; the
worker adds its queue and counters, fastmtp_sglang.serving.worker)."""

from __future__ import annotations

from typing import Any

# What the acceptance figures mean (in /server_info, so a reader of its numbers has them;
# docs/design.md section 2 defines tau, A_k and a_k)
METRIC_DEFINITIONS = {
    "tau": "tokens emitted per verification cycle (accepted drafts + 1), the prefill's token "
           "excluded; in /server_info pooled over every cycle served",
    "avg_spec_accept_length": "SGLang's server-wide figure, counted as SGLang's scheduler counts "
                              "it (accepted drafts + 1 per cycle, pooled): the same number as tau",
    "spec_accept_length": "SGLang's per-request figure in meta_info: completion_tokens / "
                          "spec_verify_ct; it counts the prefill's token too, so it is above "
                          "the request's tau by about 1 / spec_verify_ct",
    "steps": "K, drafts per cycle; \"auto\": K is picked every cycle within steps_range, and "
             "meta_info.mean_drafted says how many drafts a request's cycles verified on average",
}


def is_auto(engine) -> bool:
    """Whether the engine picks K per cycle (``--steps auto``)."""
    return getattr(engine, "auto", None) is not None


def steps_info(engine) -> dict[str, Any]:
    """``steps``: K, or "auto" with ``steps_range`` [0, largest K] (K picked every cycle)."""
    k = engine.steps
    auto = is_auto(engine)
    return {"steps": "auto" if auto else k, "steps_range": [0, k] if auto else [k, k]}


def model_info(engine, model_path: str, draft_path: str | None) -> dict[str, Any]:
    """``/get_model_info``'s answer."""
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "draft_model_path": draft_path,
        **steps_info(engine),
        "context_length": engine.max_context,
    }
