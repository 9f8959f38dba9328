"""The vLLM model class for FastMTP draft directories, registered out of tree.

A sibling of ``fastmtp_sglang.models`` rather than a module inside it: SGLang's
``SGLANG_EXTERNAL_MODEL_PACKAGE=fastmtp_sglang.models`` imports *every* submodule of that
package in every scheduler process, and a vLLM module there would import vLLM inside SGLang (or
fail to import where vLLM is absent). Nothing here imports vLLM until vLLM itself resolves the
class: :func:`register` hands vLLM's registry a ``"module:Class"`` string (vLLM's lazy form).

vLLM runs :func:`register` in each of its processes through the ``vllm.general_plugins`` entry
point that ``pyproject.toml`` declares (``fastmtp = "fastmtp_sglang.vllm_models:register"``).

Owns: ``fastmtp`` (FastMTPForCausalLM on vLLM's layers), ``k0`` (vLLM's K=0 steps write the
draft's KV cache only).

May import: ``fastmtp_sglang.models`` (what the two draft classes share),
``fastmtp_sglang.vocab`` and ``fastmtp_sglang.core``.
"""

from __future__ import annotations

ARCHITECTURE = "FastMTPForCausalLM"
# vLLM's EAGLEConfig renames a draft's architecture X to EagleX (method "eagle")
EAGLE_ARCHITECTURE = "Eagle" + ARCHITECTURE
MODEL_CLASS = "fastmtp_sglang.vllm_models.fastmtp:FastMTPForCausalLM"


def register() -> None:
    """``vllm.general_plugins`` entry point: add the FastMTP draft class to vLLM's registry, and
    make vLLM's K=0 steps write our draft's KV cache only (:mod:`fastmtp_sglang.vllm_models.k0`)."""
    from vllm import ModelRegistry

    from fastmtp_sglang.vllm_models import k0

    for arch in (ARCHITECTURE, EAGLE_ARCHITECTURE):
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, MODEL_CLASS)
    k0.install()
