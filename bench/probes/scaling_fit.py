"""How far is tau(K=3) = 2.2? A power law through the learning-curve points of one recipe.

    python bench/probes/scaling_fit.py --recipe bench/results/ablation/ablation.json:kl-lr3e-3 \
        --recipe bench/results/head_demo/curve.json:fastmtp \
        --reference bench/results/curve_demo/curve.json:fastmtp --out bench/results/head_demo

Each ``FILE:ARM`` names the points of one arm in a ``fastmtp curve`` (or ablation) JSON. The
``--recipe`` points (same recipe, same held-out rows, growing data) are fitted as
``tau - 1 = a * tokens**b`` in log-log space, separately for held-out tau_walk and for served tau
at each K; the fit is extrapolated to the token count at which it reaches ``--goal``. The
``--reference`` points are only drawn. Optimizer steps grow with the data (fixed epochs), so the
fit is of data and steps together. With two points the "fit" is the line through them: an
estimate of order of magnitude, not a prediction.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _points(spec: str) -> list[dict]:
    path, _, arm = spec.rpartition(":")
    if not path:
        raise SystemExit(f"{spec!r}: expected FILE:ARM")
    pts = [p for p in json.loads(Path(path).read_text())["points"] if p["arm"] == arm]
    if not pts:
        raise SystemExit(f"no points of arm {arm!r} in {path}")
    return pts


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares of log(y) = log(a) + b log(x); returns (a, b)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    b = sum((u - mx) * (v - my) for u, v in zip(lx, ly)) / sum((u - mx) ** 2 for u in lx)
    return math.exp(my - b * mx), b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", action="append", required=True, help="FILE:ARM, repeated: points to fit")
    ap.add_argument("--reference", action="append", default=[], help="FILE:ARM, repeated: points only drawn")
    ap.add_argument("--goal", type=float, default=2.2, help="tau to extrapolate to (default 2.2)")
    ap.add_argument("--out", required=True, help="directory for scaling.json/.md/.png")
    args = ap.parse_args()

    pts = sorted((p for s in args.recipe for p in _points(s)), key=lambda p: p["tokens"])
    if len({p["tokens"] for p in pts}) < 2:
        raise SystemExit("need recipe points at two or more token counts")
    # name -> (values, the K that bounds it: tau <= K+1; the held-out walk runs to K=5 but is not
    # a tau(K) of one K, so it gets no bound)
    series = {"held-out tau_walk": ([p["heldout"]["tau_walk"] for p in pts], None)}
    for k in sorted({k for p in pts for k in p.get("served_tau", {})}, key=int):
        if all(k in p.get("served_tau", {}) for p in pts):
            series[f"served tau K={k}"] = ([p["served_tau"][k] for p in pts], int(k))
    toks = [p["tokens"] for p in pts]
    fits = {}
    for name, (ys, k) in series.items():
        a, b = _fit(toks, [y - 1 for y in ys])
        reachable = b > 0 and (k is None or args.goal <= k + 1)
        fits[name] = {"a": a, "b": b, "values": ys,
                      "tokens_for_goal": ((args.goal - 1) / a) ** (1 / b) if reachable else None}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"goal": args.goal, "tokens": toks, "steps": [p["optimizer_steps"] for p in pts],
              "recipe": args.recipe, "reference": args.reference, "fits": fits}
    (out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")

    lines = [f"# What the learning curve says about tau = {args.goal}", "",
             "Command: `python bench/probes/scaling_fit.py " + " ".join(
                 [f"--recipe {s}" for s in args.recipe] + [f"--reference {s}" for s in args.reference]
                 + [f"--goal {args.goal}", f"--out {args.out}"]) + "`", "",
             "Fit: tau - 1 = a * tokens^b through the recipe's points (optimizer steps grow with the "
             "data); with two points it is the line through them, an order of magnitude.", "",
             "| measure | " + " | ".join(f"{t:,} tokens ({s} steps)" for t, s in zip(toks, result["steps"]))
             + f" | exponent b | tokens for tau {args.goal} |",
             "|---|" + "---|" * (len(toks) + 2)]
    for name, f in fits.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in f["values"])
                     + f" | {f['b']:.3f} | " + (f"{f['tokens_for_goal'] / 1e6:,.1f}M |" if f["tokens_for_goal"] is not None
                                            else "out of reach |"))
    (out / "scaling.md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = [toks[0] * (100 ** (i / 50)) for i in range(51)]
    for name, f in fits.items():
        if name not in ("held-out tau_walk", "served tau K=3"):
            continue
        line, = ax.plot(toks, f["values"], "o", label=f"{name} (recipe)")
        ax.plot(grid, [1 + f["a"] * x ** f["b"] for x in grid], "--", color=line.get_color(), alpha=0.6)
    for spec in args.reference:
        ref = sorted(_points(spec), key=lambda p: p["tokens"])
        ax.plot([p["tokens"] for p in ref], [p["heldout"]["tau_walk"] for p in ref], "x", color="grey",
                label=f"held-out tau_walk, {Path(spec.rpartition(':')[0]).parent.name} (earlier recipe)")
    ax.axhline(args.goal, color="red", lw=0.8, label=f"goal tau(K=3) = {args.goal}")
    ax.set_xscale("log")
    ax.set_xlabel("training response tokens (optimizer steps grow with them)")
    ax.set_ylabel("tau")
    ax.set_title("Demo head: tau against data, with the power law through the recipe's points")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    print(f"wrote {out}/scaling.json, scaling.md, scaling.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
