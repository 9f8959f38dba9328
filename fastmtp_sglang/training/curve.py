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

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastmtp_sglang.core.errors import FastMTPError


@dataclass
class Arm:
    name: str
    flags: list[str]


def parse_arm(text: str) -> Arm:
    name, _, flags = text.partition("=")
    name = name.strip()
    if not name or not name.replace("-", "").replace("_", "").replace("+", "").isalnum():
        raise FastMTPError(f"--arm takes NAME=FLAGS with a plain name (letters, digits, - _ +), "
                           f"got {text!r}")
    return Arm(name, shlex.split(flags))


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


def _train_parser() -> argparse.ArgumentParser:
    from fastmtp_sglang.training import train as train_mod

    root = argparse.ArgumentParser(prog="fastmtp")
    train_mod.register(root.add_subparsers(dest="command"))
    return root


def run(args: argparse.Namespace) -> int:
    import torch

    from fastmtp_sglang.core.draft_dir import load_head
    from fastmtp_sglang.training.features import open_or_build
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.training.train import (Projection, _config_from_args, evaluate, load_examples,
                                      load_trainer_state, train)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = _ints(args.tokens, "--tokens")
    serve_steps = _ints(args.serve_steps, "--serve-steps")
    arms = [parse_arm(a) for a in (args.arm or ["fastmtp="])]
    if len({a.name for a in arms}) != len(arms):
        raise FastMTPError("two --arm share a name")
    common = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    parser = _train_parser()
    base = ["train", "--target", args.target, "--data", args.data, "--out", "x", "--init", args.init]

    def config_for(arm: Arm):
        ns = parser.parse_args(base + common + arm.flags)
        return ns, _config_from_args(ns, None)

    ns0, cfg0 = config_for(arms[0])
    target = load_target(args.target, dtype=ns0.dtype)
    target.model.requires_grad_(False)
    vocab = int(target.config.get("vocab_size") or target.lm_head.weight.shape[0])
    examples, _ = load_examples(args.data, target.tokenizer, vocab, cfg0.max_len)
    if len(examples) <= args.heldout_rows:
        raise FastMTPError(f"{args.data} has {len(examples)} usable rows; --heldout-rows "
                           f"{args.heldout_rows} would leave none to train on")
    rows, available = prefix_rows(examples, args.heldout_rows, tokens)
    for n in tokens:
        if n not in rows:
            print(f"curve: {n} response tokens requested, the data has {available} before the "
                  "held-out rows: point skipped", file=sys.stderr)
    held = [(i, examples[i]) for i in range(len(examples) - args.heldout_rows, len(examples))]
    vocab_ids = vocab_name = draft_vocab = None
    if ns0.vocab:  # train, score and serve with the compressed head that will serve
        from fastmtp_sglang.vocab.draft_vocab import resolve_vocab
        from fastmtp_sglang.vocab.tables import load_table

        table = load_table(ns0.vocab, target.tokenizer)
        vocab_ids, vocab_name = table.ids, table.name
        draft_vocab = resolve_vocab(ns0.vocab, target.tokenizer, target.lm_head)
    feats = Path(args.features) if args.features else out / "features"
    need_topk = max((config_for(a)[1].kl_topk for a in arms), default=0)
    store = open_or_build(target, args.target, args.data, examples, feats, cfg0.max_len, None,
                          args.feature_dtype, need_topk, not args.no_progress)
    dev = []
    if args.dev_prompts:
        from fastmtp_sglang.cli.bench import load_prompt_ids

        dev = [ids for *_, ids in load_prompt_ids(target.tokenizer, args.dev_prompts,
                                                  args.dev_per_category, None, True)]
    results_file = out / "curve.json"
    points: list[dict[str, Any]] = (json.loads(results_file.read_text())["points"]
                                    if results_file.is_file() else [])
    done = {(p["arm"], p["tokens"]) for p in points}
    for arm in arms:
        ns, cfg = config_for(arm)
        if ns.vocab != ns0.vocab:
            raise FastMTPError("every arm of one curve uses the same --vocab (pass it after --)")
        cfg.heldout_fraction = 0.0  # the curve's own held-out rows are scored instead
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
            res = train(cfg, target, args.data, pdir, init=args.init, resume=resume,
                        vocab_ids=vocab_ids, vocab_name=vocab_name,
                        overwrite=resume is None and pdir.exists(), progress=not args.no_progress,
                        features=feats, target_dir=args.target, feature_dtype=args.feature_dtype,
                        allow_base_mismatch=getattr(ns, "allow_base_mismatch", False))
            seconds = time.perf_counter() - t0
            head = load_head(pdir, target.embed, target.lm_head, dtype=torch.float32)
            proj = Projection(target.lm_head, vocab_ids)
            ev = evaluate(head, store, held, proj, max(serve_steps), cfg.batch_size, cfg.ce_chunk)
            point = {"arm": arm.name, "flags": arm.flags, "tokens": n, "rows": rows[n],
                     "optimizer_steps": res.global_step, "train_seconds": round(seconds, 1),
                     "heldout": {k: ev[k] for k in ("tau_train", "tau_walk", "A_k", "acc_k", "anchors")}}
            if dev:
                mdt = next(target.model.parameters()).dtype
                h = load_head(pdir, target.embed, target.lm_head, dtype=mdt)
                point["served_tau"] = {str(k): v for k, v in served_tau(
                    target, h, dev, serve_steps, args.dev_max_new_tokens, draft_vocab).items()}
            points.append(point)
            _write(out, points, {"command": "fastmtp " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                                 "data": args.data, "heldout_rows": args.heldout_rows,
                                 "serve_steps": serve_steps, "dev_prompts": args.dev_prompts,
                                 "dev_per_category": args.dev_per_category,
                                 "available_tokens": available})
            print(f"curve: {arm.name} @ {n}: held-out tau_walk {ev['tau_walk']:.3f}"
                  + (f", served tau {point['served_tau']}" if dev else ""), file=sys.stderr)
    if not points:
        raise FastMTPError(f"no point to train: every --tokens value exceeds the {available} "
                           "response tokens before the held-out rows; pass smaller --tokens")
    print(f"wrote {out}/curve.json, curve.md, curve.png")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FastMTPError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise FastMTPError(f"{flag} needs numbers >= 1, got {text!r}")
    return vals


