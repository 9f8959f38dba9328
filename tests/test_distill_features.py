"""`fastmtp distill --url ... --with-features F`: data and the feature cache in one pass through
real `fastmtp serve --engine reference --enable-return-hidden-states` subprocesses on loopback.

The server answers ``return_hidden_states: true`` as SGLang 0.5.23 does (docs/scale.md,
"Features from SGLang servers"); the cache it yields must be the one `fastmtp features` builds
from the same data file with the target in this process (fp32), open under the trainer's key,
and stay so when requests are spread over two servers. A server started without the flag is
refused with one line before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import reference_server
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.serving import client
from fastmtp_sglang.serving.hidden_states import HIDDEN_STATES_OFF
from fastmtp_sglang.training.distill import DistillConfig, distill
from fastmtp_sglang.training.features import FeatureStore, make_key, open_or_build
from fastmtp_sglang.training.features_server import NoHiddenStates, hidden_rows

MAX_CONTEXT = 96
MAX_LEN = 45  # some sequences are cut at it, others are not (asserted below)
STARTUP_S = 90
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPTS = ["Hi", "The quick brown fox", "Name three colours", "A list is a sequence of values",
           "Python"]


@pytest.fixture(scope="module")
def target_dir(llama_target, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("feat_target") / "llama-chat"
    shutil.copytree(llama_target.path, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def _server(target_dir: Path, tmp_path_factory, name: str, *flags: str):
    log = tmp_path_factory.mktemp(name) / "server.log"
    args = ["--target", str(target_dir), "--steps", "0", "--max-context", str(MAX_CONTEXT),
            "--max-batch", "4", *flags]
    return reference_server(args, log, STARTUP_S)


@pytest.fixture(scope="module")
def servers(target_dir, tmp_path_factory):
    """Two servers with --enable-return-hidden-states."""
    with _server(target_dir, tmp_path_factory, "hs_a", "--enable-return-hidden-states") as a, \
            _server(target_dir, tmp_path_factory, "hs_b", "--enable-return-hidden-states") as b:
        yield a, b


@pytest.fixture(scope="module")
def plain_server(target_dir, tmp_path_factory):
    with _server(target_dir, tmp_path_factory, "plain") as url:
        yield url


def prompt_file(tmp: Path) -> Path:
    p = tmp / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n"
                         for i, t in enumerate(PROMPTS)))
    return p


def cfg_for(url, target_dir: Path, tmp: Path, out: str = "data.jsonl", feats: str = "data.features",
            **kw) -> DistillConfig:
    base = dict(url=url, prompts=[str(prompt_file(tmp))], out=str(tmp / out),
                tokenizer=str(target_dir), n=2, temperature=(0.0, 0.7), max_new_tokens=12,
                concurrency=2, retries=0, backoff=0, timeout=60, progress=False,
                with_features=str(tmp / feats), feature_dtype="float32", max_len=MAX_LEN)
    base.update(kw)
    return DistillConfig(**base)


def served(url: str) -> int:
    return client.server_info(url)["requests_served"]


# --------------------------------------------------------------------------------------------
# the reply, as SGLang 0.5.23 shapes it
# --------------------------------------------------------------------------------------------

def test_reply_shape_is_sglangs(servers, target_dir):
    """[prefill block [P][H], then one [H] row per decode step] = P + N - 1 rows, the target's
    post-norm states at those positions."""
    from transformers import AutoModelForCausalLM

    url = servers[0]
    ids = [5, 17, 42, 8, 99, 3]
    out = client.generate(url, input_ids=ids, return_hidden_states=True,
                          sampling_params={"temperature": 0, "max_new_tokens": 5,
                                           "ignore_eos": True})
    hs = out["meta_info"]["hidden_states"]
    n = len(out["output_ids"])
    assert n == 5
    assert len(hs) == 1 + (n - 1)
    assert len(hs[0]) == len(ids) and all(len(r) == 64 for r in hs[0])
    assert all(isinstance(r, list) and len(r) == 64 and isinstance(r[0], float) for r in hs[1:])
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.model(input_ids=torch.tensor([ids + out["output_ids"]])).last_hidden_state[0]
    rows = hidden_rows(out, url, len(ids), 64)
    torch.testing.assert_close(rows, ref[:-1], atol=1e-5, rtol=0)
    # without the field: no rows, as SGLang
    plain = client.generate(url, input_ids=ids, sampling_params={"temperature": 0,
                                                                 "max_new_tokens": 2})
    assert "hidden_states" not in plain["meta_info"]


def test_reply_refusals(servers, plain_server):
    ids = [5, 17, 42]
    with pytest.raises(client.ServerError) as e:  # the flag is off: SGLang's own 400
        client.generate(plain_server, input_ids=ids, return_hidden_states=True,
                        sampling_params={"max_new_tokens": 2})
    assert e.value.status == 400 and e.value.message == HIDDEN_STATES_OFF
    for bad in ("last", [True], 1):  # SGLang's HTTP schema takes a bool
        with pytest.raises(client.ServerError) as e:
            _post(servers[0], {"input_ids": ids, "return_hidden_states": bad})
        assert e.value.status == 400 and "return_hidden_states" in e.value.message


def _post(url: str, body: dict) -> dict:
    with client._open(url.rstrip("/") + "/generate", body, 30) as resp:
        return json.loads(resp.read())


def test_hidden_rows_checks():
    reply = {"output_ids": [1, 2, 3], "meta_info": {"hidden_states": [[[0.5] * 4] * 2, [1.0] * 4,
                                                                      [2.0] * 4]}}
    rows = hidden_rows(reply, "U", 2, 4)
    assert rows.shape == (4, 4) and rows[2, 0] == 1.0 and rows[3, 0] == 2.0
    with pytest.raises(NoHiddenStates, match="--disable-radix-cache"):
        hidden_rows(reply, "U", 3, 4)     # a cached prefix: the prefill block is short
    with pytest.raises(NoHiddenStates, match="width 4.*hidden size is 8"):
        hidden_rows(reply, "U", 2, 8)
    with pytest.raises(NoHiddenStates, match="--enable-return-hidden-states"):
        hidden_rows({"output_ids": [1], "meta_info": {}}, "U", 2, 4)


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------

def reference_cache(target_dir: Path, data: Path, out: Path,
                    max_len: int = MAX_LEN) -> tuple[FeatureStore, list, Any]:
    """`fastmtp features` on ``data`` (fp32), the examples as `fastmtp train` reads them, and
    the trainer's key for that file."""
    from fastmtp_sglang.core.target import load_target
    from fastmtp_sglang.training.data import load_examples

    target = load_target(target_dir, "float32")
    vocab = int(target.config["vocab_size"])
    examples, _ = load_examples(data, target.tokenizer, vocab, max_len, 1)
    store = open_or_build(target, target_dir, data, examples, out, max_len, None, "float32", 0,
                          progress=False, log=lambda s: None)
    key = make_key(target, target_dir, data, max_len, None, "float32", 0)
    return store, examples, key


