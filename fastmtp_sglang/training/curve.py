"""`fastmtp curve`: learning curves. Train on growing prefixes of one dataset, score each head.

    fastmtp curve --target T --init D0 --data D.jsonl --out R/ \\
        --tokens 84000,250000,500000,1000000 --arm fastmtp= --arm vanilla=--vanilla \\
        --dev-prompts bench/data/spec_bench.jsonl --features D.features -- --epochs 2 --lr 1e-3

Answers "does more data, or more steps, move tau?" before anyone spends a day on a run. For
every arm (a name and the ``fastmtp train`` flags that make it differ: ``vanilla=--vanilla``,
``kl=--loss kl --kl-topk 32``; the flags after ``--`` apply to every arm) and every point N of
``--tokens``, a head is trained from ``--init`` on the first rows of ``--data`` that hold N
response tokens, then scored twice:

- **held-out training-time tau** (``tau_walk``, the cycles a greedy server would run on the text,
  and ``tau_train``, every anchor) on the last ``--heldout-rows`` rows of the data, which no
  prefix ever contains, so every point is scored on the same text;
- **served tau** at each K of ``--serve-steps`` by the reference engine, greedy, on
  ``--dev-prompts`` (``--dev-per-category`` of each category), when given.

Every point reads the target's hidden states from one feature cache over the whole file
(``--features``, built once; see ``fastmtp features``). Each point's checkpoint lives in
``OUT/<arm>/<N>/``: a rerun skips finished points and resumes an interrupted one. Results:
``OUT/curve.json``, ``OUT/curve.md`` and ``OUT/curve.png`` (tau against tokens, log x).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.hardware import default_device
from fastmtp_sglang.decode.costs import cpu_description
from fastmtp_sglang.training.checkpoints import load_trainer_state
from fastmtp_sglang.training.config import TrainConfig
from fastmtp_sglang.training.data import load_examples
from fastmtp_sglang.training.features import open_or_build
from fastmtp_sglang.training.objective import Projection, evaluate
from fastmtp_sglang.training.train import train


@dataclass
class Arm:
    """One arm of a curve: its name, the `fastmtp train` flags that make it differ (recorded with
    each point), and what those flags (with the common ones) set: the training config, the
    target's dtype, the compressed-vocabulary table and whether a draft of another base is allowed."""
    name: str
    flags: list[str]
    cfg: TrainConfig = field(default_factory=TrainConfig)
    target_dtype: str = "float32"
    vocab: str | None = None
    allow_base_mismatch: bool = False
    device: str | None = None  # --device: None = cuda when available, as `fastmtp train`


def prefix_rows(examples, heldout_rows: int, tokens: list[int]) -> tuple[dict[int, int], int]:
    """For each N in ``tokens``: the number of leading rows holding >= N response tokens (rows
    before the held-out tail). Returns ({N: rows}, response tokens available)."""
    pool = examples[: max(len(examples) - heldout_rows, 0)]
    cum, rows = 0, {}
    todo = sorted(tokens)
    for i, e in enumerate(pool, start=1):
        cum += len(e.ids) - e.prompt_len
        while todo and cum >= todo[0]:
            rows[todo.pop(0)] = i
    return rows, cum


def served_tau(target, head, prompts: list[list[int]], steps: list[int], max_new_tokens: int,
               draft_vocab=None) -> dict[int, float]:
    """Greedy tau of the reference engine at each K, pooled over the prompts (``draft_vocab``: a
    :class:`~fastmtp_sglang.vocab.draft_vocab.DraftVocab` to draft over, None = full vocabulary)."""
    from fastmtp_sglang.decode.engine import ReferenceEngine, Request
    from fastmtp_sglang.decode.metrics import aggregate
    from fastmtp_sglang.decode.sampling import SamplingParams

    out = {}
    for k in steps:
        eng = ReferenceEngine(target, head, k, draft_vocab=draft_vocab)
        res = [eng.generate([Request(p, SamplingParams(max_new_tokens=max_new_tokens))])[0]
               for p in prompts]
        out[k] = aggregate([r.metrics for r in res])["tau"]
    return out


def step_curve(pdir: str | Path) -> list[dict[str, Any]]:
    """The held-out scores a run logged while it trained (``--eval-every`` and each epoch's end),
    in optimizer steps, from its ``train_log.jsonl`` (a resumed run's log holds the whole run)."""
    from fastmtp_sglang.training.checkpoints import LOG_NAME

    f = Path(pdir) / LOG_NAME
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("event") == "eval":
            out.append({k: rec.get(k) for k in ("step", "epoch", "tau_walk", "tau_train", "A_k")})
    return out


