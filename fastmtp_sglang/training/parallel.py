"""Data-parallel training under torchrun: which process this is, the process group, each rank's
share of a batch, the token counts a batch's loss is averaged over, and the sums over ranks.

    torchrun --nproc_per_node 8 -m fastmtp_sglang train --target T --init D0 --data D --out D1

Every process holds the frozen target and a copy of the head. The global batch is the
single-process batch (``--batch-size`` sequences per micro-batch, ``--grad-accum`` micro-batches
per optimizer step); rank r of N takes rows r, r+N, r+2N, ... of each micro-batch (strided, so
``--group-by-length``'s longest rows are spread over the ranks). The data order is therefore the
single-process order, and a checkpoint (global step, position in the epoch) resumes with any N.

**Weighting.** A micro-batch's loss is, per step k, a mean over its scored response tokens
(objective.batch_loss). Ranks hold different numbers of tokens, so averaging the ranks' own means
would weight a token by 1 / its rank's count. Instead every rank divides its sums by the counts of
the whole micro-batch (:func:`token_counts`, computed from the rows alone, no communication) and
the gradients are summed over ranks (:func:`all_reduce_grads`): the sum is the gradient of the
single-process loss. After the sum every rank holds the same gradient, clips it the same way and
takes the same AdamW step, so the heads stay identical. Rank 0 alone writes checkpoints, the log
and the progress bar; the held-out split is scored in shards and the counts combined
(:func:`combine_evals`), which gives the single-process numbers exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.hardware import default_device

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank ``rank`` of ``world`` (1 = a single process)."""
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes checkpoints, logs and progress."""
        return self.rank == 0

    def shard(self, rows: list) -> list:
        """This rank's rows of a global batch (strided: rows r, r+N, ...; may be empty)."""
        return rows[self.rank::self.world]


def current() -> Ranks:
    """The process group's view when one is initialised, else a single process."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


def torchrun_env(environ: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) as torchrun sets them; None outside torchrun."""
    environ = os.environ if environ is None else environ
    have = [k for k in TORCHRUN_VARS if k in environ]
    if not have:
        return None
    missing = [k for k in TORCHRUN_VARS if k not in environ]
    if missing:
        raise FastMTPError(f"{', '.join(have)} set but {', '.join(missing)} not: start data-parallel "
                           "training with torchrun (it sets all three), or unset them")
    try:
        rank, world, local = (int(environ[k]) for k in TORCHRUN_VARS)
    except ValueError:
        raise FastMTPError("RANK, WORLD_SIZE and LOCAL_RANK must be integers, got "
                           + ", ".join(f"{k}={environ[k]!r}" for k in TORCHRUN_VARS)) from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise FastMTPError(f"bad torchrun environment: RANK={rank}, WORLD_SIZE={world}, "
                           f"LOCAL_RANK={local}")
    return rank, world, local


def start(device: str | None) -> tuple[str, bool]:
    """This process's device, joining torchrun's process group first when launched by torchrun.

    ``device`` is the --device flag (None: cuda when available). Under torchrun a CUDA device is
    the process's own GPU, ``cuda:LOCAL_RANK``, and the group uses NCCL; on CPU it uses gloo.
    Returns (device, whether this call created the group: then :func:`end` destroys it). A group
    that already exists (a caller running several commands in one process) is joined as is.
    """
    env = torchrun_env()
    device = default_device(device)
    if env is None:
        return device, False
    rank, world, local = env
    cuda = torch.device(device).type == "cuda"
    if cuda:
        visible = torch.cuda.device_count()
        if local >= visible:
            raise FastMTPError(f"torchrun started local rank {local} but this machine shows "
                               f"{visible} GPU(s): use --nproc_per_node <= {visible}")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if dist.is_initialized():
        return device, False
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return device, True


def end(started: bool) -> None:
    if started and dist.is_initialized():
        dist.destroy_process_group()


