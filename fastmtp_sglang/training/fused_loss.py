"""The projection and the loss of one draft step in one pass over row chunks, with its gradient.

The plain autograd path (objective._chunk_terms) materialises [N, S] logits, casts them to fp32,
keeps their log-softmax for backward, and walks that 100+ MB array five or six times per step
(cast, log-softmax, its backward, the cast back, argmax). Here each chunk of rows is scored
while its logits sit in cache: the loss terms and their gradient with respect to the logits are
closed-form (below), so the chunk's gradient with respect to the draft's hidden states is one
more matrix product, taken in the forward pass, and backward only scales the stored [N, H]
gradients. No logits survive a chunk, and nothing is recomputed.

With q = softmax(z) over the S scored columns of a row, lse = logsumexp(z):
- CE to label y (in the table): lse - z_y; d/dz = q - onehot(y).
- KL(p || q) exact, p the target's distribution over the table: sum p (log p - log q);
  d/dz = q - p.
- KL over {the target's top-k} + {the rest} (objective.kl_topk_terms): with lq_i = z_{c_i} - lse,
  inside_i = (c_i is a column), p_i = exp(logp_i) inside_i, rest_p = max(1 - sum p, eps),
  rest_q = max(1 - sum inside_i exp(lq_i), eps):
  L = sum_i p_i (logp_i - lq_i) + rest_p (log rest_p - log rest_q);
  dL/dlq_i = -p_i + [rest_q > eps] rest_p exp(lq_i) inside_i / rest_q;
  d/dz_j = sum_i dL/dlq_i (onehot(c_i)_j - q_j).
- acc, -log alpha with alpha = sum min(p, q) (objective._chunk_terms), m = [q < p]: exact,
  d/dz = -(m q - q sum(m q)) / alpha; over the top-k (objective.acceptance_topk),
  dL/dlq_i = -m_i q_i inside_i / alpha, then d/dz as for the top-k KL. alpha <= eps: clamped,
  no gradient.
The weight (the target's lm_head rows) is frozen: no gradient flows to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastmtp_sglang.training.config import divergence


def _mm_dtype(g: torch.Tensor) -> torch.dtype:
    """The dtype the projection's products run in: autocast's (bf16 on CPU) when it is on, as the
    autograd path's F.linear would, else the hidden states' own."""
    dev = g.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return g.dtype


class _ProjectedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, weight, bias, labels, target_h, topk_ids, topk_logp, kind, chunk, eps,
                row_w=None):
        cd = _mm_dtype(g)
        w = weight.to(cd)
        gc = g.detach().to(cd)
        div = divergence(kind)
        want_ce, want_kl = "ce" in kind, div is not None
        n = g.shape[0]
        f = torch.promote_types(torch.float32, weight.dtype)  # fp32 sums (fp64 for fp64 weights)
        ce = torch.zeros((), dtype=f, device=g.device)
        kl = torch.zeros((), dtype=f, device=g.device)
        correct = torch.zeros((), dtype=torch.long, device=g.device)
        dg_ce = torch.zeros(n, g.shape[1], dtype=f, device=g.device) if want_ce else None
        dg_kl = torch.zeros(n, g.shape[1], dtype=f, device=g.device) if want_kl else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = (gc[s:e] @ w.t()).to(f)
            if bias is not None:
                z = z + bias.to(f)
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            q = (z - lse).exp_()
            lab = labels[s:e]
            rw = None if row_w is None else row_w[s:e].to(f)[:, None]  # [n, 1] loss weights
            correct += (z.argmax(-1) == lab).sum()
            if want_ce:
                ok = lab >= 0
                safe = lab.clamp(min=0)[:, None]
                okw = ok[:, None].to(f) if rw is None else ok[:, None] * rw
                ce += ((lse - z.gather(-1, safe)) * okw).sum()
                dz = q * okw
                dz.scatter_add_(-1, safe, -okw)
                dg_ce[s:e] = dz.to(cd) @ w
            if want_kl:
                if topk_ids is not None:
                    cols, logp = topk_ids[s:e], topk_logp[s:e].to(f)
                    inside = cols >= 0
                    cols0 = cols.clamp(min=0)
                    lq = z.gather(-1, cols0) - lse
                    p = logp.exp() * inside
                    qk = lq.exp() * inside
                    if div == "acc":  # a = dL/dlq
                        alpha = torch.minimum(p, qk).sum(-1)
                        row = -alpha.clamp(min=eps).log()
                        a = -(qk * (qk < p)) * ((alpha > eps) / alpha.clamp(min=eps))[:, None]
                    else:
                        rest_p = (1 - p.sum(-1)).clamp(min=eps)
                        rest_q_raw = 1 - qk.sum(-1)
                        rest_q = rest_q_raw.clamp(min=eps)
                        row = (p * (logp - lq)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())
                        a = -p + ((rest_q_raw > eps) * rest_p / rest_q)[:, None] * qk
                    if rw is not None:
                        row, a = row * rw[:, 0], a * rw
                    kl += row.sum()
                    dz = q * (-a.sum(-1, keepdim=True))
                    dz.scatter_add_(-1, cols0, a)
                else:
                    zt = (target_h[s:e].to(cd) @ w.t()).to(f)
                    if bias is not None:
                        zt = zt + bias.to(f)
                    logp_t = F.log_softmax(zt, dim=-1)
                    p_t = logp_t.exp()
                    if div == "acc":
                        mq = q * (q < p_t)
                        alpha = torch.minimum(p_t, q).sum(-1, keepdim=True)
                        row = -alpha.clamp(min=eps).log()
                        dz = -(mq - q * mq.sum(-1, keepdim=True)) * ((alpha > eps) / alpha.clamp(min=eps))
                    else:
                        row = (p_t * (logp_t - (z - lse))).sum(-1, keepdim=True)
                        dz = q - p_t
                    if rw is not None:
                        row, dz = row * rw, dz * rw
                    kl += row.sum()
                dg_kl[s:e] = dz.to(cd) @ w
        ctx.save_for_backward(dg_ce, dg_kl)
        ctx.g_dtype = g.dtype
        ctx.mark_non_differentiable(correct)
        return ce, kl, correct

    @staticmethod
    def backward(ctx, grad_ce, grad_kl, _grad_correct):
        dg_ce, dg_kl = ctx.saved_tensors
        grad = None
        if dg_ce is not None and grad_ce is not None:
            grad = dg_ce * grad_ce
        if dg_kl is not None and grad_kl is not None:
            grad = dg_kl * grad_kl if grad is None else grad + dg_kl * grad_kl
        if grad is not None:
            grad = grad.to(ctx.g_dtype)
        return grad, None, None, None, None, None, None, None, None, None, None


def projected_loss(weight: torch.Tensor, bias: torch.Tensor | None, kind: str, g: torch.Tensor,
                   labels: torch.Tensor, target_h: torch.Tensor | None = None,
                   topk_ids: torch.Tensor | None = None, topk_logp: torch.Tensor | None = None,
                   chunk: int = 256, eps: float = 1e-6, row_weights: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE sum over in-table labels, divergence sum (KL or acc), argmax hits) of one step,
    differentiable in ``g``.

    weight [S, H] (bias [S]): the scored lm_head rows, frozen; g [N, H]; labels [N] logit columns
    (-1: outside the table, no CE, a miss); KL is exact from ``target_h`` [N, H] or, with
    ``topk_ids`` (as logit columns, -1 outside) / ``topk_logp`` [N, k], over the top-k partition.
    ``row_weights`` [N] (default all 1) multiply each row's CE and divergence terms and their
    gradients (the hybrid-aware weighting: training/lookup_cover.py).
    The values and gradients are objective._chunk_terms's (tests/test_train.py holds them equal).
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("projected_loss keeps the projection frozen: pass detached weights")
    if divergence(kind) and target_h is None and topk_ids is None:
        raise ValueError("KL and acc need the target's hidden states or its cached top-k")
    return _ProjectedLoss.apply(g, weight, bias, labels, target_h, topk_ids, topk_logp, kind,
                                max(int(chunk), 1), eps, row_weights)