def markdown(points: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    ks = [str(k) for k in meta["serve_steps"]]
    lines = ["# Learning curve", "", f"Command: `{meta['command']}`", "",
             f"Held-out: the last {meta['heldout_rows']} rows of `{meta['data']}` (in no prefix); "
             f"served: reference engine, greedy, `{meta['dev_prompts']}` "
             f"({meta['dev_per_category']} per category).", "",
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("curve", help="learning curves: tau against training tokens, per arm",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--init", required=True, help="draft directory every point starts from")
    p.add_argument("--data", required=True, help="training JSONL (prefixes are taken in file order)")
    p.add_argument("--out", required=True, help="results and per-point checkpoints")
    p.add_argument("--tokens", default="84000,250000,500000,1000000",
                   help="response tokens per point, comma-separated (default 84000,250000,500000,1000000)")
    p.add_argument("--arm", action="append", help="NAME=TRAIN-FLAGS, repeatable (default "
                   "fastmtp=, i.e. the defaults); e.g. --arm vanilla=--vanilla")
    p.add_argument("--heldout-rows", type=int, default=100, help="rows at the end of the data "
                   "scored at every point and never trained on (default 100)")
    p.add_argument("--features", default=None, help="feature cache over the whole data "
                   "(default OUT/features; built once)")
    p.add_argument("--feature-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--serve-steps", default="3", help="K values scored (default 3)")
    p.add_argument("--dev-prompts", nargs="+", default=None, help="prompt files for served tau "
                   "(e.g. bench/data/spec_bench.jsonl); default: no served tau")
    p.add_argument("--dev-per-category", type=int, default=1, help="dev prompts per category (default 1)")
    p.add_argument("--dev-max-new-tokens", type=int, default=64, help="tokens per dev prompt (default 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then `fastmtp train` flags for every arm")
    p.set_defaults(func=run)
