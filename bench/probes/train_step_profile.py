"""Where a cached-feature training step's time goes on CPU: collate (feature cache -> batch), the
head's K-step forward, the loss (projection over the table + KL/CE), backward and the optimizer,
timed separately over the same batches for each setting, plus a torch.profiler table of one
step. Nothing else should run meanwhile.

    python bench/probes/train_step_profile.py --features DIR --data DATA.jsonl --init HEAD_DIR \
        [--vocab TABLE.pt] [--batch-size 8] [--steps 6] [--settings shipped,...] [--out FILE.json]

A setting is a `name` from SETTINGS below: each is one change to the shipped run's step
(bf16 autocast, KL to the cached top-32, batch 8, max-len 512, --ce-chunk 0, grouped by length).
Reports targets per second (scored step-1 positions, as train_log.jsonl's "targets") per
setting: all timed batches' targets over their summed step time (the first batch is a warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

SETTINGS = {
    "shipped": {},
    "batch16": {"batch_size": 16},
    "batch32": {"batch_size": 32},
    "fp32": {"compute_dtype": "float32"},
    "fused128": {"ce_chunk": 128},
    "fused256": {"ce_chunk": 256},
    "fused512": {"ce_chunk": 512},
    "fused512-batch16": {"ce_chunk": 512, "batch_size": 16},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--vocab", default=str(REPO / "vocab_tables/smollm2/en-16384.pt"))
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps per setting")
    ap.add_argument("--settings", default="shipped")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one "
                    "step of the first setting")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from fastmtp_sglang.core.demo_target import materialize_smollm2
    from fastmtp_sglang.core.draft_dir import load_draft_dir
    from fastmtp_sglang.core.head import FastMTPHead
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.training.config import autocast
    from fastmtp_sglang.training.data import collate, epoch_batches, load_examples
    from fastmtp_sglang.training.features import FeatureStore
    from fastmtp_sglang.training.objective import Projection, batch_loss

    tdir = args.target or materialize_smollm2()
    target = load_target(tdir)
    target.model.requires_grad_(False)
    examples, _ = load_examples(Path(args.data), target.tokenizer, target.lm_head.weight.shape[0],
                                args.max_len)
    store = FeatureStore(args.features)
    table = torch.load(args.vocab)
    vocab_ids = table["ids"] if isinstance(table, dict) else table
    proj = Projection(target.lm_head, vocab_ids)
    draft = load_draft_dir(args.init)
    lengths = [len(e.ids) for e in examples]
    results = {}
    for si, name in enumerate(args.settings.split(",")):
        s = {"batch_size": 8, "compute_dtype": "bfloat16", "ce_chunk": 0, "kl_topk": 32,
             **SETTINGS[name]}
        head = FastMTPHead(draft.head_config, target.embed, target.lm_head)
        head.load_state_dict(draft.state_dict, strict=True)
        head = head.float().train()
        opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
        batches = epoch_batches(list(range(len(examples))), lengths, s["batch_size"], 0, 0, True)
        phases: dict[str, list[float]] = {k: [] for k in ("collate", "forward+loss", "backward",
                                                          "optimizer", "total")}
        tps = []
        n_targets = 0
        active = None
        for bi, idxs in enumerate(batches[: args.steps + 1]):
            t0 = time.perf_counter()
            tk = [tuple(x[:, :s["kl_topk"]] for x in store.topk(i)) for i in idxs]
            batch = collate([examples[i] for i in idxs], [store(i) for i in idxs],
                            torch.device("cpu"), tk)
            t1 = time.perf_counter()
            prof = None
            if args.profile and si == 0 and bi == 1:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            if prof is None and args.profile and si == 0 and bi > 1:
                prof = active
            with autocast("cpu", s["compute_dtype"]):
                loss, st = batch_loss(head, batch, proj, 3, [0.51, 0.31, 0.18], "kl", "serve",
                                      s["ce_chunk"])
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            active = prof
            if prof is not None and bi == args.steps:
                prof.__exit__(None, None, None)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            if bi == 0:
                continue  # warm-up
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                phases[k].append(v)
            tps.append(st["targets"][0] / (t4 - t0))
            n_targets += st["targets"][0]
        med = {k: round(statistics.median(v), 4) for k, v in phases.items()}
        results[name] = {"setting": s, "median_s": med,
                         "targets_per_s": round(n_targets / sum(phases["total"]), 1),
                         "median_targets_per_s": round(statistics.median(tps), 1),
                         "targets_per_s_all": [round(x, 1) for x in tps]}
        print(name, json.dumps(results[name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
