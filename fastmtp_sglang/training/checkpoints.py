"""A training run's state and its checkpoints: :class:`RunState` (head, optimizer, schedule,
position in the data, log), and on disk a draft directory with ``trainer_state.pt`` (fp32
weights, optimizer, scheduler, position in the data, RNG) and ``train_log.jsonl`` beside
``model.safetensors``, written atomically, read back for ``--resume``."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch

from fastmtp_sglang.core.draft_dir import copy_tables, save_draft_dir
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.parallel import Ranks

if TYPE_CHECKING:
    from fastmtp_sglang.core.draft_dir import DraftDir
    from fastmtp_sglang.core.head import FastMTPHead
    from fastmtp_sglang.training.config import TrainConfig
    from fastmtp_sglang.training.data import TrainData
    from fastmtp_sglang.training.objective import Projection

STATE_NAME = "trainer_state.pt"
LOG_NAME = "train_log.jsonl"
STATE_FORMAT = 1


def write_checkpoint(out: Path, config: dict[str, Any], state_dict: dict[str, torch.Tensor],
                     trainer_state: dict[str, Any], log_lines: list[str],
                     tables_from: Path | None = None) -> None:
    """A draft directory plus trainer_state.pt and train_log.jsonl, atomically (replaces ``out``;
    a failed write leaves the previous checkpoint intact). ``tables_from``: the directory whose
    table files ``config``'s ``fastmtp.vocab_tables`` names (the init's), copied beside the
    weights so the checkpoint serves as it is."""
    def extra(tmp: Path) -> None:
        torch.save(trainer_state, tmp / STATE_NAME)
        (tmp / LOG_NAME).write_text("".join(line + "\n" for line in log_lines))
        if tables_from is not None:
            copy_tables((config.get("fastmtp") or {}).get("vocab_tables"), Path(tables_from), tmp)

    save_draft_dir(out, config, state_dict, overwrite=True, write_extra=extra)


def load_trainer_state(path: Path) -> dict[str, Any]:
    f = Path(path) / STATE_NAME
    if not f.is_file():
        raise FastMTPError(f"{path} has no {STATE_NAME}: it is not a checkpoint `fastmtp train` "
                           "wrote, so it cannot be resumed (use it as --init instead)")
    state = torch.load(f, map_location="cpu", weights_only=True)
    if state.get("format") != STATE_FORMAT:
        raise FastMTPError(f"{f} has trainer-state format {state.get('format')!r}; expected {STATE_FORMAT}")
    return state


@dataclass
class RunState:
    """What a checkpoint saves: the head, optimizer and schedule, the position in the data, the
    last held-out score and the log (``records``: this process's; ``log_lines``: the whole run's).

    The position is global (micro-batches of the single-process order), whatever the number of
    processes: under torchrun every rank holds the same state and rank 0 alone writes it."""
    cfg: TrainConfig
    out: Path
    init: str | Path | None
    draft: DraftDir
    head: FastMTPHead
    proj: Projection
    data: TrainData
    features: str | Path | None
    feature_dtype: str
    vocab_name: str | None
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    n_batches: int                    # micro-batches per epoch
    total: int                        # optimizer steps of the whole run
    epoch: int = 0
    batch_pos: int = 0                # micro-batches of this epoch done
    global_step: int = 0
    last_eval: dict[str, Any] | None = None
    log_lines: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    wrote_out: bool = False
    ranks: Ranks = Ranks()
    lineage: list[dict[str, Any]] = field(default_factory=list)  # the runs before --init's weights
    in_table: torch.Tensor | None = field(init=False)  # [V] bool on the CPU: ids in proj's table

    def __post_init__(self) -> None:
        index = self.proj.index
        self.in_table = index.cpu() >= 0 if index is not None else None

    @property
    def device(self) -> torch.device:
        return self.head.enorm.weight.device

    def log(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        line = json.dumps(rec)
        self.log_lines.append(line)
        if self.wrote_out:  # live tail in the directory this run owns
            with (self.out / LOG_NAME).open("a") as f:
                f.write(line + "\n")

    def checkpoint(self, finished: bool) -> None:
        """Write the checkpoint at ``out`` (rank 0; the other ranks hold the same state); from then
        on log records are appended there too."""
        if not self.ranks.main:
            return
        trainer_state = self._trainer_state()
        config = self._draft_config(finished)
        write_checkpoint(self.out, config, self.head.state_dict(), trainer_state, self.log_lines,
                         tables_from=self.draft.path)
        self.wrote_out = True

    def _trainer_state(self) -> dict[str, Any]:
        cfg, features = self.cfg, self.features
        return {
            "format": STATE_FORMAT, "config": asdict(cfg), "head": {k: v.detach().cpu().clone()
                                                                   for k, v in self.head.state_dict().items()},
            "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            "epoch": self.epoch, "batch_in_epoch": self.batch_pos, "global_step": self.global_step,
            "rng": torch.get_rng_state(), "last_eval": self.last_eval,
            "world_size": self.ranks.world,  # informational: a resume may use another
            "data": {"path": str(self.data.path), "sha256": self.data.sha256},
            "vocab_ids": self.proj.vocab_ids.cpu() if self.proj.vocab_ids is not None else None,
            "features": str(features) if features is not None else None,
            "feature_dtype": self.feature_dtype if features is not None else None,
        }

    def _draft_config(self, finished: bool) -> dict[str, Any]:
        """The draft's config.json with what trained it under ``fastmtp``."""
        cfg, ds, proj, init, last_eval = self.cfg, self.data, self.proj, self.init, self.last_eval
        epoch, batch_pos = self.epoch, self.batch_pos
        config = json.loads(json.dumps(self.draft.config))
        meta = config.setdefault("fastmtp", {})
        meta["trained_steps"] = cfg.train_steps
        meta["step_weights"] = [round(w, 6) for w in cfg.weights]
        meta["training"] = {
            "mode": "vanilla" if cfg.vanilla else "fastmtp",
            "attention": cfg.attention,
            "data": portable_path(ds.path), "data_sha256": ds.sha256, "data_counts": asdict(ds.counts),
            "sequences_train": len(ds.train_idx), "sequences_heldout": len(ds.held_idx),
            "optimizer_steps": self.global_step, "optimizer_steps_total": self.total, "finished": finished,
            "optimizer_steps_cumulative": self.global_step + sum(e["optimizer_steps"] for e in self.lineage),
            "epochs_done": epoch if batch_pos == 0 else epoch + (batch_pos / self.n_batches),
            "last_train": _last_train(self.records, self.log_lines),
            "heldout": last_eval,
            "tau_train": (last_eval or {}).get("tau_train"),
            "vocab": {"name": self.vocab_name, "size": proj.size} if proj.vocab_ids is not None else None,
            "init": portable_path(init if init is not None
                                  else self.draft.meta.get("training", {}).get("init")),
            "config": asdict(cfg),
        }
        if self.lineage:
            meta["lineage"] = self.lineage
        return config


