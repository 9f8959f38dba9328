"""`fastmtp synth-prompts`: deterministic, every kind present, valid prompt rows, no overlap with
the evaluation prompts, and the shipped file is what the command makes."""

from __future__ import annotations

import json
from pathlib import Path

from fastmtp_sglang.training.distill_filters import Excluder, eval_texts
from fastmtp_sglang.training.distill_prompts import read_prompts_tolerant
from fastmtp_sglang.training.synth_prompts import KINDS, synth_prompts

REPO = Path(__file__).resolve().parents[1]
SMALL = {"rag": 6, "summarize": 5, "translate": 8, "math": 7, "code": 4}


def test_deterministic_and_every_kind():
    a, b = synth_prompts(SMALL, seed=3), synth_prompts(SMALL, seed=3)
    assert a == b
    assert synth_prompts(SMALL, seed=4) != a
    for kind in KINDS:
        rows = [r for r in a if r["id"].startswith(f"synth-s3-{kind}-")]
        assert len(rows) == SMALL[kind] and all(r["source"].startswith(f"synth:{kind}:") for r in rows)
    assert len({r["id"] for r in a}) == len(a)
    assert any("Chinese" in r["prompt"] for r in a if "translate" in r["id"])
    assert all(r["prompt"].strip() for r in a)


def test_seeds_name_their_ids_so_files_can_be_distilled_together():
    """Seed 0 keeps the shipped ids (synth-<kind>-NNNN); another seed's ids carry it, so two
    files never share an id (distill refuses a prompt id used twice)."""
    zero, one = synth_prompts(SMALL, seed=0), synth_prompts(SMALL, seed=1)
    assert all(r["id"].split("-")[1] in KINDS for r in zero)
    assert all(r["id"].startswith("synth-s1-") and r["id"].split("-")[2] in KINDS for r in one)
    assert not {r["id"] for r in zero} & {r["id"] for r in one}


def test_no_overlap_with_evaluation_and_valid_rows(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in synth_prompts(SMALL)))
    prompts, bad = read_prompts_tolerant([f])
    assert not bad and len(prompts) == sum(SMALL.values())
    ex = Excluder(eval_texts([REPO / "bench" / "data" / "spec_bench.jsonl",
                              REPO / "bench" / "data" / "c_eval_zh.jsonl"]))
    assert not [p.id for p in prompts if ex.match(p.text)]


def test_shipped_file_is_clean_and_complete():
    f = REPO / "fastmtp_sglang" / "data" / "train_prompts" / "synth_tasks.jsonl"
    prompts, bad = read_prompts_tolerant([f])
    assert not bad and len(prompts) == 1250
    ex = Excluder(eval_texts([REPO / "bench" / "data" / "spec_bench.jsonl",
                              REPO / "bench" / "data" / "c_eval_zh.jsonl"]))
    assert not [p.id for p in prompts if ex.match(p.text)]
