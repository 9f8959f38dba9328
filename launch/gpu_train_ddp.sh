#!/usr/bin/env bash
# GPU check of data-parallel training: `fastmtp train` under torchrun (NCCL) trains the head one
# process trains. The CPU twin is tests/test_train_ddp.py (2 gloo processes).
#
#   launch/gpu_train_ddp.sh [OUT]          # OUT: work and results directory (default /tmp/gpu_train_ddp)
#   TOL=1e-5 PYTHON=python launch/gpu_train_ddp.sh
#
# Needs one or more CUDA GPUs, torch with CUDA and this package installed (pip install -e .).
# No downloads: it makes a small random Llama target (hidden 256, 2 layers, vocab 320) with a
# tokenizer, 96 rows of its greedy text with responses of varied length, and an initial head, then
# trains 8 optimizer steps (global batch 8, grad-accum 2, 2 epochs) on cuda:
#   one       a single process (no process group)
#   one_half  the same, halted after 3 steps (a checkpoint to resume)
#   nccl1     torchrun --nproc_per_node 1 (the `fastmtp` console script when on PATH)
#   nccl2     torchrun --nproc_per_node 2                      } with two GPUs or more
#   half_nccl2  one_half resumed by torchrun --nproc_per_node 2 }
# and checks that each head equals `one` within TOL (default 1e-5: CUDA kernels are not batch-shape
# invariant, so 2 processes padding half-batches round differently from one) and that the held-out
# tau_train agrees within 0.02. A few minutes, most of it process start-up; fits a 15-minute GPU lease.
# Exit status 0 = every check passed; OUT/result.json holds the numbers.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-/tmp/gpu_train_ddp}
PYTHON=${PYTHON:-python}
TOL=${TOL:-1e-5}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_train_ddp: no NVIDIA GPU visible (nvidia-smi)" >&2
    exit 2
fi
if ! "$PYTHON" -c 'import torch, fastmtp_sglang; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "gpu_train_ddp: torch with CUDA or fastmtp_sglang does not import; run: pip install -e ." >&2
    exit 2
fi
NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
rm -rf "$OUT"
mkdir -p "$OUT"

# the target, its data and an initial head
"$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

import torch
from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fastmtp_sglang.core.draft_dir import make_draft_config, save_draft_dir
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig

out = Path(sys.argv[1])
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator([topics[k] for k in sorted(topics)][:40],
                        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                            show_progress=False))
torch.manual_seed(0)
V, P = 320, 8
cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=V, max_position_embeddings=512, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
model = LlamaForCausalLM(cfg).eval()
with torch.no_grad():
    model.lm_head.weight.mul_(30.0)  # sharper distributions: a tiny random model's are flat
model.save_pretrained(str(out / "target"))
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(out / "target"))

g = torch.Generator().manual_seed(1)
ids = torch.randint(0, V, (96, P), generator=g)
with torch.no_grad():
    for _ in range(64):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
cut = torch.randint(8, 65, (96,), generator=g).tolist()  # varied token counts per rank
with (out / "data.jsonl").open("w") as f:
    for s, c in zip(ids.tolist(), cut):
        f.write(json.dumps({"prompt_ids": s[:P], "response_ids": s[P:P + c]}) + "\n")

dcfg = make_draft_config(model.config.to_dict(), "deepseek", dtype="float32")
head = FastMTPHead(HeadConfig.from_dict(dcfg), model.model.embed_tokens, model.lm_head)
with torch.no_grad():
    for name, p in head.named_parameters():
        if not name.endswith("norm.weight"):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
save_draft_dir(out / "init", dcfg, head.state_dict())
print(f"gpu_train_ddp: target, {len(cut)} rows and an initial head in {out}")
EOF

COMMON=(train --target "$OUT/target" --data "$OUT/data.jsonl" --steps 3 --epochs 2 --batch-size 8
        --grad-accum 2 --lr 3e-3 --warmup 0.1 --max-len 128 --heldout-fraction 0.1 --seed 0
        --device cuda --no-progress)
TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone)
set -x
"$PYTHON" -m fastmtp_sglang "${COMMON[@]}" --init "$OUT/init" --out "$OUT/one"
"$PYTHON" -m fastmtp_sglang "${COMMON[@]}" --init "$OUT/init" --out "$OUT/one_half" --halt-after-steps 3
if command -v fastmtp >/dev/null; then
    "${TORCHRUN[@]}" --nproc_per_node 1 "$(command -v fastmtp)" "${COMMON[@]}" --init "$OUT/init" --out "$OUT/nccl1"
else
    "${TORCHRUN[@]}" --nproc_per_node 1 -m fastmtp_sglang "${COMMON[@]}" --init "$OUT/init" --out "$OUT/nccl1"
fi
if [[ $NGPU -ge 2 ]]; then
    "${TORCHRUN[@]}" --nproc_per_node 2 -m fastmtp_sglang "${COMMON[@]}" --init "$OUT/init" --out "$OUT/nccl2"
    "${TORCHRUN[@]}" --nproc_per_node 2 -m fastmtp_sglang "${COMMON[@]}" --resume "$OUT/one_half" \
        --out "$OUT/half_nccl2"
fi
set +x

"$PYTHON" - "$OUT" "$TOL" <<'EOF'
import json, sys
from pathlib import Path

import torch

out, tol = Path(sys.argv[1]), float(sys.argv[2])
state = lambda name: torch.load(out / name / "trainer_state.pt", map_location="cpu", weights_only=True)
ref = state("one")
rows, ok = [], True
for name in ("nccl1", "nccl2", "half_nccl2"):
    if not (out / name).is_dir():
        continue
    st = state(name)
    diff = max(float((st["head"][k] - ref["head"][k]).abs().max()) for k in ref["head"])
    tau, tau_ref = (st["last_eval"] or {}).get("tau_train"), (ref["last_eval"] or {}).get("tau_train")
    good = (diff <= tol and st["global_step"] == ref["global_step"]
            and tau is not None and abs(tau - tau_ref) <= 0.02)  # one argmax flip moves it ~0.003
    ok &= good
    rows.append({"run": name, "world_size": st.get("world_size"), "steps": st["global_step"],
                 "max_abs_head_diff": diff, "tau_train": tau, "tau_train_single": tau_ref,
                 "pass": good})
    print(f"{name:>11}: {st.get('world_size')} process(es), {st['global_step']} steps, head max |diff| "
          f"{diff:.2e} (tol {tol:g}), tau_train {tau} vs {tau_ref}: {'PASS' if good else 'FAIL'}")
(out / "result.json").write_text(json.dumps({"tol": tol, "runs": rows, "pass": ok}, indent=1))
sys.exit(0 if ok and rows else 1)
EOF
