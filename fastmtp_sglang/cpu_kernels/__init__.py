"""The CPU speed code: C kernels built on first use, their one loader, and linear layers on
prepared weights.

Owns: ``loader`` (builds and loads the C files of this folder: the private kernel cache, the
sha256 check, ``FASTMTP_CPU_KERNELS=off``), ``amx`` (+ ``amx.c``, built on AMX tiles or,
without AMX, on AVX-512 bf16 dot products: the small-rows bf16 linear, its argmax without the products, the fused elementwise steps of a bf16 decoder layer, a
Llama-block head's whole draft step or short extend in one call, and a verify's attention of a
few tokens a row on tiles), ``decode_attention`` (+
``decode_attention.c``: one new token per row over a bf16 cache in one pass, AVX-512),
``packed_linear`` (bf16 linear layers on weights laid out once: oneDNN's, or ``amx`` tiles).
``bf16.h``: the helpers both C files include; ``amx_products.h``: the tile pass (and its vector
twin) and the one-row argmax that ``amx.c`` builds its products on.

May import: ``fastmtp_sglang.core`` (what the CPU has, the cache folder). Never ``vocab`` or
anything above it.
"""
