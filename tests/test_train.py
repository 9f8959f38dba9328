"""`fastmtp train`: the training path reproduces serving, and the trainer's bookkeeping is exact.

- train-as-you-serve: the head's step-k outputs (hidden and logits) at anchor j from the training
  path equal those of running the head the way the reference engine does (draft extend over
  0..j in a HeadKVCache, then steps 2..K at positions j+k-1), in fp32, padded batch included;
  training-time tau's cycle walk equals the reference engine's served cycles on greedy text;
- loss weights; chunked (checkpointed) loss == unchunked loss, value and gradients; response-only
  mask; compressed vocabulary; resume == uninterrupted run, bit for bit; vanilla mode trains step 1
  only; a few steps on a repetitive toy set lower the loss and raise tau; the CLI end to end.

Tiny random Llama target (hidden 32-64, vocab 61-97), CPU, fp32.
Run: .venv/bin/pytest tests/test_train.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastmtp_sglang.core.draft_dir import load_draft_dir, load_head, make_draft_config, save_draft_dir
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.head import FastMTPHead, HeadConfig
from fastmtp_sglang.decode.sampling import SamplingParams
from fastmtp_sglang.core.target import Target
from fastmtp_sglang.training.checkpoints import load_trainer_state
from fastmtp_sglang.training.config import TrainConfig, divergence, step_weights
from fastmtp_sglang.training.data import Batch, collate, load_examples
from fastmtp_sglang.training.objective import (Projection, acceptance, anchors, at, batch_loss,
                                               serve_mask, unroll)
from fastmtp_sglang.training.train import train

K = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices gain nothing from threads; on a shared 2-core machine, intra-op threads made
    this file about 10x slower (measured: 6.5 s vs 0.75 s for one 12-step training run)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def tiny_target(vocab: int = 97, hidden: int = 64, layers: int = 2, seed: int = 0,
                lm_scale: float = 1.0) -> Target:
    """``lm_scale`` sharpens the target's distributions (argmax unchanged): with transformers'
    init (std 0.02) a tiny model's logits are nearly flat, and CE could hardly fall."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=layers, vocab_size=vocab,
                      max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_scale)
    return Target(model, None, model.config.to_dict(), "tiny")


