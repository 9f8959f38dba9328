"""`fastmtp train`: flags for :func:`fastmtp_sglang.training.train.train` (its module docstring is
the help), over a resumed checkpoint's settings. Under torchrun (``torchrun --nproc_per_node N -m
fastmtp_sglang train ...``) each process joins the process group first and trains on its share of
every batch (training/parallel.py)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training import parallel
from fastmtp_sglang.training import train as lib
from fastmtp_sglang.training.checkpoints import load_trainer_state
from fastmtp_sglang.training.config import (ATTENTIONS, COMPUTE_DTYPES, LOSSES, NEW_HEAD_LR,
                                            TrainConfig, is_new_head)
from fastmtp_sglang.training.train import fmt_score, train


def config_from_args(args: argparse.Namespace, saved: dict[str, Any] | None) -> TrainConfig:
    """Flags given on the command line, over the checkpoint's settings (resume) or the defaults
    (the peak LR defaults to :data:`NEW_HEAD_LR` for a head from `fastmtp init-head`)."""
    names = {f.name for f in fields(TrainConfig)}
    # a halt belongs to the run that asked for it: the resumed run goes on unless told otherwise
    kw = {k: v for k, v in (saved or {}).items() if k in names and k != "halt_after_steps"}
    for name in names:
        val = getattr(args, name, None)
        if val is not None:
            kw[name] = val
    if "lr" not in kw and is_new_head(getattr(args, "init", None)):
        kw["lr"] = NEW_HEAD_LR
    return TrainConfig(**kw)


def _run(args: argparse.Namespace) -> int:
    saved = load_trainer_state(Path(args.resume))["config"] if args.resume else None
    cfg = config_from_args(args, saved)
    if not args.resume and not args.init:
        raise FastMTPError("pass --init DIR (a draft directory from `fastmtp init-head` or "
                           "`fastmtp convert`) or --resume DIR")
    device, started = parallel.start(args.device)
    try:
        return _train(args, cfg, device)
    finally:
        parallel.end(started)


def _load_target(args: argparse.Namespace, device: str):
    """With a complete feature cache (--features, or the one a resumed checkpoint names) the
    trainer reads only the target's embedding and lm_head (from its safetensors files): the
    other layers' outputs are in the cache. Otherwise the whole model, which builds the cache or
    runs every step."""
    import sys

    from fastmtp_sglang.core.target import load_embed_and_head, load_target
    from fastmtp_sglang.training.features import INDEX

    features = args.features
    if features is None and args.resume:
        features = load_trainer_state(Path(args.resume)).get("features")
    if features is not None and (Path(features) / INDEX).is_file():
        target = load_embed_and_head(args.target, dtype=args.dtype, device=device)
        if target is not None:
            if parallel.current().main:
                print(f"train: feature cache {features} is complete: read the target's embedding "
                      "and lm_head only", file=sys.stderr)
            return target
    return load_target(args.target, dtype=args.dtype, device=device)


def _train(args: argparse.Namespace, cfg: TrainConfig, device: str) -> int:
    target = _load_target(args, device)
    vocab_ids = vocab_name = None
    if args.vocab:
        from fastmtp_sglang.vocab.tables import load_table

        table = load_table(args.vocab, target.tokenizer)
        vocab_ids, vocab_name = table.ids, table.name
    res = train(cfg, target, args.data, args.out, init=args.init, resume=args.resume,
                vocab_ids=vocab_ids, vocab_name=vocab_name, overwrite=args.overwrite,
                progress=not args.no_progress, allow_base_mismatch=args.allow_base_mismatch,
                features=args.features, target_dir=args.target, feature_dtype=args.feature_dtype)
    if not parallel.current().main:
        return 0
    ev = res.last_eval or {}
    print(f"wrote draft directory {res.out} after {res.global_step} optimizer steps"
          + ("" if res.finished else " (halted early: continue with --resume)")
          + (f"; held-out tau_train {fmt_score(ev.get('tau_train'))}" if ev else ""))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="FastMTP fine-tune of a draft head (train as you serve)",
                       description=lib.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory (Hugging Face format)")
    p.add_argument("--init", help="draft directory to start from (fastmtp init-head / convert)")
    p.add_argument("--data", required=True, help="JSONL rows with prompt_ids/response_ids (as "
                   "`fastmtp distill` writes) or prompt/response text")
    p.add_argument("--out", required=True, help="output draft directory (rewritten at each checkpoint)")
    p.add_argument("--resume", help="checkpoint directory to continue from (same data and settings)")
    p.add_argument("--steps", type=int, help=f"K, recursive draft steps trained and scored (default {d.steps})")
    p.add_argument("--beta", type=float, help=f"step-weight decay, w_k ~ beta^(k-1) (default {d.beta})")
    p.add_argument("--vanilla", action="store_true", default=None, help="vanilla MTP: train step 1 only, "
                   "teacher-forced (held-out tau is still scored at --steps)")
    p.add_argument("--attention", choices=ATTENTIONS, help="serve: train as you serve (default); "
                   "fastmtp: the paper's pattern (step k at position j, causal over its own step)")
    p.add_argument("--loss", choices=LOSSES, help="ce on the data, kl to the target's logits, "
                   "acc: -log of the acceptance rate sum min(p, q) against them (directly what "
                   "sampled verification accepts), or a sum (default ce)")
    p.add_argument("--epochs", type=int, help=f"passes over the training split (default {d.epochs})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {NEW_HEAD_LR} for a head from "
                   f"`fastmtp init-head`, {d.lr} for a converted MTP layer; the paper: 5e-5)")
    p.add_argument("--warmup", type=float, help=f"warmup fraction of optimizer steps (default {d.warmup})")
    p.add_argument("--weight-decay", type=float, help=f"AdamW weight decay (default {d.weight_decay})")
    p.add_argument("--grad-clip", type=float, help=f"max gradient norm, 0 = off (default {d.grad_clip})")
    p.add_argument("--batch-size", type=int, help=f"sequences per micro-batch, all processes "
                   f"together: under torchrun the N processes share it (default {d.batch_size})")
    p.add_argument("--grad-accum", type=int, help=f"micro-batches per optimizer step (default {d.grad_accum})")
    p.add_argument("--max-len", type=int, help=f"tokens per sequence, prompt + response; longer "
                   f"responses are cut (default {d.max_len})")
    p.add_argument("--ce-chunk", type=int, help=f"scored positions per chunk of the fused "
                   f"projection + loss (its gradient taken in the same pass; no logits kept); 0 = "
                   f"the plain autograd path, slower, the reference (default {d.ce_chunk})")
    p.add_argument("--vocab", help="compressed-vocabulary table (.pt) to train the head with")
    p.add_argument("--heldout-fraction", type=float, help=f"share of sequences held out and scored "
                   f"as training-time tau each epoch, 0 = none (default {d.heldout_fraction})")
    p.add_argument("--max-sequences", type=int, help="use only the first N usable rows (default all)")
    p.add_argument("--seed", type=int, help=f"data order and split seed (default {d.seed})")
    p.add_argument("--save-every", type=int, help="optimizer steps between checkpoints, 0 = each "
                   "epoch only (default 0)")
    p.add_argument("--eval-every", type=int, help="optimizer steps between held-out scores, "
                   "logged as the learning curve in steps; 0 = each epoch only (default 0)")
    p.add_argument("--halt-after-steps", type=int, help="stop after N optimizer steps, with a "
                   "checkpoint to --resume from (default: run all epochs)")
    p.add_argument("--cache-hidden-gb", type=float, help=f"GB of memory for caching the target's "
                   f"hidden states across epochs, 0 = recompute (default {d.cache_hidden_gb})")
    p.add_argument("--features", help="feature cache directory: the target runs once over the "
                   "data and epochs read its hidden states from disk (built here when missing; "
                   "see `fastmtp features`). Default: run the target every epoch")
    p.add_argument("--feature-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of cached hidden states when --features builds (default bfloat16)")
    p.add_argument("--kl-topk", type=int, help="with --loss kl/acc (or ce+) and --features: "
                   "against the target's cached top-k distribution instead of recomputing its full logits "
                   f"(default {d.kl_topk} = exact)")
    p.add_argument("--lookup-weight", type=float, help="hybrid-aware weighting for heads served "
                   "with --steps auto: a target that prompt lookup would have proposed right (a "
                   "match of --lookup-min-match tokens or more) weighs this much in the loss, so the "
                   f"head's capacity goes where lookup is not already right (default {d.lookup_weight} = off)")
    p.add_argument("--lookup-min-match", type=int, help="with --lookup-weight: the shortest lookup "
                   f"match counted (default {d.lookup_min_match})")
    p.add_argument("--group-by-length", action="store_true", default=None,
                   help="batch sequences of similar length together (less padding, same number of "
                        "batches, batch order still shuffled; default off)")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES,
                   help="the head's forward/backward under autocast: bfloat16 is ~2-4x faster on "
                        "CPUs with AMX or AVX512-BF16 and on GPUs; weights, optimizer and evaluation "
                        f"stay fp32 (default {d.compute_dtype})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the target's dtype; the head always trains in fp32 (default float32)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available; under torchrun "
                   "each process takes cuda:LOCAL_RANK)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--allow-base-mismatch", action="store_true", help="train a draft made for another target (its recorded config / tokenizer hash differs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
