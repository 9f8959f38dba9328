"""What a request asks the engine to keep for training (``Request.features = k``): the target's
state at every position it fed, and the top-k log-probabilities of the next token there.

A training row of prompt P and response of N tokens needs, at positions 0 .. P + N - 2, the
target's post-norm hidden state and, for ``--loss kl``, its top-k ``log_softmax``
(training/features.py stores the same for a last-layer head; a head fusing middle layers needs
more, which this does not keep). SGLang's ``return_hidden_states`` returns the same rows, so the
reference server answers it from here too (serving/worker.py). The
engine computes all of it while it generates: the prefill's states at the prompt positions and,
each cycle, the states and logits of the positions it verified. Keeping them makes
``fastmtp distill --target ... --with-features`` write the feature cache in the same pass, where
a second ``fastmtp features`` pass over the output cost about as much CPU as generating it (on 2
cores: ~900 feature tokens/s against ~330 kept response tokens/s, ~1.75 feature tokens a
response token).

The top-k come from logits the engine computed anyway (no extra lm_head product), except at the
prompt positions, where the prefill only scored the last one: the prompt's positions get one
lm_head product per distinct prompt (n samples of a prompt share it).
"""

from __future__ import annotations

import torch


def topk_logp(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """(ids int32 [..., k], log-probabilities fp16 [..., k]) of the top-k of ``log_softmax(logits)``
    (the top-k logits less their logsumexp: no [.., V] log-softmax); (None, None) for k = 0."""
    if not k:
        return None, None
    z = logits.float()
    top = z.topk(k, dim=-1)
    lp = top.values - torch.logsumexp(z, dim=-1, keepdim=True)
    return top.indices.to(torch.int32), lp.to(torch.float16)


def _own(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as a tensor of its own in host memory."""
    if t is None:
        return None
    return t.detach().cpu() if t.device.type != "cpu" else t.detach().clone()


class Capture:
    """One request's kept positions, in order: (states [m, H], top-k ids, top-k log-probs)."""

    def __init__(self, k: int):
        self.k = k
        self.parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self.rows = 0

    def add(self, states: torch.Tensor, ids: torch.Tensor | None, lp: torch.Tensor | None) -> None:
        # copies: a view would keep the whole batch's tensor of that prefill or cycle alive
        self.parts.append((_own(states), _own(ids), _own(lp)))
        self.rows += len(states)

    def finish(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The first ``rows`` positions (a request keeps positions 0 .. P + N - 2: what it fed
        and kept; a cycle's positions past a stop string or the token budget are dropped)."""
        if rows > self.rows:
            raise AssertionError(f"captured {self.rows} positions, the sequence needs {rows}")
        h = torch.cat([p[0] for p in self.parts])[:rows]
        if not self.k:
            return h, None, None
        return (h, torch.cat([p[1] for p in self.parts])[:rows],
                torch.cat([p[2] for p in self.parts])[:rows])


def capture_prompts(rows, hidden: torch.Tensor, lens: torch.Tensor, src: list[int], lm_head) -> None:
    """After a prefill: each capturing row keeps its prompt positions. ``hidden`` [B, L, H]: the
    post-norm states per row; ``src[i]``: the first row with row i's prompt (its
    log-probabilities are computed once and shared)."""
    ks = [r.capture.k for r in rows if r.capture is not None]
    if not ks:
        return
    done: dict[int, tuple] = {}
    for i, r in enumerate(rows):
        if r.capture is None:
            continue
        n, k = int(lens[i]), r.capture.k
        if src[i] not in done:
            done[src[i]] = topk_logp(lm_head(hidden[i, :n]), max(ks))
        ids, lp = done[src[i]]
        r.capture.add(hidden[i, :n], None if ids is None else ids[:, :k], None if lp is None else lp[:, :k])


def capture_verified(rows, hidden: torch.Tensor, logits: torch.Tensor, acc: torch.Tensor) -> None:
    """After a verify: each capturing row keeps the positions it fed and accepted (the pending
    token and its accepted drafts: ``acc + 1``). ``hidden`` [n, K+1, H], ``logits`` [n, K+1, V]."""
    js = [j for j, r in enumerate(rows) if r.capture is not None]
    if not js:
        return
    k = max(rows[j].capture.k for j in js)
    sel = torch.tensor(js, device=logits.device)
    ids, lp = topk_logp(logits[sel], k)
    counts = (acc[sel] + 1).tolist()
    for n, (j, m) in enumerate(zip(js, counts)):
        kj = rows[j].capture.k
        rows[j].capture.add(hidden[j, :m], None if ids is None else ids[n, :m, :kj],
                            None if lp is None else lp[n, :m, :kj])
