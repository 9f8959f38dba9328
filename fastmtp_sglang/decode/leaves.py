"""Leaves: the head's chain plus ``W - 1`` other candidates at each of its positions, verified in
the same target forward (``ReferenceEngine(..., width=W)``, ``--draft-width W``).

Where a chain's draft at position k is rejected, the target's token there is often the head's
second or third choice (on the shipped head, greedy: the target's token is among the head's top 3
at 70% of positions against 52% for its first choice; sampled at T=1, three candidates are
accepted 57% of the time against 40% for one). A tree that continues every candidate costs a
head step per branch; this one does not branch further: each position has the chain's draft,
which the next position continues, and ``W - 1`` leaves, taken from the same step's distribution
at no extra head work. The target reads ``1 + K * W`` tokens instead of ``1 + K`` (nearly free
on a CPU, where verifying 8 tokens costs ~1.26x one: docs/design.md section 6.7).

Layout of a cycle's verified tokens (one row; every row the same):
``[pending, c_1 .. c_K, leaves of position 1 (W - 1), .., leaves of position K]``. The chain's
node k sees the pending token and ``c_1 .. c_k``; a leaf at position k sees the pending token,
``c_1 .. c_{k-1}`` and itself, at the same position as ``c_k`` (``tree_mask``, ``positions``).

Acceptance walks the chain; at the first position whose chain draft is rejected it tries that
position's leaves, and an accepted leaf ends the walk there, with the target's own token after it
(its distribution comes from the leaf's node of the same forward):

- greedy: the target's argmax is accepted if it is the chain's draft or one of the leaves;
- sampling: recursive rejection sampling with candidates drawn **without replacement** from the
  head's q (Jeon et al., 2024, "Recursive Speculative Decoding"; SpecTr, Sun et al., 2023, for
  several drafts): candidate i, drawn from q with the earlier candidates removed (renormalised),
  is kept with probability ``min(1, r_i(x) / q_i(x))``; on a rejection the target's residual
  becomes ``r_{i+1} = norm(max(r_i - q_i, 0))``; when every candidate is rejected the token is
  drawn from the last residual. Each step is a lossless speculative-sampling step for ``r_i``
  (its candidate is distributed as ``q_i`` given everything before it), so the emitted token is
  distributed as the target's p (tests/test_leaves.py checks the frequencies).
"""

from __future__ import annotations

import functools

import torch

from fastmtp_sglang.decode.batch import spread_slots
from fastmtp_sglang.decode.sampling import draw_distinct, first_argmax, sample

__all__ = ["candidates", "positions", "tree_mask", "verify"]


@functools.lru_cache(maxsize=64)
def tree_mask(K: int, W: int, device=None) -> torch.Tensor:
    """[S, S] bool, S = 1 + K * W: which of a cycle's verified tokens each one sees (layout in
    the module docstring). Built once per (K, W, device) and shared: read it, never write it."""
    S = 1 + K * W
    m = torch.zeros(S, S, dtype=torch.bool, device=device)
    m[: K + 1, : K + 1] = torch.ones(K + 1, K + 1, dtype=torch.bool, device=device).tril()
    for k in range(1, K + 1):
        for j in range(W - 1):
            n = leaf_node(K, W, k, j)
            m[n, :k] = True     # pending, c_1 .. c_{k-1}
            m[n, n] = True
    return m


def leaf_node(K: int, W: int, k: int, j: int) -> int:
    """Index among the verified tokens of leaf j (0-based) at position k (1-based)."""
    return 1 + K + (k - 1) * (W - 1) + j


def positions(pos: torch.Tensor, K: int, W: int) -> torch.Tensor:
    """pos [n] (the pending token's) -> [n, 1 + K * W]: the chain's node k at pos + k, a leaf
    at the position of the chain's draft it stands beside."""
    dev = pos.device
    depth = torch.cat([torch.arange(K + 1, device=dev),
                       torch.arange(1, K + 1, device=dev).repeat_interleave(W - 1)])
    return pos[:, None] + depth[None]


