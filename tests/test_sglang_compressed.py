"""Per-request compressed draft vocabulary inside SGLang (the real sglang package, on CPU).

A draft directory that lists two vocab tables (en, zh) and a script-class file: on load,
FastMTPForCausalLM installs a CompressedProjection, and through SGLang's own LogitsProcessor,
KV pool and attention backend:

- each row's logits equal the full head's at its table's ids and are -inf elsewhere, full width;
- rows of different languages in one batch get their own tables;
- DECODE after EXTEND keeps the table picked at EXTEND; a new request in the slot starts over
  (prefix 0, or another request id);
- argmax of the compressed logits is compressed_head's top_id;
- no tables (or FASTMTP_SGLANG_VOCAB=full) -> the full head, bit for bit as before;
- SGLang's --speculative-token-map replaces the tables;
- tensor parallelism: per-rank shards of the tables, computed on slices of the head,
  concatenated as SGLang's all-gather does, equal the unsharded row (tp 2 and 4, a vocabulary
  that does not split evenly).

CUDA-graph capture and the Triton path of the kernel need a GPU (see docs/sglang_backend.md).
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from fastmtp_sglang.core.errors import MismatchError  # noqa: E402
from fastmtp_sglang.kernels.compressed_head import compressed_head  # noqa: E402
from fastmtp_sglang.vocab.language import SCRIPT_CJK, SCRIPT_LATIN, SCRIPT_NEUTRAL  # noqa: E402
from fastmtp_sglang.vocab.tables import save_table, tokenizer_identity  # noqa: E402
from sglang_cpu import sglang_on_cpu  # noqa: E402
from test_sglang_model import KVHarness, build, make_draft, sglang_config, weights_of  # noqa: E402

pytestmark = pytest.mark.sglang

V = 320
# script classes of the test vocabulary: 1..159 Latin, 160..319 CJK, 0 neutral
SCRIPTS = torch.full((V,), SCRIPT_LATIN, dtype=torch.int8)
SCRIPTS[160:] = SCRIPT_CJK
SCRIPTS[0] = SCRIPT_NEUTRAL
LATIN_IDS = torch.arange(1, 160)
CJK_IDS = torch.arange(160, V)


@pytest.fixture(scope="module")
def sgl():
    """SGLang's layers, pools and backend on CPU, world size 1 (torn down at module end, so the
    other SGLang test module can set up its own)."""
    with sglang_on_cpu() as ns:
        yield ns


def _table_ids(seed: int, n_latin: int, n_cjk: int) -> torch.Tensor:
    """Distinct ids from both halves of the vocabulary (so both TP shards hold some), shuffled."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([LATIN_IDS[torch.randperm(len(LATIN_IDS), generator=g)[:n_latin]],
                     CJK_IDS[torch.randperm(len(CJK_IDS), generator=g)[:n_cjk]], torch.tensor([0])])
    return ids[torch.randperm(len(ids), generator=g)]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, llama_target, tiny_tokenizer):
    """"plain": a llama/mimo draft without tables; "tables": the same weights, listing an en and
    a zh table (vocab/*.pt with sidecars) and the script classes (vocab/scripts.pt)."""
    root = tmp_path_factory.mktemp("compressed_drafts")
    plain, tables = root / "plain", root / "tables"
    make_draft(plain, llama_target.config, "mimo", seed=31)
    shutil.copytree(plain, tables)
    ident = tokenizer_identity(tiny_tokenizer)
    en = save_table(tables / "vocab", _table_ids(1, 30, 6), {"lang": "en", "tokenizer": ident})
    zh = save_table(tables / "vocab", _table_ids(2, 5, 20), {"lang": "zh", "tokenizer": ident})
    torch.save(SCRIPTS, tables / "vocab" / "scripts.pt")
    cfg = json.loads((tables / "config.json").read_text())
    cfg["fastmtp"]["vocab_tables"] = [f"vocab/{en.name}", {"path": f"vocab/{zh.name}"}]
    cfg["fastmtp"]["script_classes"] = "vocab/scripts.pt"
    (tables / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"plain": plain, "tables": tables, "en": torch.load(en), "zh": torch.load(zh)}


