"""vLLM's K=0 steps with our draft: KV-only (``FASTMTP_VLLM_K0=kv``, the default) against vLLM's
own full draft forward (``full``), on the demo target with the shipped head.

    /tmp/fastmtp-ci-vllm-venv/bin/python bench/vllm_k0_check.py --out /tmp/k0check

Three ``vllm.LLM`` runs (each in its own process, fp32, greedy) of the same prompts in one
``generate`` call, the first prompt answering ``--long`` tokens and the others ``--short``: K=0
without a draft, then the draft with K per batch size ``[[1, 1, K], [2, 256, 0]]`` under ``kv``
and under ``full``. While several requests run the batch decodes at K=0 (our draft writes its KV
cache only, or vLLM's whole forward runs); when the first prompt is left alone it drafts at K,
over KV slots written at K=0. Checked: every output equals K=0's (lossless); ``kv`` and
``full`` leave the draft's KV cache the same bit for bit (a digest of the whole cache, read in
vLLM's worker) and accept the same drafts at every position. Written
to ``--out``: ``results.json``. Wall times are printed for direction only (one small batch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from vllm_e2e import DEFAULT_DRAFT, DEFAULT_PROMPTS, run_vllm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT), help="FastMTP draft directory")
    ap.add_argument("--steps", type=int, default=3, help="K when one request runs (default 3)")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompt file (JSONL)")
    ap.add_argument("--categories", default="coding,math_reasoning,writing",
                    help="one prompt of each (comma-separated; the first answers --long tokens)")
    ap.add_argument("--long", type=int, default=64, help="tokens the first prompt answers")
    ap.add_argument("--short", type=int, default=16, help="tokens the others answer")
    ap.add_argument("--out", required=True, help="output directory (results.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from transformers import AutoTokenizer

    from fastmtp_sglang.core.demo_target import materialize_smollm2
    from fastmtp_sglang.core.prompts import load_prompts, render_chat

    target = str(materialize_smollm2())
    tok = AutoTokenizer.from_pretrained(target)
    prompts = []
    for i, p in enumerate(load_prompts(args.prompts, limit_per_category=1,
                                       categories=args.categories.split(","))):
        prompts.append({"id": p.id, "ids": tok(render_chat(tok, p.text), add_special_tokens=False).input_ids,
                        "max_new_tokens": args.long if i == 0 else args.short})
    if len(prompts) < 2:
        raise SystemExit("need at least two prompts (--categories): K=0 runs while several requests do")
    out = Path(args.out)
    work = out / "_work"
    work.mkdir(parents=True, exist_ok=True)
    table = [[1, 1, args.steps], [2, 256, 0]]
    base = {"target": target, "draft": str(Path(args.draft).resolve()), "dtype": "float32",
            "prompts": prompts, "max_new_tokens": args.long, "max_model_len": 2048, "together": True}
    # the engine core in the caller's process: generate adds every prompt before the first step,
    # so the batches (and which steps run at K=0) are the same in every run, whatever the load
    one = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runs = {"k0": run_vllm({**base, "steps": 0, "tag": "-k0", "env": one}, work)}
    for mode in ("kv", "full"):
        print(f"vLLM K per batch size {table}, FASTMTP_VLLM_K0={mode} ...", flush=True)
        # (the digest comes back from vLLM's worker through collective_rpc: a callable, pickled)
        runs[mode] = run_vllm({**base, "steps": args.steps, "k_per_batch_size": table,
                               "env": {**one, "FASTMTP_VLLM_K0": mode, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
                               "draft_kv_digest": True, "tag": f"-{mode}"}, work)
    from fastmtp_sglang.vllm_models.k0 import LOG_LINE

    # the plugin says so at its first KV-only step: kv must have taken that path, full not
    logged = {m: LOG_LINE in (work / f"vllm-float32-{args.steps}-{m}.log").read_text() for m in ("kv", "full")}
    ids = {name: [r["output_ids"] for r in run["rows"]] for name, run in runs.items()}
    summary = {
        "prompts": len(prompts), "table": table,
        "kv_same_as_k0": ids["kv"] == ids["k0"], "full_same_as_k0": ids["full"] == ids["k0"],
        "kv_only_logged": logged,
        "draft_kv_same": runs["kv"]["draft_kv_digest"] == runs["full"]["draft_kv_digest"],
        "drafts": {m: runs[m]["drafts"] for m in ("kv", "full")},
        "accepted_per_pos": {m: runs[m]["accepted_per_pos"] for m in ("kv", "full")},
        "wall_s": {m: round(runs[m]["wall_s"], 3) for m in runs},
    }
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    shutil.rmtree(work)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