def test_features_equal_fastmtp_features(servers, target_dir, tmp_path):
    cfg = cfg_for(servers[0], target_dir, tmp_path)
    stats = distill(cfg, log=lambda s: None)
    assert stats.written >= 6 and stats.feature_tokens > 0
    ref, examples, key = reference_cache(target_dir, tmp_path / "data.jsonl",
                                         tmp_path / "ref.features")
    got = FeatureStore(tmp_path / "data.features", key)  # the trainer's key opens it
    assert len(got) == len(ref) == len(examples) == stats.written
    lines = (tmp_path / "data.jsonl").read_text().splitlines()
    full = [len(r["prompt_ids"]) + len(r["response_ids"])
            for r in (json.loads(lines[e.line - 1]) for e in examples)]
    cut = [n > MAX_LEN for n in full]
    assert any(cut) and not all(cut)  # both kinds of row are exercised
    shifted = []
    for i, e in enumerate(examples):
        g, r = got(i, e.ids), ref(i, e.ids)
        assert g.dtype == torch.float32 and g.shape == r.shape == (len(e.ids), 64)
        if cut[i]:  # the server returned every position up to MAX_LEN
            torch.testing.assert_close(g, r, atol=1e-5, rtol=0)
        else:  # the last position (no loss reads it) is never returned: zeros
            torch.testing.assert_close(g[:-1], r[:-1], atol=1e-5, rtol=0)
            assert not g[-1].any()
        shifted.append(float((g[1:-1] - r[:-2]).abs().max()))
    assert min(shifted) > 1e-2  # a row off by one position would fail the comparison above
    # another max_len is another key: refused, with the field named
    other = dataclasses.replace(key, max_len=MAX_LEN + 1)
    with pytest.raises(FastMTPError, match="max_len"):
        FeatureStore(tmp_path / "data.features", other)
    assert not (tmp_path / ".data.features.distill").exists()


