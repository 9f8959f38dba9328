"""`fastmtp train`: recursive K-step FastMTP fine-tuning that reproduces serving.

  fastmtp train --target T --init D0 --data data.jsonl --steps 3 --beta 0.6 --out D1
  fastmtp train --target T --init D0 --data data.jsonl --steps 3 --vanilla --out D1v
  fastmtp train --target T --data data.jsonl --resume D1 --out D1     # continue exactly

The target (with its embedding and lm_head) is frozen and shared; only the head trains.

**Train as you serve** (docs/design.md section 3, where FastMTP's own training disagrees with
serving). For a sequence x_0..x_{T-1} with the target's post-norm hidden states h_0..h_{T-1},
anchor j runs K steps:

- step 1: input (h_j, x_{j+1}) at position j, predicts x_{j+2};
- step k: input (g^{k-1}_j, x_{j+k}) at position j+k-1, predicts x_{j+k+1}, where g^{k-1}_j is the
  head's own step k-1 output hidden state (the ground-truth token stands in for the drafted one:
  on the accepted path they are equal).

At serving time, when step k of anchor j runs, the head's KV cache holds step-1 keys at positions
<= j (the draft extend rebuilds them from the target's states after every verification) plus
one key per earlier recursive step of this cycle, at positions j+1..j+k-1. Training computes all
anchors of a sequence at once with keys ``[K_1 | K_2 | ... | K_k]`` (each [T], rotated at the
positions above) and a boolean mask: block 1 causal (key i <= query j), blocks 2..k diagonal
(i == j). Gradients flow through the recursion, as in FastMTP. ``--attention fastmtp`` is
FastMTP's original pattern instead (every step at position j, causal over its own step's keys),
for comparison.

Loss: sum_k w_k L_k with w_k = beta^(k-1) / sum_j beta^(j-1) (beta 0.6, K 3: 0.51/0.31/0.18);
L_k is the mean over the step's targets that are response tokens of cross-entropy ("ce"), KL(target
|| draft) to the frozen target's own logits for the same token ("kl"), -log of the acceptance rate
sum min(p, q) against them ("acc", LK losses), or a sum ("ce+kl", "ce+acc").
Logits are computed per step and per chunk of ``--ce-chunk`` positions, scored and
differentiated in the same pass (training/fused_loss.py), so K x T x V logits never sit in
memory. Only the anchors a scored target needs are computed (objective.anchors: prompt
positions add their step-1 keys and nothing else). ``--vocab TABLE.pt`` trains
with the compressed head that will serve (lm_head rows of the table only; CE targets outside the
table are masked out and counted; KL is over the table, the target renormalised on it).

Each epoch, a held-out split is scored as training-time tau by simulated greedy acceptance with the
serve pattern: ``tau_train`` = 1 + mean over every anchor of the number of leading steps whose
argmax equals the ground truth; ``tau_walk`` follows the cycles a greedy server would run on the
text (anchor j -> j + accepted + 1), which is exactly the served tau when the text is the target's
greedy output.

Checkpoints (each epoch, every ``--save-every`` optimizer steps, and at the end) are draft
directories written atomically, with ``trainer_state.pt`` (fp32 weights, optimizer, scheduler,
position in the data, RNG) and ``train_log.jsonl`` beside ``model.safetensors``.

Data-parallel under torchrun (docs/scale.md):

  torchrun --nproc_per_node 8 -m fastmtp_sglang train --target T --init D0 --data data.jsonl ...

``--batch-size`` stays the global batch: the N processes share each micro-batch (rank r takes
rows r, r+N, ...), the loss is weighted by the whole batch's token counts and the gradients are
summed, so the run computes the single-process run's steps in the single-process data order, and
``--resume`` continues a checkpoint with any N (training/parallel.py).
"""


from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fastmtp_sglang.core.draft_dir import DraftDir, load_draft_dir
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.head import FastMTPHead
from fastmtp_sglang.training import parallel
from fastmtp_sglang.training.checkpoints import (LOG_NAME, RunState, lineage_of, load_trainer_state,
                                                 portable_path)
