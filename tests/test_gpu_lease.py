"""The offline bundle and the lease driver (launch/gpu_bundle.py, launch/gpu_lease.py), on CPU.

What the GPU run relies on and a CPU can check: parts that join back byte for byte and refuse a
corrupt or missing part; wheels laid out as pip --target lays them; the kernel trim; image
versions that a pin refuses are carried; the flashinfer stand-in imports any name and refuses to
be used; the tree shrink that makes room for a part leaves the repository exactly as committed.
The full build and its import check (network, a Python 3.12 with torch 2.11) are
``python launch/gpu_bundle.py build`` / ``check``; their results are in
bench/results/sglang_e2e_h200/bundle_check.json.
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gb():
    return _load("gpu_bundle")


@pytest.fixture(scope="module")
def gl():
    return _load("gpu_lease")


def _bundle(tmp: Path, gb, files: dict[str, bytes], part_bytes: int) -> Path:
    """A bundle of ``files`` under site/, split like build() splits it."""
    out = tmp / "bundle"
    out.mkdir()
    archive = out / "bundle.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"site/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    parts = gb.split(archive, out, part_bytes)
    archive.unlink()
    (out / "manifest.json").write_text(json.dumps({"parts": parts}))
    return out


def test_parts_join_back_and_refuse_corruption(gb, tmp_path):
    files = {"pkg/__init__.py": b"X = 1\n", "pkg/blob.bin": random.Random(0).randbytes(3000)}
    bundle = _bundle(tmp_path, gb, files, part_bytes=1000)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert len(manifest["parts"]) > 1 and all(p["bytes"] <= 1000 for p in manifest["parts"])
    gb.join_and_unpack(bundle, tmp_path / "ok")
    for name, data in files.items():
        assert (tmp_path / "ok" / "site" / name).read_bytes() == data
    assert not (tmp_path / "ok" / "bundle.tar.xz").exists()
    # a flipped byte, then a missing part: refused with the part's name
    part = bundle / manifest["parts"][1]["file"]
    data = bytearray(part.read_bytes())
    data[0] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="part02 does not match its sha256"):
        gb.join_and_unpack(bundle, tmp_path / "bad")
    part.unlink()
    with pytest.raises(SystemExit, match="parts missing .*part02"):
        gb.join_and_unpack(bundle, tmp_path / "bad2")


def test_wheel_unpacks_as_pip_target_lays_it_out(gb, tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/__init__.py", "A = 1\n")
        z.writestr("demo/__pycache__/x.pyc", b"junk")
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
        z.writestr("demo-1.0.data/platlib/demo_ext/lib.so", b"\x7fELF")
        z.writestr("demo-1.0.data/scripts/demo-cli", "#!/bin/sh\n")
    site = tmp_path / "site"
    gb.unpack_wheel(wheel, site)
    got = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    assert got == ["demo-1.0.dist-info/METADATA", "demo/__init__.py", "demo_ext/lib.so"]


def test_trim_keeps_the_hopper_ops_only(gb, tmp_path):
    site = tmp_path / "site"
    keep = ["sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/__init__.py", "xgrammar/x.so"]
    drop = ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so",
            "sgl_kernel/flashmla_ops.abi3.so", "xgrammar/libxgrammar.a"]
    for name in keep + drop:
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(b"x" * 10)
    assert gb.trim(site) == 10 * len(drop)
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()) == sorted(keep)


def test_image_versions_a_pin_refuses_are_carried(gb):
    rows = [{"name": "sglang", "version": "0.5.17",
             "requires": ["transformers==5.12.1", "numpy", "torch==2.11.0", "av==16.1.0; platform_machine == 'aarch64'"]},
            {"name": "transformers", "version": "5.12.1", "requires": ["tokenizers<=0.23.0,>=0.22.0"]}]
    image = {"transformers": "5.17.0", "torch": "2.11.0", "numpy": None, "tokenizers": "0.23.2", "av": "1.0"}
    bad = gb.refused_image_versions(rows, image)
    assert set(bad) == {"transformers", "tokenizers"}
    assert "image has 5.17.0" in bad["transformers"]


def test_flashinfer_stand_in_imports_anything_and_refuses_use(gb, tmp_path):
    site = tmp_path / "site"
    gb.install_stand_in(site)
    code = (
        "import flashinfer, flashinfer.sampling as s\n"
        "from flashinfer.gemm import bmm_fp8\n"
        "class Sub(flashinfer.BatchDecodeWithPagedKVCacheWrapper): pass\n"
        "assert flashinfer.STAND_IN\n"
        "try:\n    s.top_k_top_p_sampling_from_probs(1, 2)\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(site)},
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "flashinfer.sampling.top_k_top_p_sampling_from_probs is not available" in out.stdout


def test_shrink_and_restore_leave_the_repository_as_committed(gl, tmp_path):
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "bench" / "results" / "r.json").write_text("{}" * 5000)
    (repo / "code.py").write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    before = gl.tree_bytes(repo)
    gl.shrink(repo, ("bench/results", "bench/absent"))
    assert gl.tree_bytes(repo) == len("x = 1\n") < before
    assert "bench/results" not in gl.git(repo, "ls-files")
    gl.restore(repo, ("bench/results", "bench/absent"))
    assert gl.tree_bytes(repo) == before
    assert gl.git(repo, "status", "--porcelain") == ""
    assert (repo / "bench" / "results" / "r.json").read_text() == "{}" * 5000


# --------------------------------------------------------------------------------------------
# launch/gpu_e2e.py's stages, against our reference server (what writes expected.json on a CPU)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def e2e_models(tmp_path_factory, llama_target):
    """The tiny Llama target with a chat template, and an init-head draft for it."""
    import shutil

    from fastmtp_sglang.cli import main as fastmtp

    root = tmp_path_factory.mktemp("e2e")
    target = root / "target"
    shutil.copytree(llama_target.path, target)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    cfg_path.write_text(json.dumps(cfg))
    assert fastmtp(["init-head", "--target", str(target), str(root / "draft")]) == 0
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in
                               enumerate(["def add(a, b):", "The sky is", "import os\nimport"])))
    return target, root / "draft", prompts


def _free_port_block(n: int) -> int:
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535:
            return base
    raise RuntimeError("no port")


def test_e2e_reference_run_writes_expected_and_a_later_run_meets_it(e2e_models, tmp_path):
    e2e = _load("gpu_e2e")
    target, draft, prompts = e2e_models
    common = dict(target=target, draft=draft, steps=[0, 2], prompts=[prompts], num_prompts=3,
                  max_new_tokens=8, dtype="float32", engine="reference", min_accept_length=1.0)
    first = e2e.Config(out=tmp_path / "ref", port=_free_port_block(3), **common)
    assert e2e.main(first) == 0
    expected = json.loads((tmp_path / "ref" / "expected.json").read_text())
    assert expected["prompt_ids"] == ["p0", "p1", "p2"] and set(expected["tau"]) == {"2"}
    assert len(expected["k0_ids"]) == 3 and all(len(ids) <= 8 for ids in expected["k0_ids"])
    report = json.loads((tmp_path / "ref" / "e2e.json").read_text())
    assert report["greedy"]["2"]["identical"] == 1.0 and report["passed"]

    # the same head against that file: K=0 tokens identical (deterministic CPU fp32); a frozen
    # clock with 20 s left runs K=0 (always) and skips K=2, which fails "every K and stage ran"
    frozen = e2e.Config(out=tmp_path / "again", port=_free_port_block(3), expected=tmp_path / "ref" / "expected.json",
                        deadline_s=20.0, clock=lambda: 0.0, **common)
    assert e2e.main(frozen) == 1
    report = json.loads((tmp_path / "again" / "e2e.json").read_text())
    assert report["skipped"] == [2] and report["k0_identical_to_reference"] == 1.0
    assert report["checks"] == {"every K and stage ran": False}

    # expected.json from another head is refused before any server starts
    other = dict(expected, draft_sha256="0" * 64)
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="made with another head"):
        e2e.main(e2e.Config(out=tmp_path / "x", expected=tmp_path / "other.json", **common))
