"""Prompt files: per-row format detection, filtering, error locations, chat rendering.

Fast tests use the shipped data files and a word-level tokenizer built in memory; the one test
with the real SmolLM2 tokenizer is slow (it materialises the demo target on first use).
"""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from fastmtp_sglang.core.demo_target import SMOLLM2_CHAT_TEMPLATE
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.prompts import Prompt, load_prompts, render_chat

REPO = Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO / "bench" / "data" / "spec_bench.jsonl"
C_EVAL = REPO / "bench" / "data" / "c_eval_zh.jsonl"


def _write(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- formats ---------------------------------------------------------------------------------


def test_spec_bench_uses_first_turn_and_all_categories():
    prompts = load_prompts(SPEC_BENCH)
    assert len(prompts) == 480
    counts = Counter(p.category for p in prompts)
    assert len(counts) == 13 and counts["writing"] == 10 and counts["rag"] == 80
    first = json.loads(SPEC_BENCH.read_text().splitlines()[0])
    assert prompts[0] == Prompt(id=str(first["question_id"]), category=first["category"],
                                text=first["turns"][0])
    assert len({p.id for p in prompts}) == 480


def test_c_eval_rows():
    prompts = load_prompts(C_EVAL)
    assert len(prompts) == 51
    assert prompts[0].id == "accountant-327" and prompts[0].category == "accountant"
    assert len({p.id for p in prompts}) == 51  # raw ids repeat across subjects (279, twice)
    assert prompts[0].text.startswith("以下是中国关于注册会计师考试的单项选择题")


def test_shipped_demo_prompts_one_per_category_and_short():
    path = resources.files("fastmtp_sglang.data") / "demo_prompts.jsonl"
    with resources.as_file(path) as p:
        prompts = load_prompts(p)
    assert 6 <= len(prompts) <= 8
    assert len({p.category for p in prompts}) == len(prompts)
    assert max(len(p.text) for p in prompts) < 200  # keeps `fastmtp demo` cheap on a CPU
    spec_ids = {p.id for p in load_prompts(SPEC_BENCH)}
    assert {p.id for p in prompts} <= spec_ids


def test_training_and_generic_rows(tmp_path):
    path = _write(tmp_path / "mine.jsonl", [
        {"id": "seed-0", "source": "seed_task_0", "prompt": "Train prompt."},
        {"id": "a1", "source": "oasst", "category": "chat", "prompt": "With a category."},
        {"prompt": "Bare prompt."},
        {"text": "Bare text.", "category": "misc"},
        {"id": 7, "text": "Integer id."},
    ])
    assert load_prompts(path) == [
        Prompt("seed-0", "seed_task_0", "Train prompt."),
        Prompt("a1", "chat", "With a category."),
        Prompt("mine:3", "mine", "Bare prompt."),
        Prompt("mine:4", "misc", "Bare text."),
        Prompt("7", "mine", "Integer id."),
    ]


def test_mixed_formats_in_one_file_and_blank_lines(tmp_path):
    path = _write(tmp_path / "mixed.jsonl", [
        {"question_id": 1, "category": "qa", "turns": ["First turn.", "Second turn."]},
        "",
        {"id": 2, "question": "问题？", "category": "zh", "answer": "A"},
        "   ",
        {"text": "Line five."},
    ])
    got = load_prompts(path)
    assert [(p.id, p.category, p.text) for p in got] == [
        ("1", "qa", "First turn."), ("zh-2", "zh", "问题？"), ("mixed:5", "mixed", "Line five."),
    ]


def test_several_files_concatenate_in_order(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"text": "a1"}, {"text": "a2"}])
    b = _write(tmp_path / "b.jsonl", [{"text": "b1"}])
    assert [p.text for p in load_prompts([b, str(a)])] == ["b1", "a1", "a2"]


# --- filtering -------------------------------------------------------------------------------


def test_limit_per_category_keeps_the_first_n_in_file_order():
    full = load_prompts(SPEC_BENCH)
    got = load_prompts(SPEC_BENCH, limit_per_category=2)
    assert len(got) == 26
    assert all(n == 2 for n in Counter(p.category for p in got).values())
    for cat in {p.category for p in full}:
        assert [p for p in got if p.category == cat] == [p for p in full if p.category == cat][:2]


def test_categories_filter_and_limit_together():
    got = load_prompts(SPEC_BENCH, limit_per_category=3, categories=["math", "translation"])
    assert Counter(p.category for p in got) == {"math": 3, "translation": 3}


def test_unknown_category_lists_the_available_ones():
    with pytest.raises(FastMTPError, match=r"mathh.*categories there: .*math_reasoning"):
        load_prompts(SPEC_BENCH, categories=["mathh"])


def test_bad_limit():
    with pytest.raises(FastMTPError, match="at least 1"):
        load_prompts(SPEC_BENCH, limit_per_category=0)


# --- errors name file and line ---------------------------------------------------------------


@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "unterminated', "not valid JSON"),
    ('["a", "list"]', "expected a JSON object"),
    ('{"foo": 1}', "unrecognised row with keys \\['foo'\\]"),
    ('{"question_id": 3, "category": "qa", "turns": []}', "non-empty list of strings"),
    ('{"question_id": 3, "turns": ["no category"]}', "missing field 'category'"),
    ('{"id": 3, "question": "q", "category": "", "answer": "A"}', "'category' must be"),
    ('{"text": "   "}', "empty"),
    ('{"prompt": 5}', "empty or not a string"),
])
def test_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path / "bad.jsonl", [{"text": "fine"}, "", bad_line, {"text": "fine too"}])
    with pytest.raises(FastMTPError, match=message) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}:3: ")


def test_duplicate_id_names_both_lines(tmp_path):
    path = _write(tmp_path / "dup.jsonl", [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}])
    with pytest.raises(FastMTPError, match=r"dup.jsonl:2: id 'x' already used on line 1"):
        load_prompts(path)


def test_missing_file(tmp_path):
    with pytest.raises(FastMTPError, match="prompt file not found: .*nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")


# --- render_chat ---------------------------------------------------------------------------


@pytest.fixture()
def chatml_tokenizer():
    """A real transformers tokenizer (word level, built in memory) with SmolLM2's template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "hello", "world", "user", "assistant"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                         unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tok


def test_render_chat_default_system_and_generation_prompt(chatml_tokenizer):
    assert render_chat(chatml_tokenizer, "hello world") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_chat_explicit_system(chatml_tokenizer):
    assert render_chat(chatml_tokenizer, "hello", system="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_chat_without_template_says_so(chatml_tokenizer):
    chatml_tokenizer.chat_template = None
    with pytest.raises(FastMTPError, match="has no chat template"):
        render_chat(chatml_tokenizer, "hello")


@pytest.mark.slow
def test_render_chat_with_the_demo_tokenizer():
    from transformers import AutoTokenizer

    from fastmtp_sglang.core.demo_target import materialize_smollm2

    tok = AutoTokenizer.from_pretrained(materialize_smollm2(progress=False))
    prompt = load_prompts(SPEC_BENCH, categories=["math"], limit_per_category=1)[0]
    text = render_chat(tok, prompt.text)
    assert text.endswith(f"<|im_start|>user\n{prompt.text}<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False).input_ids
    # the markers are single special tokens: three <|im_start|> (system, user, assistant)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok.decode(ids[-4:]) == "<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