from fastmtp_sglang.training.config import TrainConfig, autocast, divergence, resume_mismatches
from fastmtp_sglang.training.data import (HiddenStates, TrainData, collate, epoch_batches,
                                          file_sha256, load_examples, split_heldout)
from fastmtp_sglang.training.features import INDEX, open_or_build
from fastmtp_sglang.training.lookup_cover import mark_lookup_cover
from fastmtp_sglang.training.objective import Projection, batch_loss, evaluate


def lr_lambda(total_steps: int, warmup: float):
    """Linear warmup over ceil(warmup * total) steps, then cosine to 0. LambdaLR saves no function state: rebuilt identically on resume."""
    warm = math.ceil(warmup * total_steps)

    def fn(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return fn


@dataclass
class TrainResult:
    out: Path
    global_step: int
    finished: bool                    # all epochs done (False when halted early)
    last_eval: dict[str, Any] | None
    log: list[dict[str, Any]] = field(default_factory=list)


def train(cfg: TrainConfig, target, data: str | Path, out: str | Path, init: str | Path | None = None,
          resume: str | Path | None = None, vocab_ids: torch.Tensor | None = None,
          vocab_name: str | None = None, overwrite: bool = False, progress: bool = True,
          allow_base_mismatch: bool = False, features: str | Path | None = None,
          target_dir: str | Path | None = None, feature_dtype: str = "bfloat16",
          heldout: list[tuple[int, Any]] | None = None) -> TrainResult:
    """Train a FastMTP head; returns where the final checkpoint is and the log.

    Parameters
    ----------
    cfg : TrainConfig
    target : fastmtp_sglang.core.target.Target, frozen here (requires_grad False, never saved).
    data : JSONL data file (see :func:`~fastmtp_sglang.training.data.parse_row`).
    out : output draft directory (replaced atomically at every checkpoint).
    init : draft directory to start from (ignored with ``resume``).
    resume : a checkpoint this function wrote; training continues exactly where it stopped.
    vocab_ids : optional [S] compressed vocabulary the loss uses (``vocab_name`` is recorded).
    features : a feature cache directory (fastmtp_sglang.training.features): the target's hidden states
        (and top-k logits for ``cfg.kl_topk``) are read from it, built there first when missing
        (needs ``target_dir``, the target's directory, for the weights hash). A resumed run
        reuses the cache its checkpoint names.
    heldout : (row, Example) pairs of ``data`` to score instead of the ``cfg.heldout_fraction``
        split (``fastmtp curve`` passes its own held-out rows, which no training prefix holds);
        rows index the whole file, as the feature cache does.

    Under torchrun (a process group initialised, as `fastmtp train` does) every process calls
    this with the same arguments; each computes its share of every batch, rank 0 alone writes
    ``out`` (training/parallel.py).
    """
    data, out = Path(data), Path(out)
    ranks = parallel.current()
    if cfg.batch_size < ranks.world:
        raise FastMTPError(f"--batch-size {cfg.batch_size} is the global batch, which the "
                           f"{ranks.world} processes share: it must be at least {ranks.world}")
    state = _check_start(cfg, out, init, resume, overwrite)
    draft, head, proj = _load_head(target, init, resume, state, vocab_ids, allow_base_mismatch)
    ds = _load_data(cfg, target, data, proj, state)
    feed = _feature_source(cfg, target, ds, state, features, target_dir, feature_dtype, progress,
                           head.cfg.aux_hidden_states, ranks)
    run = _new_run(cfg, out, init, draft, head, proj, ds, feed, vocab_name, ranks)
    run.lineage = lineage_of(draft.meta, resumed=state is not None)
    _restore_or_seed(run, state, resume)
    parallel.require_same(ranks, {
        "data": ds.sha256, "training rows": ds.train_idx, "settings": asdict(cfg),
        "head": parallel.head_fingerprint(head), "vocabulary": proj.size,
        "position": (run.epoch, run.batch_pos, run.global_step)})
    _announce(run, fresh=state is None)
    held = heldout if heldout is not None else [(i, ds.examples[i]) for i in ds.held_idx]
    _train_epochs(run, feed, held, progress)
    if ranks.world > 1:  # the checkpoint is on disk for every rank once train() returns
        parallel.barrier(run.device)
    return TrainResult(out, run.global_step, run.epoch >= cfg.epochs, run.last_eval, run.records)


# ------------------------------------------------------------------------------------------------
# the phases of a run
# ------------------------------------------------------------------------------------------------

@dataclass
class _Feed:
    """Where the target's hidden states (and cached top-k logits) come from."""
    hidden_fn: Callable[[int, torch.Tensor], torch.Tensor]
    topks_of: Callable[[list[int]], list | None]
    features: str | Path | None       # the feature cache directory, recorded in checkpoints
    feature_dtype: str


def _check_start(cfg: TrainConfig, out: Path, init: str | Path | None, resume: str | Path | None,
                 overwrite: bool) -> dict[str, Any] | None:
    """Refuse a run that cannot start; the trainer state of ``resume`` (None for a new run)."""
    if resume is None and init is None:
        raise FastMTPError("pass --init (a draft directory to start from) or --resume")
    if out.exists() and not overwrite and (resume is None or Path(resume).resolve() != out.resolve()):
        raise FastMTPError(f"{out} already exists; choose another --out or pass --overwrite")
    state = load_trainer_state(Path(resume)) if resume is not None else None
    if state is not None:
        diff = resume_mismatches(state["config"], cfg)
        if diff:
            raise FastMTPError("--resume needs the settings the run started with; these differ: "
                               + "; ".join(diff))
    return state


def _load_head(target, init: str | Path | None, resume: str | Path | None,
               state: dict[str, Any] | None, vocab_ids: torch.Tensor | None,
               allow_base_mismatch: bool) -> tuple[DraftDir, FastMTPHead, Projection]:
    """The draft to start from (checked against the target, which is frozen here), the fp32 head
    on the target's device, and the lm_head rows it scores (a checkpoint's table on resume)."""
    from fastmtp_sglang.core.target import require_fits

    src = Path(resume) if resume is not None else Path(init)  # type: ignore[arg-type]
    draft = load_draft_dir(src)
    require_fits(draft.config, target.config, target.tokenizer, where=str(src),
                 allow_base_mismatch=allow_base_mismatch)
    _freeze(target)
    device = next(target.model.parameters()).device

    head = FastMTPHead(draft.head_config, target.embed, target.lm_head)
    head.load_state_dict(state["head"] if state is not None else draft.state_dict, strict=True)
    head = head.to(device=device, dtype=torch.float32).train()
    if vocab_ids is None and state is not None and state.get("vocab_ids") is not None:
        vocab_ids = state["vocab_ids"]
    return draft, head, Projection(target.lm_head, vocab_ids)


def _freeze(target) -> None:
    target.model.requires_grad_(False)
    target.model.eval()


def _load_data(cfg: TrainConfig, target, data: Path, proj: Projection,
               state: dict[str, Any] | None) -> TrainData:
    """The usable rows of ``data`` (a resumed run must read the same file) and their split."""
    vocab_size = int(target.config.get("vocab_size") or proj.full_size)
    examples, counts = load_examples(data, target.tokenizer, min(vocab_size, proj.full_size),
                                     cfg.max_len, 1, cfg.max_sequences)
    data_sha = file_sha256(data)
    if state is not None and state["data"]["sha256"] != data_sha:
        raise FastMTPError(f"{data} is not the data file the checkpoint was trained on "
                           f"(sha256 differs): resume with the same --data")
    train_idx, held_idx = split_heldout(len(examples), cfg.heldout_fraction, cfg.seed)
    if cfg.lookup_weight != 1.0:
        mark_lookup_cover([examples[i] for i in train_idx], cfg.train_steps, cfg.lookup_min_match)
    if not train_idx:
        raise FastMTPError(f"{data}: no usable training rows ({counts.lines} lines, "
                           f"{counts.skipped()} skipped: {asdict(counts)})")
    return TrainData(data, data_sha, examples, counts, train_idx, held_idx)


def _feature_source(cfg: TrainConfig, target, ds: TrainData, state: dict[str, Any] | None,
                    features: str | Path | None, target_dir: str | Path | None, feature_dtype: str,
                    progress: bool, aux: tuple[int, ...] = (),
                    ranks: parallel.Ranks = parallel.Ranks()) -> _Feed:
    """The feature cache (opened, or built when missing; a resumed run reuses its checkpoint's),
    else the target run per sequence with an in-memory cache of ``cfg.cache_hidden_gb``."""
    if state is not None and state.get("features"):
        if features is None and Path(state["features"]).is_dir():
            features = state["features"]
        feature_dtype = state.get("feature_dtype") or feature_dtype  # the cache's, not the default
    if cfg.kl_topk and features is None:
        raise FastMTPError("--kl-topk reads the target's top-k logits from a feature cache: pass "
                           "--features DIR")
    store = None
    if features is not None:
        if target_dir is None:
            raise FastMTPError("a feature cache needs the target's directory (target_dir)")
        if ranks.world > 1 and not (Path(features) / INDEX).is_file():
            # one process would build it while N-1 wait on a collective that times out
            raise FastMTPError(f"feature cache {features} does not exist: build it first with "
                               "`fastmtp features` (one process), then start torchrun")
        need_topk = cfg.kl_topk if divergence(cfg.loss) else 0
        store = open_or_build(target, target_dir, ds.path, ds.examples, features, cfg.max_len,
                              cfg.max_sequences, feature_dtype, need_topk, progress, aux_layers=aux)
        if len(store) < len(ds.examples):
            raise FastMTPError(f"feature cache {features} holds {len(store)} sequences, the data "
                               f"{len(ds.examples)}: rebuild it")
    hidden_fn = store if store is not None else HiddenStates(target.model, cfg.cache_hidden_gb * 1e9, aux)
    use_topk = store is not None and cfg.kl_topk > 0 and divergence(cfg.loss) is not None

    def topks_of(idxs: list[int]):
        if not use_topk:
            return None
        return [tuple(x[:, :cfg.kl_topk] for x in store.topk(i)) for i in idxs]

    return _Feed(hidden_fn, topks_of, features, feature_dtype)


def _new_run(cfg: TrainConfig, out: Path, init: str | Path | None, draft: DraftDir,
             head: FastMTPHead, proj: Projection, ds: TrainData, feed: _Feed,
             vocab_name: str | None, ranks: parallel.Ranks = parallel.Ranks()) -> RunState:
    """The run with its optimizer (AdamW) and schedule (warmup, then cosine) over all epochs."""
    n_batches = math.ceil(len(ds.train_idx) / cfg.batch_size)
    per_epoch = math.ceil(n_batches / cfg.grad_accum)
    total = per_epoch * cfg.epochs
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=cfg.adam_betas,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup))
    return RunState(cfg, out, init, draft, head, proj, ds, feed.features, feed.feature_dtype, vocab_name,
                    opt, sched, n_batches, total, ranks=ranks)


