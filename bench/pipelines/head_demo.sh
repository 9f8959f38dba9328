#!/usr/bin/env bash
# The demo head (issue 11): the ablation's recipe (bench/pipelines/ablation.sh, bench/results/ablation/) on
# as much of the self-distilled data as POINTS asks, as points of one learning curve, so the head
# that ships is also the curve's last point.
#
#   POINTS=940000 bash bench/pipelines/head_demo.sh [PIPELINE_DIR] [OUT]
#   ARMS="fastmtp vanilla" LOSS=kl LR=1e-3 POINTS=400000,1000000 bash bench/pipelines/head_demo.sh
#   POINTS=1300000 EPOCHS=4 LR=6e-3 EVAL_EVERY=250 RESULTS=bench/results/head_steps \
#       bash bench/pipelines/head_demo.sh runs/demo-pipeline-v2 runs/demo-pipeline-v2/head-steps
#   INIT=D_TRAINED POINTS=1290000 EPOCHS=1 LR=3e-3 ...   # a warm restart from a trained head; link
#       data.jsonl, features/ and table/ from the first run's OUT to reuse its feature cache
#   INIT=fastmtp_sglang/data/heads/smollm2-135m-fastmtp-k3 FROM_ROW=15872 DISJOINT=1 EPOCHS=2 LR=3e-3 \
#       POINTS=... ...   # continue the shipped head on the rows appended after its training rows
#       (it was trained up to row 15,872; put its table at OUT/table/en-16384.pt first: a head keeps
#       the table it learnt; POINTS at most the usable tokens (checked before the features run), or all)
#   REUSE=runs/data-v3/snap-15872.features ...   # copy the rows a finished cache over (a superset
#       of) these rows holds instead of running the target again (`fastmtp features --reuse`)
#
# Layout as bench/pipelines/curve_demo.sh and bench/pipelines/ablation.sh: the first 200 rows of distill.jsonl are
# the held-out rows, the training prefixes start after them, so the points here continue the
# ablation's 120K-token point on the same held-out text. The draft table (en-16384) is built from
# the target's own responses in the training rows (never the held-out rows or evaluation files);
# the feature cache stores the target's top-32 log-probabilities for the KL loss. Every step
# resumes: rerun the same command after a stop.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-runs/demo-pipeline-v2}
OUT=${2:-$W/head}
POINTS=${POINTS:-940000}   # ~947K usable response tokens after the held-out rows
ARMS=${ARMS:-fastmtp}
LOSS=${LOSS:-kl}
BATCH=${BATCH:-8}             # sequences per optimizer step (levers: 4 = twice the steps, +0.03 held-out)
BETA=${BETA:-0.6}             # step-weight decay, w_k ~ BETA^(k-1): lower weighs step 1 more
LR=${LR:-1e-3}
EPOCHS=${EPOCHS:-2}
SIZE=${SIZE:-16384}
EVAL_EVERY=${EVAL_EVERY:-0}   # optimizer steps between held-out scores (the curve in steps); 0 = per epoch
RESULTS=${RESULTS:-bench/results/head_demo}
INIT=${INIT:-}                # a trained head to continue from (a warm restart); default: the pipeline's init head
DISJOINT=${DISJOINT:-0}       # 1: no training row (or table text) shares a prompt with a held-out row
REUSE=${REUSE:-}              # feature caches to copy rows from (space-separated)
FROM_ROW=${FROM_ROW:-}        # training rows start at this row of distill.jsonl (default: after the
                              # held-out rows); with INIT, a warm restart on rows the head never saw
REPLAY=${REPLAY:-}            # with FROM_ROW: about this many response tokens of older rows mixed
REPLAY_FROM=${REPLAY_FROM:-}  # in (drawn from rows REPLAY_FROM to FROM_ROW), shuffled together
MAX_LEN=${MAX_LEN:-512}       # the training window in tokens (1024 for the long prompts: a row of
                              # <= 512 tokens keeps its features, so REUSE still copies it)
HELD=200
if [[ -n $REPLAY && $POINTS != all ]] || [[ -n $REPLAY_FROM && -z $REPLAY ]]; then
    echo "head_demo: REPLAY needs POINTS=all (a point would take the first tokens of the shuffled mix)," \
        "and REPLAY_FROM needs REPLAY" >&2
    exit 1