def test_two_servers_share_the_work(servers, target_dir, tmp_path):
    a, b = servers
    one = tmp_path / "one"
    two = tmp_path / "two"
    one.mkdir()
    two.mkdir()
    distill(cfg_for(a, target_dir, one), log=lambda s: None)
    before = served(a), served(b)
    stats = distill(cfg_for([a, b], target_dir, two), log=lambda s: None)
    after = served(a), served(b)
    assert after[0] > before[0] and after[1] > before[1]  # both answered requests
    assert set(stats.requests_per_server) == {a, b} and all(stats.requests_per_server.values())
    assert (one / "data.jsonl").read_text() == (two / "data.jsonl").read_text()
    s1 = FeatureStore(one / "data.features")
    s2 = FeatureStore(two / "data.features")
    assert s1.index["key"] == s2.index["key"] and s1.index["rows"] == s2.index["rows"]
    for i in range(len(s1)):
        # (the states the servers computed, in batches of other shapes: equal up to fp32 rounding)
        torch.testing.assert_close(s1(i), s2(i), atol=1e-5, rtol=0)


def test_server_without_hidden_states_is_refused(plain_server, servers, target_dir, tmp_path):
    cfg = cfg_for(plain_server, target_dir, tmp_path)
    with pytest.raises(FastMTPError) as e:
        distill(cfg, log=lambda s: None)
    msg = str(e.value)
    assert "\n" not in msg and "--enable-return-hidden-states" in msg and plain_server in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]  # nothing written
    # one such server among good ones is refused the same way
    cfg = cfg_for([servers[0], plain_server], target_dir, tmp_path)
    with pytest.raises(FastMTPError, match="--enable-return-hidden-states"):
        distill(cfg, log=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_resume_appends_and_reindexes(servers, target_dir, tmp_path):
    """A run over the first prompts, then one over all: the cache equals a one-shot run's."""
    once = tmp_path / "once"
    twice = tmp_path / "twice"
    once.mkdir()
    twice.mkdir()
    distill(cfg_for(servers[0], target_dir, once), log=lambda s: None)
    distill(cfg_for(servers[0], target_dir, twice, limit=2), log=lambda s: None)
    assert FeatureStore(twice / "data.features").index["rows"]  # a complete cache in between
    distill(cfg_for(servers[0], target_dir, twice), log=lambda s: None)
    assert (once / "data.jsonl").read_text() == (twice / "data.jsonl").read_text()
    s1, s2 = FeatureStore(once / "data.features"), FeatureStore(twice / "data.features")
    assert s1.index["key"] == s2.index["key"] and len(s1) == len(s2)
    for i in range(len(s1)):
        # (the states the servers computed, in batches of other shapes: equal up to fp32 rounding)
        torch.testing.assert_close(s1(i), s2(i), atol=1e-5, rtol=0)
    # samples already written without their rows are not asked again: the new cache covers none
    # of them and says so (`fastmtp features --reuse` fills them in: test_distill_capture.py)
    said: list[str] = []
    distill(cfg_for(servers[0], target_dir, once, feats="other.features"), log=said.append)
    assert any("have no hidden states" in s for s in said)
    other = FeatureStore(once / "other.features")
    assert len(other) == 0 and other.index["partial"] == {"rows": 0, "of": len(s1),
                                                          "file": str(once / "data.jsonl")}


def test_cli(servers, plain_server, target_dir, tmp_path, run_cli):
    """The command as typed: two --url flags and --with-features; a plain server: one line, exit
    1, nothing written."""
    a, b = servers
    prompts = prompt_file(tmp_path)
    common = ["--prompts", prompts, "--out", tmp_path / "d.jsonl", "--tokenizer", target_dir,
              "--with-features", tmp_path / "d.features", "--feature-dtype", "float32",
              "--max-len", str(MAX_LEN), "--temperature", "0", "--max-new-tokens", "4",
              "--no-progress"]
    rc, _, err = run_cli("distill", "--url", plain_server, *common)
    assert rc == 1 and err.count("\n") == 1 and "--enable-return-hidden-states" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]
    rc, out, err = run_cli("distill", "--url", a, "--url", b, *common)
    assert rc == 0, err
    store = FeatureStore(tmp_path / "d.features")
    assert len(store) == len(PROMPTS) and store.index["key"]["max_len"] == MAX_LEN
    assert "features of 5 sequences" in err


