"""The hybrid-aware loss weighting (training/lookup_cover.py): which targets prompt lookup
covers (held against the drafter auto serves with, anchor by anchor), the weighted fused loss
against the weighted autograd reference (values and gradients), a weight of 1 leaving the loss
unchanged, a covered step weighing W and the others 1 (per step, in the trainer's batch loss),
a weight of 0 removing exactly those rows' gradient in the fused loss, and a checkpoint from
before the flag resuming. (A training run with the flag: tests/test_train.py.)

Run: .venv/bin/pytest tests/test_lookup_weight.py
"""

from __future__ import annotations

import random

import pytest
import torch

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.config import TrainConfig, step_weights
from fastmtp_sglang.training.data import Example, collate
from fastmtp_sglang.training.lookup_cover import AUTO_NGRAM, lookup_cover, mark_lookup_cover
from fastmtp_sglang.training.objective import Projection, _chunk_terms, batch_loss, step_loss_terms
from test_fused_loss import setup
from test_train import K, random_head, target_hidden, tiny_target


def _copy_heavy(n: int, seed: int) -> list[int]:
    """A sequence that repeats pieces of itself (lookup matches of every length) over a small
    alphabet (and one-token matches that mislead)."""
    rng = random.Random(seed)
    seq = [rng.randrange(12) for _ in range(8)]
    while len(seq) < n:
        if rng.random() < 0.5 and len(seq) > 6:
            i = rng.randrange(len(seq) - 4)
            seq += seq[i:i + rng.randrange(2, 6)]
        else:
            seq.append(rng.randrange(12))
    return seq[:n]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_match", [1, 2, 3])
def test_cover_is_what_lookup_proposes_right_from_each_anchor(seed, min_match):
    """cover[j] = how many of x_{j+2}.. the drafter's proposal from x_0..x_{j+1} gets right,
    computed here by the drafter's own scan over the prefix (no index); prompts of 0 and 1
    tokens too."""
    ids = _copy_heavy(70, seed)
    plen = (0, 1, 6, 7, 8, 10)[seed]
    cover = lookup_cover(ids, plen, K, min_match)
    assert cover.shape == (70,) and cover.dtype == torch.int8
    for j in range(70):
        want = 0
        if plen - 2 <= j < 68:
            prop, m = AUTO_NGRAM.propose_match(ids[:j + 2], K)
            if m >= min_match:
                while want < len(prop) and j + 2 + want < 70 and prop[want] == ids[j + 2 + want]:
                    want += 1
        assert int(cover[j]) == want, (j, want, int(cover[j]))
    assert int(cover.max()) >= 1  # the repeats give right proposals


def test_cover_share_counts_the_scored_targets(capsys):
    exs = [Example(torch.tensor(_copy_heavy(60, s)), 6) for s in range(3)]
    shares = mark_lookup_cover(exs, K, 2)
    assert all(e.cover is not None and len(e.cover) == 60 for e in exs)
    # step k scores x_{j+k+1} for anchors j in [max(prompt_len, k + 1) - k - 1, n - k - 1)
    for k in range(1, K + 1):
        lo, hi = 6 - k - 1, 60 - k - 1
        want = sum(int((e.cover[lo:hi] >= k).sum()) for e in exs) / (3 * (hi - lo))
        assert shares[k - 1] == pytest.approx(want)
    assert shares[0] >= shares[1] >= shares[2] > 0
    assert "prompt lookup covers" in capsys.readouterr().err


@pytest.mark.parametrize("kind,use_topk", [("ce", False), ("kl", True), ("ce+kl", False),
                                           ("acc", True), ("acc", False)])
@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_weighted_fused_loss_equals_the_weighted_reference(kind, use_topk, chunk):
    proj, x, th, lab, ti, tl = setup(compressed=True, bias=True)
    if not use_topk:
        ti = tl = None
    w = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(5), dtype=x.dtype)
    w[::4] = 0.0

    def run(fused: bool):
        g = x.clone().requires_grad_(True)
        if fused:
            ce, kl, hit = step_loss_terms(proj, g, lab, th if ti is None else None, kind, chunk,
                                          (ti, tl) if ti is not None else None, w)
        else:
            ce, kl, hit = _chunk_terms(proj, kind, g, lab, th if ti is None else None, ti, tl, w)
        (ce * 0.7 + kl * 1.3).backward()
        return ce.detach(), kl.detach(), hit, g.grad

    for a, b, what in zip(run(True), run(False), ("ce", "kl", "hits", "grad")):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m: f"{what}: {m}")
    grad = run(True)[3]
    assert torch.all(grad[::4] == 0) and grad[1::4].abs().sum() > 0  # weight 0: no gradient