def candidates(b, g: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One head step's W candidates for every row of batch ``b`` (decode/batch.py): the head's
    output hidden g [n, H] -> (the chain's draft [n], q [n, V] or None (greedy), leaves
    [n, W - 1] with -1 where the distribution has fewer than W tokens).

    Greedy: the head's top W, the first continuing the chain. Sampling: W tokens drawn without
    replacement from q (the draft distribution ``Batch.draft_pick`` samples from), in order."""
    e = b.engine
    n = g.shape[0]
    if e.draft_vocab is not None:
        lg, ids = e.draft_vocab.compressed_logits(g, b.tidx, b.extra)                 # [n, S] each
    else:
        lg = e.head.project(g).float()
        ids = torch.arange(lg.shape[-1], device=lg.device)[None].expand(n, -1)
    if b.greedy:
        top = lg.topk(min(W, lg.shape[-1]), dim=-1)
        toks = ids.gather(1, top.indices).masked_fill(top.values == float("-inf"), -1)
        return toks[:, 0], None, _pad(toks[:, 1:], W - 1)
    probs = b.probs(lg)                                                               # [n, S]
    slots = draw_distinct(probs, W, b.gens)                                           # [n, W]
    toks = ids.gather(1, slots.clamp(min=0)).masked_fill(slots < 0, -1)
    return toks[:, 0], spread_slots(probs, ids, e.target.lm_head.weight.shape[0]), toks[:, 1:]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)


def verify(chain: torch.Tensor, leaves: torch.Tensor, qs: list, tlogits: torch.Tensor, b,
           cap: list[int], chain_probs: bool = False):
    """Accept along the chain, then among one position's leaves (module docstring).

    chain [n, K], leaves [n, K, W - 1] (-1: none), qs the draft's q [n, V] per position (sampling)
    , tlogits [n, 1 + K * W, V] the target's logits at every verified token, cap[i] the drafts
    row i may accept. Returns (accepted [n], emitted [n, K + 1] (the accepted path's tokens,
    then the target's, then -1), the path's nodes [n, K + 1] (node of each accepted position,
    index 0 the pending token's, then repeating the last), whether a leaf was accepted [n],
    and with ``chain_probs`` (sampling) per row the chance ``sum_x min(p, q)`` that the chain's
    draft was accepted at each position the walk reached (auto's estimates: AutoK._observe),
    else None)."""
    n, K = chain.shape
    W = leaves.shape[2] + 1
    dev = chain.device
    acc = torch.zeros(n, dtype=torch.long)
    emitted = torch.full((n, K + 1), -1, dtype=torch.long)
    path = torch.zeros(n, K + 1, dtype=torch.long)
    took_leaf = [False] * n
    if b.greedy:
        am = first_argmax(tlogits).tolist()
        walk = [_walk_greedy(chain[i].tolist(), leaves[i].tolist(), am[i], cap[i], K, W)
                for i in range(n)]
    else:
        ps = [_target_probs(tlogits, b, i) for i in range(n)]
        walk = [_walk_sampled(chain[i].tolist(), leaves[i].tolist(), [q[i] for q in qs],
                              ps[i], cap[i], K, W, b.gens[i]) for i in range(n)]
    for i, (toks, nodes, leaf) in enumerate(walk):
        a = len(toks) - 1
        acc[i] = a
        emitted[i, : a + 1] = torch.tensor(toks)
        path[i, : a + 1] = torch.tensor(nodes)
        path[i, a + 1:] = nodes[-1]
        took_leaf[i] = leaf
    probs = None
    if chain_probs and not b.greedy:
        # the chain's node k - 1 precedes its draft k; nodes[:a + 1] are the chain's up to the
        # first rejection (or the leaf's position), each already computed by the walk
        probs = []
        for i, (toks, nodes, leaf) in enumerate(walk):
            reach = min(len(toks) - int(leaf), cap[i])  # positions whose chain draft was tried
            probs.append([float(torch.minimum(ps[i](k), qs[k][i].float()).sum()) for k in range(reach)])
    return acc.to(dev), emitted.to(dev), path.to(dev), took_leaf, probs


def _target_probs(tlogits: torch.Tensor, b, i: int):
    """Row i's p at a node, computed when the walk first reads it (a walk reads the chain's
    nodes up to its first rejection and at most one leaf's: ~3 of 10 at K=3, width 3)."""
    memo: dict[int, torch.Tensor] = {}

    def at(node: int) -> torch.Tensor:
        if node not in memo:
            memo[node] = b.probs(tlogits[i, node][None], row=i)[0]
        return memo[node]
    return at


def _walk_greedy(chain: list[int], leaves: list[list[int]], am: list[int], cap: int, K: int, W: int):
    """(tokens emitted, nodes of the accepted positions from the pending token's, leaf taken)."""
    node, toks, nodes = 0, [], [0]
    for k in range(1, cap + 1):
        t = am[node]
        if chain[k - 1] == t:
            node = k
        elif t in leaves[k - 1]:
            node = leaf_node(K, W, k, leaves[k - 1].index(t))
            return toks + [t, am[node]], nodes + [node], True
        else:
            return toks + [t], nodes, False
        toks.append(t)
        nodes.append(node)
    return toks + [am[node]], nodes, False


def _walk_sampled(chain: list[int], leaves: list[list[int]], qs: list[torch.Tensor], p,
                  cap: int, K: int, W: int, gen):
    """As _walk_greedy, sampled; p(node) is the target's distribution at a node."""
    node, toks, nodes = 0, [], [0]
    for k in range(1, cap + 1):
        # (r, q): the distribution being sampled and the last candidate's, which drew `tried`
        r, q, tried = p(node), qs[k - 1].float(), chain[k - 1]
        if _keep(tried, r, q, gen):
            node = k
            toks.append(tried)
            nodes.append(node)
            continue
        # rejected: the leaves, each a lossless step for the residual left by the candidates before
        for j, x in enumerate(leaves[k - 1]):
            if x < 0:
                break
            q_next = q.clone()
            q_next[tried] = 0.0
            mass = float(q_next.sum())
            if mass <= 0.0:  # (x was drawn from q without `tried`: only rounding gets here)
                break
            r, q, tried = _residual(r, q), q_next / mass, x
            if _keep(x, r, q, gen):
                node = leaf_node(K, W, k, j)
                nxt = int(sample(p(node)[None], generator=gen)[0])
                return toks + [x, nxt], nodes + [node], True
        return toks + [_draw_residual(r, q, gen)], nodes, False
    return toks + [int(sample(p(node)[None], generator=gen)[0])], nodes, False


def _keep(x: int, r: torch.Tensor, q: torch.Tensor, gen) -> bool:
    """A candidate x drawn from q is kept with probability min(1, r(x) / q(x)) (u in [0, 1):
    q <= r always keeps, r == 0 never does)."""
    return float(torch.rand(1, generator=gen)) * float(q[x]) < float(r[x])


def _draw_residual(r: torch.Tensor, q: torch.Tensor, gen) -> int:
    """A token from norm(max(r - q, 0)) (:func:`_residual`), drawn without normalising it."""
    res = (r - q).clamp_min_(0.0)
    if not float(res.sum()) > 0.0:
        res = r
    return int(sample(res[None], generator=gen)[0])


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What is left of r (a distribution) after a rejected candidate drawn from q:
    norm(max(r - q, 0)). Zero everywhere only when r == q up to rounding (a rejection of
    probability 0): r itself is then the right distribution."""
    res = (r - q).clamp_min(0.0)
    mass = float(res.sum())
    return res / mass if mass > 0.0 else r
