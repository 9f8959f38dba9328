#!/usr/bin/env bash
# Training levers for acceptance when SAMPLING (T=1): the shipped head, warm-started, fine-tuned
# by arms that differ only in their loss, on the same rows, features, table, seed, data order
# and optimizer steps (one `fastmtp curve`, one point per arm):
#   kl    the shipped loss: KL to the target's top-32 (--loss kl --kl-topk 32): the control
#   acc   -log sum_x min(p_x, q_x) over the top-32 (--loss acc --kl-topk 32): the acceptance
#         rate of sampled verification, what a T=1 server accepts
#   k6    opt-in (ARMS="kl acc k6"): kl trained at K=6 (--steps 6). The head is one block applied
#         recursively, so a K=3 head trains at K=6 as it is; but the step weights change too
#         (beta 0.6: step 1 weighs 0.42 instead of 0.51) and a step costs ~2x (~25 min an arm)
#   hyb   opt-in (ARMS="kl hyb"): kl, hybrid-aware (--lookup-weight LOOKUP_WEIGHT, default 0.25):
#         a target that prompt lookup (as `--steps auto` runs it) would have proposed right from
#         the same anchor weighs that much, so the head's capacity goes where lookup is not right
#   hyb3  opt-in: hyb counting only lookup matches of 3 tokens or more (two-token matches lose
#         to the head on average: bench/results/sampling_levers/README.md)
#
#   bash bench/pipelines/sampling_levers.sh [WORK]          # WORK default runs/sampling-levers
#   ARMS="kl acc k6" TOKENS=600000 LR=1e-3 bash bench/pipelines/sampling_levers.sh
#
# Every stage resumes: rerun the same command after a stop (the data file and the init snapshot
# are never rewritten; the feature build continues from its last complete 1M-token shard (~1.2M
# tokens stored here: 2 shards); each arm from its last --save-every checkpoint; a finished arm is
# skipped). Don't change TOKENS, LR, BATCH, SEED or MAX_LEN between a stop and its rerun.
#
# Data: the committed self-distilled rows with their growth (bench/train_data/, restored into
# WORK/src/), never bench/data or ../shared/eval. Rows 0-199 are the held-out rows every head card
# scores (no training row shares a prompt with them: DISJOINT as runs 2-6); the training rows are
# whole prompts (all their samples, 4-8 each) drawn at random (SEED) from the rest until TOKENS
# usable response tokens, so the mix of sources follows the committed data and the feature build
# runs each prompt once. The shipped head has trained on every one of these rows before (runs 1-6
# covered rows 200-46,242): this is a fine-tune on seen text, the same for every arm.
#
# Layout (WORK):
#   src/distill.jsonl          the restored data (base + growth, sha256 checked)
#   init/                      a snapshot of fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3
#                              (weights + its own table en-16384.pt, which every arm keeps)
#   data.jsonl                 training rows (shuffled prompts), then the 200 held-out rows last
#   data.summary.json          rows, prompts, tokens per source and per sampling temperature
#   heldout_prompts.jsonl      the held-out rows' distinct prompts (for `fastmtp bench --prompts`)
#   features/                  the target's hidden states + top-32 log-probs (max-len 512, bf16)
#   curve/<arm>/<TOKENS>/      each arm's checkpoint = its final draft directory (config.json,
#                              model.safetensors, en-16384.pt, train_log.jsonl, trainer_state.pt)
#   curve/curve.json, curve.md held-out greedy walk (K=SCORE_K) per arm, train seconds, step curve
#   heads/<arm> -> ../curve/<arm>/<TOKENS>    for `fastmtp bench --draft WORK/heads/<arm>`
#   timings.log                each stage's wall seconds
#
# Expected time on 2 cores (estimates, not measured here): restore + draw ~1 min; features
# ~12-17 min (the draw at TOKENS=600K: ~3,900 rows of ~530 prompts, ~0.62M response + ~0.08M
# prompt tokens computed, ~1.2M stored; run 2's features computed 1.59M (2.32M stored) in 39 min
# on an AMD EPYC, ~680/s); each K=3 arm ~11-14 min (~930 optimizer steps at batch 4; ~780 response
# tokens/s on the EPYC in levers/ and head_v8/, AMX somewhat faster) + ~1 min of held-out scores;
# k6 ~2x. kl + acc in all: ~40-50 min.
# The held-out score here is greedy; the sampled comparison is `fastmtp bench --temperature 1` on
# WORK/heads/<arm> (the command is printed at the end).
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-runs/sampling-levers}
TOKENS=${TOKENS:-600000}      # response tokens per arm (one epoch)
ARMS=${ARMS:-"kl acc"}
LOOKUP_WEIGHT=${LOOKUP_WEIGHT:-0.25}  # the hyb arm's weight of targets prompt lookup covers
LR=${LR:-1e-3}                # warm start: at 3e-3 (head_v8) the held-out walk dipped 1.92 -> 1.86
                              # at step 500 and needed ~2,000 steps to climb back; an arm here has ~1,000
