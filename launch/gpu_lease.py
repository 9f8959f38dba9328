"""The lease protocol for the lent H200, as one driver: prepare on the CPU, then the calls in order.

    python launch/gpu_lease.py prepare   # bundle + expected.json present? shrink the tree; print the calls
    python launch/gpu_lease.py plan      # print the calls again (JSON: command, carry, timeout_s)
    python launch/gpu_lease.py restore   # after the lease: put the shrunk folders back
    python launch/gpu_lease.py collect DIR  # copy a lease's returned files to bench/results/sglang_e2e_h200/
    python launch/gpu_lease.py room      # bytes a bundle part may have (gpu_bundle.py build asks)

A device call carries at most 64 MiB: the working tree plus the paths it names in ``carry``. The
bundle (``launch/gpu_bundle.py build``) is split into parts that fit beside the tree once the
tree is shrunk: ``prepare`` takes the tracked folders that the GPU run never reads
(``bench/train_data``, ``bench/results``, ``tests``, ``docs``) out of the index (``git rm --cached``) and moves them to
``.lease_stash/`` (ignored), so that they neither count as tracked nor as untracked files; ``restore``
moves them back and re-adds them (the commit history is never touched).

The calls (each must start within the machine's 30 s warm time after the last one ends):

1. ``bash launch/gpu_lease.sh probe`` carrying the manifest and part 1: nvidia-smi, g++, nvcc,
   the image's ``pip list`` (compare it with launch/gpu_image/packages.txt);
2. ``bash launch/gpu_lease.sh part`` carrying part k, once per middle part;
3. ``bash launch/gpu_lease.sh run`` carrying the last part and ``expected.json`` (this script's
   CPU reference run): unpack, install our package, check the imports without simulation,
   materialise the demo target and run ``launch/gpu_e2e.py`` (float32, bundle route, K=0 and
   K=3 first, deadline DEADLINE s), its results in the call's $OUT.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / ".gpu_bundle"
STASH = REPO / ".lease_stash"
SHRINK = ("bench/train_data", "bench/results", "tests", "docs")  # tracked, never read by the GPU run
CALL_LIMIT = 64 << 20
MARGIN = 1 << 20  # besides a part: the manifest or expected.json (~10 KB), and files added later
RESULTS = REPO / "bench" / "results" / "sglang_e2e_h200"
# our reference engine's answers on the GPU run's prompts (float32, greedy, the shipped head): committed,
# since they take ~10 min of CPU; gpu_e2e.py refuses them if the head changed
REFERENCE = RESULTS / "reference_cpu" / "expected.json"
EXPECTED_CMD = ("python launch/gpu_e2e.py --engine reference --dtype float32 --steps 0,1,2,3,4,5 "
                f"--num-prompts 16 --max-new-tokens 128 --out {REFERENCE.parent.relative_to(REPO)}")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def tree_bytes(repo: Path = REPO, paths: tuple[str, ...] = ()) -> int:
    """What a device call carries of the checkout (of ``paths`` only, if given): tracked files
    and untracked files not ignored."""
    names = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *paths).split("\0")
    return sum((repo / n).stat().st_size for n in names if n and (repo / n).is_file())


def exclude_stash(repo: Path) -> None:
    exclude = repo / ".git" / "info" / "exclude"
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    for entry in ("/.lease_stash/", "/.gpu_bundle/"):
        if entry not in lines:
            lines.append(entry)
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("\n".join(lines) + "\n")


def shrink(repo: Path = REPO, folders: tuple[str, ...] = SHRINK) -> None:
    """Take ``folders`` out of what a device call carries (out of the index, into the stash)."""
    exclude_stash(repo)
    stash = repo / STASH.name
    for folder in folders:
        src = repo / folder
        if not src.exists():
            continue
        git(repo, "rm", "-r", "-q", "--cached", folder)
        dest = stash / folder
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dest))


def restore(repo: Path = REPO, folders: tuple[str, ...] = SHRINK) -> None:
    """Undo :func:`shrink`: the folders back in place and in the index, as committed."""
    stash = repo / STASH.name
    for folder in folders:
        src = stash / folder
        if src.exists():
            shutil.move(str(src), str(repo / folder))
        git(repo, "reset", "-q", "--", folder)
    shutil.rmtree(stash, ignore_errors=True)


def room(repo: Path = REPO) -> int:
    """Bytes a bundle part may have: a call's limit minus the tree once shrunk, minus a margin."""
    return CALL_LIMIT - (tree_bytes(repo) - tree_bytes(repo, SHRINK)) - MARGIN


