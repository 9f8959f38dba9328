#!/usr/bin/env bash
# Seconds per training epoch with and without the target-feature cache, and with the head's
# forward/backward in fp32 or under bf16 autocast (--compute-dtype), same data and settings, on the
# demo target (CPU). Writes bench/results/train_throughput/results.{json,md}.
#
#   bash bench/pipelines/train_throughput.sh [WORKDIR] [N_PROMPTS]
#
# A small self-distilled set (N_PROMPTS training prompts, one sample each, in-process), then
# `fastmtp train` for 2 epochs four ways: recomputing the target every epoch (--cache-hidden-gb 0)
# or with --features (the cache is built before epoch 1, counted in it), each with the head in
# fp32 and in bf16 autocast. Epoch times come from train_log.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-runs/train-throughput}
N=${2:-64}
BIN=${BIN:-.venv/bin}
mkdir -p "$W"
T=$("$BIN/python" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2; print(materialize_smollm2())")
[[ -f $W/init/config.json ]] || "$BIN/fastmtp" init-head --target "$T" "$W/init"
"$BIN/fastmtp" distill --target "$T" --prompts bench/train_prompts/alpaca_eval_instructions.jsonl \
    --limit "$N" --max-new-tokens 256 --batch-size 64 --no-progress \
    --exclude bench/data/spec_bench.jsonl bench/data/c_eval_zh.jsonl --out "$W/data.jsonl"
common=(--target "$T" --init "$W/init" --data "$W/data.jsonl" --epochs 2 --steps 3 --batch-size 8
        --max-len 512 --lr 1e-3 --vocab vocab_tables/smollm2/en-16384.pt --heldout-fraction 0
        --overwrite --no-progress)
for cd in float32 bfloat16; do
    /usr/bin/time -v "$BIN/fastmtp" train "${common[@]}" --compute-dtype $cd --cache-hidden-gb 0 \
        --out "$W/no-cache-$cd" 2> "$W/no-cache-$cd.time"
    rm -rf "$W/features"   # each cached run builds its cache inside its first epoch
    /usr/bin/time -v "$BIN/fastmtp" train "${common[@]}" --compute-dtype $cd --features "$W/features" \
        --out "$W/cached-$cd" 2> "$W/cached-$cd.time"
    cp "$W/features/index.json" "$W/cached-$cd.features.json"
done
# the cheapest head epoch: bf16, length-grouped batches (the fused loss is the default)
rm -rf "$W/features"
/usr/bin/time -v "$BIN/fastmtp" train "${common[@]}" --compute-dtype bfloat16 --group-by-length \
    --features "$W/features" --out "$W/cached-bfloat16-grouped" 2> "$W/cached-bfloat16-grouped.time"
cp "$W/features/index.json" "$W/cached-bfloat16-grouped.features.json"
"$BIN/python" - "$W" <<'PY'
import json, re, sys
from pathlib import Path
w = Path(sys.argv[1])
def epochs(d):
    log = [json.loads(l) for l in (w / d / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if r.get("event") == "step"]
    per = len(steps) // 2
    e1 = steps[per - 1]["elapsed_s"]
    return e1, steps[-1]["elapsed_s"] - e1
def peak(d):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", (w / f"{d}.time").read_text())
    return int(m.group(1)) / 2**20 if m else None
data = [json.loads(l) for l in (w / "data.jsonl").read_text().splitlines()]
toks = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in data)
rows = {}
builds = []
for d in ("no-cache-float32", "cached-float32", "no-cache-bfloat16", "cached-bfloat16",
          "cached-bfloat16-grouped"):
    e1, e2 = epochs(d)
    if d.startswith("cached"):
        build = json.loads((w / f"{d}.features.json").read_text())["build_seconds"]
        e1 += build  # the cache is built before the first step
        builds.append(build)
    rows[d] = {"epoch1_s": round(e1, 1), "epoch2_s": round(e2, 1), "tokens_per_s_epoch2": round(toks / e2, 1),
               "peak_rss_gib": round(peak(d), 2)}
out = Path("bench/results/train_throughput"); out.mkdir(parents=True, exist_ok=True)
meta = {"command": f"bash bench/pipelines/train_throughput.sh {sys.argv[1]}", "sequences": len(data), "tokens": toks,
        "settings": "K=3, batch 8, max-len 512, en-16384 loss table, 2 epochs, fp32 target; "
                    "run names end in the head's --compute-dtype; the last run adds "
                    "--group-by-length"}
(out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
lines = ["# Training throughput: with and without the target-feature cache", "",
         f"Command: `{meta['command']}`; {len(data)} sequences, {toks} tokens (prompt + response); "
         f"{meta['settings']}. Epoch times from train_log.jsonl (optimizer steps only; a cached run's "
         f"epoch 1 includes building its cache, {builds} s).", "",
         "| run | epoch 1 s | epoch 2 s | epoch 2 tokens/s | epoch 1 / epoch 2 | peak RSS GiB |", "|---|---|---|---|---|---|"]
for d, r in rows.items():
    lines.append(f"| {d} | {r['epoch1_s']} | {r['epoch2_s']} | {r['tokens_per_s_epoch2']} | "
                 f"{r['epoch1_s'] / r['epoch2_s']:.2f}x | {r['peak_rss_gib']} |")
lines.append("")
for cd in ("float32", "bfloat16"):
    lines.append(f"- {cd} head: epoch 2 without the cache / with it: "
                 f"{rows['no-cache-' + cd]['epoch2_s'] / rows['cached-' + cd]['epoch2_s']:.2f}x.")
lines.append(f"- no cache, fp32 head (what training did before the cache) / cached bf16 head, epoch 2: "
             f"{rows['no-cache-float32']['epoch2_s'] / rows['cached-bfloat16']['epoch2_s']:.2f}x.")
lines.append(f"- cached bf16 head, grouped, no recompute: epoch 1 (with the cache build) / epoch 2: "
             f"{rows['cached-bfloat16-grouped']['epoch1_s'] / rows['cached-bfloat16-grouped']['epoch2_s']:.2f}x.")
(out / "results.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