def _batch(target, covered: bool):
    g = torch.Generator().manual_seed(4)
    exs = []
    for n, p in ((30, 6), (24, 5)):
        ids = torch.tensor(_copy_heavy(n, n), dtype=torch.long) % target.config["vocab_size"]
        exs.append(Example(ids, p))
    if covered:
        mark_lookup_cover(exs, K, 2)
    del g
    return collate(exs, [target_hidden(target, e.ids[None])[0] for e in exs], torch.device("cpu"))


def _grads(head, batch, proj, weight):
    head.zero_grad(set_to_none=True)
    loss, stats = batch_loss(head, batch, proj, K, step_weights(K, 0.6), "ce", "serve", 5,
                             lookup_weight=weight)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters()}, stats


def test_weight_one_changes_nothing_and_lower_weights_lower_the_loss():
    target = tiny_target()
    head = random_head(target).train()
    proj = Projection(target.lm_head)
    plain, covered = _batch(target, False), _batch(target, True)
    assert plain.lookup_cover is None and int(covered.lookup_cover.max()) >= 1
    ref = _grads(head, plain, proj, 1.0)
    same = _grads(head, covered, proj, 1.0)
    torch.testing.assert_close(same[0], ref[0], atol=0, rtol=0)
    assert same[2] == ref[2]
    losses = [float(_grads(head, covered, proj, w)[0]) for w in (1.0, 0.5, 0.0)]
    assert losses[0] > losses[1] > losses[2] > 0  # CE terms are positive; covered ones shrink
    # the targets scored (the means' denominators) do not change with the weight
    assert _grads(head, covered, proj, 0.0)[2]["targets"] == ref[2]["targets"]
    # without covers in the batch (held-out rows), a weight changes nothing either
    torch.testing.assert_close(_grads(head, plain, proj, 0.0)[0], ref[0], atol=0, rtol=0)


def test_a_covered_step_weighs_w_and_the_others_one():
    """cover = c at every anchor covers steps 1..c: at weight 0 their losses L_k are 0 and the
    later steps' are exactly those of weight 1 (the comparison runs the right way in k); a row
    without a cover in the batch counts as covering nothing."""
    target = tiny_target()
    head = random_head(target).train()
    proj = Projection(target.lm_head)
    batch = _batch(target, True)
    ref = _grads(head, batch, proj, 1.0)[2]["loss"]
    for c in (1, 2):
        batch.lookup_cover = torch.full_like(batch.lookup_cover, c)
        got = _grads(head, batch, proj, 0.0)[2]["loss"]
        assert got[:c] == [0.0] * c and got[c:] == pytest.approx(ref[c:], rel=1e-6)
    # a batch mixing rows with and without covers: the row without one keeps weight 1
    g = torch.Generator().manual_seed(1)
    a = Example(torch.randint(0, target.config["vocab_size"], (20,), generator=g), 5)
    bb = Example(torch.randint(0, target.config["vocab_size"], (16,), generator=g), 4)
    a.cover = torch.full((20,), K, dtype=torch.int8)
    mixed = collate([a, bb], [target_hidden(target, e.ids[None])[0] for e in (a, bb)], torch.device("cpu"))
    assert mixed.lookup_cover[0, :20].eq(K).all() and mixed.lookup_cover[1].eq(0).all()


def test_a_checkpoint_from_before_the_flag_resumes_under_its_defaults():
    from fastmtp_sglang.training.config import resume_mismatches

    saved = {k: v for k, v in vars(TrainConfig()).items() if not k.startswith("lookup_")}
    assert resume_mismatches(saved, TrainConfig()) == []
    assert resume_mismatches(saved, TrainConfig(lookup_weight=0.5)) == [
        "lookup_weight: checkpoint 1.0, now 0.5"]


def test_config_refuses_weights_outside_zero_one():
    with pytest.raises(FastMTPError, match="lookup_weight must lie in"):
        TrainConfig(lookup_weight=1.5)
    for bad in (0, 5):
        with pytest.raises(FastMTPError, match="lookup_min_match must lie in 1..4"):
            TrainConfig(lookup_min_match=bad)
