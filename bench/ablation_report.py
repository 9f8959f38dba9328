"""One table and one plot for the training-signal ablation (bench/pipelines/ablation.sh, issue 14).

    python bench/ablation_report.py runs/demo-pipeline-v2/ablation bench/results/ablation

Reads the ``curve.json`` of each stage (``loss``, ``data``, ``seed``, ``lr``) under the ablation folder and
writes ``ablation.json``, ``ablation.md`` and ``ablation.png`` (served tau against K per arm, and
held-out training-time tau) to the results folder. The noise level is the spread between an arm
and its ``-seed1`` repeat: the same data and steps, another initial shuffle.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STAGES = ("loss", "data", "seed", "lr")


def load(root: Path) -> tuple[list[dict], dict[str, str]]:
    points, commands = [], {}
    for stage in STAGES:
        f = root / stage / "curve.json"
        if not f.is_file():
            continue
        res = json.loads(f.read_text())
        commands[stage] = res["meta"]["command"] if "meta" in res else res.get("command", "")
        for p in res["points"]:
            points.append({"stage": stage, **p})
    return points, commands


def noise(points: list[dict]) -> dict[str, dict]:
    """|arm - arm-seed1| per metric, for every arm that has a repeat."""
    by = {p["arm"]: p for p in points}
    out = {}
    for name, p in by.items():
        q = by.get(f"{name}-seed1")
        if q is None:
            continue
        d = {"heldout_tau_walk": abs(p["heldout"]["tau_walk"] - q["heldout"]["tau_walk"])}
        for k, v in p.get("served_tau", {}).items():
            d[f"served_tau_K{k}"] = abs(v - q["served_tau"][k])
        out[name] = {k: round(v, 4) for k, v in d.items()}
    return out


def markdown(points: list[dict], commands: dict[str, str], nz: dict[str, dict]) -> str:
    ks = sorted({k for p in points for k in p.get("served_tau", {})}, key=int)
    lines = ["# Training-signal ablation (demo target SmolLM2-135M-Instruct)", "",
             "Every arm: same init, same training rows, same optimizer steps, the en-16384 table "
             "built from the target's own responses for the loss and for serving. Held-out: 200 "
             "rows never trained on (training-time tau, simulated greedy acceptance, K=5 walk). "
             "Served: the reference engine, greedy, Spec-Bench dev prompts (1 per category).", "",
             "| arm | stage | tokens | steps | train s | held-out tau_walk | A_k (%) | "
             + " | ".join(f"served tau K={k}" for k in ks) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(ks)]
    for p in points:
        h = p["heldout"]
        a = "/".join(f"{100 * x:.0f}" for x in h.get("A_k", [])[:3])
        lines.append(f"| {p['arm']} | {p['stage']} | {p['tokens']} | {p['optimizer_steps']} | "
                     f"{p['train_seconds']:.0f} | {h['tau_walk']:.3f} | {a} | "
                     + " | ".join(f"{p.get('served_tau', {}).get(k, float('nan')):.3f}" for k in ks) + " |")
    if nz:
        lines += ["", "Noise (|arm - same arm with --seed 1|):", ""]
        for name, d in nz.items():
            lines.append(f"- {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in d.items()))
    lines += ["", "Commands (bash bench/pipelines/ablation.sh runs them all):", ""]
    lines += [f"- {s}: `{c}`" for s, c in commands.items()]
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for i, p in enumerate(points):
        st = p.get("served_tau", {})
        ks = sorted(st, key=int)
        style = "--" if p["arm"].endswith("-seed1") else "-"
        a1.plot([int(k) for k in ks], [st[k] for k in ks], style, marker="o", color=f"C{i % 10}",
                label=p["arm"])
    a1.set_xticks(sorted({int(k) for p in points for k in p.get("served_tau", {})}))
    a1.set_xlabel("K (draft steps)")
    a1.set_ylabel("served tau (dev prompts, greedy)")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    names = [p["arm"] for p in points]
    a2.barh(names, [p["heldout"]["tau_walk"] for p in points], color=[f"C{i % 10}" for i in range(len(points))])
    lo = min(p["heldout"]["tau_walk"] for p in points)
    a2.set_xlim(lo - 0.05, max(p["heldout"]["tau_walk"] for p in points) + 0.02)
    a2.set_xlabel("held-out tau_walk")
    fig.suptitle("Training-signal ablation, SmolLM2-135M demo target")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.exit(__doc__)
    root, dst = Path(argv[0]), Path(argv[1])
    points, commands = load(root)
    if not points:
        sys.exit(f"no curve.json under {root}/{{{','.join(STAGES)}}}: run bench/pipelines/ablation.sh first")
    nz = noise(points)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "ablation.json").write_text(json.dumps({"points": points, "noise": nz, "commands": commands},
                                                  indent=1) + "\n")
    (dst / "ablation.md").write_text(markdown(points, commands, nz))
    plot(points, dst / "ablation.png")
    print(f"wrote {dst}/ablation.json, ablation.md, ablation.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