def random_head(target: Target, layout: str = "mimo", seed: int = 1) -> FastMTPHead:
    """Random weights everywhere (norms too), scaled so attention is far from uniform."""
    cfg = HeadConfig.from_dict(make_draft_config(target.config, layout, dtype="float32"))
    head = FastMTPHead(cfg, target.embed, target.lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return head.eval()


def target_hidden(target: Target, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return target.model.model(input_ids=ids).last_hidden_state


def served_steps(head: FastMTPHead, hidden: torch.Tensor, ids: torch.Tensor, j: int, steps: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the reference engine computes for anchor j: draft extend over positions 0..j with
    (h_i, x_{i+1}), then step k >= 2 with the previous step's output hidden and token x_{j+k} at
    position j+k-1, all through the head's KV cache. [(hidden [H], logits [V]) per step]."""
    return _served_steps(head, hidden, ids, j, steps)


@torch.no_grad()
def _served_steps(head, hidden, ids, j, steps):
    cache = head.new_cache(1, ids.shape[1] + steps + 2)
    pos = torch.arange(j + 1)[None]
    g, lg = head(hidden[:, : j + 1], ids[:, 1: j + 2], pos, cache)
    out = [(g[0, j], lg[0, j])]
    g = g[:, j:j + 1]
    for k in range(2, steps + 1):
        g, lg = head(g, ids[:, j + k: j + k + 1], torch.tensor([[j + k - 1]]), cache)
        out.append((g[0, 0], lg[0, 0]))
    return out


# ------------------------------------------------------------------------------------------------
# (a) train-as-you-serve equivalence
# ------------------------------------------------------------------------------------------------

def test_serve_mask_pattern():
    m = serve_mask(4, 3)
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))


@pytest.mark.parametrize("layout", ["mimo", "split"])
def test_training_path_equals_serving_path(layout):
    target = tiny_target()
    head = random_head(target, layout)
    g = torch.Generator().manual_seed(7)
    T = 13
    ids = torch.randint(0, 97, (1, T), generator=g)
    hidden = target_hidden(target, ids)
    with torch.no_grad():
        gs = unroll(head, hidden, ids, K, "serve")
        paper = unroll(head, hidden, ids, K, "fastmtp")
    worst = 0.0
    for j in (0, 1, 4, 8, T - 1 - K):
        served = served_steps(head, hidden, ids, j, K)
        for k, (h_serve, l_serve) in enumerate(served, start=1):
            h_train = gs[k - 1][0, j]
            with torch.no_grad():
                l_train = head.project(h_train)
            torch.testing.assert_close(h_train, h_serve, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"hidden, anchor {j} step {k}: {m}")
            torch.testing.assert_close(l_train, l_serve, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"logits, anchor {j} step {k}: {m}")
            if k >= 2 and j >= 1:  # FastMTP's own pattern is a different computation
                worst = max(worst, float((paper[k - 1][0, j] - h_serve).abs().max()))
    assert worst > 1e-2


def test_training_path_padded_batch_equals_single():
    """Right padding in a batch changes nothing at a sequence's real anchors."""
    target = tiny_target()
    head = random_head(target)
    g = torch.Generator().manual_seed(8)
    long, short = torch.randint(0, 97, (1, 14), generator=g), torch.randint(0, 97, (1, 9), generator=g)
    ids = torch.zeros(2, 14, dtype=torch.long)
    ids[0], ids[1, :9] = long[0], short[0]
    hidden = torch.zeros(2, 14, 64)
    hidden[0], hidden[1, :9] = target_hidden(target, long)[0], target_hidden(target, short)[0]
    with torch.no_grad():
        batched = unroll(head, hidden, ids, K, "serve")
        alone = unroll(head, hidden[1:, :9], short, K, "serve")
    for k in range(K):
        valid = 9 - (k + 1)  # anchors whose step-k input token exists
        torch.testing.assert_close(batched[k][1, :valid], alone[k][0, :valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["mimo", "split"])
def test_anchor_subset_equals_every_position(layout):
    """Training computes only the anchors a scored target needs (step 1 still adds every
    position's keys): outputs and gradients equal the all-positions unroll at those anchors,
    rows of different prompt lengths and padding included. In fp64: the two sum in other orders,
    and fp32 gradients near cancellation differ by its rounding alone."""
    target = tiny_target()
    head = random_head(target, layout).train().double()
    batch = toy_batch(target, lengths=(14, 9, 12), prompt_lens=(9, 2, 5))
    batch.hidden = batch.hidden.double()
    idx, valid = anchors(batch.prompt_lens, batch.lengths, K, batch.input_ids.shape[1])
    assert idx[:, 0].tolist() == [5, 0, 1] and valid.sum(1).tolist() == [9, 9, 11]
    w = torch.randn(64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run(index):
        head.zero_grad(set_to_none=True)
        gs = unroll(head, batch.hidden, batch.input_ids, K, "serve", index)
        outs = [at(g, None if index is not None else idx)[valid] for g in gs]
        sum(((o @ w) ** 2).sum() for o in outs).backward()
        return [o.detach() for o in outs], {n: p.grad.clone() for n, p in head.named_parameters()}

    full, full_grads = run(None)
    sub, sub_grads = run(idx)
    for k in range(K):
        torch.testing.assert_close(sub[k], full[k], atol=1e-10, rtol=1e-10)
    for name, grad in full_grads.items():
        torch.testing.assert_close(sub_grads[name], grad, atol=1e-9, rtol=1e-9, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# (b) loss weights, (c) chunked loss, (e) response-only mask, compressed vocabulary
# ------------------------------------------------------------------------------------------------

def test_step_weights():
    w = step_weights(3, 0.6)
    assert [round(x, 2) for x in w] == [0.51, 0.31, 0.18]
    assert sum(w) == pytest.approx(1.0)
    assert step_weights(1, 0.6) == [1.0]
    assert TrainConfig(steps=3, vanilla=True).weights == [1.0]
    assert sum(step_weights(7, 0.3)) == pytest.approx(1.0)


def toy_batch(target: Target, lengths=(11, 8), prompt_lens=(4, 3), seed: int = 9) -> Batch:
    from fastmtp_sglang.training.data import Example

    g = torch.Generator().manual_seed(seed)
    exs = [Example(torch.randint(0, target.config["vocab_size"], (n,), generator=g), p)
           for n, p in zip(lengths, prompt_lens)]
    return collate(exs, [target_hidden(target, e.ids[None])[0] for e in exs], torch.device("cpu"))


def _loss_and_grads(head, batch, proj, kind, chunk, labels=None):
    head.zero_grad(set_to_none=True)
    loss, stats = batch_loss(head, batch, proj, K, step_weights(K, 0.6), kind, "serve", chunk, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters()}, stats


@pytest.mark.parametrize("kind", ["ce", "kl", "ce+kl", "acc", "ce+acc"])
@pytest.mark.parametrize("compressed", [False, True])
def test_chunked_loss_equals_unchunked(kind, compressed):
    target = tiny_target()
    head = random_head(target).train()
    batch = toy_batch(target)
    vocab = torch.randperm(97, generator=torch.Generator().manual_seed(3))[:40] if compressed else None
    proj = Projection(target.lm_head, vocab)
    ref_loss, ref_grads, ref_stats = _loss_and_grads(head, batch, proj, kind, chunk=0)
    for chunk in (1, 5, 64):  # 5: chunks straddle sequence boundaries; 64: one chunk
        loss, grads, stats = _loss_and_grads(head, batch, proj, kind, chunk)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        assert stats["loss"] == pytest.approx(ref_stats["loss"], rel=1e-5, abs=1e-6)
        assert {k: v for k, v in stats.items() if k != "loss"} == {k: v for k, v in ref_stats.items() if k != "loss"}
    if compressed:  # targets outside the table are counted and score as misses
        assert any(n > i for n, i in zip(ref_stats["targets"], ref_stats["in_table"]))


def test_loss_matches_hand_computed_ce():
    """Step k's CE at anchor j is CE(lm_head(g^k_j), x_{j+k+1}) over response targets only."""
    target = tiny_target()
    head = random_head(target)
    batch = toy_batch(target)
    proj = Projection(target.lm_head)
    with torch.no_grad():
        loss, stats = batch_loss(head, batch, proj, K, step_weights(K, 0.6), "ce", "serve", 0)
        gs = unroll(head, batch.hidden, batch.input_ids, K)
    want = 0.0
    for k in range(1, K + 1):
        terms = []
        for b in range(2):
            n, p = int(batch.lengths[b]), int(batch.prompt_lens[b])
            for j in range(n - k - 1):
                if j + k + 1 >= p:
                    lg = head.project(gs[k - 1][b, j])
                    terms.append(torch.nn.functional.cross_entropy(lg[None], batch.input_ids[b, j + k + 1][None]))
        assert stats["targets"][k - 1] == len(terms)
        want += step_weights(K, 0.6)[k - 1] * float(torch.stack(terms).mean().detach())
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_loss_only_on_response_tokens():
    target = tiny_target()
    head = random_head(target)
    batch = toy_batch(target)
    proj = Projection(target.lm_head)
    labels = batch.input_ids.clone()
    prompt = torch.arange(labels.shape[1])[None] < batch.prompt_lens[:, None]
    changed = labels.clone()
    changed[prompt] = (changed[prompt] + 17) % 97
    with torch.no_grad():
        base, _ = batch_loss(head, batch, proj, K, step_weights(K, 0.6), "ce+kl", "serve", 4, labels)
        same, _ = batch_loss(head, batch, proj, K, step_weights(K, 0.6), "ce+kl", "serve", 4, changed)
        assert float(same) == float(base)
        changed[0, int(batch.prompt_lens[0]) + 2] += 1  # a response target does count
        other, _ = batch_loss(head, batch, proj, K, step_weights(K, 0.6), "ce+kl", "serve", 4, changed)
        assert float(other) != float(base)


def test_acceptance_counts():
    # K=3, sequence of 10 tokens, prompt 3: anchors 2..5 have all K targets
    hits = torch.zeros(3, 10, dtype=torch.bool)
    hits[:, 2] = torch.tensor([1, 1, 0])   # anchor 2 accepts 2
    hits[:, 5] = torch.tensor([1, 1, 1])   # anchor 5 accepts 3
    hits[0, 3] = True                      # anchor 3 accepts 1
    hits[1, 4] = True                      # anchor 4: step 2 alone does not count
    per_anchor, walk = acceptance(hits, 3, 10)
    assert per_anchor == [2, 1, 0, 3]
    # walk: anchor 2 accepts 2 -> anchor 5 accepts 3 -> anchor 9 > 10 - 3: done
    assert walk == [2, 3]


# ------------------------------------------------------------------------------------------------
# the trainer: toy self-distilled data (the target's own greedy text, which loops quickly)
# ------------------------------------------------------------------------------------------------

TOY_V, TOY_PROMPT, TOY_NEW = 61, 4, 28


@torch.no_grad()
def greedy(target: Target, prompts: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompts
    for _ in range(n):
        nxt = target.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A tiny target, its greedy continuations of random prompts as distilled data (with a few
    bad lines), and an initial draft directory."""
    root = tmp_path_factory.mktemp("train")
    target = tiny_target(vocab=TOY_V, hidden=32, layers=1, lm_scale=30.0)
    g = torch.Generator().manual_seed(1)
    seqs = greedy(target, torch.randint(0, TOY_V, (20, TOY_PROMPT), generator=g), TOY_NEW)
    rows = [json.dumps({"prompt_ids": s[:TOY_PROMPT].tolist(), "response_ids": s[TOY_PROMPT:].tolist()})
            for s in seqs]
    rows[3:3] = ["{not json", json.dumps({"prompt_ids": [1, 2]}), json.dumps({"prompt_ids": [1, 2],
                 "response_ids": [TOY_V + 5]}), "", json.dumps({"prompt_ids": [1, 2, 3], "response_ids": []})]
    data = root / "data.jsonl"
    data.write_text("\n".join(rows) + "\n")
    head = random_head(target, "deepseek", seed=2)
    with torch.no_grad():  # a calmer start than random_head's: plain init scale
        for name, p in head.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(0.5)
    init = root / "init"
    save_draft_dir(init, make_draft_config(target.config, "deepseek", dtype="float32"), head.state_dict())
    return target, data, init, root, seqs


def small_cfg(**kw) -> TrainConfig:
    base = dict(steps=K, epochs=2, batch_size=4, lr=3e-3, warmup=0.1, max_len=64, ce_chunk=16,
                heldout_fraction=0.2, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_eval_every_scores_the_heldout_rows_in_optimizer_steps(toy):
    target, data, init, root, _ = toy
    # 4 optimizer steps per epoch: scores at steps 3, 6, 9, 12 and at the epochs' ends 4 and 8
    # (12 is both, scored once)
    res = train(small_cfg(epochs=3, eval_every=3), target, data, root / "every", init=init,
                progress=False)
    evals = [r for r in res.log if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [3, 4, 6, 8, 9, 12]
    assert [r["epoch"] for r in evals] == [0.75, 1.0, 1.5, 2.0, 2.25, 3.0]
    assert evals[-1]["tau_train"] == res.last_eval["tau_train"]
    # scoring inside the epoch changes nothing the run computes (same final loss as without)
    plain = train(small_cfg(epochs=3), target, data, root / "plain", init=init, progress=False)
    last = [r for r in res.log if r["event"] == "step"][-1]
    assert last["loss"] == [r for r in plain.log if r["event"] == "step"][-1]["loss"]
    assert plain.last_eval["tau_train"] == res.last_eval["tau_train"]
    with pytest.raises(FastMTPError, match="eval_every"):
        small_cfg(eval_every=-1)


def test_data_loading_counts_bad_lines(toy):
    target, data, *_ = toy
    exs, counts = load_examples(data, None, TOY_V, max_len=64)
    assert counts.used == 20 and len(exs) == 20
    assert counts.bad_json == 1 and counts.bad_fields == 2 and counts.empty_response == 1
    assert counts.blank == 1
    exs, counts = load_examples(data, None, TOY_V, max_len=20, max_sequences=5)
    assert len(exs) == 5 and counts.truncated == 5 and all(len(e.ids) == 20 for e in exs)


def test_training_lowers_loss_and_raises_tau(toy):
    target, data, init, root, _ = toy
    res = train(small_cfg(epochs=3), target, data, root / "fast", init=init, progress=False)
    steps = [r for r in res.log if r["event"] == "step"]
    evals = [r for r in res.log if r["event"] == "eval"]
    assert len(steps) == res.global_step == 12 and len(evals) == 3
    first, last = steps[0], steps[-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert all(b < a for a, b in zip(first["loss_k"], last["loss_k"]))
    # the untrained head's held-out tau, scored the same way
    before = train(small_cfg(epochs=1, lr=1e-12), target, data, root / "untrained", init=init,
                   progress=False).last_eval
    after = res.last_eval
    assert after["tau_train"] > before["tau_train"] + 0.5, (before, after)
    assert after["tau_walk"] > before["tau_walk"]
    # the output is a loadable draft directory that records how it was trained
    d = load_draft_dir(root / "fast")
    meta = d.meta
    assert meta["trained_steps"] == K
    assert meta["step_weights"] == pytest.approx([0.510204, 0.306122, 0.183673])
    tr = meta["training"]
    assert tr["finished"] and tr["mode"] == "fastmtp" and tr["attention"] == "serve"
    assert tr["tau_train"] == pytest.approx(after["tau_train"])
    assert tr["data_counts"]["bad_json"] == 1 and tr["sequences_heldout"] == 4
    assert (root / "fast" / "trainer_state.pt").is_file()
    log = [json.loads(x) for x in (root / "fast" / "train_log.jsonl").read_text().splitlines()]
    assert [r["event"] for r in log].count("step") == 12
    assert set(d.state_dict) == set(load_head(root / "fast").state_dict())  # no embed / lm_head
    assert not any(p.requires_grad for p in target.model.parameters())  # the target stayed frozen


def test_training_tau_walk_equals_served_tau(toy):
    """On the target's own greedy text, the training-time cycle walk reproduces the reference
    engine's cycles exactly: same accepted counts, hence the same tau."""
    target, data, init, root, _ = toy
    out = root / "walk"
    if not out.exists():
        train(small_cfg(epochs=1, lr=2e-3), target, data, out, init=init, progress=False)
    head = load_head(out, target.embed, target.lm_head)
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, TOY_V, (3, 5), generator=g)
    n_new = 20
    text = greedy(target, prompts, n_new + K + 2)  # ground truth reaching past the last cycle
    eng = ReferenceEngine(target, head, K)
    accepted_any = 0
    from fastmtp_sglang.training.data import Example
    from fastmtp_sglang.training.objective import draft_hits

    for b in range(3):
        served = eng.generate([Request(prompts[b].tolist(), SamplingParams(max_new_tokens=n_new))])[0]
        assert served.output_ids == text[b, 5: 5 + n_new].tolist()
        cycles = [c.accepted for c in served.metrics.cycles]
        ex = Example(text[b], 5)
        batch = collate([ex], [target_hidden(target, text[b:b + 1])[0]], torch.device("cpu"))
        hits = draft_hits(head, batch, Projection(target.lm_head), K)
        _, walk = acceptance(hits[0], ex.prompt_len, len(ex.ids))
        assert walk[: len(cycles)] == cycles
        accepted_any += sum(cycles)
    assert accepted_any > 0  # a non-trivial case: some drafts were accepted


def _state(path: Path) -> dict:
    return load_trainer_state(path)


def test_resume_reproduces_uninterrupted_run(toy):
    target, data, init, root, _ = toy
    cfg = small_cfg(epochs=2, grad_accum=2, batch_size=2)   # 16 train rows: 4 steps per epoch
    straight = train(cfg, target, data, root / "straight", init=init, progress=False)
    assert straight.global_step == 8
    half = train(small_cfg(epochs=2, grad_accum=2, batch_size=2, halt_after_steps=3), target, data,
                 root / "halves", init=init, progress=False)
    assert half.global_step == 3 and not half.finished
    st = _state(root / "halves")
    assert (st["epoch"], st["batch_in_epoch"]) == (0, 6)  # stopped mid-epoch
    resumed = train(cfg, target, data, root / "halves", resume=root / "halves", progress=False)
    assert resumed.finished and resumed.global_step == 8
    a, b = _state(root / "straight"), _state(root / "halves")
    for name, w in a["head"].items():
        assert torch.equal(w, b["head"][name]), name
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 8
    assert a["last_eval"] == b["last_eval"]
    log = [json.loads(x) for x in (root / "halves" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["event"] == "step"] == list(range(1, 9))
    # a changed setting is refused, naming it
    with pytest.raises(FastMTPError, match="lr"):
        train(small_cfg(epochs=2, grad_accum=2, batch_size=2, lr=1.0), target, data, root / "halves",
              resume=root / "halves", progress=False)


def test_warm_restart_records_the_lineage(toy, monkeypatch):
    """A head continued from a trained head says which runs made it and their summed steps; a
    resumed continuation keeps that lineage instead of adding itself to it."""
    target, data, init, root, _ = toy
    monkeypatch.chdir(root)  # the "repository" the runs start in: paths recorded relative to it
    first = train(small_cfg(epochs=1), target, data, root / "lin1", init=init, progress=False)
    meta1 = json.loads((root / "lin1" / "config.json").read_text())["fastmtp"]
    assert "lineage" not in meta1  # from an untrained init
    assert meta1["training"]["optimizer_steps_cumulative"] == first.global_step
    second = train(small_cfg(epochs=1, lr=1e-3), target, data, root / "lin2", init=root / "lin1",
                   progress=False)
    meta2 = json.loads((root / "lin2" / "config.json").read_text())["fastmtp"]
    (entry,) = meta2["lineage"]
    assert entry["optimizer_steps"] == first.global_step and entry["lr"] == 3e-3
    assert entry["init"] == "init" and entry["data"] == "data.jsonl"
    assert entry["data_sha256"] == meta1["training"]["data_sha256"]
    assert meta2["training"]["optimizer_steps_cumulative"] == first.global_step + second.global_step
    half = train(small_cfg(epochs=2, halt_after_steps=2), target, data, root / "lin3",
                 init=root / "lin2", progress=False)
    resumed = train(small_cfg(epochs=2), target, data, root / "lin3", resume=root / "lin3",
                    progress=False)
    assert half.global_step == 2 and resumed.finished
    meta3 = json.loads((root / "lin3" / "config.json").read_text())["fastmtp"]
    assert [e["optimizer_steps"] for e in meta3["lineage"]] == [first.global_step, second.global_step]
    assert meta3["training"]["optimizer_steps_cumulative"] == (
        first.global_step + second.global_step + resumed.global_step)


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def test_a_written_lineage_has_no_absolute_path(toy):
    """A head's training record and lineage travel with it (the shipped head's config.json): data
    and init outside the directory the run started in are recorded as None, never as this
    machine's absolute paths; the data's sha256 still identifies them. The log that ships beside
    the weights holds none either."""
    target, data, init, root, _ = toy
    assert not Path.cwd().resolve() in root.resolve().parents  # the toy lives outside the cwd
    train(small_cfg(epochs=1, halt_after_steps=2), target, data, root / "abs1", init=init,
          progress=False)
    train(small_cfg(epochs=1, halt_after_steps=2), target, data, root / "abs2", init=root / "abs1",
          progress=False)
    meta = json.loads((root / "abs2" / "config.json").read_text())["fastmtp"]
    (entry,) = meta["lineage"]
    assert entry["data"] is None and entry["init"] is None and len(entry["data_sha256"]) == 64
    assert meta["training"]["data"] is None and meta["training"]["init"] is None
    log = [json.loads(x) for x in (root / "abs2" / "train_log.jsonl").read_text().splitlines()]
    for text in [*_strings(meta), *(s for rec in log for s in _strings(rec))]:
        assert not Path(text).is_absolute() and str(root) not in text, text


def test_the_shipped_heads_record_no_absolute_path():
    """The committed heads' config.json and train_log.jsonl: repository-relative paths and
    hashes only (their records were written before portable_path; kept clean by hand)."""
    heads = Path(__file__).resolve().parent.parent / "fastmtp_sglang" / "data" / "heads"
    configs = sorted(heads.glob("*/config.json"))
    assert configs
    for cfg in configs:
        records = [json.loads(cfg.read_text())]
        log = cfg.with_name("train_log.jsonl")
        if log.is_file():
            records += [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        for text in (s for rec in records for s in _strings(rec)):
            assert not Path(text).is_absolute(), f"{cfg.parent.name}: {text}"


def test_portable_path(tmp_path):
    from fastmtp_sglang.training.checkpoints import portable_path

    assert portable_path(None) is None
    assert portable_path("runs/x/data.jsonl") == "runs/x/data.jsonl"  # relative: kept
    assert portable_path(tmp_path / "runs" / "d.jsonl", root=tmp_path) == "runs/d.jsonl"
    assert portable_path(tmp_path / "d.jsonl", root=tmp_path / "repo") is None
    assert portable_path("/work/main/runs/init", root=tmp_path) is None


def test_checkpoint_carries_the_init_tables(toy):
    """The tables a head lists by file name travel into every checkpoint, so a trained head serves
    (and benchmarks) from its directory as it is."""
    import shutil
    target, data, init, root, _ = toy
    src = root / "init-with-table"
    shutil.copytree(init, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["fastmtp"]["vocab_tables"] = ["tables/t.pt", "builtin:smollm2/zh-4096"]
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "tables").mkdir()
    (src / "tables" / "t.pt").write_bytes(b"table bytes")
    (src / "tables" / "t.json").write_text('{"size": 3}')
    train(small_cfg(epochs=1), target, data, root / "with-table", init=src, progress=False)
    out = root / "with-table"
    assert (out / "tables" / "t.pt").read_bytes() == b"table bytes"
    assert (out / "tables" / "t.json").read_text() == '{"size": 3}'
    assert json.loads((out / "config.json").read_text())["fastmtp"]["vocab_tables"][0] == "tables/t.pt"


def test_vanilla_trains_step_one_only(toy):
    target, data, init, root, _ = toy
    van = train(small_cfg(epochs=1, vanilla=True), target, data, root / "vanilla", init=init, progress=False)
    one = train(small_cfg(epochs=1, steps=1), target, data, root / "one", init=init, progress=False)
    a, b = _state(root / "vanilla"), _state(root / "one")
    for name, w in a["head"].items():
        assert torch.equal(w, b["head"][name]), name
    steps = [r for r in van.log if r["event"] == "step"]
    assert all(len(r["loss_k"]) == 1 for r in steps)
    assert len(van.last_eval["A_k"]) == K  # still scored as a K-step drafter
    meta = load_draft_dir(root / "vanilla").meta
    assert meta["trained_steps"] == 1 and meta["step_weights"] == [1.0]
    assert meta["training"]["mode"] == "vanilla"


def test_config_validation():
    with pytest.raises(FastMTPError, match="loss"):
        TrainConfig(loss="mse")
    assert [divergence(x) for x in ("ce", "kl", "ce+kl", "acc", "ce+acc")] == [None, "kl", "kl", "acc", "acc"]
    with pytest.raises(FastMTPError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(FastMTPError, match="heldout_fraction"):
        TrainConfig(heldout_fraction=1.5)


def test_cli_end_to_end(toy, run_cli, tmp_path, tiny_tokenizer):
    target, data, init, root, _ = toy
    tdir = tmp_path / "target"
    target.model.save_pretrained(str(tdir))
    tiny_tokenizer.save_pretrained(str(tdir))  # load_target wants one; the data rows are ids
    out = tmp_path / "d1"
    rc, _, err = run_cli("train", "--target", tdir, "--init", init, "--data", data, "--out", out,
                         "--steps", "2", "--epochs", "1", "--batch-size", "8", "--max-len", "40",
                         "--loss", "ce+kl", "--attention", "fastmtp", "--no-progress")
    assert rc == 0, err
    meta = load_draft_dir(out).meta
    assert meta["trained_steps"] == 2 and meta["training"]["config"]["loss"] == "ce+kl"
    assert meta["training"]["attention"] == "fastmtp"
    rc, _, err = run_cli("train", "--target", tdir, "--init", init, "--data", data, "--out", out,
                         "--no-progress")
    assert rc == 1 and "already exists" in err
    # halt after one step, then resume with no other flags: the checkpoint's settings carry over
    half = tmp_path / "half"
    rc, _, err = run_cli("train", "--target", tdir, "--init", init, "--data", data, "--out", half,
                         "--steps", "2", "--epochs", "1", "--batch-size", "4", "--max-len", "40",
                         "--halt-after-steps", "1", "--no-progress")
    assert rc == 0 and load_trainer_state(half)["global_step"] == 1, err
    rc, out_text, err = run_cli("train", "--target", tdir, "--data", data, "--resume", half,
                                "--out", half, "--no-progress")
    assert rc == 0, err
    st = load_trainer_state(half)
    assert st["global_step"] == 5 and st["config"]["steps"] == 2  # 19 rows / 4 and st["config"]["batch_size"] == 4
    rc, _, err = run_cli("train", "--target", tdir, "--data", data, "--resume", half, "--out", half,
                         "--beta", "0.9", "--no-progress")
    assert rc == 1 and "beta" in err
    rc, _, err = run_cli("train", "--target", tdir, "--data", data, "--out", tmp_path / "x",
                         "--no-progress")
    assert rc == 1 and "--init" in err


def test_compressed_vocabulary_training_and_resume(toy):
    """--vocab: the loss scores the table's rows only; the table travels with the checkpoint."""
    target, data, init, root, seqs = toy
    common = torch.unique(seqs[:, TOY_PROMPT:])            # the tokens the responses use
    vocab = torch.cat([common, torch.tensor([t for t in range(TOY_V) if t not in set(common.tolist())][:5])])
    cfg = small_cfg(epochs=1, batch_size=8)
    res = train(cfg, target, data, root / "vocab", init=init, vocab_ids=vocab, vocab_name="toy",
                progress=False)
    steps = [r for r in res.log if r["event"] == "step"]
    assert all(r["out_of_table"] == [0, 0, 0] for r in steps)
    st = load_trainer_state(root / "vocab")
    assert torch.equal(st["vocab_ids"], vocab)
    assert load_draft_dir(root / "vocab").meta["training"]["vocab"] == {"name": "toy", "size": len(vocab)}


def test_text_rows_use_the_chat_template(tiny_tokenizer, tmp_path):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps({"prompt": "What is a list?", "response": "A sequence of items."}) + "\n"
                    + json.dumps({"prompt": 3, "response": "x"}) + "\n")
    exs, counts = load_examples(data, tok, 320, max_len=128)
    assert counts.used == 1 and counts.bad_fields == 1
    want_prompt = tok(tok.apply_chat_template([{"role": "user", "content": "What is a list?"}],
                                              tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False).input_ids
    assert exs[0].prompt_len == len(want_prompt)
    assert exs[0].ids.tolist() == want_prompt + tok("A sequence of items.", add_special_tokens=False).input_ids
    with pytest.raises(FastMTPError, match="chat template"):
        load_examples(data, tiny_tokenizer, 320, max_len=128)


def test_bf16_compute_trains_like_fp32(toy):
    """--compute-dtype bfloat16: the head's fwd/bwd under autocast (fp32 master weights, fp32
    optimizer, fp32 evaluation). Same schedule as fp32: the losses track fp32's (bf16 rounding,
    not another optimisation), training still lowers the loss and raises tau, and the weights
    it writes are fp32."""
    target, data, init, root, _ = toy
    f32 = train(small_cfg(epochs=3), target, data, root / "f32", init=init, progress=False)
    b16 = train(small_cfg(epochs=3, compute_dtype="bfloat16"), target, data, root / "b16", init=init,
                progress=False)
    la = [r["loss"] for r in f32.log if r["event"] == "step"]
    lb = [r["loss"] for r in b16.log if r["event"] == "step"]
    assert len(la) == len(lb) == 12
    assert la[0] == pytest.approx(lb[0], rel=0.05)     # same start, bf16 rounding only
    assert la[0] != lb[0]                               # ... and autocast was really on
    assert lb[-1] < 0.5 * lb[0]
    assert b16.last_eval["tau_train"] > f32.last_eval["tau_train"] - 0.3
    assert all(v.dtype == torch.float32 for v in load_head(root / "b16").state_dict().values())
    assert load_draft_dir(root / "b16").meta["training"]["config"]["compute_dtype"] == "bfloat16"
    with pytest.raises(FastMTPError, match="compute_dtype"):
        small_cfg(compute_dtype="float16")


def test_group_by_length_batches():
    """Same rows, same number of batches, reproducible per (seed, epoch), far less padding."""
    from fastmtp_sglang.training.data import epoch_batches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 500, (1000,), generator=g).tolist()
    idx = list(range(0, 1000, 1))[:997]  # not a multiple of the batch size
    plain = epoch_batches(idx, lengths, 8, seed=3, epoch=1)
    grouped = epoch_batches(idx, lengths, 8, seed=3, epoch=1, group_by_length=True)
    assert grouped == epoch_batches(idx, lengths, 8, seed=3, epoch=1, group_by_length=True)
    assert grouped != epoch_batches(idx, lengths, 8, seed=3, epoch=2, group_by_length=True)
    assert len(grouped) == len(plain) == 125
    assert sorted(i for b in grouped for i in b) == sorted(idx)

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    assert padded(grouped) < 0.7 * padded(plain)


def test_lr_default_depends_on_the_init(tmp_path):
    """A head from `fastmtp init-head` (its config records the init) defaults to NEW_HEAD_LR; a
    converted MTP layer keeps TrainConfig's default; a flag or a checkpoint's LR wins."""
    import argparse

    from fastmtp_sglang.cli.train import config_from_args
    from fastmtp_sglang.training.config import NEW_HEAD_LR

    new, conv = tmp_path / "new", tmp_path / "conv"
    for d, extra in ((new, {"init": {"method": "lstsq"}}), (conv, {})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"fastmtp": {"format_version": 1, **extra}}))

    def cfg(init, lr=None, saved=None):
        return config_from_args(argparse.Namespace(init=str(init), lr=lr), saved)

    assert cfg(new).lr == NEW_HEAD_LR != TrainConfig().lr
    assert cfg(conv).lr == TrainConfig().lr
    assert cfg(tmp_path / "missing").lr == TrainConfig().lr
    assert cfg(new, lr=5e-5).lr == 5e-5
    assert cfg(new, saved={"lr": 1e-3}).lr == 1e-3


def test_hybrid_aware_weighting_trains_resumes_and_is_recorded(toy, capsys):
    """--lookup-weight: the covered share is printed, the run trains (loss falls), the config
    records the weight, and a resume with another weight is refused (it changes the maths)."""
    target, data, init, root, _ = toy
    res = train(small_cfg(epochs=2, lookup_weight=0.25), target, data, root / "hyb", init=init,
                progress=False)
    assert "prompt lookup covers" in capsys.readouterr().err
    steps = [r for r in res.log if r["event"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    start = next(r for r in res.log if r["event"] == "start")
    assert start["config"]["lookup_weight"] == 0.25 and start["config"]["lookup_min_match"] == 2
    # the weight reaches the loss: the same first step at weight 1 scores more (covered targets
    # count whole)
    plain = train(small_cfg(epochs=1, halt_after_steps=1), target, data, root / "hyb1", init=init,
                  progress=False)
    first = lambda r: next(x for x in r.log if x["event"] == "step")["loss"]  # noqa: E731
    hyb1 = train(small_cfg(epochs=1, halt_after_steps=1, lookup_weight=0.25), target, data,
                 root / "hyb1w", init=init, progress=False)
    assert first(hyb1) < first(plain)
    with pytest.raises(FastMTPError, match="lookup_weight"):
        train(small_cfg(epochs=2, lookup_weight=0.5), target, data, root / "hyb",
              resume=root / "hyb", progress=False)