def learning_curve(target_dir: str, init: str, data: str, out: str | Path, tokens: list[int],
                   arms: list[Arm], serve_steps: list[int], heldout_rows: int = 100,
                   features: str | Path | None = None, feature_dtype: str = "bfloat16",
                   dev_prompts: list[str] | None = None, dev_per_category: int = 1,
                   dev_max_new_tokens: int = 64, progress: bool = True,
                   command: str = "fastmtp curve") -> list[dict[str, Any]]:
    """Train and score every (arm, N) point not yet in ``OUT/curve.json``; returns all points.

    The target loads in the first arm's dtype; ``features`` defaults to ``OUT/features``;
    ``command`` is recorded in the results. Writes ``curve.json``, ``curve.md`` and
    ``curve.png`` in ``out`` after each point.
    """
    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.core.target import load_target

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arm0, cfg0 = arms[0], arms[0].cfg
    device = default_device(arm0.device)
    if any(default_device(a.device) != device for a in arms):
        raise FastMTPError("every arm of one curve trains on the same --device (pass it after --)")
    target = load_target(target_dir, dtype=arm0.target_dtype, device=device)
    target.model.requires_grad_(False)
    vocab = int(target.config.get("vocab_size") or target.lm_head.weight.shape[0])
    examples, _ = load_examples(data, target.tokenizer, vocab, cfg0.max_len)
    if len(examples) <= heldout_rows:
        raise FastMTPError(f"{data} has {len(examples)} usable rows; --heldout-rows "
                           f"{heldout_rows} would leave none to train on")
    rows, available = prefix_rows(examples, heldout_rows, tokens)
    for n in tokens:
        if n not in rows:
            print(f"curve: {n} response tokens requested, the data has {available} before the "
                  "held-out rows: point skipped", file=sys.stderr)
    held = [(i, examples[i]) for i in range(len(examples) - heldout_rows, len(examples))]
    vocab_ids = vocab_name = draft_vocab = None
    if arm0.vocab:  # train, score and serve with the compressed head that will serve
        from fastmtp_sglang.vocab.draft_vocab import resolve_vocab
        from fastmtp_sglang.vocab.tables import load_table

        table = load_table(arm0.vocab, target.tokenizer)
        vocab_ids, vocab_name = table.ids, table.name
        draft_vocab = resolve_vocab(arm0.vocab, target.tokenizer, target.lm_head)
    feats = Path(features) if features else out / "features"
    need_topk = max((a.cfg.kl_topk for a in arms), default=0)
    from fastmtp_sglang.core.draft_dir import read_config
    from fastmtp_sglang.core.head import HeadConfig

    aux = HeadConfig.from_dict(read_config(init)).aux_hidden_states  # a fused head's middle layers
    store = open_or_build(target, target_dir, data, examples, feats, cfg0.max_len, None,
                          feature_dtype, need_topk, progress, aux_layers=aux)
    dev = []
    if dev_prompts:
        from fastmtp_sglang.core.prompts import load_prompt_ids

        dev = [ids for *_, ids in load_prompt_ids(target.tokenizer, dev_prompts,
                                                  dev_per_category, None, True)]
    results_file = out / "curve.json"
    points: list[dict[str, Any]] = (json.loads(results_file.read_text())["points"]
                                    if results_file.is_file() else [])
    done = {(p["arm"], p["tokens"]) for p in points}
    for arm in arms:
        if arm.vocab != arm0.vocab:
            raise FastMTPError("every arm of one curve uses the same --vocab (pass it after --)")
        cfg = replace(arm.cfg, heldout_fraction=0.0)  # the curve's own held-out rows are scored instead
        for n in sorted(rows):
            if (arm.name, n) in done:
                continue
            cfg.max_sequences = rows[n]
            pdir = out / arm.name / str(n)
            resume = pdir if (pdir / "trainer_state.pt").is_file() else None
            if resume is not None and load_trainer_state(pdir)["config"].get("max_sequences") != rows[n]:
                raise FastMTPError(f"{pdir} was trained on another prefix: remove it")
            print(f"curve: arm {arm.name}, {n} tokens ({rows[n]} rows)", file=sys.stderr)
            t0 = time.perf_counter()
            res = train(cfg, target, data, pdir, init=init, resume=resume,
                        vocab_ids=vocab_ids, vocab_name=vocab_name,
                        overwrite=resume is None and pdir.exists(), progress=progress,
                        features=feats, target_dir=target_dir, feature_dtype=feature_dtype,
                        allow_base_mismatch=arm.allow_base_mismatch, heldout=held)
            seconds = time.perf_counter() - t0
            head = load_head(pdir, target.embed, target.lm_head, dtype=torch.float32, device=device)
            proj = Projection(target.lm_head, vocab_ids)
            ev = evaluate(head, store, held, proj, max(serve_steps), cfg.batch_size, cfg.ce_chunk)
            point = {"arm": arm.name, "flags": arm.flags, "tokens": n, "rows": rows[n],
                     "optimizer_steps": res.global_step, "train_seconds": round(seconds, 1),
                     "heldout": {k: ev[k] for k in ("tau_train", "tau_walk", "A_k", "acc_k", "anchors")},
                     "step_curve": step_curve(pdir)}
            if dev:
                mdt = next(target.model.parameters()).dtype
                h = load_head(pdir, target.embed, target.lm_head, dtype=mdt, device=device)
                point["served_tau"] = {str(k): v for k, v in served_tau(
                    target, h, dev, serve_steps, dev_max_new_tokens, draft_vocab).items()}
            points.append(point)
            _write(out, points, {"command": command,
                                 "data": data, "heldout_rows": heldout_rows,
                                 "serve_steps": serve_steps, "dev_prompts": dev_prompts,
                                 "dev_per_category": dev_per_category,
                                 "available_tokens": available, "cpu": cpu_description(),
                                 "device": (torch.cuda.get_device_name(torch.device(device))
                                            if device.startswith("cuda") else "cpu")})
            print(f"curve: {arm.name} @ {n}: held-out tau_walk {ev['tau_walk']:.3f}"
                  + (f", served tau {point['served_tau']}" if dev else ""), file=sys.stderr)
    if not points:
        raise FastMTPError(f"no point to train: every --tokens value exceeds the {available} "
                           "response tokens before the held-out rows; pass smaller --tokens")
    return points


