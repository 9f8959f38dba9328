"""Where prompt lookup would already be right: the hybrid-aware loss weighting.

Served with ``--steps auto``, the head shares its cycles with prompt lookup (decode/ngram.py):
where the text copies from the prompt or from itself, lookup's proposal is taken and the head's
drafts are not read. Training spends the head's capacity on every response token alike; the
hybrid-aware weighting gives the targets lookup would have proposed right a smaller weight
(``--lookup-weight``), so the loss counts most where the head is the only source.

Alignment with the loss (training/objective.py): step k at anchor j predicts x_{j+k+1} from the
target's state at j and the token x_{j+1}. A cycle that starts there knows x_0..x_{j+1}, which is
what prompt lookup matches against; its proposal's first ``m`` tokens equal x_{j+2}..x_{j+m+1}.
``cover[j] = m``: step k at anchor j is covered when ``cover[j] >= k``. Matches shorter than
``min_match`` tokens count as none (auto trusts a one-token match little: its acceptance
estimates are kept per match length, and one-token matches are the weakest).
"""

from __future__ import annotations

import sys

import torch

from fastmtp_sglang.decode.ngram import AUTO_MAX_NGRAM, NgramDrafter, NgramIndex

# what `--steps auto` serves with (decode/auto_setup.py)
AUTO_NGRAM = NgramDrafter(max_ngram=AUTO_MAX_NGRAM)


def lookup_proposals(ids: list[int], prompt_len: int, steps: int,
                     drafter: NgramDrafter = AUTO_NGRAM) -> tuple[torch.Tensor, torch.Tensor]:
    """(right, match), each [len(ids)] int8: at anchor j, how many of x_{j+2}..x_{j+steps+1}
    prompt lookup proposes right from x_0..x_{j+1}, and the length of the suffix it matched
    (0: no proposal). Both 0 at anchors whose step-1 target is not a response token."""
    n = len(ids)
    right = torch.zeros(n, dtype=torch.int8)
    match = torch.zeros(n, dtype=torch.int8)
    index = NgramIndex(drafter)
    prompt = ids[:prompt_len]
    first = max(prompt_len - 2, 0)  # the first anchor whose step-1 target x_{j+2} is a response token
    out = list(ids[prompt_len:first + 2])
    for j in range(first, n - 2):
        while prompt_len + len(out) < j + 2:  # the tokens known at anchor j: x_0..x_{j+1}
            out.append(ids[prompt_len + len(out)])
        index.sync(prompt, out)
        prop, m = index.propose_match(steps)
        if not prop:
            continue
        match[j] = m
        r = 0
        for a, b in zip(prop, ids[j + 2:j + 2 + steps]):
            if a != b:
                break
            r += 1
        right[j] = r
    return right, match


def lookup_cover(ids: list[int], prompt_len: int, steps: int, min_match: int = 2,
                 drafter: NgramDrafter = AUTO_NGRAM) -> torch.Tensor:
    """[len(ids)] int8: at anchor j, how many of x_{j+2}..x_{j+steps+1} prompt lookup proposes
    right from x_0..x_{j+1} (0 where its match is shorter than ``min_match``, and at anchors
    whose step-1 target is not a response token)."""
    right, match = lookup_proposals(ids, prompt_len, steps, drafter)
    return torch.where(match >= min_match, right, torch.zeros_like(right))


def step_weights_at(cover: torch.Tensor, k: int, weight: float) -> torch.Tensor:
    """The loss weight of step k at each anchor: ``weight`` where lookup covers it, else 1."""
    one = torch.ones(cover.shape, dtype=torch.float32, device=cover.device)
    return torch.where(cover >= k, torch.full_like(one, weight), one)


def mark_lookup_cover(examples: list, steps: int, min_match: int = 2) -> list[float]:
    """Set ``e.cover`` on every training row (data.Example) and return, per step k, the share
    of its scored targets that prompt lookup covers (printed: how much the weighting moves)."""
    covered, scored = [0] * steps, [0] * steps
    for e in examples:
        e.cover = lookup_cover(e.ids.tolist(), e.prompt_len, steps, min_match)
        n = len(e.ids)
        for k in range(1, steps + 1):
            # step k at anchor j scores x_{j+k+1} when it is a response token (parallel.token_counts)
            lo = max(e.prompt_len, k + 1) - k - 1
            hi = n - k - 1
            if hi > lo:
                scored[k - 1] += hi - lo
                covered[k - 1] += int((e.cover[lo:hi] >= k).sum())
    shares = [c / s if s else 0.0 for c, s in zip(covered, scored)]
    print("train: prompt lookup covers " + ", ".join(f"{100 * x:.1f}%" for x in shares)
          + f" of steps 1..{steps}'s targets (matches of >= {min_match} tokens)", file=sys.stderr)
    return shares
