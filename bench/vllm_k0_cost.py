"""What vLLM's K=0 steps cost with our draft: KV-only (``FASTMTP_VLLM_K0=kv``) against vLLM's
whole draft forward (``full``), in one vLLM process, interleaved; and, with ``--no-draft``, the
same batch on vLLM without a draft (a separate process).

    /tmp/fastmtp-ci-vllm-venv/bin/python bench/vllm_k0_cost.py --out /tmp/k0cost.json
    /tmp/fastmtp-ci-vllm-venv/bin/python bench/vllm_k0_cost.py --no-draft --out /tmp/k0none.json

One ``generate`` call of ``--batch`` prompts x ``--tokens`` tokens (fp32, greedy) per round;
with the draft, K per batch size is 0 at every size (``[[1, 1024, 0]]``), so every decode step is
a K=0 step. The mode is switched in vLLM's worker between rounds (``k0.set_mode`` through
``collective_rpc``), kv and full alternating, ``--rounds`` each. Writes the wall times of every
round and their medians (direction on a shared VM: compare only rounds of one run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(REPO / "fastmtp_sglang" / "data" / "heads" / "smollm2-135m-fastmtp-k3"))
    ap.add_argument("--no-draft", action="store_true", help="vLLM without a draft (the baseline)")
    ap.add_argument("--batch", type=int, default=16, help="prompts per generate call (default 16)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each answers (default 64)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per mode (default 4)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with our callable

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fastmtp_sglang.core.demo_target import materialize_smollm2
    from fastmtp_sglang.core.prompts import load_prompts, render_chat
    from fastmtp_sglang.vllm_models.k0 import set_mode

    target = str(materialize_smollm2())
    tok = AutoTokenizer.from_pretrained(target)
    texts = [p.text for p in load_prompts(REPO / "bench" / "data" / "spec_bench.jsonl", limit_per_category=2)]
    prompts = [TokensPrompt(prompt_token_ids=tok(render_chat(tok, texts[i % len(texts)]),
                                                 add_special_tokens=False).input_ids)
               for i in range(args.batch)]
    spec = None if args.no_draft else {"method": "eagle", "model": args.draft, "num_speculative_tokens": 1,
                                       "num_speculative_tokens_per_batch_size": [[1, 1024, 0]]}
    llm = LLM(model=target, dtype="float32", speculative_config=spec, max_model_len=2048,
              enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 30)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    modes = ["none"] if args.no_draft else ["kv", "full"]
    walls: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            if m != "none":
                assert llm.collective_rpc(set_mode, args=(m,)) == [m]
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            walls[m].append(time.perf_counter() - t)
    res = {"batch": args.batch, "tokens": args.tokens, "walls_s": walls,
           "median_s": {m: statistics.median(w) for m, w in walls.items()},
           "tokens_per_s": {m: args.batch * args.tokens / statistics.median(w) for m, w in walls.items()}}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
