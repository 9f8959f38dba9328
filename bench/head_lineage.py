"""The learning curve of a head trained in several runs (warm restarts), in cumulative optimizer steps.

    python bench/head_lineage.py --run "1.29M tokens, LR 6e-3=bench/results/head_steps/curve.json" \
        --run "+1.28M new tokens, LR 3e-3=bench/results/head_v4/curve.json" \
        --hline "prompt lookup 5, served=1.301" --out bench/results/head_lineage

Each ``--run LABEL=CURVE_JSON`` is a `fastmtp curve` result whose last point (of ``--arm``,
default fastmtp) continued the previous run's head (``INIT=`` in bench/pipelines/head_demo.sh),
so its optimizer steps are counted after the previous run's. The held-out walk (K as trained,
every ``--eval-every`` steps) is drawn as one line per run, the served tau at ``--k`` as a marker
at each run's end; the last marker is the head that ships. The runs must share their held-out
rows for the lines to join (head_demo.sh keeps the first 200 rows of distill.jsonl held out).
``--hline LABEL=TAU``: a reference level, e.g. prompt lookup's served tau on the same prompts.
``--served LABEL=RESULTS_JSON``: the served tau of run LABEL from a `fastmtp bench` results.json
(its K = ``--k``), for a run whose curve was trained where it could not be served (a GPU machine
with no dev prompts): the same prompts and tokens as the curves' own serving, or the marker means
nothing.
Writes ``OUT/lineage.png``, ``lineage.md`` and ``lineage.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _split(spec: str, what: str) -> tuple[str, str]:
    label, sep, value = spec.rpartition("=")
    if not sep or not label or not value:
        raise SystemExit(f"{what} takes LABEL=VALUE, got {spec!r}")
    return label, value


def bench_tau(path: str, k: str) -> float:
    """tau at K=k of a `fastmtp bench` results.json."""
    overall = json.loads(Path(path).read_text())["results"]["overall"]
    if k not in overall:
        raise SystemExit(f"{path} has no K={k} (it has K={', '.join(overall)})")
    return float(overall[k]["tau"])


def load_runs(specs: list[str], arm: str, k: str,
              served: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One record per run: its step curve shifted by the steps before it, and its served tau
    (from its curve, or from ``served[label]``, a bench results.json)."""
    runs, offset = [], 0
    served = served or {}
    for spec in specs:
        label, path = _split(spec, "--run")
        doc = json.loads(Path(path).read_text())
        points = [p for p in doc["points"] if p["arm"] == arm]
        if not points:
            raise SystemExit(f"{path} has no point of arm {arm!r}")
        p = max(points, key=lambda p: p["tokens"])
        curve = [{"step": offset + r["step"], "tau_walk": r["tau_walk"],
                  "A_1": (r.get("A_k") or [None])[0]} for r in p.get("step_curve") or []]
        steps = int(p["optimizer_steps"])
        runs.append({"label": label, "source": path, "tokens": p["tokens"], "rows": p.get("rows"),
                     "steps_before": offset, "steps": steps, "steps_after": offset + steps,
                     # the step curve's walk is at K as trained; curve.json's "heldout" at the
                     # largest served K: the table reports the former, as the plot does
                     "heldout_tau_walk": curve[-1]["tau_walk"] if curve else None, "curve": curve,
                     "served_tau": (bench_tau(served[label], k) if label in served
                                    else (p.get("served_tau") or {}).get(k)),
                     "served_source": served.get(label, path),
                     "cpu": doc.get("meta", {}).get("cpu")})
        offset += steps
    unknown = set(served) - {r["label"] for r in runs}
    if unknown:
        raise SystemExit(f"--served names no --run: {', '.join(sorted(unknown))}")
    return runs


def markdown(runs: list[dict[str, Any]], hlines: list[tuple[str, float]], k: str) -> str:
    lines = ["| run | response tokens | optimizer steps | cumulative | held-out walk (K as trained) "
             f"| served tau K={k} |", "|---|---|---|---|---|---|"]
    for r in runs:
        served = f"{r['served_tau']:.3f}" if r["served_tau"] is not None else "-"
        walk = f"{r['heldout_tau_walk']:.3f}" if r["heldout_tau_walk"] is not None else "-"
        lines.append(f"| {r['label']} | {r['tokens']:,} | {r['steps']:,} | {r['steps_after']:,} "
                     f"| {walk} | {served} |")
    for label, tau in hlines:
        lines.append(f"| {label} | | | | | {tau:.3f} |")
    lines += ["", "Held-out walk by cumulative optimizer step:", "",
              "| step | " + " | ".join(str(c["step"]) for r in runs for c in r["curve"]) + " |",
              "|---|" + "---|" * sum(len(r["curve"]) for r in runs),
              "| tau_walk | " + " | ".join(f"{c['tau_walk']:.3f}" for r in runs for c in r["curve"]) + " |"]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], hlines: list[tuple[str, float]], k: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for i, r in enumerate(runs):
        pts = [(c["step"], c["tau_walk"]) for c in r["curve"]]
        if i and runs[i - 1]["curve"]:  # the line starts where the head it continued ended
            pts.insert(0, (r["steps_before"], runs[i - 1]["curve"][-1]["tau_walk"]))
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        ax.plot(xs, ys, "o-", ms=3, color=f"C{i}", label=f"{r['label']}: held-out walk")
        if r["served_tau"] is not None:
            last = i == len(runs) - 1
            ax.plot([r["steps_after"]], [r["served_tau"]], "*" if last else "s", ms=12 if last else 7,
                    color=f"C{i}", label=f"served tau K={k}" + (" (shipped head)" if last else ""))
    for j, (label, tau) in enumerate(hlines):
        ax.axhline(tau, ls="--", lw=1, color=f"C{len(runs) + j}", label=label)
    ax.set_xlabel("optimizer steps (cumulative)")
    ax.set_ylabel(f"tau at K={k} (tokens per verification)")
    ax.grid(alpha=0.3)
    # below the axes: inside, it covered the first runs' points
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    fig.savefig(out / "lineage.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="LABEL=CURVE_JSON, oldest first")
    ap.add_argument("--hline", action="append", default=[], help="LABEL=TAU reference level")
    ap.add_argument("--served", action="append", default=[],
                    help="LABEL=RESULTS_JSON: run LABEL's served tau from a fastmtp bench result")
    ap.add_argument("--arm", default="fastmtp")
    ap.add_argument("--k", default="3", help="the K of the served tau (a key of served_tau)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = load_runs(args.run, args.arm, args.k, dict(_split(s, "--served") for s in args.served))
    hlines = [(lab, float(v)) for lab, v in (_split(h, "--hline") for h in args.hline)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lineage.json").write_text(json.dumps({"runs": runs, "hlines": hlines, "k": args.k}, indent=1))
    (out / "lineage.md").write_text(markdown(runs, hlines, args.k))
    plot(runs, hlines, args.k, out)
    print(f"wrote {out}/lineage.png, lineage.md, lineage.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