def _restore_or_seed(run: RunState, state: dict[str, Any] | None, resume: str | Path | None) -> None:
    """Resume: the optimizer, schedule, position in the data, RNG and log of the checkpoint.
    A new run: seed the RNG."""
    if state is not None:
        run.opt.load_state_dict(state["optimizer"])
        run.sched.load_state_dict(state["scheduler"])
        run.epoch, run.batch_pos, run.global_step = (state["epoch"], state["batch_in_epoch"],
                                                     state["global_step"])
        run.last_eval = state.get("last_eval")
        torch.set_rng_state(state["rng"])
        log_file = Path(resume) / LOG_NAME  # type: ignore[arg-type]
        if log_file.is_file():
            run.log_lines = [ln for ln in log_file.read_text().splitlines() if ln.strip()]
        run.log({"event": "resume", "step": run.global_step, "world_size": run.ranks.world})
    else:
        torch.manual_seed(run.cfg.seed)


def _announce(run: RunState, fresh: bool) -> None:
    """The start record (a new run only) and the summary line on stderr."""
    cfg, ds = run.cfg, run.data
    if fresh:
        # the log ships with a head (bench/ship_head.py): no absolute path of this machine in it
        run.log({"event": "start", "data": portable_path(ds.path), "counts": asdict(ds.counts),
                 "train": len(ds.train_idx), "heldout": len(ds.held_idx),
                 "optimizer_steps": run.total, "world_size": run.ranks.world, "config": asdict(cfg)})
    if not run.ranks.main:
        return
    print(f"train: {len(ds.train_idx)} sequences ({len(ds.held_idx)} held out) from {ds.path}; "
          f"{ds.counts.skipped()} lines skipped, {ds.counts.truncated} truncated; K={cfg.train_steps} "
          f"trained, weights {[round(w, 3) for w in cfg.weights]}, {run.total} optimizer steps"
          + (f"; {run.ranks.world} processes share each batch of {cfg.batch_size}"
             if run.ranks.world > 1 else ""), file=sys.stderr)


