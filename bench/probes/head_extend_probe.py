"""The head's draft extend over S positions a row, back to back (its weights in cache), in the
one kernel call (``LeanHead.ONE_CALL_POSITIONS`` = 16) against LeanHead's calls
(``ONE_CALL_POSITIONS`` = 1, the path before), after a prompt of 300 positions; the shipped head
and the demo target in bf16, packed as the engine packs them; medians over 50 calls after 10.
Nothing else should run meanwhile; AMX CPUs only.

    python bench/probes/head_extend_probe.py [--rows 1,4,16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fastmtp_sglang.core.demo_target import materialize_smollm2
from fastmtp_sglang.core.draft_dir import load_head
from fastmtp_sglang.core.target import load_target
from fastmtp_sglang.cpu_kernels.packed_linear import pack_for_inference
from fastmtp_sglang.decode.costs import cpu_description
from draft_step_profile import med_ms  # (bench/probes/ is the script's own folder on sys.path)
from fastmtp_sglang.decode.lean_head import LeanHead

REPO = Path(__file__).resolve().parents[2]
HEAD = REPO / "fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3"
CTX = 300


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--out", help="write the rows as JSON here too")
    args = ap.parse_args()
    t = load_target(str(materialize_smollm2()), dtype="bfloat16")
    head = load_head(str(HEAD), t.embed, t.lm_head, dtype=torch.bfloat16)
    pack_for_inference(t.model, head, "auto")
    H = head.cfg.hidden_size
    out = []
    torch.manual_seed(0)
    with torch.inference_mode():
        for B in map(int, args.rows.split(",")):
            lean = LeanHead(head)
            cache = head.new_cache(B, 2048, dtype=torch.bfloat16)
            lean.run(torch.randn(B, CTX, H).bfloat16(), torch.randint(0, 49000, (B, CTX)),
                     torch.arange(CTX)[None].expand(B, -1), cache)
            for S in (1, 2, 3, 4, 6, 9):
                h, i = torch.randn(B, S, H).bfloat16(), torch.randint(0, 49000, (B, S))
                p = (CTX + torch.arange(S))[None].expand(B, -1).contiguous()
                ms = {}
                for name, limit in (("one_call", LeanHead.ONE_CALL_POSITIONS), ("calls", 1)):
                    lean.ONE_CALL_POSITIONS = limit
                    ms[name] = med_ms(lambda: lean.run(h, i, p, cache), 50, 10)
                out.append({"rows": B, "positions": S, **{k: round(v, 3) for k, v in ms.items()}})
                print(f"rows {B:2d} positions {S}: one call {ms['one_call']:.3f} ms, calls {ms['calls']:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_description(), "threads": torch.get_num_threads(), "ctx": CTX, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
