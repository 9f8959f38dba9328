"""``--steps auto`` settings to engine: the K range chosen from measured costs (deep where
verification is flat, shallow where it is steep), the settings checked, one parser for every
command's ``--steps``."""

from __future__ import annotations

import argparse

import pytest

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.decode.auto import StepCosts
from fastmtp_sglang.decode.auto_setup import (ACCEPT_BOUND, AUTO_CEILING, AutoSpec, build_auto_engine,
                                              deepest_paying_k, describe, measure_costs, parse_steps)
from test_engine import random_head, tiny_target


def costs(verify: dict[int, float], draft: float = 1.0) -> StepCosts:
    return StepCosts(verify, draft, 0.5)


def test_flat_verification_allows_the_ceiling_and_steep_verification_stays_shallow():
    flat = costs({1: 50.0, 2: 51.0, 5: 54.0, 9: 59.0})              # bf16 with AMX: 1.18x at 9
    assert deepest_paying_k(flat, AUTO_CEILING) == AUTO_CEILING
    # every extra token costs a whole plain step: at 90% acceptance one draft is the best
    steep = costs({n: 50.0 * n for n in range(1, 10)})
    assert deepest_paying_k(steep, AUTO_CEILING) == 1
    # in between: the K where E(K) / verify(K+1) peaks
    mid = costs({n: 50.0 * (1 + 0.25 * (n - 1)) for n in range(1, 10)})
    e = lambda k: sum(ACCEPT_BOUND ** j for j in range(k + 1))  # noqa: E731
    want = max(range(1, 9), key=lambda k: e(k) / mid.verify_ms(k + 1))
    assert deepest_paying_k(mid, AUTO_CEILING) == want and 1 < want < AUTO_CEILING


def test_the_head_alone_pays_its_draft_steps():
    c = costs({1: 10.0, 2: 10.5, 5: 12.0, 9: 14.0}, draft=4.0)
    assert deepest_paying_k(c, 8, "head") < deepest_paying_k(c, 8, "hybrid")


def test_spec_checks_and_cost_points():
    assert AutoSpec().ceiling == AUTO_CEILING and AutoSpec(3).ceiling == 3
    assert AutoSpec(3).cost_points() == (1, 2, 3, 4)
    pts = AutoSpec().cost_points()
    assert pts[0] == 1 and pts[-1] == AUTO_CEILING + 1 and list(pts) == sorted(set(pts))
    for bad in (dict(max_steps=0), dict(drafter="tree"), dict(alpha=0.0), dict(probe_every=0),
                dict(sampled_alpha=1.5)):
        with pytest.raises(ValueError):
            AutoSpec(**bad)
    assert "--auto-max-steps" in describe(AutoSpec(3), 3) and "deepest" in describe(AutoSpec(), 5)


def test_one_parser_for_steps():
    assert parse_steps("0,1,3,auto") == ([0, 1, 3], True)
    assert parse_steps("auto") == ([], True) and parse_steps(" 2 ") == ([2], False)
    for bad in ("", "x", "-1", "1,,two"):
        with pytest.raises(FastMTPError, match="--steps"):
            parse_steps(bad)
    p = argparse.ArgumentParser()
    AutoSpec.add_cli_args(p)
    assert AutoSpec.from_cli_args(p.parse_args([])) == AutoSpec()
    assert AutoSpec.from_cli_args(p.parse_args(["--auto-max-steps", "5", "--auto-drafter", "head"])) == AutoSpec(5, "head")
    assert AutoSpec.from_cli_args(p.parse_args(["--auto-splice", "on"])).splice and not AutoSpec().splice
    with pytest.raises(FastMTPError, match="auto-max-steps"):
        AutoSpec.from_cli_args(p.parse_args(["--auto-max-steps", "0"]))
    assert AutoSpec.from_cli_args(p.parse_args(["--auto-width", "3"])).width == 3 and AutoSpec().width is None
    assert AutoSpec().leaf_width == 3 and AutoSpec(width=1).leaf_width == 1
    assert AutoSpec.from_cli_args(p.parse_args(["--auto-sampled-alpha", "0.3"])).sampled_alpha == 0.3
    assert AutoSpec().sampled_alpha < AutoSpec().alpha
    with pytest.raises(FastMTPError, match="auto-width"):
        AutoSpec.from_cli_args(p.parse_args(["--auto-width", "0"]))


def test_built_engine_runs_the_range_the_costs_allow():
    t = tiny_target("llama")
    head = random_head(t)
    spec = AutoSpec(None)
    curve = measure_costs(spec, t, head)
    assert sorted(curve.verify_ms) == list(spec.cost_points())
    eng = build_auto_engine(spec, t, head, curve)
    k = deepest_paying_k(eng.auto.costs, AUTO_CEILING)
    assert eng.steps == eng.auto.kmax == k and eng.hybrid and not eng.splice
    assert build_auto_engine(AutoSpec(2, splice=True), t, head, curve).splice
    assert "splices on" in describe(AutoSpec(2, splice=True), 2) and "splices" not in describe(AutoSpec(2), 2)
    fixed = build_auto_engine(AutoSpec(2, "head"), t, head, curve)
    assert fixed.steps == 2 and not fixed.hybrid
    assert build_auto_engine(AutoSpec(2, sampled_alpha=0.07), t, head, curve).auto.sampled_alpha == 0.07
    wide = build_auto_engine(AutoSpec(2, width=3), t, head, curve)
    assert wide.width == wide.auto.width == 3 and "width 3" in describe(AutoSpec(2, width=3), 2)
    # the default: leaves (width 3) in every cycle where the lean forward runs, else a chain
    dflt = build_auto_engine(AutoSpec(2), t, head, curve)
    assert dflt.width == dflt.auto.width == 3 and "where the lean forward runs" in describe(AutoSpec(2), 2)
    t.model.config.hidden_act = "gelu"  # a model the lean forward does not cover: a chain
    try:
        assert build_auto_engine(AutoSpec(2), t, head, curve).width == 1
        with pytest.raises(ValueError, match="lean forward"):  # asked for: the engine says why not
            build_auto_engine(AutoSpec(2, width=3), t, head, curve)
    finally:
        t.model.config.hidden_act = "silu"
    chain = build_auto_engine(AutoSpec(2, width=1), t, head, curve)
    assert chain.width == 1 and "leaves" not in describe(AutoSpec(2, width=1), 2)
    with pytest.raises(ValueError, match="--draft"):
        measure_costs(spec, t, None)