BATCH=${BATCH:-4}
SEED=${SEED:-0}               # the prompt draw and the trainer's data order
MAX_LEN=${MAX_LEN:-512}
EVAL_EVERY=${EVAL_EVERY:-250} # optimizer steps between held-out scores (at the arm's own K)
SAVE_EVERY=${SAVE_EVERY:-100} # optimizer steps between checkpoints (what a stop loses at most)
SCORE_K=${SCORE_K:-3}         # K of every arm's final held-out walk (the head card's: K=3)
INIT_SRC=${INIT_SRC:-fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3}
BIN=${BIN:-.venv/bin}
HELD=200
T=$("$BIN/python" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2; print(materialize_smollm2())")
arms=()
for a in $ARMS; do
    case $a in
        kl) arms+=(--arm "kl=--loss kl --kl-topk 32") ;;
        acc) arms+=(--arm "acc=--loss acc --kl-topk 32") ;;
        k6) arms+=(--arm "k6=--loss kl --kl-topk 32 --steps 6") ;;
        hyb) arms+=(--arm "hyb=--loss kl --kl-topk 32 --lookup-weight $LOOKUP_WEIGHT") ;;
        hyb3) arms+=(--arm "hyb3=--loss kl --kl-topk 32 --lookup-weight $LOOKUP_WEIGHT --lookup-min-match 3") ;;
        *) echo "ARMS holds kl, acc, k6, hyb and/or hyb3" >&2; exit 1 ;;
    esac
done
mkdir -p "$W"
stage() {  # stage NAME CMD...: run it, log its wall seconds
    local t0=$SECONDS
    echo "== $1 ($(date -u +%H:%M:%S) UTC)" >&2
    "${@:2}"
    echo "$1 $((SECONDS - t0)) s ($(date -u +%F\ %T) UTC)" >> "$W/timings.log"
}
[[ -f $W/cpu.txt ]] || { lscpu | grep -E "Model name|^CPU\(s\)"; grep -o "amx_bf16\|avx512_bf16" /proc/cpuinfo | sort -u; } > "$W/cpu.txt" || true

# 1. the init head, snapshotted (a head shipped later must not change a resumed run's start)
if [[ ! -f $W/init/config.json ]]; then
    rm -rf "$W/init.tmp"
    cp -r "$INIT_SRC" "$W/init.tmp"
    mv "$W/init.tmp" "$W/init"
fi
TABLE=$W/init/en-16384.pt
[[ -f $TABLE && -f ${TABLE%.pt}.json ]] || { echo "$TABLE (+ .json) missing in $INIT_SRC" >&2; exit 1; }

# 2. the data: restore, then draw whole prompts (never the held-out rows or their prompts)
[[ -f $W/src/distill.jsonl ]] || stage restore "$BIN/python" bench/train_data.py restore "$W/src" --with-growth
if [[ ! -f $W/data.jsonl ]]; then
    stage draw "$BIN/python" - "$W/src/distill.jsonl" "$W/data.jsonl" "$W/data.summary.json" \
        "$TOKENS" "$HELD" "$MAX_LEN" "$SEED" <<'PY'
import json, os, random, sys
src, dst, summary = sys.argv[1:4]
tokens, held, max_len, seed = (int(float(x)) for x in sys.argv[4:8])
with open(src, encoding="utf-8") as f:
    lines = f.readlines()
held_prompts = {json.loads(x)["prompt_id"] for x in lines[:held]}
by_prompt, skipped = {}, {"shares_a_heldout_prompt": 0, "prompt_too_long": 0}
for i in range(held, len(lines)):
    r = json.loads(lines[i])
    p, q = len(r["prompt_ids"]), len(r["response_ids"])
    if r["prompt_id"] in held_prompts:
        skipped["shares_a_heldout_prompt"] += 1
        continue
    if p + 8 > max_len or q == 0:      # no room for a response in the window: training drops it
        skipped["prompt_too_long"] += 1
        continue
    by_prompt.setdefault(r["prompt_id"], []).append(
        (i, p, min(q, max_len - p), (r.get("sampling_params") or {}).get("temperature")))
