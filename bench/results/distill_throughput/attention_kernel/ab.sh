#!/usr/bin/env bash
# distill throughput with the one-pass decode attention (default) and without (FASTMTP_CPU_KERNELS=off), alternated
cd /work/main
for i in 1 2; do
  for arm in on off; do
    if [[ $arm == off ]]; then export FASTMTP_CPU_KERNELS=off; else unset FASTMTP_CPU_KERNELS; fi
    .venv/bin/python bench/distill_throughput.py --out /tmp/ab_${arm}_$i --batches 64 --http-batch 0 \
      --max-new-tokens 256 --prompts-per-slot 2 --min-prompts 8 --engines queue --rounds 1 2>/dev/null | grep "^{" | sed "s/^/$arm $i /"
  done
done
