"""vLLM at K=0: the draft layer writes its KV cache and nothing more.

With ``num_speculative_tokens_per_batch_size`` (``fastmtp serve --engine vllm --steps auto``),
vLLM 0.32 decodes at K=0 at the batch sizes its table says, yet its proposer still runs the
drafter's whole forward over every token the target ran that step, "to keep the drafter KV cache
in sync", and only then returns an empty draft (``v1/spec_decode/llm_base_proposer.py``,
``SpecDecodeBaseProposer.propose``). A later step that drafts reads those KV slots, so they must
be written; the rest of that forward (attention over the context, ``o_proj``, the MLP, the final
norm) is thrown away. (On a 2-core CPU serving a 135M target, side by side in one process: vLLM
with the draft at K=0 ran 1.11x the wall of vLLM without one in KV-only, 1.14x with the full
forward; the drafting call is 2.7% against 5.3% of a profiled step, the rest of the gap vLLM's
zero-draft rejection sampler and per-step setup: bench/results/vllm_k0_cost/.)

:func:`install` wraps ``propose`` so that at K=0 our draft class (``FastMTPForCausalLM``, the
only model it touches) runs in *KV-only* mode: input fusion, the input norm, the K/V projection
and rope, then the attention layer's own KV write (``unified_kv_cache_update``, what vLLM's
``Attention.forward`` calls before attending). The slots hold exactly what the full forward
would have written, so later drafts, and acceptance, are unchanged; outputs are the target's
either way (every draft is verified).

``$FASTMTP_VLLM_K0``: ``kv`` (default) or ``full`` (vLLM's own forward at K=0, for comparison).
Installed by the ``vllm.general_plugins`` entry point (:func:`fastmtp_sglang.vllm_models.register`)
in every vLLM process; nothing here imports vLLM before that.
"""

from __future__ import annotations

import functools
import logging
import os

from fastmtp_sglang.core.errors import FastMTPError

MODE_ENV = "FASTMTP_VLLM_K0"
MODES = ("kv", "full")
# under vLLM's logger, so its handler prints it (once per process, at the first KV-only step)
logger = logging.getLogger("vllm.fastmtp_k0")
LOG_LINE = "fastmtp: K=0 steps write the draft's KV cache only (FASTMTP_VLLM_K0=kv)"


def mode() -> str:
    """``$FASTMTP_VLLM_K0`` (read at each K=0 step, so one process can compare both)."""
    m = os.environ.get(MODE_ENV, "kv").strip().lower() or "kv"
    if m not in MODES:
        raise FastMTPError(f"{MODE_ENV}={m!r}: use 'kv' (the draft writes its KV cache only at "
                           "K=0, the default) or 'full' (vLLM's whole draft forward at K=0)")
    return m


def _our_model(proposer):
    """The proposer's draft model when it is ours (unwrapped from a graph wrapper), else None."""
    from fastmtp_sglang.vllm_models.fastmtp import FastMTPForCausalLM

    model = getattr(proposer, "model", None)
    model = model.unwrap() if hasattr(model, "unwrap") else model
    return model if isinstance(model, FastMTPForCausalLM) else None


def install() -> None:
    """Wrap vLLM's ``SpecDecodeBaseProposer.propose`` once per process (see the module doc)."""
    mode()  # a bad value stops vLLM at start, with the message, not at the first K=0 step
    try:  # (vLLM 0.32's layout; another vLLM keeps its own K=0 forward rather than failing)
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        orig = SpecDecodeBaseProposer.propose
    except (ImportError, AttributeError) as e:
        logger.warning("fastmtp: this vLLM has no SpecDecodeBaseProposer.propose (%s); its K=0 "
                       "steps run the draft's whole forward", e)
        return
    if getattr(orig, "_fastmtp_k0", False):
        return

    @functools.wraps(orig)
    def propose(self, *args, **kwargs):
        k = kwargs["num_speculative_tokens"] if "num_speculative_tokens" in kwargs else args[0]
        model = _our_model(self) if k == 0 else None
        if model is None or mode() != "kv" or not model.can_write_kv_only():
            return orig(self, *args, **kwargs)
        if not propose._logged:
            logger.info(LOG_LINE)
            propose._logged = True
        model.kv_only = True
        try:
            return orig(self, *args, **kwargs)
        finally:
            model.kv_only = False

    propose._fastmtp_k0 = True
    propose._logged = False
    SpecDecodeBaseProposer.propose = propose


def draft_kv_digest(worker) -> str:
    """For checks (``LLM.collective_rpc(draft_kv_digest)``, bench/vllm_k0_check.py): sha256 of our
    draft layer's whole KV cache in this vLLM worker, so two runs of the same requests can be
    compared slot for slot."""
    import hashlib

    import torch

    model = _our_model(worker.model_runner.drafter)
    if model is None:
        raise FastMTPError("the worker's draft model is not FastMTPForCausalLM")
    cache = model.model.layer.self_attn.attn.kv_cache
    t = cache[0] if isinstance(cache, (list, tuple)) else cache
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def set_mode(worker, value: str) -> str:
    """For measurements (``LLM.collective_rpc(set_mode, args=("full",))``, bench/vllm_k0_cost.py):
    set ``$FASTMTP_VLLM_K0`` in a running vLLM worker, so both modes run in one process, their
    steps interleaved; returns the mode now in force."""
    os.environ[MODE_ENV] = value
    return mode()
