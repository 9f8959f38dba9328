"""What vLLM's K=0 steps cost with our draft, against vLLM without a draft, measured side by side in
one process so that a noisy machine's drift falls on both arms alike.

    PYTHONPATH=. /tmp/fastmtp-ci-vllm-venv/bin/python bench/vllm_k0_cost.py --out /tmp/k0cost.json
    PYTHONPATH=. /tmp/fastmtp-ci-vllm-venv/bin/python bench/vllm_k0_cost.py --arms none,kv,full --profile --out F

Arms: ``none`` (vLLM without a draft), ``kv`` (the shipped head, K per batch size 0 at every size,
so every decode step is a K=0 step, the draft writing only its KV cache: ``FASTMTP_VLLM_K0=kv``)
and ``full`` (the same engine with vLLM's whole draft forward at K=0). ``none`` gets its own
``LLM``; ``kv`` and ``full`` share one, the mode switched in its worker (``k0.set_mode``). Both
engines live in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Each round runs one
``generate`` of ``--batch`` prompts x ``--tokens`` tokens (fp32, greedy) per arm, the arms' order
reversed every other round; the report gives each arm's paired ratio to the first arm per round
and their median (robust to a burst that hits one round), not just each arm's median wall.

``--profile``: every round under cProfile (one profile per arm), and the report splits where the
time went: the target's forward, the runner's drafting call (the draft's K=0 forward or KV write
plus the proposer's input and metadata preparation), the rejection sampler (which vLLM runs at
K=0 with zero drafts in place of its plain sampler) and the plain sampler. Shares are of each
arm's own profiled time; cProfile inflates Python-heavy parts, so read them as a split, not as
wall time.
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
ARMS = ("none", "kv", "full")
# (label, vLLM 0.32 function: file suffix, function name) for the --profile split
PARTS = (
    ("target forward", "v1/worker/gpu_model_runner.py", "_model_forward"),
    ("drafting call", "v1/worker/gpu_model_runner.py", "propose_draft_token_ids"),
    ("rejection sampler", "v1/sample/rejection_sampler.py", "forward"),
    ("plain sampler", "v1/sample/sampler.py", "forward"),
)


def profile_split(prof) -> dict:
    """Seconds and shares of ``PARTS`` in one arm's cProfile (largest cumulative entry per part)."""
    import pstats

    st = pstats.Stats(prof)
    total = st.total_tt
    out = {"profiled_s": round(total, 3)}
    for label, suffix, name in PARTS:
        cum = max((v[3] for (f, _, n), v in st.stats.items() if n == name and f.endswith(suffix)), default=0.0)
        out[label] = {"s": round(cum, 3), "share": round(cum / total, 4) if total else 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(REPO / "fastmtp_sglang" / "data" / "heads" / "smollm2-135m-fastmtp-k3"))
    ap.add_argument("--arms", default="none,kv", help="comma list of none, kv, full; ratios are to the first")
    ap.add_argument("--batch", type=int, default=16, help="prompts per generate call (default 16)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens each answers (default 32)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds, every arm once each (default 20)")
    ap.add_argument("--profile", action="store_true", help="cProfile every round and report the split")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms or len(set(arms)) != len(arms):
        ap.error(f"--arms {args.arms!r}: give distinct arms out of {', '.join(ARMS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both engines in this process, side by side
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with our callable

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fastmtp_sglang.core.demo_target import materialize_smollm2
    from fastmtp_sglang.core.hardware import cpu_flags, cpu_model
    from fastmtp_sglang.core.prompts import load_prompts, render_chat
    from fastmtp_sglang.vllm_models.k0 import set_mode

    target = str(materialize_smollm2())
    tok = AutoTokenizer.from_pretrained(target)
    texts = [p.text for p in load_prompts(REPO / "bench" / "data" / "spec_bench.jsonl", limit_per_category=2)]
    prompts = [TokensPrompt(prompt_token_ids=tok(render_chat(tok, texts[i % len(texts)]),
                                                 add_special_tokens=False).input_ids)
               for i in range(args.batch)]

    def make(draft: bool):
        spec = {"method": "eagle", "model": args.draft, "num_speculative_tokens": 1,
                "num_speculative_tokens_per_batch_size": [[1, 1024, 0]]} if draft else None
        return LLM(model=target, dtype="float32", speculative_config=spec, max_model_len=2048,
                   enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 30)

    llm_none = make(False) if "none" in arms else None
    llm_draft = make(True) if {"kv", "full"} & set(arms) else None
    engine = {a: (llm_none if a == "none" else llm_draft) for a in arms}
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for a in arms:  # warm-up, every arm
        if a != "none":
            assert engine[a].collective_rpc(set_mode, args=(a,)) == [a]
        engine[a].generate(prompts, sp, use_tqdm=False)

    import cProfile

    profs = {a: cProfile.Profile() for a in arms} if args.profile else {}
    walls: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for a in (arms if r % 2 == 0 else arms[::-1]):
            if a != "none":
                assert engine[a].collective_rpc(set_mode, args=(a,)) == [a]
            if profs:
                profs[a].enable()
            t = time.perf_counter()
            engine[a].generate(prompts, sp, use_tqdm=False)
            walls[a].append(time.perf_counter() - t)
            if profs:
                profs[a].disable()
        print(f"round {r}: " + ", ".join(f"{a} {walls[a][-1]:.2f} s" for a in arms), flush=True)
    first = arms[0]
    ratios = {a: [w / b for w, b in zip(walls[a], walls[first])] for a in arms[1:]}
    res = {
        "command": "python " + " ".join(sys.argv), "cpu": {"model": cpu_model(), "flags": sorted(
            f for f in cpu_flags() if f.startswith(("avx", "amx")) or f == "fma")},
        "batch": args.batch, "tokens": args.tokens, "rounds": args.rounds, "arms": arms,
        "profiled": args.profile, "walls_s": walls,
        "median_s": {a: statistics.median(w) for a, w in walls.items()},
        "paired_ratio_to_" + first: {a: {"median": statistics.median(x), "above_1": sum(v > 1 for v in x),
                                          "all": [round(v, 4) for v in x]} for a, x in ratios.items()},
    }
    if profs:
        res["profile_split"] = {a: profile_split(p) for a, p in profs.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "walls_s"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