def test_resume_cuts_what_a_crash_left(servers, target_dir, tmp_path):
    """A run stopped between writing a sample's rows and its staged line (or mid-line) leaves
    rows no line records and a cut line: the rerun drops both and ends as a single run."""
    from fastmtp_sglang.training.features_server import DATA, INDEX, STAGED

    once, twice = tmp_path / "once", tmp_path / "twice"
    once.mkdir()
    twice.mkdir()
    distill(cfg_for(servers[0], target_dir, once), log=lambda s: None)
    distill(cfg_for(servers[0], target_dir, twice, limit=2), log=lambda s: None)
    work = twice / ".data.features.distill"
    (twice / "data.features").rename(work)  # as a stopped run leaves it: no index
    (work / INDEX).unlink()
    with open(work / DATA, "ab") as f:
        f.write(b"\x01" * (64 * 4 * 3 + 5))  # 3 rows and a piece of one, never recorded
    with open(work / STAGED, "a") as f:
        f.write('{"id": "p9#0", "row": 1')  # cut mid-line
    distill(cfg_for(servers[0], target_dir, twice), log=lambda s: None)
    assert not work.exists()
    s1, s2 = FeatureStore(once / "data.features"), FeatureStore(twice / "data.features")
    assert s1.index["rows"] == s2.index["rows"]
    for i in range(len(s1)):
        # (the states the servers computed, in batches of other shapes: equal up to fp32 rounding)
        torch.testing.assert_close(s1(i), s2(i), atol=1e-5, rtol=0)


def test_another_max_len_reindexes_without_asking(servers, target_dir, tmp_path):
    """The cache keeps every position of every sample: rerunning with another --max-len
    re-indexes it (no request sent) into the cache `fastmtp features` builds at that length."""
    longer = MAX_LEN + 8
    distill(cfg_for(servers[0], target_dir, tmp_path, limit=3), log=lambda s: None)
    before = served(servers[0])
    distill(cfg_for(servers[0], target_dir, tmp_path, limit=3, max_len=longer), log=lambda s: None)
    assert served(servers[0]) == before
    ref, examples, key = reference_cache(target_dir, tmp_path / "data.jsonl",
                                         tmp_path / "ref.features", longer)
    got = FeatureStore(tmp_path / "data.features", key)
    assert any(len(e.ids) > MAX_LEN for e in examples)
    for i, e in enumerate(examples):
        g, r = got(i, e.ids), ref(i, e.ids)
        torch.testing.assert_close(g[:-1], r[:-1], atol=1e-5, rtol=0)
