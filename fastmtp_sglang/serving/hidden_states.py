"""``return_hidden_states`` for the reference server: the rows SGLang 0.5.23 returns in
``meta_info["hidden_states"]`` for a finished request (docs/scale.md, "Features from SGLang
servers").

SGLang appends, per request, the prefill's rows as one block (the prompt positions, [P][H]) and
then one row per decode step (the state of the token that step fed, [H]). The last generated
token is never fed, so the rows cover positions 0 .. P + N - 2. Each is the target's last hidden
state after its final norm (Llama / Qwen2 / Qwen3 in SGLang: the model's ``final_norm`` output,
what the logits processor receives). The reference engine keeps the states it computed for such
a request (decode/capture.py: the prefill's and each cycle's fed positions), as SGLang returns
its own. A resumed stream that needed no further run has none kept: its rows are recomputed in
one forward over prompt + output[:-1] (the same positions and values up to the rounding of
another batch shape).
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def sglang_hidden_states(model, input_ids: list[int], output_ids: list[int], kept=None) -> list:
    """``[prefill rows [P][H], row [H], ...]`` (N - 1 decode rows) for a request with prompt
    ``input_ids`` (P) and output ``output_ids`` (N >= 1; N = 0 gives the prefill block alone).

    ``kept``: the engine's ``Result.features`` for the request (its states [P + N - 1, H] come
    first), or None: then ``model`` (a transformers causal LM whose ``model.model`` returns the
    post-norm ``last_hidden_state``) computes them.
    """
    p = len(input_ids)
    want = p + max(len(output_ids), 1) - 1
    if kept is not None and len(kept[0]) == want:
        h = kept[0].float().cpu()
    else:
        ids = list(input_ids) + list(output_ids[:-1])
        dev = next(model.parameters()).device
        h = model.model(input_ids=torch.tensor([ids], device=dev)).last_hidden_state[0]  # [P+N-1, H]
        h = h.float().cpu()
    return [h[:p].tolist()] + h[p:].tolist()


# SGLang 0.5.23's refusal of a request with return_hidden_states on a server started without
# the flag (tokenizer_manager.py, HTTP 400), word for word
HIDDEN_STATES_OFF = ("The server is not configured to return hidden states. Please set "
                     "`--return-hidden-states-mode last`, `--return-hidden-states-mode full`, or "
                     "the legacy `--enable-return-hidden-states` flag.")