def _train_epochs(run: RunState, feed: _Feed, held: list[tuple[int, Any]], progress: bool) -> None:
    """The remaining epochs: optimizer steps (held-out tau every ``cfg.eval_every``), then (each
    epoch) held-out tau and a checkpoint; ``cfg.halt_after_steps`` stops early with a checkpoint
    to resume from."""
    from tqdm import tqdm

    cfg = run.cfg
    bar = tqdm(total=run.total, initial=run.global_step, desc="train", unit="step",
               disable=not (progress and run.ranks.main), dynamic_ncols=True, file=sys.stderr)
    halted = False
    t0 = time.perf_counter()
    try:
        while run.epoch < cfg.epochs and not halted:
            batches = epoch_batches(run.data.train_idx, [len(e.ids) for e in run.data.examples],
                                    cfg.batch_size, cfg.seed, run.epoch, cfg.group_by_length)
            halted = _epoch_steps(run, feed, held, batches, bar, t0)
            if halted and run.batch_pos < len(batches):
                break
            if held and not (cfg.eval_every and run.global_step % cfg.eval_every == 0):
                _evaluate_heldout(run, feed, held)
            run.epoch += 1
            run.batch_pos = 0
            run.checkpoint(run.epoch >= cfg.epochs)
        if halted and run.batch_pos != 0:
            run.checkpoint(False)
    finally:
        bar.close()