def portable_path(path: str | os.PathLike | None, root: Path | None = None) -> str | None:
    """``path`` as a draft's training record keeps it: never an absolute path of the machine that
    wrote it (a shipped head's config.json travels to other machines).

    A relative path is kept as given (relative to the directory the run started in, say the
    repository root). An absolute one inside ``root`` (default: the working directory) becomes
    relative to it; one outside it becomes None, and the record's sha256 (``data_sha256``) is
    what identifies the file.
    """
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return p.resolve().relative_to((root or Path.cwd()).resolve()).as_posix()
    except ValueError:
        return None


def lineage_of(meta: dict[str, Any], resumed: bool) -> list[dict[str, Any]]:
    """The training runs behind a draft's weights, oldest first (``fastmtp.lineage``).

    A run that starts from a trained head (a warm restart: ``--init`` of a head ``fastmtp train``
    wrote) adds that head's run to the head's own lineage, so a head continued across sessions
    says how many optimizer steps, and on which data, made it. A resumed run keeps its
    checkpoint's lineage; a head from ``init-head`` has none. Paths are kept as
    :func:`portable_path` gives them (an inherited absolute path becomes None; the data's sha256
    stays)."""
    lineage = [{**e, "data": portable_path(e.get("data")), "init": portable_path(e.get("init"))}
               for e in meta.get("lineage") or []]
    t = meta.get("training")
    if resumed or not t:
        return lineage
    c = t.get("config") or {}
    lineage.append({
        "data": portable_path(t.get("data")), "data_sha256": t.get("data_sha256"),
        "sequences_train": t.get("sequences_train"), "optimizer_steps": int(t.get("optimizer_steps") or 0),
        "epochs_done": t.get("epochs_done"), "finished": t.get("finished"),
        "lr": c.get("lr"), "loss": c.get("loss"), "batch_size": c.get("batch_size"),
        "vocab": t.get("vocab"), "init": portable_path(t.get("init")),
        "heldout_tau_walk": (t.get("heldout") or {}).get("tau_walk"),
    })
    return lineage


def _last_train(records: list[dict[str, Any]], log_lines: list[str]) -> dict[str, Any] | None:
    """Mean loss / accuracy over the most recent (up to 50) optimizer steps."""
    steps = [r for r in records if r.get("event") == "step"]
    if not steps:
        steps = [json.loads(ln) for ln in log_lines[-200:]]
        steps = [r for r in steps if r.get("event") == "step"]
    steps = steps[-50:]
    if not steps:
        return None
    k = len(steps[0]["loss_k"])

    def mean(vals: Iterable[float | None]) -> float | None:
        v = [x for x in vals if x is not None]
        return sum(v) / len(v) if v else None

    return {"steps": len(steps), "loss": mean(r["loss"] for r in steps),
            "loss_k": [mean(r["loss_k"][i] for r in steps) for i in range(k)],
            "acc_k": [mean(r["acc_k"][i] for r in steps) for i in range(k)]}
