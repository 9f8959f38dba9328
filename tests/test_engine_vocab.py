"""The reference engine drafting over a compressed, per-request vocabulary: greedy output is
unchanged, sampling stays lossless with q supported on the table, each request uses its own table."""

from __future__ import annotations

import pytest
import torch

from fastmtp_sglang.vocab.draft_vocab import DraftVocab
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.vocab.language import SCRIPT_CJK, SCRIPT_LATIN
from fastmtp_sglang.vocab.tables import TableSet
from test_engine import PROMPTS, greedy_reference, random_head, successor_world, tiny_target


def make_vocab(target, tables: list[list[int]], langs: list[str], cjk_ids=(), extra="none") -> DraftVocab:
    s_max = max(len(t) for t in tables)
    padded = torch.full((len(tables), s_max), -1, dtype=torch.long)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t)
    lang_to_table = {}
    for i, lang in enumerate(langs):
        lang_to_table.setdefault(lang, i)
    ts = TableSet(padded, torch.tensor([len(t) for t in tables]), langs,
                  [f"{l}-{len(t)}" for l, t in zip(langs, tables)], lang_to_table)
    v = target.lm_head.weight.shape[0]
    classes = torch.full((v,), SCRIPT_LATIN, dtype=torch.int8)
    classes[list(cjk_ids)] = SCRIPT_CJK
    w = target.lm_head.weight
    return DraftVocab(ts, w, ts.gather_weight(w), classes, extra)


class Recorder(DraftVocab):
    """Keeps every greedy draft with the table it was drafted from."""

    seen: list

    def greedy(self, hidden, idx, extra):
        top = super().greedy(hidden, idx, extra)
        self.seen.append((top.clone(), idx.clone()))
        return top


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_output_unchanged_with_compressed_vocab(steps):
    t = tiny_target("llama")
    head = random_head(t, "deepseek")
    vocab = make_vocab(t, [list(range(0, 97, 2)), list(range(1, 97, 3))], ["en", "zh"], cjk_ids=[3, 4])
    res = ReferenceEngine(t, head, steps, draft_vocab=vocab).generate(
        [Request(p, SamplingParams(max_new_tokens=20)) for p in PROMPTS])
    assert [r.output_ids for r in res] == [greedy_reference(t, p, 20) for p in PROMPTS]


def test_each_request_drafts_from_its_own_table():
    t, head = successor_world()
    en = list(range(0, 50))
    zh = list(range(50, 97))
    base = make_vocab(t, [en, zh], ["en", "zh"], cjk_ids=list(range(60, 70)))
    vocab = Recorder(base.tables, base.weight, base.table_weight, base.script_classes)
    vocab.seen = []
    prompts = [[10, 11], [61, 62, 63], [20]]  # CJK-class tokens -> the zh table
    res = ReferenceEngine(t, head, 2, draft_vocab=vocab).generate(
        [Request(p, SamplingParams(max_new_tokens=12)) for p in prompts])
    assert vocab.seen
    for top, idx in vocab.seen:
        for tok, table in zip(top.tolist(), idx.tolist()):
            assert tok in (en if table == 0 else zh)
    # the zh row's drafts are all in its table: the perfect drafter keeps tau = K + 1 there
    s = res[1].metrics.summary()
    assert s["tau"] == 3.0
    # en rows: successors cross 49 -> 50 within 12 tokens for row 2? no: 20..32 stays in en
    assert res[2].metrics.summary()["tau"] == 3.0
    # output is the target's regardless of the table
    assert res[0].output_ids == [(11 + 1 + i) % 97 for i in range(12)]


def test_tokens_outside_the_table_are_never_drafted_but_still_emitted():
    t, head = successor_world()
    table = [i for i in range(97) if i % 5 != 0]  # successors that are multiples of 5 are missing
    vocab = make_vocab(t, [table], ["en"])
    r = ReferenceEngine(t, head, 3, draft_vocab=vocab).generate(
        [Request([1], SamplingParams(max_new_tokens=30))])[0]
    assert r.output_ids == [(2 + i) % 97 for i in range(30)]  # verification restores them
    assert r.metrics.summary()["tau"] < 4.0  # ... at the cost of acceptance


def test_prompt_tokens_join_the_table():
    t, head = successor_world()
    table = [i for i in range(97) if i % 5 != 0]
    plain = make_vocab(t, [table], ["en"])
    with_prompt = make_vocab(t, [table], ["en"], extra="prompt")
    prompt = [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 1]  # the missing successors, in the prompt
    kw = dict(max_new_tokens=40)
    a = ReferenceEngine(t, head, 3, draft_vocab=plain).generate([Request(prompt, SamplingParams(**kw))])[0]
    b = ReferenceEngine(t, head, 3, draft_vocab=with_prompt).generate([Request(prompt, SamplingParams(**kw))])[0]
    assert a.output_ids == b.output_ids
    assert b.metrics.summary()["tau"] > a.metrics.summary()["tau"]


