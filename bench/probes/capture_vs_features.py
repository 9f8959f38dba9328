"""Are the features distill keeps in bf16 (the engine's states and top-k, decode/capture.py) as
good as a `fastmtp features` pass in bf16? Both against the fp32 truth, on the same rows.

    python bench/probes/capture_vs_features.py [--prompts P.jsonl] [--limit 4] [--out DIR]

Distils ``--limit`` prompts x 2 samples (T=0.6 and greedy, 64 new tokens) with
``--with-features`` (bf16 engine), builds `fastmtp features` over the same file in bf16 and in
fp32, and prints per row the relative error of the stored states against fp32 (mean, max over
positions) and the agreement of the top-1 id. The engine's path (lean forward, prepared weights,
one-pass attention over a bf16 KV cache) reorders bf16 arithmetic, so its states are not the
transformers forward's bit for bit; what matters is that they are no further from fp32.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="fastmtp_sglang/data/train_prompts/synth_tasks.jsonl")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()

    from fastmtp_sglang.core.demo_target import default_cache_dir, materialize_smollm2
    from fastmtp_sglang.training.features import FeatureStore

    target = str(materialize_smollm2(default_cache_dir(), progress=False))
    work = Path(args.out or tempfile.mkdtemp(prefix="capture_vs_features-"))
    work.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "fastmtp_sglang"]
    data = work / "d.jsonl"

    def run(*a: str) -> None:
        subprocess.run(exe + list(a), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    run("distill", "--target", target, "--batch-size", "8", "--prompts", args.prompts,
        "--limit", str(args.limit), "--n", "2", "--temperature", "0.6,0", "--max-new-tokens", "64",
        "--out", str(data), "--with-features", str(work / "engine.features"), "--max-len", "512",
        "--no-progress")
    for name, dt in (("bf16", "bfloat16"), ("fp32", "float32")):
        run("features", "--target", target, "--data", str(data), "--out", str(work / f"{name}.features"),
            "--max-len", "512", "--topk", "32", "--dtype", dt, "--feature-dtype", dt, "--no-progress")
    truth = FeatureStore(work / "fp32.features")
    stores = {"engine bf16 (distill)": FeatureStore(work / "engine.features"),
              "features bf16": FeatureStore(work / "bf16.features")}
    print(f"{len(truth)} rows; last position left out (distill stores zeros there)")
    for i in range(len(truth)):
        ht, it = truth(i)[:-1].float(), truth.topk(i)[0][:-1]
        cells = []
        for name, s in stores.items():
            h, ids = s(i)[:-1].float(), s.topk(i)[0][:-1]
            rel = (h - ht).norm(dim=1) / ht.norm(dim=1)
            cells.append(f"{name}: rel err mean {rel.mean():.4f} max {rel.max():.4f}, "
                         f"top-1 agrees {(ids[:, 0] == it[:, 0]).float().mean():.3f}")
        print(f"row {i} ({len(ht)} positions) | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