def markdown(points: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    ks = [str(k) for k in meta["serve_steps"]]
    lines = ["# Learning curve", "", f"Command: `{meta['command']}`", "",
             f"Held-out: the last {meta['heldout_rows']} rows of `{meta['data']}` (in no prefix); "
             f"served: reference engine, greedy, `{meta['dev_prompts']}` "
             f"({meta['dev_per_category']} per category)."
             + (f" CPU: {meta['cpu']['model']} ({', '.join(meta['cpu']['flags'])}), "
                f"{meta['cpu']['threads']} threads." if meta.get("cpu") else ""), "",
             "| arm | response tokens | rows | optimizer steps | train s | held-out tau_walk | "
             "held-out tau_train | A_k (%) | " + " | ".join(f"served tau K={k}" for k in ks) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(ks)]
    for p in sorted(points, key=lambda p: (p["arm"], p["tokens"])):
        h = p["heldout"]
        served = p.get("served_tau") or {}
        lines.append(f"| {p['arm']} | {p['tokens']} | {p['rows']} | {p['optimizer_steps']} | "
                     f"{p['train_seconds']:.0f} | {h['tau_walk']:.3f} | {h['tau_train']:.3f} | "
                     + "/".join(f"{100 * a:.0f}" for a in h["A_k"]) + " | "
                     + " | ".join(f"{served[k]:.3f}" if k in served else "-" for k in ks) + " |")
    for p in sorted(points, key=lambda p: (p["arm"], p["tokens"])):
        sc = p.get("step_curve") or []
        if len(sc) < 2:
            continue
        lines += ["", f"## {p['arm']} @ {p['tokens']} tokens: held-out score in optimizer steps "
                  "(K as trained)", "", "| step | epoch | tau_walk | tau_train | A_k (%) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['epoch']:.2f} | {r['tau_walk']:.3f} | {r['tau_train']:.3f} | "
                  + "/".join(f"{100 * a:.0f}" for a in r["A_k"]) + " |" for r in sc]
    return "\n".join(lines) + "\n"


def _write(out: Path, points: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    tmp = out / ".curve.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    tmp.replace(out / "curve.json")
    (out / "curve.md").write_text(markdown(points, meta))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    kmax = str(max(meta["serve_steps"]))
    for i, arm in enumerate(sorted({p["arm"] for p in points})):
        ps = sorted((p for p in points if p["arm"] == arm), key=lambda p: p["tokens"])
        x = [p["tokens"] for p in ps]
        ax.plot(x, [p["heldout"]["tau_walk"] for p in ps], "o--", color=f"C{i}", alpha=0.6,
                label=f"{arm}: held-out tau_walk (K={kmax})")
        if all(p.get("served_tau") for p in ps):
            ax.plot(x, [p["served_tau"][kmax] for p in ps], "s-", color=f"C{i}",
                    label=f"{arm}: served tau (K={kmax})")
    ax.set_xscale("log")
    ax.set_xlabel("response tokens trained on")
    ax.set_ylabel("tau (tokens per verification)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=110)
    plt.close(fig)
    runs = [p for p in points if len(p.get("step_curve") or []) >= 2]
    if runs:  # the curve in optimizer steps: where more passes over the same data stop paying
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, p in enumerate(sorted(runs, key=lambda p: (p["arm"], p["tokens"]))):
            sc = p["step_curve"]
            ax.plot([r["step"] for r in sc], [r["tau_walk"] for r in sc], "o-", color=f"C{i}",
                    label=f"{p['arm']} @ {p['tokens']} tokens")
        ax.set_xlabel("optimizer steps")
        ax.set_ylabel("held-out tau_walk (K as trained)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "curve_steps.png", dpi=110)
        plt.close(fig)
