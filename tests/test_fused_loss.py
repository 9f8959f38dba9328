"""The fused projection + loss (training/fused_loss.py) against the autograd reference
(objective._chunk_terms): CE, exact KL, top-k KL, the acceptance loss (exact and top-k) and sums; full and compressed vocabularies
with labels and top-k tokens outside the table; chunks that do not divide the rows; values and
gradients in fp32 (and fp64, where only the order of sums differs), and bf16 autocast within
its rounding. CPU, tiny shapes.

Run: .venv/bin/pytest tests/test_fused_loss.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastmtp_sglang.training.fused_loss import projected_loss
from fastmtp_sglang.training.objective import Projection, _chunk_terms, step_loss_terms

V, H, N, TOPK = 53, 24, 37, 6


def setup(dtype=torch.float64, compressed=False, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(H, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=dtype))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g, dtype=dtype))
    head.requires_grad_(False)
    vocab = torch.randperm(V, generator=g)[:31] if compressed else None
    proj = Projection(head, vocab)
    x = torch.randn(N, H, generator=g, dtype=dtype)
    th = torch.randn(N, H, generator=g, dtype=dtype)
    full_labels = torch.randint(0, V, (N,), generator=g)
    # the target's top-k over the full vocabulary, as the feature cache holds them
    logp_full = torch.log_softmax(1.5 * torch.randn(N, V, generator=g, dtype=dtype), -1)
    top = logp_full.topk(TOPK, -1)
    return proj, x, th, proj.labels(full_labels), top.indices, top.values


def reference(proj, kind, x, lab, th, ti, tl):
    g = x.clone().requires_grad_(True)
    ce, kl, hit = _chunk_terms(proj, kind, g, lab, th if ti is None else None, ti, tl)
    (ce * 0.7 + kl * 1.3).backward()
    return ce.detach(), kl.detach(), hit, g.grad


def fused(proj, kind, x, lab, th, ti, tl, chunk):
    g = x.clone().requires_grad_(True)
    ce, kl, hit = step_loss_terms(proj, g, lab, th if ti is None else None, kind, chunk,
                                  (ti, tl) if ti is not None else None)
    (ce * 0.7 + kl * 1.3).backward()
    return ce.detach(), kl.detach(), hit, g.grad


@pytest.mark.parametrize("kind,use_topk", [("ce", False), ("kl", False), ("kl", True),
                                           ("ce+kl", False), ("ce+kl", True), ("acc", False),
                                           ("acc", True), ("ce+acc", True)])
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("chunk", [1, 8, 100])
def test_fused_equals_autograd_reference(kind, use_topk, compressed, chunk):
    proj, x, th, lab, ti, tl = setup(compressed=compressed, bias=compressed)
    if not use_topk:
        ti = tl = None
    want = reference(proj, kind, x, lab, th, ti, tl)
    got = fused(proj, kind, x, lab, th, ti, tl, chunk)
    for a, b, what in zip(got, want, ("ce", "kl", "hits", "grad")):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m: f"{what}: {m}")
    if compressed:  # some labels and top-k tokens fall outside the table: masked, not wrapped
        assert (lab < 0).any() and (proj.labels(ti) < 0).any()
    assert float(got[0 if "ce" in kind else 1]) > 0


def test_fp32_matches_the_reference_to_rounding():
    proj, x, th, lab, ti, tl = setup(dtype=torch.float32, compressed=True)
    want = reference(proj, "ce+kl", x, lab, th, ti, tl)
    got = fused(proj, "ce+kl", x, lab, th, ti, tl, 5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_bf16_autocast_products_stay_within_rounding():
    """Under bf16 autocast both paths take the projection's products in bf16 (the fused one also
    the gradient's): the losses agree to bf16 rounding, the gradients point the same way."""
    proj, x, th, lab, ti, tl = setup(dtype=torch.float32)
    want = reference(proj, "ce+kl", x, lab, th, ti, tl)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused(proj, "ce+kl", x, lab, th, ti, tl, 16)
        ref_bf16 = reference(proj, "ce+kl", x, lab, th, ti, tl)
    for a, b in ((got, want), (ref_bf16, want)):
        assert float(a[0]) == pytest.approx(float(b[0]), rel=2e-2)
        assert float(a[1]) == pytest.approx(float(b[1]), rel=2e-2)
        cos = torch.nn.functional.cosine_similarity(a[3].flatten(), b[3].flatten(), dim=0)
        assert float(cos) > 0.999


def test_saturated_rest_mass_passes_no_gradient_through_the_clamp():
    """When the draft puts (almost) all its mass on the target's top-k, 1 - sum q clamps at eps
    and that term is constant, as in the reference."""
    proj, x, th, lab, ti, tl = setup()
    w = proj.weight
    x = 40.0 * w[ti[:, 0]] / w[ti[:, 0]].norm(dim=-1, keepdim=True)  # each row aims at its top-1
    want = reference(proj, "kl", x, lab, th, ti, tl)
    got = fused(proj, "kl", x, lab, th, ti, tl, 7)
    torch.testing.assert_close(got[1], want[1], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(got[3], want[3], atol=1e-8, rtol=1e-8)


def test_refuses_a_trainable_projection_and_kl_without_a_target():
    proj, x, th, lab, ti, tl = setup()
    with pytest.raises(ValueError, match="frozen"):
        projected_loss(proj.weight.clone().requires_grad_(True), None, "ce", x, lab)
    with pytest.raises(ValueError, match="KL and acc need"):
        projected_loss(proj.weight, None, "kl", x, lab)


def test_the_acceptance_loss_is_minus_log_of_what_sampled_verification_accepts():
    """alpha = sum min(p, q) is the probability that a token drawn from the draft survives the
    target's rejection sampling: checked by simulation; the top-k form is a lower bound that
    equals it when the top-k cover every token; the loss is 0 when q = p."""
    from fastmtp_sglang.training.objective import acceptance_topk
    g = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(torch.randn(1, 12, generator=g, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(1, 12, generator=g, dtype=torch.float64), -1)
    p, q = logp.exp()[0], logq.exp()[0]
    n = 200_000
    x = torch.multinomial(q, n, replacement=True, generator=g)
    accepted = torch.rand(n, generator=g, dtype=torch.float64) < (p[x] / q[x]).clamp(max=1)
    alpha = float(torch.minimum(p, q).sum())
    assert float(accepted.double().mean()) == pytest.approx(alpha, abs=4 * (alpha / n) ** 0.5)
    every = torch.arange(12)[None]
    assert float(acceptance_topk(logq, every, logp)[0]) == pytest.approx(alpha)
    top = logp.topk(4, -1)
    assert float(acceptance_topk(logq, top.indices, top.values)[0]) < alpha
    proj, x_, th, lab, ti, tl = setup()
    same = _chunk_terms(proj, "acc", th.clone(), lab, th, None, None)[1]   # the draft is the target
    assert float(same) == pytest.approx(0.0, abs=1e-9)