def plan(deadline: int) -> list[dict]:
    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    parts = [p["file"] for p in manifest["parts"]]
    tree = tree_bytes()
    calls = []
    for i, part in enumerate(parts):
        carry = [f".gpu_bundle/{part}"]
        if i == 0:
            carry.append(".gpu_bundle/manifest.json")
        if i == len(parts) - 1:
            carry.append(".gpu_bundle/expected.json")
        step = "probe" if i == 0 else "part"
        if i == len(parts) - 1:
            step = "run" if i else "probe && bash launch/gpu_lease.sh run"
        size = tree + sum((REPO / c).stat().st_size for c in carry)
        if size > CALL_LIMIT:
            raise SystemExit(f"gpu_lease: call {i + 1} would carry {size / 2**20:.1f} MiB (tree "
                             f"{tree / 2**20:.1f} MiB): rebuild the bundle with a smaller --part-mib")
        calls.append({"call": i + 1, "command": f"DEADLINE={deadline} bash launch/gpu_lease.sh {step}",
                      "carry": carry, "timeout_s": 600 if "run" in step else 180,
                      "carries_mib": round(size / 2**20, 1)})
    return calls


def collect(src: Path) -> int:
    """A lease's returned files (probe, pip list, imports, e2e) into the results folder."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.name == "e2e_results.tgz":
            subprocess.run(["tar", "xzf", str(f), "-C", str(RESULTS), "--exclude", "*/logs/*"], check=True)
            subprocess.run(["tar", "xzf", str(f), "-C", str(RESULTS), "--wildcards", "*/logs/*"], check=False)
        elif f.is_file():
            shutil.copyfile(f, RESULTS / f.name)
    print(f"gpu_lease: results in {RESULTS}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("prepare", "plan", "restore", "collect", "room"))
    ap.add_argument("dir", nargs="?", help="collect: the folder the last call's files came back to")
    ap.add_argument("--deadline", type=int, default=400, help="seconds gpu_e2e.py may take in the "
                    "last call (its limit is 600 s with unpacking and the import check)")
    a = ap.parse_args(argv)
    if a.step == "restore":
        restore()
        print(f"gpu_lease: restored {', '.join(SHRINK)}; tree {tree_bytes() / 2**20:.1f} MiB")
        return 0
    if a.step == "room":  # what launch/gpu_bundle.py build sizes its parts by
        print(room())
        return 0
    if a.step == "collect":
        if not a.dir:
            raise SystemExit("gpu_lease: collect needs the folder the files came back to")
        return collect(Path(a.dir))
    if not (BUNDLE / "manifest.json").exists():
        raise SystemExit("gpu_lease: no bundle: python launch/gpu_bundle.py build")
    if not REFERENCE.exists() and not (BUNDLE / "expected.json").exists():
        raise SystemExit(f"gpu_lease: no reference run to compare against; on this CPU: {EXPECTED_CMD}")
    if REFERENCE.exists():
        shutil.copyfile(REFERENCE, BUNDLE / "expected.json")
    if a.step == "prepare":
        shrink()
    print(json.dumps(plan(a.deadline), indent=1))
    print("then: python launch/gpu_lease.py collect <files_at>; python launch/gpu_lease.py restore",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
