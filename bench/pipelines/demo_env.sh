# Sourced by the demo-target bench scripts (curve_demo.sh, ablation.sh, head_demo.sh) after they
# set W: BIN (the venv's bin), T (the materialised demo target) and a check that the pipeline's
# distillation exists.
BIN=${BIN:-.venv/bin}
T=$("$BIN/python" -c "from fastmtp_sglang.core.demo_target import materialize_smollm2; print(materialize_smollm2())")
[[ -f $W/distill.jsonl && -f $W/init/config.json ]] || {
    echo "run STAGE=distill bash bench/pipelines/demo_pipeline.sh $W first" >&2; exit 1; }
