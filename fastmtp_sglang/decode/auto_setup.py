"""``--steps auto`` from settings to engine, in one place: what the user asked for
(:class:`AutoSpec`), the costs measured on this machine, the deepest K worth allowing, and the
engine that picks K per cycle (``decode.auto``). `fastmtp serve`, `fastmtp bench` and
`fastmtp demo` all go through :func:`measure_costs` and :func:`build_auto_engine`, and parse
``--steps`` with :func:`parse_steps` and the ``--auto-*`` flags with :meth:`AutoSpec.add_cli_args`
and :meth:`AutoSpec.from_cli_args`.

The K range is chosen from the measured costs unless ``--auto-max-steps`` fixes it: the deepest K
at which a source accepting :data:`ACCEPT_BOUND` of its drafts at every position (prompt lookup
on text that copies its prompt: it drafts for free) still gains tokens per second, up to
:data:`AUTO_CEILING`. Where verification is nearly flat (bf16 with AMX or avx512_bf16) that is
the ceiling; where it is steep it is lower. The controller then picks K per cycle within it from
each request's own acceptance, so a deep range costs nothing where deep chains do not pay.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.decode.auto import AutoK, StepCosts, expected_tokens

AUTO_CEILING = 8    # the deepest K considered by default (K<=8 beat K<=3 by 1.14x in speedup: docs/design.md section 6.7)
ACCEPT_BOUND = 0.9  # per-position acceptance of the best case that sizes the range
AUTO_DRAFTERS = ("hybrid", "head")
DEFAULT_WIDTH = 3  # leaves in auto's head cycles by default (AutoSpec.width None), where the lean forward runs


@dataclass(frozen=True)
class AutoSpec:
    """What ``--steps auto`` was asked for.

    max_steps : int or None
        The largest K; None = chosen from this machine's costs (:func:`deepest_paying_k`), at most
        :data:`AUTO_CEILING`.
    drafter : str
        ``hybrid``: the head and prompt lookup, per row and cycle; ``head``: the head alone.
    alpha : float
        Weight of a cycle in a request's moving acceptance estimate, in (0, 1].
    sampled_alpha : float
        The same for a sampled request, whose cycles observe acceptance probabilities; in
        (0, 1]. Lower than ``alpha``: measured, docs/design.md section 6.7, "A sampled row's
        estimate moves slower".
    probe_every : int
        Cycles at K=0 before the controller may draft once at K=1 to look again, >= 1.
    splice : bool
        ``hybrid``: chains spliced from both sources where the estimates say that pays (a
        prompt-lookup proposal continued by the head past its end; prompt lookup asked again
        after the head's drafts). Off by default: on the AMX protocol it raised tau 6% at the
        same speed (docs/design.md section 6.7, "Splices").
    width : int or None
        Candidates per position the head drafts: its draft and ``width - 1`` leaves beside it,
        verified in the same forward (decode/leaves.py); 1 = a chain. None (default): 3 where
        the target runs through the lean forward (a tree mask needs it), else a chain. Measured
        on the AMX protocol once a verified token cost 0.16-0.30 ms (vectorised norm and rotary):
        greedy 1.70x -> 1.79x with tau 2.14 -> 2.45 (bench/results/vector_kernels/); sampled,
        width 3 had made `auto` 5-6% faster already (bench/results/leaves/).
    """

    max_steps: int | None = None
    drafter: str = "hybrid"
    alpha: float = 0.2
    probe_every: int = 8
    splice: bool = False
    width: int | None = None
    sampled_alpha: float = 0.1

    def __post_init__(self) -> None:
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):
            raise ValueError(f"the auto arm's largest K (--auto-max-steps) must be an integer >= 1, "
                             f"got {self.max_steps!r}")
        if self.drafter not in AUTO_DRAFTERS:
            raise ValueError(f"the auto drafter is one of {AUTO_DRAFTERS}, got {self.drafter!r}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"--auto-alpha must be in (0, 1], got {self.alpha}")
        if not 0.0 < self.sampled_alpha <= 1.0:
            raise ValueError(f"--auto-sampled-alpha must be in (0, 1], got {self.sampled_alpha}")
        if self.probe_every < 1:
            raise ValueError(f"--auto-probe-every must be >= 1, got {self.probe_every}")
        if self.width is not None and (isinstance(self.width, bool) or not isinstance(self.width, int)
                                       or self.width < 1):
            raise ValueError(f"--auto-width must be an integer >= 1, got {self.width!r}")

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, scope: str = "the auto arm", max_steps_note: str = "") -> None:
        """The flags of ``--steps auto``, with one default and one help each (``max_steps_note``:
        what else the largest K means for this command)."""
        p.add_argument("--auto-max-steps", type=int, default=None,
                       help=f"{scope}: the largest K (default: the deepest K, at most {AUTO_CEILING}, "
                            f"that pays on this machine's costs measured at start){max_steps_note}")
        p.add_argument("--auto-drafter", choices=AUTO_DRAFTERS, default=AutoSpec.drafter,
                       help=f"{scope}: the head and prompt lookup per request and cycle, each where "
                            "it is expected to accept more (hybrid, default), or the head alone")
        p.add_argument("--auto-alpha", type=float, default=AutoSpec.alpha,
                       help=f"{scope}: weight of a cycle in a greedy request's running acceptance "
                            f"estimate (default {AutoSpec.alpha})")
        p.add_argument("--auto-sampled-alpha", type=float, default=AutoSpec.sampled_alpha,
                       help=f"{scope}: the same for a sampled request (temperature > 0), whose "
                            f"cycles observe acceptance probabilities (default {AutoSpec.sampled_alpha})")
        p.add_argument("--auto-probe-every", type=int, default=AutoSpec.probe_every,
                       help=f"{scope}: cycles at K=0 before one cycle drafts at K=1 to look again "
                            f"(default {AutoSpec.probe_every})")
        p.add_argument("--auto-splice", choices=("on", "off"), default="off",
                       help=f"{scope}, hybrid: also draft chains spliced from the head and prompt "
                            "lookup where the estimates say they pay (a proposal continued by the "
                            "head past its end; lookup asked again after the head's drafts); "
                            "default off: measured, more accepted tokens at the same speed")
        p.add_argument("--auto-width", type=int, default=None,
                       help=f"{scope}: candidates per position the head drafts, its draft and "
                            "width - 1 leaves beside it, verified in the same forward (1: a "
                            f"chain); default: {DEFAULT_WIDTH} where the target runs through the "
                            "engine's lean forward, else a chain")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "AutoSpec":
        """The AutoSpec the ``--auto-*`` flags ask for; FastMTPError naming the flag when one is off."""
        try:
            return cls(args.auto_max_steps, args.auto_drafter, args.auto_alpha, args.auto_probe_every,
                       args.auto_splice == "on", getattr(args, "auto_width", AutoSpec.width),
                       getattr(args, "auto_sampled_alpha", AutoSpec.sampled_alpha))
        except ValueError as exc:
            raise FastMTPError(str(exc)) from None

    @property
    def leaf_width(self) -> int:
        """The width the head drafts at where leaves can run (``width``, or 3 by default)."""
        return self.width if self.width is not None else DEFAULT_WIDTH

    @property
    def ceiling(self) -> int:
        """The deepest K the costs are measured for."""
        return self.max_steps or AUTO_CEILING

    def cost_points(self) -> tuple[int, ...]:
        """Tokens per target forward to time: every size up to ``max_steps + 1`` when it is fixed,
        else a sparse set up to the ceiling's (interpolated between: StepCosts.verify_ms)."""
        if self.max_steps is not None:
            return tuple(range(1, self.max_steps + 2))
        return tuple(n for n in (1, 2, 3, 4, 6) if n <= self.ceiling) + (self.ceiling + 1,)


def parse_steps(text: str, flag: str = "--steps") -> tuple[list[int], bool]:
    """``"0,1,3,auto"`` -> ([0, 1, 3], True): the K values listed (integers >= 0) and whether
    ``auto`` is among them (the one parser of ``--steps`` for serve, bench and demo)."""
    parts = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    auto = "auto" in parts
    try:
        steps = [int(x) for x in parts if x != "auto"]
    except ValueError:
        raise FastMTPError(f"{flag} takes comma-separated integers K >= 0 (0 = plain decoding) "
                           f"or auto, like 0,1,3,auto; got {text!r}") from None
    if (not steps and not auto) or any(k < 0 for k in steps):
        raise FastMTPError(f"{flag} needs integers K >= 0 or auto; got {text!r}")
    return steps, auto


def deepest_paying_k(costs: StepCosts, ceiling: int, drafter: str = "hybrid",
                     accept: float = ACCEPT_BOUND) -> int:
    """The K in 1..ceiling with the most tokens per millisecond for a source whose drafts are
    accepted with probability ``accept`` at every position: prompt lookup (free drafts) for the
    ``hybrid`` drafter, the head (K draft steps and its extend) for ``head``. Ties go to the
    smaller K."""
    est = [accept] * ceiling

    def cost(k: int) -> float:
        return costs.verify_ms(k + 1) if drafter == "hybrid" else costs.cycle_ms(k)

    return max(range(1, ceiling + 1), key=lambda k: (expected_tokens(est, k) / cost(k), -k))


def measure_costs(spec: AutoSpec, target, head, draft_vocab=None, batch: int = 1):
    """This machine's cost curve for ``spec`` at ``batch`` rows (a few seconds;
    fastmtp_sglang.decode.costs.measure)."""
    from fastmtp_sglang.decode.costs import measure

    if head is None:
        raise ValueError("--steps auto drafts with a head: give --draft DIR")
    return measure(target, head, draft_vocab, ns=spec.cost_points(), repeats=7, warmup=2,
                   bandwidth_mib=256, batch=batch)  # (larger than the last-level cache)


def build_auto_engine(spec: AutoSpec, target, head, curve, max_context: int | None = None,
                      draft_vocab=None, batched_curves: list | None = None):
    """The ReferenceEngine that picks K per cycle in 0..Kmax from ``curve`` (batch 1) and
    ``batched_curves`` (the same calls at larger batches); Kmax is ``spec.max_steps`` or
    :func:`deepest_paying_k` of the batch-1 costs. Its ``steps`` is that Kmax."""
    from fastmtp_sglang.decode.engine import ReferenceEngine
    from fastmtp_sglang.decode.ngram import AUTO_MAX_NGRAM, NgramDrafter

    from fastmtp_sglang.decode.lean_forward import covers

    costs = StepCosts.from_curve(curve, batched_curves)
    kmax = spec.max_steps or deepest_paying_k(costs, spec.ceiling, spec.drafter)
    hybrid = spec.drafter == "hybrid"
    # leaves need the lean forward (a tree mask): by default, where it does not run, a chain
    width = spec.leaf_width if spec.width is not None or covers(target.model) else 1
    return ReferenceEngine(target, head, kmax, max_context, draft_vocab=draft_vocab,
                           drafter=NgramDrafter(max_ngram=AUTO_MAX_NGRAM) if hybrid else None,
                           auto=AutoK(costs, kmax, alpha=spec.alpha, probe_every=spec.probe_every,
                                      width=width, sampled_alpha=spec.sampled_alpha),
                           hybrid=hybrid, splice=spec.splice, width=width)


def describe(spec: AutoSpec, kmax: int) -> str:
    """One line saying which K range an auto engine runs and why."""
    why = ("--auto-max-steps" if spec.max_steps is not None else
           f"the deepest K that pays on this machine's measured costs for drafts accepted "
           f"{ACCEPT_BOUND:.0%} of the time, at most {AUTO_CEILING}")
    return (f"K in 0..{kmax} per cycle ({why}); drafter {spec.drafter}"
            + (", splices on" if spec.drafter == "hybrid" and spec.splice else "")
            + (f", width {spec.width} (leaves)" if spec.width is not None and spec.width > 1 else
               f", width {spec.leaf_width} (leaves) where the lean forward runs" if spec.width is None else ""))
