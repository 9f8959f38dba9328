"""A verify's attention, one call: ``amx.multi_query_attention`` (AMX tiles) against PyTorch's
attention with the folded additive mask it replaced (``core.attention.grouped_attention``), at
the demo target's heads (3 key/value heads of 3 query heads, head size 64), random bf16 inputs,
medians over 100 calls after 10. Nothing else should run meanwhile; AMX CPUs only.

    python bench/probes/tile_attention_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from fastmtp_sglang.core.attention import fold_mask, grouped_attention
from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.decode.costs import cpu_description
from draft_step_profile import med_ms  # (bench/probes/ is the script's own folder on sys.path)

CASES = [(1, 4, 300), (1, 7, 400), (1, 10, 1000), (4, 7, 400), (8, 7, 800), (16, 4, 600), (16, 7, 1000)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here too")
    args = ap.parse_args()
    if not amx.available():
        raise SystemExit(f"needs the AMX kernels: {amx.unavailable_reason()}")
    torch.manual_seed(0)
    nkv, G, D = 3, 3, 64
    rows = []
    for B, S, T in CASES:
        q = torch.randn(B, nkv * G, S, D).bfloat16()
        k, v = torch.randn(B, nkv, T, D).bfloat16(), torch.randn(B, nkv, T, D).bfloat16()
        valid = torch.rand(B, S, T) < 0.95
        folded = fold_mask(valid[:, None], nkv * G, nkv, torch.bfloat16)
        tiles = 1e3 * med_ms(lambda: amx.multi_query_attention(q, k, v, valid, D ** -0.5), 100, 10)
        torch_us = 1e3 * med_ms(lambda: grouped_attention(q, k, v, folded, D ** -0.5, folded=True), 100, 10)
        rows.append({"rows": B, "tokens": S, "slots": T, "tiles_us": round(tiles, 1),
                     "pytorch_us": round(torch_us, 1), "ratio": round(torch_us / tiles, 2)})
        print(f"rows {B:2d} tokens {S:2d} slots {T:4d}: tiles {tiles:7.1f} us, PyTorch {torch_us:7.1f} us, "
              f"{torch_us / tiles:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_description(), "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
