"""Draft-directory writes after a kill -9: the next write to the same output removes (or, when
the output itself is gone, restores) what the dead writer left, and says so; it never touches a
live writer's temporaries or names that are not its own. `--overwrite` replaces only a draft
directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DEEPSEEK_CONFIG

# Runs in a child process, which kills itself with SIGKILL in the middle of a write.
CRASH = r"""
import json, os, shutil, signal, sys
import torch
from fastmtp_sglang.core import draft_dir as dd
from fastmtp_sglang.core.head import HeadConfig

out, mode = sys.argv[1], sys.argv[2]
cfg = dd.make_draft_config(json.loads(sys.argv[3]), "deepseek", dtype="float32")
sd = {k: torch.zeros(s) for k, s in dd.expected_shapes(HeadConfig.from_dict(cfg)).items()}

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if mode == "half-deleted-old":  # killed while removing the replaced directory
    dd.save_draft_dir(out, cfg, sd)
    def half(path, ignore_errors=False):
        os.remove(os.path.join(path, os.path.basename(out), "config.json"))
        die()
    shutil.rmtree = half
    dd.save_draft_dir(out, cfg, sd, overwrite=True)
else:  # killed while writing the new directory
    dd.save_draft_dir(out, cfg, sd, overwrite=True, write_extra=lambda tmp: die())
"""


def crash(out: Path, mode: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", CRASH, str(out), mode, json.dumps(DEEPSEEK_CONFIG)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -9, proc.stderr
    return proc


def a_draft(tmp: Path, name: str = "out") -> Path:
    import torch

    from fastmtp_sglang.core.draft_dir import expected_shapes, make_draft_config, save_draft_dir
    from fastmtp_sglang.core.head import HeadConfig

    cfg = make_draft_config(DEEPSEEK_CONFIG, "deepseek", dtype="float32")
    sd = {k: torch.randn(s) for k, s in expected_shapes(HeadConfig.from_dict(cfg)).items()}
    return save_draft_dir(tmp / name, cfg, sd, overwrite=True)


def test_leftovers_of_kill_9_are_removed_by_the_next_write(tmp_path, capsys):
    out = tmp_path / "out"
    first = crash(out, "half-deleted-old")
    old = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    assert len(old) == 1 and not (tmp_path / old[0] / "out" / "config.json").exists()
    assert (out / "config.json").exists()  # the new one had been renamed in place
    second = crash(out, "tmp")
    assert f"removed {tmp_path / old[0]}" in second.stderr and "interrupted write" in second.stderr
    tmp = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(tmp) == 1 and str(first.args) != str(second.args)
    capsys.readouterr()
    a_draft(tmp_path)
    assert f"removed {tmp_path / tmp[0]}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_crash_between_the_renames_restores_the_old_directory(tmp_path, capsys):
    from fastmtp_sglang.core.draft_dir import clean_stale_temporaries, is_draft_dir

    out = a_draft(tmp_path)
    before = (out / "config.json").read_text()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    trash = tmp_path / f".out.old-{dead}-abc123"
    trash.mkdir()
    os.replace(out, trash / "out")  # the first rename happened, the second did not
    clean_stale_temporaries(out)
    assert is_draft_dir(out) and (out / "config.json").read_text() == before
    assert "restored" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_live_writers_and_foreign_names_are_left_alone(tmp_path):
    from fastmtp_sglang.core.draft_dir import stale_temporaries

    out = a_draft(tmp_path)
    live = tmp_path / f".out.tmp-{os.getppid()}-abc"      # a live process's write in progress
    mine = tmp_path / f".out.tmp-{os.getpid()}-abc"       # this process's own
    other = tmp_path / ".out.backup"                      # not a name we make
    fresh_legacy = tmp_path / ".out.tmp-k3j2h1g0"         # old naming, minutes old: maybe live
    old_legacy = tmp_path / ".out.old-a9b8c7d6"           # old naming, two hours old: stale
    for p in (live, mine, other, fresh_legacy, old_legacy):
        p.mkdir()
    two_hours_ago = time.time() - 7200
    os.utime(old_legacy, (two_hours_ago, two_hours_ago))
    assert stale_temporaries(out) == [(old_legacy, "old")]
    a_draft(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out", live.name, mine.name, other.name, fresh_legacy.name])


def test_overwrite_refuses_what_is_not_a_draft_directory(mimo_ckpt, tmp_path, run_cli):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("my notes")
    rc, _, err = run_cli("convert", "--format", "mimo", mimo_ckpt.path, notes, "--overwrite")
    assert rc == 1 and "not a draft directory" in err and "Traceback" not in err
    assert (notes / "notes.txt").read_text() == "my notes"
    listed = tmp_path / "listed"  # config.json holds a JSON list: not a draft directory either
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    rc, _, err = run_cli("convert", "--format", "mimo", mimo_ckpt.path, listed, "--overwrite")
    assert rc == 1 and "not a draft directory" in err
    empty = tmp_path / "empty"  # nothing to lose
    empty.mkdir()
    assert run_cli("convert", "--format", "mimo", mimo_ckpt.path, empty, "--overwrite")[0] == 0
    # and a draft directory is replaced, as before
    rc, _, err = run_cli("convert", "--format", "mimo", mimo_ckpt.path, empty, "--overwrite")
    assert rc == 0, err
    # the library refuses too, not only the CLI
    from fastmtp_sglang.core.draft_dir import load_draft_dir, save_draft_dir
    from fastmtp_sglang.core.errors import FastMTPError

    d = load_draft_dir(empty)
    with pytest.raises(FastMTPError, match="not a draft directory"):
        save_draft_dir(notes, d.config, d.state_dict, overwrite=True)
    assert sorted(p.name for p in notes.iterdir()) == ["notes.txt"]
    shutil.rmtree(notes)
