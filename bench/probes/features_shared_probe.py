"""The feature cache's build with and without the shared-prompt path, on real distilled rows:
each prompt run once and its samples' responses on its KV cache, against every sequence whole.
Builds alternate (whole, shared, whole, shared, ...) into temporary folders; tokens stored per
second of build. Nothing else should run meanwhile.

    python bench/probes/features_shared_probe.py --target T --data D.jsonl [--rows 400]
        [--rounds 2] [--dtype bfloat16] [--topk 32] [--max-len 1024] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rows", type=int, default=400, help="the data file's first rows")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.decode.costs import cpu_description
    from fastmtp_sglang.training.data import load_examples
    from fastmtp_sglang.training.features import build_features, make_key, shared_prompt_groups

    torch.manual_seed(0)
    t = load_target(args.target, dtype=args.dtype)
    t.model.requires_grad_(False)
    tmp = Path(tempfile.mkdtemp(prefix="features-probe-"))
    try:
        data = tmp / "rows.jsonl"
        with open(args.data, encoding="utf-8") as f, data.open("w", encoding="utf-8") as g:
            for i, line in enumerate(f):
                if i >= args.rows:
                    break
                g.write(line)
        ex = load_examples(data, t.tokenizer, int(t.config["vocab_size"]), args.max_len)[0]
        groups, rest = shared_prompt_groups(ex, list(range(len(ex))))
        tokens = sum(len(e.ids) for e in ex)
        prompt = sum(e.prompt_len for e in ex)
        key = make_key(t, args.target, data, args.max_len, None, "bfloat16", args.topk)
        runs: dict[str, list[float]] = {"whole": [], "shared": []}
        for rnd in range(args.rounds):
            for name in ("whole", "shared"):
                out = tmp / f"{name}-{rnd}"
                t0 = time.perf_counter()
                build_features(t, ex, out, key, progress=False, log=lambda s: None,
                               share_prompts=name == "shared")
                runs[name].append(tokens / (time.perf_counter() - t0))
                shutil.rmtree(out)
                print(f"round {rnd} {name}: {runs[name][-1]:.0f} tok/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = cpu_description()
    res = {"rows": len(ex), "tokens": tokens, "prompt_tokens": prompt,
           "groups": len(groups), "rows_in_groups": sum(map(len, groups)), "alone": len(rest),
           "tok_s": runs, "median": {k: statistics.median(v) for k, v in runs.items()},
           "dtype": args.dtype, "topk": args.topk, "max_len": args.max_len,
           "cpu": f"{cpu['model']}; flags {' '.join(cpu['flags'])}; {cpu['threads']} threads",
           "torch_threads": torch.get_num_threads()}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
