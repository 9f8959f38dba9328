# Sourced by the demo-target bench scripts (curve_demo.sh, ablation.sh, head_demo.sh) after they
# set W: BIN (the venv's bin), T (the materialised demo target), the pipeline's distillation
# (restored from bench/train_data/ when W has none) and the initial head.
BIN=${BIN:-.venv/bin}
T=$("$BIN/python" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2; print(materialize_smollm2())")
# the committed distillation (bench/train_data/) stands in for a pipeline run that has none
if [[ ! -f $W/distill.jsonl && -f bench/train_data/manifest.json ]]; then
    "$BIN/python" bench/train_data.py restore "$W"
fi
[[ -f $W/init/config.json ]] || "$BIN/fastmtp" init-head --target "$T" "$W/init"
[[ -f $W/distill.jsonl && -f $W/init/config.json ]] || {
    echo "run STAGE=distill bash bench/pipelines/demo_pipeline.sh $W first" >&2; exit 1; }