def _epoch_steps(run: RunState, feed: _Feed, held: list[tuple[int, Any]], batches: list[list[int]],
                 bar, t0: float) -> bool:
    """Optimizer steps from ``run.batch_pos`` to the end of the epoch's ``batches``, each logged,
    with held-out tau every ``cfg.eval_every`` steps and a checkpoint every ``cfg.save_every``;
    True when ``cfg.halt_after_steps`` stops it."""
    cfg = run.cfg
    while run.batch_pos < len(batches):
        group = batches[run.batch_pos: run.batch_pos + cfg.grad_accum]
        rec = _optimizer_step(run, feed, group, len(batches), t0)
        run.log(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}",
                        acc="/".join(f"{a:.2f}" if a is not None else "-" for a in rec["acc_k"]))
        if held and cfg.eval_every and run.global_step % cfg.eval_every == 0:
            _evaluate_heldout(run, feed, held)
        if cfg.halt_after_steps is not None and run.global_step >= cfg.halt_after_steps:
            return True
        if cfg.save_every and run.global_step % cfg.save_every == 0 and run.batch_pos < len(batches):
            run.checkpoint(False)
    return False


def _optimizer_step(run: RunState, feed: _Feed, group: list[list[int]], n_batches: int,
                    t0: float) -> dict[str, Any]:
    """One optimizer step over the micro-batches of ``group`` (gradient accumulation, clipping,
    the schedule); returns its train_log.jsonl record.

    Each micro-batch's loss is averaged over the whole micro-batch's tokens; under torchrun this
    process computes only its rows' share of it, and the gradients and the record's sums are
    summed over the processes before clipping."""
    cfg, head, examples, ranks = run.cfg, run.head, run.data.examples, run.ranks
    steps = cfg.train_steps
    run.opt.zero_grad(set_to_none=True)
    agg: dict[str, list] = {"loss": [0.0] * steps, "correct": [0] * steps, "targets": [0] * steps,
                            "in_table": [0] * steps}
    expected = [[0] * steps, [0] * steps]  # (targets, in_table) of the whole group
    loss_sum = 0.0
    for global_idxs in group:
        counts = parallel.token_counts([examples[i] for i in global_idxs], run.in_table, steps)
        expected = [[a + b for a, b in zip(e, c)] for e, c in zip(expected, counts)]
        idxs = ranks.shard(global_idxs)
        if not idxs:  # an epoch's last micro-batch can have fewer rows than there are processes
            continue
        batch = collate([examples[i] for i in idxs],
                        [feed.hidden_fn(i, examples[i].ids) for i in idxs], run.device,
                        feed.topks_of(idxs))
        with autocast(run.device, cfg.compute_dtype):
            loss, st = batch_loss(head, batch, run.proj, steps, cfg.weights, cfg.loss,
                                  cfg.attention, cfg.ce_chunk, denominators=counts,
                                  lookup_weight=cfg.lookup_weight)
        (loss / len(group)).backward()
        loss_sum += float(loss.detach()) / len(group)
        for key, vals in st.items():
            agg[key] = [a + b for a, b in zip(agg[key], vals)]
    if ranks.world > 1:
        parallel.all_reduce_grads(head.parameters())
        keys = ("loss", "correct", "targets", "in_table")
        sums = parallel.sum_over_ranks([loss_sum] + [v for k in keys for v in agg[k]], run.device)
        loss_sum = sums[0]
        for i, key in enumerate(keys):
            vals = sums[1 + i * steps: 1 + (i + 1) * steps]
            agg[key] = vals if key == "loss" else [round(v) for v in vals]
    # token_counts counted what batch_loss scored (its means divide by these counts)
    assert [agg["targets"], agg["in_table"]] == expected, (agg["targets"], agg["in_table"], expected)
    gnorm = (torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
             if cfg.grad_clip > 0 else _grad_norm(head))
    lr = run.opt.param_groups[0]["lr"]
    run.opt.step()
    run.sched.step()
    run.batch_pos += len(group)
    run.global_step += 1
    acc = [c / n if n else None for c, n in zip(agg["correct"], agg["targets"])]
    return {"event": "step", "step": run.global_step, "epoch": run.epoch + run.batch_pos / n_batches,
            "lr": lr, "loss": loss_sum,
            "loss_k": [v / len(group) for v in agg["loss"]], "acc_k": acc,
            "targets": agg["targets"][0],
            "out_of_table": [n - i for n, i in zip(agg["targets"], agg["in_table"])],
            "grad_norm": float(gnorm), "elapsed_s": round(time.perf_counter() - t0, 3)}