ids = sorted(by_prompt)
random.Random(seed).shuffle(ids)
take, n, n_prompt, n_prompt_once, n_prompts, by_source, by_temp = [], 0, 0, 0, 0, {}, {}
for pid in ids:
    if n >= tokens * 1.04:             # margin: `fastmtp curve --tokens` needs >= TOKENS usable
        break
    rows = by_prompt[pid]
    src_name = pid.rsplit("-", 1)[0]
    for i, p, u, temp in rows:
        take.append(i)
        n += u
        n_prompt += p
        by_source[src_name] = by_source.get(src_name, 0) + u
        by_temp[str(temp)] = by_temp.get(str(temp), 0) + u
    n_prompt_once += rows[0][1]
    n_prompts += 1
if n < tokens:
    sys.exit(f"draw: only {n} usable response tokens outside the held-out prompts; lower TOKENS")
tmp = dst + ".tmp"
with open(tmp, "w", encoding="utf-8") as f:
    f.writelines([lines[i] for i in take] + lines[:held])
os.replace(tmp, dst)
info = {"source": src, "seed": seed, "tokens_asked": tokens, "heldout_rows": held,
        "train_rows": len(take), "train_prompts": n_prompts, "response_tokens_usable": n,
        "prompt_tokens_stored": n_prompt, "prompt_tokens_computed_once": n_prompt_once,
        "row_range": [min(take), max(take)], "skipped": skipped,
        "response_tokens_by_source": dict(sorted(by_source.items(), key=lambda kv: -kv[1])),
        "response_tokens_by_temperature": by_temp}
with open(summary, "w") as f:
    json.dump(info, f, indent=1)
print(f"draw: {info['train_rows']} training rows of {info['train_prompts']} prompts, {n} usable "
      f"response tokens (+{n_prompt} prompt tokens stored, {n_prompt_once} computed), + {held} "
      f"held-out rows -> {dst}")
PY
fi
[[ -f $W/heldout_prompts.jsonl ]] || "$BIN/python" bench/demo_data.py heldout "$W/src/distill.jsonl" "$W/heldout_prompts.jsonl" "$HELD"
read -r usable _ <<< "$("$BIN/python" bench/demo_data.py usable "$W/data.jsonl" "$HELD" "$T" "$MAX_LEN")"
[[ ${usable:-} =~ ^[0-9]+$ ]] || { echo "sampling_levers: could not count $W/data.jsonl's usable tokens" >&2; exit 1; }
if (( TOKENS > usable )); then
    echo "sampling_levers: $W/data.jsonl holds $usable usable response tokens, TOKENS asks $TOKENS" >&2
    exit 1
fi

# 3. the feature cache (the target once over data.jsonl; every arm reads it)
[[ -f $W/features/index.json ]] || stage features "$BIN/fastmtp" features --target "$T" \
    --data "$W/data.jsonl" --out "$W/features" --max-len "$MAX_LEN" --topk 32 --dtype bfloat16

# 4. the arms: one point each at TOKENS, same rows / order / steps; a rerun skips finished arms
stage "curve[$ARMS]" "$BIN/fastmtp" curve --target "$T" --init "$W/init" --data "$W/data.jsonl" \
    --out "$W/curve" --features "$W/features" --tokens "$TOKENS" --heldout-rows "$HELD" \
    "${arms[@]}" --serve-steps "$SCORE_K" \
    -- --steps 3 --epochs 1 --batch-size "$BATCH" --max-len "$MAX_LEN" --lr "$LR" --seed "$SEED" \
       --dtype bfloat16 --compute-dtype bfloat16 --group-by-length --save-every "$SAVE_EVERY" \
       --eval-every "$EVAL_EVERY" --vocab "$TABLE"

mkdir -p "$W/heads"
for a in $ARMS; do
    d=$W/curve/$a/$TOKENS
    [[ -f $d/model.safetensors ]] && ln -sfn "../curve/$a/$TOKENS" "$W/heads/$a"
done
cat "$W/curve/curve.md"
cat "$W/timings.log"
echo
echo "draft dirs: $W/heads/{$(tr ' ' , <<< "$ARMS")} (the shipped head's start: $W/init)"
echo "sampled acceptance, each head (and $W/init) in turn, e.g.:"
echo "  $BIN/fastmtp bench --engine reference --target $T --draft $W/heads/kl --steps 3" \
     "--prompts bench/data/spec_bench.jsonl --limit-per-category 2 --max-new-tokens 128 --repeats 3" \
     "--temperature 1 --seed 0 --dtype auto --no-progress --out $W/bench-t1/kl"