def test_sampling_with_compressed_q_is_lossless():
    """q lives on a strict subset of p's support: emitted tokens still follow the target."""
    v = 12
    t = tiny_target("llama", seed=5, vocab=v)
    head = random_head(t, "deepseek", seed=9)
    with torch.no_grad():
        head.final_norm.weight.mul_(4.0)
    vocab = make_vocab(t, [[0, 2, 3, 5, 7]], ["en"])
    prompt = [4, 9, 2]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        p1 = torch.softmax(t.model(ids).logits[0, -1].float(), -1)
        both = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], dim=1)
        want = p1 @ torch.softmax(t.model(both).logits[:, -1].float(), -1)
    n = 4000
    res = ReferenceEngine(t, head, 2, max_context=16, draft_vocab=vocab).generate(
        [Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=3 + i)) for i in range(n)])
    emp = torch.bincount(torch.tensor([r.output_ids[1] for r in res]), minlength=v).float() / n
    tv = 0.5 * (emp - want).abs().sum().item()
    assert tv < 0.05, f"total variation {tv:.3f}"
    # tokens outside the table are emitted too (through the residual), at their target rate
    outside = [i for i in range(v) if i not in (0, 2, 3, 5, 7)]
    assert emp[outside].sum().item() == pytest.approx(want[outside].sum().item(), abs=0.04)


@pytest.mark.parametrize("rows,extra", [(1, False), (2, False), (1, True)])
def test_sampled_draft_draws_from_the_full_width_softmax(rows, extra):
    """A sampled draft step works on the table's slots only (batch 1 on CPU: one product with the
    table's rows); its q must equal the softmax of the full-width logits (-inf outside the table),
    and its tokens must follow q."""
    from fastmtp_sglang.decode.batch import Batch
    from fastmtp_sglang.decode.sampling import logits_to_probs

    t = tiny_target("llama", seed=12)
    head = random_head(t, "deepseek", seed=13)
    vocab = make_vocab(t, [list(range(0, 97, 2)), list(range(5, 90))], ["en", "zh"],
                       extra="prompt" if extra else "none")
    eng = ReferenceEngine(t, head, 2, draft_vocab=vocab)
    reqs = [Request([3, 4, 5], SamplingParams(temperature=0.7, seed=i)) for i in range(rows)]
    b = Batch(eng, reqs, list(range(rows)))
    b.tidx = torch.tensor([1, 0][:rows])
    b.extra = torch.tensor([[3, 99, 99, -1, 100]] * rows) if extra else None
    g = torch.randn(rows, t.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(1)) * 3
    want = logits_to_probs(vocab.logits(g, b.tidx, b.extra), 0.7, 1.0, -1)        # [rows, V]
    n = 3000
    counts = torch.zeros_like(want)
    for _ in range(n):
        toks, q = b.draft_pick(g)
        counts[torch.arange(rows), toks] += 1
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-6)
    assert (want[torch.arange(rows), toks] > 0).all()
    tv = 0.5 * (counts / n - want).abs().sum(-1)
    assert (tv < 0.06).all(), tv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_greedy_takes_the_first_of_tied_maxima(dtype):
    """The one-row CPU path of DraftVocab.greedy (one product and a max) picks what the general
    path (compressed_head) picks, the first maximum of the table's slots, also where the table
    holds tied rows."""
    t = tiny_target("llama", seed=2)
    with torch.no_grad():
        w = t.model.lm_head.weight
        w[7].copy_(w[3])  # tokens 3 and 7 tie everywhere
        w[11].copy_(w[3])
    t.model.to(dtype)
    tables = [[5, 7, 3, 11, 20, 21], [11, 3, 7, 0, 1]]
    vocab = make_vocab(t, tables, ["en", "zh"])
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(20):
            h = torch.randn(1, 64, generator=g).to(dtype)
            for i in range(2):
                idx = torch.tensor([i])
                one = vocab.greedy(h, idx, None)
                two = vocab.greedy(torch.cat([h, h]), torch.cat([idx, idx]), None)  # the general path
                assert int(one[0]) == int(two[0])
        # where 3/7/11 win, the first of them in the table's order is taken
        h = w[3].to(dtype)[None] * 50
        assert int(vocab.greedy(h, torch.tensor([0]), None)[0]) == 7
        assert int(vocab.greedy(h, torch.tensor([1]), None)[0]) == 11