def _evaluate_heldout(run: RunState, feed: _Feed, held: list[tuple[int, Any]]) -> None:
    """Training-time tau on the held-out rows: logged (``event: eval`` with its optimizer step,
    the learning curve in steps) and printed."""
    cfg, ranks = run.cfg, run.ranks
    if ranks.world == 1:
        run.last_eval = evaluate(run.head, feed.hidden_fn, held, run.proj, cfg.steps,
                                 cfg.batch_size, cfg.ce_chunk)
    else:  # each process scores its shard; the counts combine to the single-process numbers
        mine = ranks.shard(held)
        part = evaluate(run.head, feed.hidden_fn, mine, run.proj, cfg.steps, cfg.batch_size,
                        cfg.ce_chunk)
        scored = parallel.token_counts([e for _, e in mine], None, cfg.steps)[0]
        run.last_eval = parallel.combine_evals(parallel.gather((part, scored)))
    last_eval = run.last_eval
    epoch = run.epoch + run.batch_pos / max(run.n_batches, 1)
    run.log({"event": "eval", "epoch": round(epoch, 4), "step": run.global_step, **last_eval})
    if not ranks.main:
        return
    print(f"\ntrain: step {run.global_step} (epoch {epoch:.2f}): held-out tau_train {fmt_score(last_eval['tau_train'])} "
          f"(walk {fmt_score(last_eval['tau_walk'])}), A_k "
          f"{[fmt_score(a) for a in last_eval['A_k']]}", file=sys.stderr)


def _grad_norm(head: nn.Module) -> torch.Tensor:
    norms = [p.grad.detach().norm() for p in head.parameters() if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.zeros(())


def fmt_score(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"

