"""`fastmtp distill` against a real `fastmtp serve --engine reference` subprocess on loopback.

The server runs the session's tiny Llama target (conftest's ``llama_target``, with a chat
template added) at K=0 with a small context (--max-context 80), so one long prompt is refused
with 400. The distillation scenario runs greedy with n=2, so every prompt's second sample is a
duplicate of its first (the duplicate filter in the real pipeline); the server's own request
counters (/server_info) show what a rerun re-requests. The filters are also tested alone on
hand-made strings, and the retry logic against a small scripted HTTP server.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import reference_server
from fastmtp_sglang.serving import client
from fastmtp_sglang.training.distill import DistillConfig, distill
from fastmtp_sglang.training.distill_drivers import Refused, Unreachable, request_with_retries
from fastmtp_sglang.training.distill_filters import (
    Excluder, ResponseFilter, eval_texts, is_degenerate, normalise, repetition_coverage,
)
from fastmtp_sglang.training.distill_io import load_jsonl_repair, rejected_path, stats_path
from fastmtp_sglang.training.distill_prompts import Job, read_prompts_tolerant, sample_seed
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.prompts import Prompt, render_chat

REPO = Path(__file__).resolve().parents[1]
MAX_CONTEXT = 80
N_NEW = 8
STARTUP_S = 90
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GOOD = ["The quick brown fox", "Python is a programming language", "Hello there",
        "A list is a sequence of values", "Name three colours"]
LEAKED = "Summarise   the EVALUATION text,\nplease"  # matches EVAL_ROWS after normalising
LONG = " ".join(["word"] * 200)  # well over the 80-token context: the server answers 400


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_dir(llama_target, tmp_path_factory) -> Path:
    """The tiny Llama target with a chat template on its tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("distill_target") / "llama-chat"
    shutil.copytree(llama_target.path, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def server(target_dir, tmp_path_factory):
    """URL of a `fastmtp serve --engine reference` subprocess (K=0); killed at teardown."""
    log_path = tmp_path_factory.mktemp("distill_log") / "server.log"
    args = ["--target", str(target_dir), "--steps", "0", "--max-context", str(MAX_CONTEXT),
            "--max-batch", "8", "--batch-window-ms", "20"]
    with reference_server(args, log_path, STARTUP_S) as url:
        yield url


def counts(url: str) -> tuple[int, int]:
    """(requests served with 200, requests refused or failed) so far."""
    info = client.server_info(url)
    return info["requests_served"], info["requests_failed"]


def write_prompt_file(path: Path) -> Path:
    rows = [json.dumps({"id": f"p{i}", "source": "test", "prompt": t}) for i, t in enumerate(GOOD)]
    lines = [
        rows[0],
        '{"id": "broken", "prompt": "no closing brace"',          # line 2: not JSON
        rows[1],
        json.dumps({"id": "odd", "title": "no prompt field"}),     # line 4: unrecognised row
        "",                                                        # blank: skipped silently
        rows[2],
        json.dumps({"id": "p0", "prompt": "same id again"}),      # line 7: repeated id
        json.dumps({"id": "leak", "prompt": LEAKED}),
        json.dumps({"id": "long", "prompt": LONG}),
        json.dumps({"id": "blank", "prompt": "   "}),             # line 10: empty text
        rows[3],
        rows[4],
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


EVAL_ROWS = [{"question_id": 1, "category": "writing",
              "turns": ["Unrelated first turn about the weather.",
                        "summarise the evaluation text, please"]}]


def make_cfg(server, target_dir, tmp: Path, out: str = "data.jsonl", **kw) -> DistillConfig:
    prompts = write_prompt_file(tmp / "prompts.jsonl")
    evalf = tmp / "eval.jsonl"
    evalf.write_text("".join(json.dumps(r) + "\n" for r in EVAL_ROWS))
    base = dict(url=server, prompts=[str(prompts)], out=str(tmp / out), tokenizer=str(target_dir),
                n=2, temperature=0.0, max_new_tokens=N_NEW, concurrency=4, retries=1,
                backoff=0.01, timeout=60, exclude=[str(evalf)], progress=False)
    base.update(kw)
    return DistillConfig(**base)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(server, target_dir, tmp_path_factory):
    """The greedy scenario's first run: (config, stats, server counts before and after)."""
    tmp = tmp_path_factory.mktemp("distill_run")
    cfg = make_cfg(server, target_dir, tmp)
    before = counts(server)
    stats = distill(cfg, log=lambda s: None)
    return cfg, stats, before, counts(server)


# --------------------------------------------------------------------------------------------
# against the real server
# --------------------------------------------------------------------------------------------

def test_first_run_writes_the_expected_lines(first_run, server, tokenizer, target_dir):
    cfg, stats, before, after = first_run
    lines = read_lines(Path(cfg.out))
    # greedy, n=2: sample 1 repeats sample 0 and is dropped as a duplicate
    assert sorted(r["id"] for r in lines) == [f"p{i}#0" for i in range(len(GOOD))]
    assert stats.written == len(GOOD) and stats.dropped["duplicate"] == len(GOOD)
    keys = {"id", "prompt_id", "prompt", "prompt_text", "prompt_ids", "response", "response_ids",
            "finish_reason", "sampling_params", "target", "completion_tokens"}
    for r in lines:
        assert set(r) == keys
        i = int(r["prompt_id"][1:])
        assert r["prompt"] == GOOD[i]
        assert r["prompt_text"] == render_chat(tokenizer, GOOD[i])
        assert r["prompt_ids"] == tokenizer(r["prompt_text"], add_special_tokens=False)["input_ids"]
        assert r["target"] == str(target_dir)  # the server's model_path
        assert r["sampling_params"] == {"temperature": 0.0, "top_p": 0.95, "top_k": 20,
                                        "max_new_tokens": N_NEW,
                                        "sampling_seed": sample_seed(0, r["prompt_id"], 0)}
        assert r["completion_tokens"] == len(r["response_ids"]) <= N_NEW
        assert r["response"] == tokenizer.decode(r["response_ids"], skip_special_tokens=True)
        assert r["finish_reason"]["type"] in ("length", "stop")
    # what the server gives for the same ids, asked directly
    direct = client.generate(server, input_ids=lines[0]["prompt_ids"],
                             sampling_params=lines[0]["sampling_params"])
    assert direct["output_ids"] == lines[0]["response_ids"]
    # stats file = returned stats; truncation counted (max_new_tokens 8) but kept by default
    assert json.loads(stats_path(Path(cfg.out)).read_text())["written"] == stats.written
    n_length = sum(r["finish_reason"]["type"] == "length" for r in lines)
    assert stats.truncated_kept == n_length and stats.truncated >= n_length  # + dropped duplicates
    # the server saw exactly the good prompts' samples, plus the refused long one
    assert after[0] - before[0] == 2 * len(GOOD)
    assert after[1] - before[1] == stats.requested - 2 * len(GOOD) >= 1


def test_bad_lines_are_skipped_and_counted(first_run):
    cfg, stats, _, _ = first_run
    prompts = cfg.prompts[0]
    assert stats.bad_prompt_lines == 4
    assert [b.split(": ")[0] for b in stats.bad_prompt_line_list] == [
        f"{prompts}:{n}" for n in (2, 4, 7, 10)]
    assert "not valid JSON" in stats.bad_prompt_line_list[0]
    assert "already used" in stats.bad_prompt_line_list[2]
    assert stats.prompts_read == len(GOOD) + 2  # + the leaked and the long one


def test_exclude_refuses_overlapping_prompts(first_run):
    cfg, stats, _, _ = first_run
    assert stats.excluded == 1 and stats.excluded_ids == ["leak"] and stats.eval_texts == 2
    assert not any(r["prompt_id"] == "leak" for r in read_lines(Path(cfg.out)))


def test_a_400_does_not_kill_the_run(first_run):
    cfg, stats, _, _ = first_run
    assert stats.refused == 2  # both samples of the long prompt
    assert len(stats.refused_list) == 1 and stats.refused_list[0].startswith("long: ")
    assert "context" in stats.refused_list[0]
    assert stats.failed == 0 and stats.aborted is None


def test_rerun_skips_done_samples(first_run, server):
    cfg, first, _, _ = first_run
    before_lines = Path(cfg.out).read_text()
    before = counts(server)
    stats = distill(cfg, log=lambda s: None)
    after = counts(server)
    assert stats.already_done == len(GOOD) and stats.already_rejected == len(GOOD)
    assert after[0] == before[0]  # no sample that is done (or filtered) was requested again
    assert stats.requested == after[1] - before[1] >= 1  # only the refused prompt is retried
    assert stats.written == 0 and Path(cfg.out).read_text() == before_lines


def test_crash_truncated_last_line_is_repaired(first_run, server):
    cfg, _, _, _ = first_run
    out = Path(cfg.out)
    original = read_lines(out)
    text = out.read_text()
    cut = text.rstrip("\n").rfind("\n") + 1
    out.write_text(text[: cut + 25])  # the last line half-written, no newline: a crash
    before = counts(server)
    stats = distill(cfg, log=lambda s: None)
    assert len(stats.damaged_output_lines) == 1 and "cut off" in stats.damaged_output_lines[0]
    assert counts(server)[0] - before[0] == 1 and stats.written == 1
    repaired = read_lines(out)  # every line parses again
    assert sorted(r["id"] for r in repaired) == sorted(r["id"] for r in original)
    assert {r["id"]: r["response_ids"] for r in repaired} == {r["id"]: r["response_ids"] for r in original}


def test_resume_refuses_other_settings(first_run, server):
    cfg, _, _, _ = first_run
    other = DistillConfig(**{**cfg.__dict__, "temperature": 0.7})
    with pytest.raises(FastMTPError, match="other sampling settings.*temperature"):
        distill(other, log=lambda s: None)


def test_sampled_runs_are_seeded_and_reproducible(server, target_dir, tmp_path):
    """Default sampling (T=0.6): each sample has its own seed; one request at a time, two fresh
    runs give the same data (the reference server seeds a batch from its first request)."""
    runs = []
    for name in ("a.jsonl", "b.jsonl"):
        cfg = make_cfg(server, target_dir, tmp_path, out=name, temperature=0.6, limit=2,
                       concurrency=1, max_repeat_fraction=1.0)
        distill(cfg, log=lambda s: None)
        runs.append(sorted(read_lines(Path(cfg.out)), key=lambda r: r["id"]))
    a, b = runs
    assert [r["response_ids"] for r in a] == [r["response_ids"] for r in b]
    seeds = [r["sampling_params"]["sampling_seed"] for r in a]
    assert len(set(seeds)) == len(seeds) and a[0]["sampling_params"]["temperature"] == 0.6


def test_cli(server, target_dir, tmp_path, run_cli):
    prompts = write_prompt_file(tmp_path / "p.jsonl")
    out = tmp_path / "cli.jsonl"
    rc, stdout, err = run_cli("distill", "--url", server, "--prompts", prompts, "--out", out,
                              "--tokenizer", target_dir, "--temperature", "0", "--max-new-tokens",
                              "4", "--limit", "2", "--drop-truncated", "--no-progress")
    assert rc == 0, err
    assert "4 bad lines skipped" in stdout and f"statistics in {out}.stats.json" in stdout
    assert f"skipped 4 bad prompt line(s), first {prompts}:2" in err
    assert f"  {prompts}:10: the prompt text is empty" in stdout
    stats = json.loads(stats_path(out).read_text())
    # --drop-truncated: 4 new tokens end on "length" unless EOS came first
    assert stats["written"] + stats["dropped"]["truncated"] + stats["dropped"]["empty"] == 2
    assert stats["truncated_kept"] == 0
    rc, _, err = run_cli("distill", "--url", server, "--prompts", prompts, "--out", out, "--n", "0")
    assert rc == 1 and "--n must be >= 1" in err


def test_unreachable_server_stops_the_run_resumably(target_dir, tmp_path):
    prompts = write_prompt_file(tmp_path / "p.jsonl")
    cfg = DistillConfig(url="http://127.0.0.1:9", prompts=[str(prompts)], out=str(tmp_path / "o.jsonl"),
                        tokenizer=str(target_dir), target_name="tiny", retries=1, backoff=0.001,
                        timeout=5, progress=False)
    with pytest.raises(FastMTPError, match="unreachable after 1 retries.*rerun"):
        distill(cfg, log=lambda s: None)
    assert json.loads(stats_path(Path(cfg.out)).read_text())["aborted"].startswith("http://127.0.0.1:9")
    assert Path(cfg.out).read_text() == ""


# --------------------------------------------------------------------------------------------
# retries against a scripted server
# --------------------------------------------------------------------------------------------

class _Scripted(BaseHTTPRequestHandler):
    script: list[int] = []
    seen: list[int] = []

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        status = self.script.pop(0) if self.script else 200
        self.seen.append(status)
        body = (json.dumps({"text": "ok", "output_ids": [5], "meta_info": {"completion_tokens": 1}})
                if status == 200 else json.dumps({"error": {"message": f"status {status}"}}))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())


@pytest.fixture
def scripted():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Scripted.seen = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


JOB = Job(Prompt("x", "c", "hi"), 0, "hi", [1, 2], {"temperature": 0})


def test_retries_5xx_with_exponential_backoff(scripted):
    _Scripted.script = [503, 500]
    slept = []
    out, used = request_with_retries(scripted, JOB, retries=3, backoff=0.5, timeout=10, sleep=slept.append)
    assert out["text"] == "ok" and used == 2 and slept == [0.5, 1.0]
    _Scripted.script = [502, 502, 502]
    with pytest.raises(client.ServerError):
        request_with_retries(scripted, JOB, retries=2, backoff=0, timeout=10, sleep=slept.append)


def test_400_is_not_retried(scripted):
    _Scripted.script = [400]
    _Scripted.seen = []
    with pytest.raises(Refused, match="status 400"):
        request_with_retries(scripted, JOB, retries=3, backoff=0, timeout=10)
    assert _Scripted.seen == [400]


def test_unreachable_after_retries():
    slept = []
    with pytest.raises(Unreachable, match="cannot reach"):
        request_with_retries("http://127.0.0.1:9", JOB, retries=2, backoff=0.25, timeout=5,
                             sleep=slept.append)
    assert slept == [0.25, 0.5]


# --------------------------------------------------------------------------------------------
# the filters and readers, on hand-made data
# --------------------------------------------------------------------------------------------

def test_repetition_rule_on_hand_made_strings():
    prose = ("The cat sat on the mat while the dog slept by the door, and nobody in the house "
             "noticed that the kettle had been boiling for a quarter of an hour.").split()
    assert repetition_coverage(prose) < 0.2 and not is_degenerate(prose)
    loop = ("I think so. " * 12).split()  # 3-word period, 36 words
    assert repetition_coverage(loop) == 1.0 and is_degenerate(loop)
    # a prefix of sense, then a loop over most of it
    half = prose[:10] + ("and then again " * 5).split()  # 10 + 15 words
    assert repetition_coverage(half) == pytest.approx(15 / 25)
    assert is_degenerate(half) and not is_degenerate(half, max_fraction=0.7)
    # characters work too: a single repeated character
    assert repetition_coverage("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab") == pytest.approx(31 / 32)
    # seen only twice (a restated sentence) is not a loop; short responses are never degenerate
    twice = "one two three four five six seven eight nine ten".split() * 2
    assert repetition_coverage(twice) == 0.0
    assert not is_degenerate("no no no no".split())
    assert not is_degenerate(loop, max_fraction=1.0)  # 1 = off
    # overlapping occurrences are counted once: "abab..." covered fully, not doubly
    assert repetition_coverage(list("ab" * 20)) == 1.0


def test_response_filter_counts_duplicates_per_prompt():
    f = ResponseFilter()
    ids = list(range(20))
    assert f.reason("p", "An answer.", ids, {"type": "stop"}) is None
    assert f.reason("p", "  An answer.\n", ids, {"type": "stop"}) == "duplicate"
    assert f.reason("q", "An answer.", ids, {"type": "stop"}) is None  # another prompt: kept
    assert f.reason("p", " \n", [7], {"type": "stop"}) == "empty"
    assert f.reason("p", "loop", [1, 2] * 20, {"type": "length"}) == "degenerate"
    assert f.reason("p", "cut", ids, {"type": "length"}) is None  # truncated kept by default
    g = ResponseFilter(drop_truncated=True)
    assert g.reason("p", "cut", ids, {"type": "length"}) == "truncated"
    assert g.reason("p", "cut", ids, "length") == "truncated"  # a bare-string finish reason


def test_normalise_and_excluder():
    assert normalise("  Hello\n\tWORLD  ") == "hello world"
    ex = Excluder([normalise("What is the capital of France? Answer in one word."), "hi"])
    assert ex.match("what is the   capital of FRANCE? answer in one word.") == "equal"
    assert ex.match("Hi") == "equal"
    assert ex.match("Please: what is the capital of France? Answer in one word. Thanks") == "contained"
    assert ex.match("capital of France? Answer in one word.") == "contained"  # 38 chars inside
    assert ex.match("Hi there") is None  # short eval texts only match when equal
    assert ex.match("capital of France") is None  # under 32 characters


def test_eval_texts_reads_every_turn_and_is_strict(tmp_path):
    f = tmp_path / "e.jsonl"
    f.write_text(json.dumps(EVAL_ROWS[0]) + "\n" + json.dumps({"id": 1, "question": "Q?",
                                                                "category": "c", "answer": "A"}) + "\n")
    assert eval_texts([f]) == [normalise(t) for t in EVAL_ROWS[0]["turns"]] + ["q?"]
    f.write_text('{"turns": ["a"]}\n{oops\n')
    with pytest.raises(FastMTPError, match=r"e\.jsonl:2: not valid JSON"):
        eval_texts([f])


def test_shipped_training_prompts_do_not_overlap_evaluation():
    """The counts in fastmtp_sglang/data/train_prompts/README.md (AlpacaEval's instructions are
    non-commercial: in the repository's bench/train_prompts/, not in the package)."""
    data = REPO / "fastmtp_sglang" / "data" / "train_prompts"
    evals = [REPO / "bench" / "data" / "spec_bench.jsonl", REPO / "bench" / "data" / "c_eval_zh.jsonl"]
    ex = Excluder(eval_texts(evals))
    prompts, bad = read_prompts_tolerant([REPO / "bench" / "train_prompts" / "alpaca_eval_instructions.jsonl",
                                          data / "self_instruct_seed.jsonl"])
    assert (len(prompts), bad) == (978, [])
    assert [p.id for p in prompts if ex.match(p.text)] == []
    spec, _ = read_prompts_tolerant(evals[:1])  # sanity: the rule does catch evaluation prompts
    assert all(ex.match(p.text) == "equal" for p in spec)


def test_read_prompts_tolerant_errors_on_missing_file(tmp_path):
    with pytest.raises(FastMTPError, match="not found"):
        read_prompts_tolerant([tmp_path / "nope.jsonl"])
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n\xff\xfe\n{"prompt": "fine"}\n')
    prompts, bad = read_prompts_tolerant([f])
    assert [p.id for p in prompts] == ["p:1", "p:3"] and bad == [f"{f}:2: not UTF-8 (invalid start byte)"]


def test_load_jsonl_repair_drops_damaged_lines(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"id": "a"}\nnot json\n{"id": "a"}\n[1]\n{"id": "b"}\n{"id": "c", "resp')
    recs, dropped = load_jsonl_repair(f)
    assert [r["id"] for r in recs] == ["a", "b"]
    assert [d.split(":")[0] for d in dropped] == ["line 2", "line 3", "line 4", "line 6"]
    assert f.read_text() == '{"id": "a"}\n{"id": "b"}\n'
    assert load_jsonl_repair(f) == (recs, [])  # clean now: left as it is
    assert load_jsonl_repair(tmp_path / "missing.jsonl") == ([], [])


def test_config_validation():
    with pytest.raises(FastMTPError, match="--top-p"):
        DistillConfig(url="u", prompts=["p"], out="o", top_p=0)
    with pytest.raises(FastMTPError, match="--max-repeat-fraction"):
        DistillConfig(url="u", prompts=["p"], out="o", max_repeat_fraction=0)
    assert sample_seed(0, "p", 0) == sample_seed(0, "p", 0) != sample_seed(0, "p", 1)
    assert rejected_path(Path("x/d.jsonl")) == Path("x/d.jsonl.rejected.jsonl")


# --------------------------------------------------------------------------------------------
# in-process generation (--target): same data as through the server
# --------------------------------------------------------------------------------------------

def test_in_process_equals_server(server, target_dir, tmp_path):
    """fp32, greedy, n=2 (siblings share one prefill), batch 3 with refill: every line equals
    what the reference server wrote for the same settings, the same filters apply, and the file
    resumes across engines. Sampled runs: reproducible, the same kind of file."""
    kw = dict(temperature=0.0, n=2, max_repeat_fraction=1.0, concurrency=1)
    via_http = make_cfg(server, target_dir, tmp_path, out="http.jsonl", **kw)
    distill(via_http, log=lambda s: None)
    local = make_cfg(None, target_dir, tmp_path, out="local.jsonl", target=str(target_dir),
                     target_name=server_target(server), batch_size=3, dtype="float32", **kw)
    stats = distill(local, log=lambda s: None)
    a, b = read_lines(Path(via_http.out)), read_lines(Path(local.out))
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert a == b
    assert stats.refused == 2 and "in-process" in stats.engine  # the over-long prompt, both samples
    # resume across engines: nothing left to do
    again = distill(make_cfg(server, target_dir, tmp_path, out="local.jsonl", **kw), log=lambda s: None)
    assert again.written == 0 and again.already_done == len(b)  # (the refused prompt is retried)
    sampled = []
    for name in ("s1.jsonl", "s2.jsonl"):
        cfg = make_cfg(None, target_dir, tmp_path, out=name, target=str(target_dir), batch_size=2,
                       dtype="float32", **{**kw, "temperature": 0.6})
        distill(cfg, log=lambda s: None)
        sampled.append(read_lines(Path(cfg.out)))
    assert sampled[0] == sampled[1] and len(sampled[0]) > len(a)  # greedy n=2 dropped duplicates
    assert sampled[0][0]["sampling_params"]["temperature"] == 0.6


def test_a_temperature_per_sample_index_resumes_and_extends(target_dir, tmp_path):
    """--temperature 0.6,0: sample k uses item k mod 2 (sample 1 greedy, equal to the target's
    own greedy answer); a file written with n=2 and a single 0.6 resumes under the list as long as
    its samples' temperatures agree, and n=4 adds exactly samples 2 and 3; a list that disagrees
    with what the file holds is refused."""
    kw = dict(target=str(target_dir), batch_size=4, dtype="float32", max_repeat_fraction=1.0, limit=2)
    first = make_cfg(None, target_dir, tmp_path, out="mix.jsonl", **{**kw, "n": 1, "temperature": 0.6})
    distill(first, log=lambda s: None)
    mixed = make_cfg(None, target_dir, tmp_path, out="mix.jsonl", **{**kw, "n": 4, "temperature": (0.6, 0.0)})
    stats = distill(mixed, log=lambda s: None)
    rows = {r["id"]: r for r in read_lines(Path(mixed.out))}
    assert stats.already_done == 2
    for rid, r in rows.items():
        k = int(rid.rpartition("#")[2])
        assert r["sampling_params"]["temperature"] == (0.6, 0.0)[k % 2]
    greedy = make_cfg(None, target_dir, tmp_path, out="greedy.jsonl", **{**kw, "n": 1, "temperature": 0.0})
    distill(greedy, log=lambda s: None)
    for g in read_lines(Path(greedy.out)):  # greedy sample 1 (and 3, if kept) = the greedy answer
        pid = g["prompt_id"]
        assert rows[f"{pid}#1"]["response_ids"] == g["response_ids"]
    wrong = make_cfg(None, target_dir, tmp_path, out="mix.jsonl", **{**kw, "n": 4, "temperature": (0.0, 0.6)})
    with pytest.raises(FastMTPError, match="other sampling settings.*temperature"):
        distill(wrong, log=lambda s: None)
    with pytest.raises(FastMTPError, match="--temperature must be >= 0"):
        make_cfg(None, target_dir, tmp_path, **{**kw, "temperature": (0.6, -1.0)})


def server_target(url: str) -> str:
    return client.server_info(url)["model_path"]


def test_resume_refuses_another_system_message(target_dir, tmp_path):
    cfg = make_cfg(None, target_dir, tmp_path, target=str(target_dir), batch_size=2, limit=1,
                   dtype="float32", max_new_tokens=3)
    distill(cfg, log=lambda s: None)
    other = DistillConfig(**{**cfg.__dict__, "system": "You are terse."})
    with pytest.raises(FastMTPError, match="another system message"):
        distill(other, log=lambda s: None)


def test_url_or_target_not_both(target_dir, tmp_path):
    with pytest.raises(FastMTPError, match="either --url"):
        make_cfg("http://127.0.0.1:9", target_dir, tmp_path, target=str(target_dir))
    with pytest.raises(FastMTPError, match="either --url"):
        make_cfg(None, target_dir, tmp_path)


def test_in_process_interrupt_leaves_a_resumable_file(target_dir, tmp_path):
    """Ctrl-C reaches the main thread, where the in-process generator computes: the run stops
    with KeyboardInterrupt, every line written is whole, the stats say "interrupted", and the
    same command then completes to exactly what an uninterrupted run writes.

    Python's default SIGINT handler raises KeyboardInterrupt in the main thread at its next
    bytecode; the test raises it there itself, in the engine's step, once the step is seen to run
    on the main thread. (It had sent itself a real SIGINT: in two full-suite runs on a loaded
    machine the run then finished without the exception, never when the file ran alone; the
    delivery's timing is the operating system's, not the code's.)"""
    import threading

    from fastmtp_sglang.decode.engine import ReferenceEngine

    kw = dict(target=str(target_dir), batch_size=2, dtype="float32", temperature=0.0, n=2,
              max_repeat_fraction=1.0)
    whole = make_cfg(None, target_dir, tmp_path, out="whole.jsonl", **kw)
    distill(whole, log=lambda s: None)
    cfg = make_cfg(None, target_dir, tmp_path, out="cut.jsonl", **kw)
    real = ReferenceEngine.step
    calls = {"n": 0}

    def step(self, *a, **k):  # Ctrl-C, once a few cycles have run
        assert threading.current_thread() is threading.main_thread()
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    ReferenceEngine.step = step
    try:
        with pytest.raises(KeyboardInterrupt):
            distill(cfg, log=lambda s: None)
    finally:
        ReferenceEngine.step = real
    part = read_lines(Path(cfg.out))  # every line parses
    stats = json.loads(Path(cfg.out + ".stats.json").read_text())
    assert stats["aborted"] == "interrupted"
    assert len(part) < len(read_lines(Path(whole.out)))
    distill(cfg, log=lambda s: None)
    assert sorted(read_lines(Path(cfg.out)), key=lambda r: r["id"]) == \
        sorted(read_lines(Path(whole.out)), key=lambda r: r["id"])


def test_eval_texts_names_an_unreadable_exclude_file(tmp_path):
    with pytest.raises(FastMTPError, match=r"--exclude file not found: .*nope\.jsonl"):
        eval_texts([tmp_path / "nope.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "ok"}\n\xff\xfe\n')
    with pytest.raises(FastMTPError, match=r"cannot read --exclude file .*bad\.jsonl"):
        eval_texts([bad])