fi
source bench/pipelines/demo_env.sh
mkdir -p "$OUT"
max=$([[ $POINTS == all ]] && echo 1000000000 || tr , "\n" <<< "$POINTS" | sort -n | tail -1)
[[ -f $OUT/data.jsonl ]] || "$BIN/python" bench/demo_data.py prefix "$W/distill.jsonl" "$OUT/data.jsonl" "$max" "$HELD" \
    $( ((DISJOINT)) && echo --disjoint ) ${FROM_ROW:+--from-row "$FROM_ROW"} \
    ${REPLAY:+--replay "$REPLAY"} ${REPLAY_FROM:+--replay-from "$REPLAY_FROM"}
# the largest point must fit the usable tokens (cut at --max-len), known before the features run;
# POINTS=all trains on all of them
read -r usable _ <<< "$("$BIN/python" bench/demo_data.py usable "$OUT/data.jsonl" "$HELD" "$T" "$MAX_LEN")"
if [[ $POINTS == all ]]; then
    POINTS=$usable
elif (( max > usable )); then
    echo "head_demo: POINTS asks for $max response tokens; $OUT/data.jsonl holds $usable usable" \
        "ones before its held-out rows: lower POINTS (or POINTS=all)" >&2
    exit 1
fi
TABLE=$OUT/table/en-$SIZE.pt
if [[ ! -f $TABLE ]]; then
    "$BIN/python" bench/demo_data.py corpus "$W/distill.jsonl" "$OUT/table-corpus.jsonl" "$HELD" \
        $( ((DISJOINT)) && echo --disjoint )
    "$BIN/fastmtp" build-vocab --tokenizer "$T" --lang en --size "$SIZE" \
        --corpus "$OUT/table-corpus.jsonl" --out "$OUT/table" --quiet
fi
"$BIN/fastmtp" features --target "$T" --data "$OUT/data.jsonl" --out "$OUT/features" \
    --max-len "$MAX_LEN" --topk 32 --dtype bfloat16 $(for r in $REUSE; do echo --reuse "$r"; done)
case $LOSS in
    ce) loss=(--loss ce) ;;
    kl) loss=(--loss kl --kl-topk 32) ;;
    ce+kl) loss=(--loss ce+kl --kl-topk 32) ;;
    acc) loss=(--loss acc --kl-topk 32) ;;
    ce+acc) loss=(--loss ce+acc --kl-topk 32) ;;
    *) echo "LOSS is ce, kl, ce+kl, acc or ce+acc" >&2; exit 1 ;;
esac
arms=()
for a in $ARMS; do
    case $a in
        fastmtp) arms+=(--arm "fastmtp=${loss[*]}") ;;
        vanilla) arms+=(--arm "vanilla=${loss[*]} --vanilla") ;;
        *) echo "ARMS holds fastmtp and/or vanilla" >&2; exit 1 ;;
    esac
done
"$BIN/fastmtp" curve --target "$T" --init "${INIT:-$W/init}" --data "$OUT/data.jsonl" --out "$OUT" \
    --features "$OUT/features" --tokens "$POINTS" --heldout-rows "$HELD" "${arms[@]}" \
    --serve-steps 1,2,3,4,5 --dev-prompts bench/data/spec_bench.jsonl --dev-per-category 1 \
    -- --steps 3 --beta "$BETA" --epochs "$EPOCHS" --batch-size "$BATCH" --max-len "$MAX_LEN" --lr "$LR" \
       --dtype bfloat16 --compute-dtype bfloat16 --group-by-length --save-every 200 \
       --eval-every "$EVAL_EVERY" --vocab "$TABLE"
mkdir -p "$RESULTS"
cp "$OUT/curve.json" "$OUT/curve.md" "$RESULTS/"
for f in curve.png curve_steps.png; do if [[ -f $OUT/$f ]]; then cp "$OUT/$f" "$RESULTS/"; fi; done
echo "results in $RESULTS/; heads in $OUT/<arm>/<tokens>/"
