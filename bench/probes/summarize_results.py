"""One table over several `fastmtp bench` result folders (tau and speedup per K), plus a plot.

    python bench/probes/summarize_results.py bench/results/summary/smollm2-init bench/results/summary/smollm2-vanilla \
        bench/results/summary/smollm2-fastmtp-k3 --out bench/results/summary
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="folders holding results.json")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = []
    for d in args.dirs:
        res = json.loads((Path(d) / "results.json").read_text())
        runs.append((Path(d).name, res))
    ks = sorted({int(k) for _, r in runs for k in r["results"]["overall"]})
    lines = ["# Summary: tau / speedup over K=0 (same run), per head", "",
             "| run | " + " | ".join(f"K={k}" for k in ks) + " | draft ms/step | verify ms (K=0 -> K=3) |",
             "|---|" + "---|" * len(ks) + "---|---|"]
    for name, r in runs:
        ov = r["results"]["overall"]
        cells = []
        for k in ks:
            x = ov.get(str(k))
            cells.append("-" if x is None else f"{x['tau']:.3f} / {x['speedup']:.2f}x")
        d3 = ov.get("3", {})
        draft_step = d3.get("draft_ms_per_cycle", 0) / 3 if d3 else 0
        verify = f"{ov['0'].get('verify_ms_per_cycle', 0):.1f} -> {d3.get('verify_ms_per_cycle', 0):.1f}" if d3 else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {draft_step:.1f} | {verify} |")
    lines += ["", "Commands: see each folder's results.md."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, r in runs:
        ov = r["results"]["overall"]
        kk = sorted(int(k) for k in ov)
        style = "o-" if kk == list(range(kk[0], kk[-1] + 1)) else "s"  # no line across gaps in K
        kk_shown = [k for k in kk if k > 0] if style == "s" else kk
        a1.plot(kk_shown, [ov[str(k)]["tau"] for k in kk_shown], style, label=name)
        a2.plot(kk_shown, [ov[str(k)]["speedup"] for k in kk_shown], style, label=name)
    a1.set_xlabel("K"); a1.set_ylabel("tau"); a1.grid(alpha=0.3); a1.legend(fontsize=7)
    a2.axhline(1.0, color="grey", ls=":"); a2.set_xlabel("K"); a2.set_ylabel("speedup over K=0")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