def token_counts(rows: Iterable, in_table: torch.Tensor | None, steps: int
                 ) -> tuple[list[int], list[int]]:
    """What objective.batch_loss averages over, for a batch of ``rows`` (data.Example).

    Per step k = 1..steps: the scored targets (step k at anchor j scores x_{j+k+1} when it is a
    response token: positions t in [max(prompt_len, k+1), length)), and how many of those lie in
    the compressed table (``in_table``: bool [V] on the CPU, True for table ids; None = no table,
    every target counts). Independent of padding and of which rank holds a row.
    """
    targets, inside = [0] * steps, [0] * steps
    for e in rows:
        n = len(e.ids)
        hit = in_table[e.ids] if in_table is not None else None
        for k in range(1, steps + 1):
            lo = max(e.prompt_len, k + 1)
            if lo < n:
                targets[k - 1] += n - lo
                inside[k - 1] += int(hit[lo:].sum()) if hit is not None else n - lo
    return targets, inside


def all_reduce_grads(params: Iterable[nn.Parameter]) -> None:
    """Sum the gradients of the trainable ``params`` over ranks, in place, in one all-reduce.

    A parameter without a gradient on a rank (its share of every micro-batch was empty) counts as
    zeros there; one without a gradient on every rank stays None, so AdamW skips it as it would
    in a single process.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    dev = params[0].device
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params]
                     + [torch.tensor([float(p.grad is not None) for p in params], device=dev)])
    dist.all_reduce(flat)
    flags = flat[-len(params):].tolist()
    off = 0
    for p, flag in zip(params, flags):
        n = p.numel()
        if flag == 0:
            p.grad = None
        else:
            p.grad = flat[off:off + n].view_as(p).to(p.dtype)
        off += n


def sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums over ranks (fp64: token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier(device: torch.device) -> None:
    """Wait for every rank (an all-reduce of one number on ``device``: gloo and NCCL alike)."""
    dist.all_reduce(torch.zeros(1, device=device))


def require_same(ranks: Ranks, what: dict[str, Any]) -> None:
    """Refuse a launch whose processes disagree on the run (data, settings, head, position):
    raised on every rank alike."""
    if ranks.world == 1:
        return
    got = gather(what)
    diff = [k for k in what if any(g.get(k) != got[0].get(k) for g in got)]
    if diff:
        raise FastMTPError(f"the {ranks.world} torchrun processes disagree on {', '.join(diff)}: "
                           "start them with one command over the same files")


def head_fingerprint(head: nn.Module) -> list[float]:
    """One fp64 number per tensor of the head: equal on every rank when the heads are equal."""
    return [float(t.detach().double().abs().sum() + t.detach().double().sum())
            for t in head.state_dict().values()]


def combine_evals(parts: list[tuple[dict[str, Any], list[int]]]) -> dict[str, Any]:
    """One held-out score from each rank's objective.evaluate over its shard, with the shard's
    scored targets per step (acc_k's denominators, :func:`token_counts`).

    evaluate reports ratios; the integer counts behind them are recovered (round(ratio * count):
    exact while counts stay far below 2**52) and the ratios recomputed the way evaluate computes
    them, so the result equals a single process's evaluation of the whole split bit for bit.
    """
    anchors = sum(p["anchors"] for p, _ in parts)
    cycles = sum(p["cycles"] for p, _ in parts)
    steps = len(parts[0][0]["A_k"])
    accepted = sum(round((p["tau_train"] - 1) * p["anchors"]) for p, _ in parts if p["anchors"])
    walked = sum(round((p["tau_walk"] - 1) * p["cycles"]) for p, _ in parts if p["cycles"])
    reach = [sum(round(p["A_k"][k] * p["anchors"]) for p, _ in parts if p["anchors"])
             for k in range(steps)]
    hits = [sum(round(p["acc_k"][k] * n[k]) for p, n in parts if n[k]) for k in range(steps)]
    scored = [sum(n[k] for _, n in parts) for k in range(steps)]
    return {
        "tau_train": 1 + accepted / anchors if anchors else None,
        "A_k": [r / anchors if anchors else None for r in reach],
        "anchors": anchors,
        "tau_walk": 1 + walked / cycles if cycles else None,
        "cycles": cycles,
        "acc_k": [h / n if n else None for h, n in zip(hits, scored)],
    }