@pytest.fixture(scope="module")
def models(sgl, drafts, llama_target):
    return {k: build(sgl, drafts[k], llama_target) for k in ("plain", "tables")}


def support(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).squeeze(1).tolist())


def assert_table_row(row: torch.Tensor, full_row: torch.Tensor, ids: torch.Tensor) -> None:
    """Full width; equal to the full head at the table's ids; -inf everywhere else."""
    assert row.shape == full_row.shape == (V,)
    assert support(row) == set(ids.tolist())
    torch.testing.assert_close(row[ids], full_row[ids], rtol=1e-5, atol=1e-5)


def pick(ids: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ids[torch.randint(0, len(ids), (n,), generator=g)]


# --------------------------------------------------------------------------------------------
# installation
# --------------------------------------------------------------------------------------------

def test_tables_installed_on_load(sgl, models, drafts):
    proj = models["tables"].draft_projection
    assert isinstance(proj, sgl.cp.CompressedProjection)
    assert [p.split("-")[0] for p in proj.names] == ["en", "zh"]
    assert proj.lens.tolist() == [len(drafts["en"]), len(drafts["zh"])]
    assert proj.weight is models["tables"].lm_head.weight  # the target's head, bound later
    assert torch.equal(proj.script_classes, SCRIPTS)
    assert models["plain"].draft_projection is None
    # the projection is not a parameter owner: the model's state is the draft's alone
    assert set(dict(models["tables"].named_parameters())) == set(dict(models["plain"].named_parameters()))


def test_vocab_env_full_turns_tables_off(sgl, drafts, monkeypatch):
    monkeypatch.setenv("FASTMTP_SGLANG_VOCAB", "full")
    model = sgl.fastmtp.FastMTPForCausalLM(sglang_config(drafts["tables"]))
    model.load_weights(weights_of(sgl, drafts["tables"]))
    assert model.draft_projection is None


def test_vocab_env_names_the_tables(sgl, drafts, monkeypatch):
    """FASTMTP_SGLANG_VOCAB: auto = the draft's tables; table files replace them (also for a
    draft that lists none)."""
    zh = sorted((drafts["tables"] / "vocab").glob("zh-*.pt"))[0]
    for key, spec, langs in (("tables", "auto", ["en", "zh"]), ("tables", str(zh), ["zh"]),
                             ("plain", str(zh), ["zh"])):
        monkeypatch.setenv("FASTMTP_SGLANG_VOCAB", spec)
        model = sgl.fastmtp.FastMTPForCausalLM(sglang_config(drafts[key]))
        model.load_weights(weights_of(sgl, drafts[key]))
        assert [n.split("-")[0] for n in model.draft_projection.names] == langs


# --------------------------------------------------------------------------------------------
# through SGLang's LogitsProcessor
# --------------------------------------------------------------------------------------------

def test_extend_then_decode_per_request_tables(sgl, models, drafts):
    """Request 0 is English, request 1 Chinese, in one batch: EXTEND picks en / zh, DECODE
    keeps them (even fed tokens of the other script), a later EXTEND on the cached prefix adds
    to the counts, and a new request in the slot starts over."""
    full_m, comp_m = models["plain"], models["tables"]
    en, zh = drafts["en"], drafts["zh"]
    g = torch.Generator().manual_seed(7)
    full_kv, comp_kv = KVHarness(sgl, full_m), KVHarness(sgl, comp_m)

    def both(ids, hidden, decode=False):
        with torch.no_grad():
            full, _ = full_kv.run(ids, hidden, decode=decode)
            comp, _ = comp_kv.run(ids, hidden, decode=decode)
        torch.testing.assert_close(comp.hidden_states, full.hidden_states)
        assert comp.next_token_logits.shape == full.next_token_logits.shape == (len(ids), V)
        return full.next_token_logits, comp.next_token_logits

    # 1. EXTEND: a Latin prompt and a CJK prompt
    ids = [pick(LATIN_IDS, 6, 1), pick(CJK_IDS, 5, 2)]
    full, comp = both(ids, torch.randn(11, 64, generator=g))
    assert_table_row(comp[0], full[0], en)
    assert_table_row(comp[1], full[1], zh)
    assert comp_m.draft_projection.slot_table[1:3].tolist() == [0, 1]

    # 2. DECODE (twice), tokens of the other script: the tables stay
    for step in range(2):
        ids = [pick(CJK_IDS, 1, 10 + step), pick(LATIN_IDS, 1, 20 + step)]
        full, comp = both(ids, torch.randn(2, 64, generator=g), decode=True)
        assert_table_row(comp[0], full[0], en)
        assert_table_row(comp[1], full[1], zh)

    # 3. EXTEND on the cached prefix: counts add up (6 Latin + 2 CJK stays en; 5 CJK + 3 Latin
    #    stays zh: 5 > 0.3 * 8)
    ids = [pick(CJK_IDS, 2, 30), pick(LATIN_IDS, 3, 31)]
    full, comp = both(ids, torch.randn(5, 64, generator=g))
    assert_table_row(comp[0], full[0], en)
    assert_table_row(comp[1], full[1], zh)

    # 4. new requests in the same slots (prefix 0): the counts start over, languages swapped
    full_kv, comp_kv = KVHarness(sgl, full_m), KVHarness(sgl, comp_m)
    ids = [pick(CJK_IDS, 4, 40), pick(LATIN_IDS, 7, 41)]
    full, comp = both(ids, torch.randn(11, 64, generator=g))
    assert_table_row(comp[0], full[0], zh)
    assert_table_row(comp[1], full[1], en)


def test_argmax_is_compressed_head_top_id(sgl, models, drafts):
    model = models["tables"]
    proj = model.draft_projection
    g = torch.Generator().manual_seed(8)
    ids = [pick(LATIN_IDS, 4, 3), pick(CJK_IDS, 6, 4), pick(LATIN_IDS, 3, 5)]
    with torch.no_grad():
        out, _ = KVHarness(sgl, model, n_reqs=3).run(ids, torch.randn(13, 64, generator=g))
    last = out.hidden_states[torch.tensor([3, 9, 12])]  # FULL capture: every token's hidden state
    idx = torch.tensor([0, 1, 0])
    top_id, _, _ = compressed_head(last, model.lm_head.weight, proj.global_tables, proj.global_lens, idx)
    assert torch.equal(out.next_token_logits.argmax(dim=1), top_id)
    assert all(t in set(drafts["en" if i != 1 else "zh"].tolist()) for i, t in enumerate(top_id.tolist()))


def test_no_tables_is_the_full_head_as_before(sgl, models, drafts, llama_target):
    """The plain draft (no tables) and the tables draft with its projection removed give the
    same logits, bit for bit; and they equal the full matmul of the hidden state."""
    g = torch.Generator().manual_seed(9)
    ids, hidden = [pick(LATIN_IDS, 5, 6), pick(CJK_IDS, 3, 7)], torch.randn(8, 64, generator=g)
    off = build(sgl, drafts["tables"], llama_target)
    off.set_draft_projection(None)
    with torch.no_grad():
        a, _ = KVHarness(sgl, models["plain"]).run(ids, hidden)
        b, _ = KVHarness(sgl, off).run(ids, hidden)
    assert torch.equal(a.next_token_logits, b.next_token_logits)
    assert torch.isfinite(a.next_token_logits).all()
    last = a.hidden_states[torch.tensor([4, 7])]
    torch.testing.assert_close(a.next_token_logits, last @ models["plain"].lm_head.weight.T)


def test_token_map_replaces_the_tables(sgl, drafts, llama_target):
    """SGLang's --speculative-token-map (a truncated head through set_embed_and_head) wins over
    the draft's tables: logits [N, len(map)], equal to the full logits at the mapped ids."""
    model = build(sgl, drafts["tables"], llama_target)
    assert model.draft_projection is not None
    embed, head_w = model.get_embed_and_head()
    hot = torch.tensor([3, 17, 250, 5, 99])
    g = torch.Generator().manual_seed(10)
    ids, hidden = [pick(LATIN_IDS, 4, 8)], torch.randn(4, 64, generator=g)
    full_model = build(sgl, drafts["plain"], llama_target)
    with torch.no_grad():
        full, _ = KVHarness(sgl, full_model, n_reqs=1).run(ids, hidden)
        model.set_embed_and_head(embed, head_w[hot])
        small, _ = KVHarness(sgl, model, n_reqs=1).run(ids, hidden)
    assert model.draft_projection is None
    assert small.next_token_logits.shape == (1, 5)
    torch.testing.assert_close(small.next_token_logits, full.next_token_logits[:, hot])


# --------------------------------------------------------------------------------------------
# the projection on its own: slot state, row layouts, TP shards, tokenizer checks
# --------------------------------------------------------------------------------------------

def _extend_batch(sgl, slots, seqs, prefix, rids=None):
    return SimpleNamespace(
        forward_mode=sgl.ForwardMode.EXTEND, req_pool_indices=torch.tensor(slots),
        extend_seq_lens=torch.tensor([len(s) for s in seqs]), extend_prefix_lens=torch.tensor(prefix),
        rids=rids), torch.cat(seqs)


def test_slot_restarts_for_a_new_request_id(sgl, models):
    """A radix-cache hit gives a new request a prefix > 0: the request id tells it apart."""
    proj = sgl.cp.CompressedProjection(models["tables"].draft_projection.table_set,
                                       models["tables"].lm_head, script_classes=SCRIPTS, capacity=8)
    fb, ids = _extend_batch(sgl, [3, 5], [pick(LATIN_IDS, 6, 1), pick(CJK_IDS, 6, 2)], [0, 0], ["a", "b"])
    proj.prepare(ids, fb)
    assert proj.row_table.tolist() == [0, 1]
    # same request "a", a cached prefix, a few CJK tokens: counts add up, still en
    fb, ids = _extend_batch(sgl, [3], [pick(CJK_IDS, 2, 3)], [6], ["a"])
    proj.prepare(ids, fb)
    assert proj.row_table.tolist() == [0] and proj.slot_counts[3, SCRIPT_CJK] == 2
    # a new request "c" in slot 3 with a prefix hit: starts over, zh
    fb, ids = _extend_batch(sgl, [3], [pick(CJK_IDS, 2, 4)], [6], ["c"])
    proj.prepare(ids, fb)
    assert proj.row_table.tolist() == [1] and proj.slot_counts[3].tolist()[SCRIPT_LATIN] == 0
    # slots beyond the capacity wrap around instead of indexing out of range
    assert proj.slots_of(torch.tensor([11])).tolist() == [3]
    # padding tokens past sum(extend_seq_lens) are not counted
    fb, ids = _extend_batch(sgl, [5], [pick(LATIN_IDS, 3, 5)], [0], ["d"])
    proj.prepare(torch.cat([ids, pick(CJK_IDS, 4, 6)]), fb)
    assert proj.slot_counts[5].tolist()[SCRIPT_CJK] == 0 and proj.row_table.tolist() == [0]


def test_table_log_names_each_requests_table(sgl, models, monkeypatch, caplog):
    """FASTMTP_SGLANG_LOG_TABLES=1 logs the table each request drafts with (the GPU check reads
    it); off by default, since it costs a host sync per EXTEND."""
    tables = models["tables"].draft_projection.table_set
    fb, ids = _extend_batch(sgl, [1, 2], [pick(LATIN_IDS, 6, 7), pick(CJK_IDS, 6, 8)], [0, 0], ["en-1", "zh-1"])
    with caplog.at_level("INFO", logger=sgl.cp.__name__):
        sgl.cp.CompressedProjection(tables, models["tables"].lm_head, script_classes=SCRIPTS,
                                    capacity=8).prepare(ids, fb)
    assert "drafts with table" not in caplog.text
    monkeypatch.setenv(sgl.cp.LOG_TABLES_ENV, "1")
    with caplog.at_level("INFO", logger=sgl.cp.__name__):
        sgl.cp.CompressedProjection(tables, models["tables"].lm_head, script_classes=SCRIPTS,
                                    capacity=8).prepare(ids, fb)
    assert f"request en-1 drafts with table {tables.names[0]}" in caplog.text
    assert f"request zh-1 drafts with table {tables.names[1]}" in caplog.text


def test_row_layouts(sgl, models):
    """One row per request; k rows per request (topk k, eager draft extend); anything else
    (an EXTEND with input logprobs) falls back to the full head."""
    proj = models["tables"].draft_projection
    w = proj.weight
    proj.row_table = torch.tensor([1, 0])
    h = torch.randn(6, w.shape[1])
    out = proj.project(h)  # 3 rows per request
    for r in range(6):
        expect = proj.global_tables[[1, 0][r // 3], : int(proj.global_lens[[1, 0][r // 3]])]
        assert support(out[r]) == set(expect.tolist())
    before = proj.full_fallbacks
    out = proj.project(h[:5])
    assert proj.full_fallbacks == before + 1
    torch.testing.assert_close(out, h[:5] @ w.T)
    assert proj.project(h[:0]).shape == (0, V)


@pytest.mark.parametrize("tp, vocab", [(2, 320), (4, 320), (2, 300)])
def test_tp_shards_assemble_the_unsharded_row(sgl, models, tp, vocab):
    """Each rank keeps the table ids of its own ParallelLMHead shard (SGLang's own shard
    arithmetic), scores them on its slice of the head, and writes -inf elsewhere in its
    [N, V/tp] block; the blocks concatenated (SGLang's all-gather) and cut to the vocabulary
    equal the unsharded row. Each id is computed on exactly one rank."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, pad_vocab_size

    table_set = models["tables"].draft_projection.table_set
    g = torch.Generator().manual_seed(tp * 1000 + vocab)
    padded = pad_vocab_size(vocab, 64)
    weight = torch.randn(padded, 64, generator=g)
    weight[vocab:] = 0  # padding rows
    hidden = torch.randn(5, 64, generator=g)
    idx = torch.tensor([0, 1, 1, 0, 1])

    whole = sgl.cp.CompressedProjection(table_set, SimpleNamespace(weight=weight[:vocab]),
                                        shard=sgl.cp.ShardRange.full(vocab))
    ref = whole.project(hidden, idx)
    per = padded // tp
    blocks, n_ids = [], 0
    for rank in range(tp):
        si = ParallelLMHead._get_indices(padded, padded, vocab, vocab, rank, tp)
        head = SimpleNamespace(weight=weight[rank * per:(rank + 1) * per], shard_indices=si,
                               num_embeddings_per_partition=per)
        proj = sgl.cp.CompressedProjection(table_set, head)
        assert (proj.shard.org_start, proj.shard.width) == (rank * per, per)
        n_ids += int(proj.lens.sum())
        blocks.append(proj.project(hidden, idx))
        assert blocks[-1].shape == (5, per)
    assert n_ids == int(whole.lens.sum())  # ids past a 300-token vocabulary are dropped everywhere
    assembled = torch.cat(blocks, dim=1)[:, :vocab]
    assert torch.equal(torch.isinf(assembled), torch.isinf(ref))  # the same ids, once each
    torch.testing.assert_close(assembled, ref, rtol=1e-5, atol=1e-5)  # other matmul shapes
    # and the real (tp = 1) ParallelLMHead is one unsharded range
    assert models["tables"].draft_projection.shard == sgl.cp.ShardRange.full(V)


def test_tables_are_checked_against_the_tokenizer(sgl, tmp_path, models):
    """With the target's tokenizer, a table built for another tokenizer is refused, and the
    script classes come from the tokenizer's own tokens."""
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def word_tokenizer(words):
        tk = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")

    tok = word_tokenizer(["the", "cat", "sat", "你", "好"])
    other = word_tokenizer(["the", "dog", "sat", "你", "好"])
    lm_head = models["tables"].lm_head
    en = save_table(tmp_path, torch.tensor([1, 2, 3, 0]), {"lang": "en", "tokenizer": tokenizer_identity(tok)})
    zh = save_table(tmp_path, torch.tensor([4, 5, 0]), {"lang": "zh", "tokenizer": tokenizer_identity(tok)})
    proj = sgl.cp.build_projection([en.name, zh.name], lm_head, base_dir=tmp_path, tokenizer=tok)
    assert proj.script_classes.tolist() == [SCRIPT_NEUTRAL, SCRIPT_LATIN, SCRIPT_LATIN, SCRIPT_LATIN,
                                            SCRIPT_CJK, SCRIPT_CJK]
    with pytest.raises(MismatchError, match="built for tokenizer"):
        sgl.cp.build_projection([en.name, zh.name], lm_head, base_dir=tmp_path, tokenizer=other)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA-graph capture, Triton kernel)")
def test_decode_projection_in_a_cuda_graph(sgl, models):
    """DECODE's table selection and the compressed head captured in one CUDA graph: replays follow
    the request slots and the tables an eager EXTEND picks later, with no host sync."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(V, 64, generator=g).to(dev, torch.bfloat16)
    proj = sgl.cp.CompressedProjection(models["tables"].draft_projection.table_set,
                                       SimpleNamespace(weight=weight), script_classes=SCRIPTS, capacity=64)
    fb, ids = _extend_batch(sgl, [1, 2], [pick(LATIN_IDS, 6, 1), pick(CJK_IDS, 6, 2)], [0, 0], ["a", "b"])
    fb.req_pool_indices, fb.extend_seq_lens, fb.extend_prefix_lens = (
        t.to(dev) for t in (fb.req_pool_indices, fb.extend_seq_lens, fb.extend_prefix_lens))
    proj.prepare(ids.to(dev), fb)
    decode = SimpleNamespace(forward_mode=sgl.ForwardMode.DECODE,
                             req_pool_indices=torch.tensor([1, 2, 0, 0], device=dev))
    hidden = torch.randn(4, 64, generator=g).to(dev, torch.bfloat16)

    def step():
        proj.prepare(decode.req_pool_indices, decode)
        return proj.project(hidden)

    eager = step()  # compiles the Triton kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            static_out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.testing.assert_close(static_out, eager)
    en_ids = proj.global_tables[0, : int(proj.global_lens[0])].cpu()
    zh_ids = proj.global_tables[1, : int(proj.global_lens[1])].cpu()
    assert support(static_out[0].float().cpu()) == set(en_ids.tolist())
    assert support(static_out[1].float().cpu()) == set(zh_ids.tolist())
    # swap the requests' slots in the static input, and re-pick slot 1 by a new request: replay follows
    fb, ids = _extend_batch(sgl, [1], [pick(CJK_IDS, 5, 3)], [0], ["c"])
    fb.req_pool_indices, fb.extend_seq_lens, fb.extend_prefix_lens = (
        t.to(dev) for t in (fb.req_pool_indices, fb.extend_seq_lens, fb.extend_prefix_lens))
    proj.prepare(ids.to(dev), fb)
    decode.req_pool_indices.copy_(torch.tensor([2, 1, 0, 0], device=dev))
    graph.replay()
    assert support(static_out[0].float().cpu()) == set(zh_ids.tolist())
    assert support(static_out[1].float().cpu()) == set(zh_ids.tolist())
    torch.testing.assert_close(static_out, step())


# --------------------------------------------------------------------------------------------
# fastmtp serve --engine sglang --vocab ...: the choice reaches the scheduler processes
# --------------------------------------------------------------------------------------------

def test_launch_passes_the_vocab_choice(drafts, tmp_path, monkeypatch):
    from fastmtp_sglang.core.errors import FastMTPError
    from fastmtp_sglang.serving.sglang_launch import VOCAB_ENV, build_launch_command

    def env_of(vocab):
        return build_launch_command("T", drafts["tables"], 3, 30000, "127.0.0.1", [], vocab=vocab)[1]

    assert VOCAB_ENV == "FASTMTP_SGLANG_VOCAB"
    assert VOCAB_ENV not in env_of(None)  # the draft's own tables (or the full vocabulary)
    assert env_of("full")[VOCAB_ENV] == env_of("none")[VOCAB_ENV] == "full"
    assert env_of("auto")[VOCAB_ENV] == "auto"
    en = sorted((drafts["tables"] / "vocab").glob("en-*.pt"))[0]
    monkeypatch.chdir(en.parent)
    assert env_of(f"{en.name}, builtin:qwen2/zh-16384")[VOCAB_ENV] == f"{en.resolve()},builtin:qwen2/zh-16384"
    with pytest.raises(FastMTPError, match="does not exist"):
        env_of("missing-1.pt")
    with pytest.raises(FastMTPError, match="compressed"):
        build_launch_command("T", None, 0, 30000, "127.0.0.1", [], vocab="auto")
    assert build_launch_command("T", None, 0, 30000, "127.0.0.1", [], vocab="full")[1] == {}
