"""The bench's timing guard, on synthetic timings (timing tests are not tests: these fix the inputs).

A cycle verifies K+1 tokens (at least one plain step, t0) and drafts K, and emits tau tokens on
average, so no honest run shows a speedup above ``tau * t0 / (t0 + draft per cycle)``.
"""

from __future__ import annotations

import pytest

from fastmtp_sglang.benchmark.sweep import BenchConfig, Sample, markdown, rotated, summarize, timing_guard


def _samples(steps, tau_acc, t0_ms, draft_ms, verify_ms, repeats=3, prompts=4, tokens=64,
             k0_scale=None, cats=("a", "b")):
    """Synthetic runs: at K>0 every cycle accepts ``tau_acc[k]`` drafts (an int), costs
    ``draft_ms[k] + verify_ms[k]``; plain decoding costs ``t0_ms`` per token.
    ``k0_scale[rep]`` multiplies the K=0 seconds of repeat rep (a disturbed baseline)."""
    out = []
    for rep in range(repeats):
        for p in range(prompts):
            cat = cats[p % len(cats)]
            for k in steps:
                if k == 0:
                    n = tokens
                    secs = (tokens - 1) * t0_ms / 1000 * (k0_scale[rep] if k0_scale else 1.0)
                    acc = [0] * (tokens - 1)
                    out.append(Sample(f"p{p}", cat, 0, n, secs, tokens - 1, acc, list(range(n)),
                                      0.0, secs, 0.0, rep))
                    continue
                a = tau_acc[k]
                cycles = (tokens - 1) // (a + 1)
                n = cycles * (a + 1) + 1
                d, v = cycles * draft_ms[k] / 1000, cycles * verify_ms[k] / 1000
                out.append(Sample(f"p{p}", cat, k, n, d + v, cycles, [a] * cycles, list(range(n)),
                                  d, v, 0.0, rep))
    return out


def test_honest_run_passes():
    cfg = BenchConfig([0, 1, 3])
    s = _samples(cfg.steps, {1: 1, 3: 1}, t0_ms=30, draft_ms={1: 3, 3: 9}, verify_ms={1: 31, 3: 33})
    res = summarize(s, cfg)
    chk = res["timing_check"]
    assert not chk["contaminated"], chk["problems"]
    assert res["overall"][1]["speedup"] == pytest.approx(2 * 30 / 34, rel=0.02)
    assert "Timing check passed" in markdown(res, _meta(cfg))


def test_slow_baseline_is_caught():
    """A cold first run drags K=0 down: K=1 reads 4x with tau 2 (the demo's 4.01x)."""
    cfg = BenchConfig([0, 1])
    s = _samples(cfg.steps, {1: 1}, t0_ms=120, draft_ms={1: 3}, verify_ms={1: 31})
    for x in s:  # the K=0 verify split must look like a plain step of 30 ms to be consistent...
        if x.steps == 0:
            x.verify_s = x.seconds / 4  # ...but the K=0 wall time was 4x that
    res = summarize(s, cfg)
    chk = res["timing_check"]
    assert chk["contaminated"]
    assert any("exceeds" in p and "K=1" in p for p in chk["problems"])
    md = markdown(res, _meta(cfg))
    assert "CONTAMINATED" in md
    # the number appears only inside the reason, never in the table as a result
    assert f"| {res['overall'][1]['speedup']:.2f}x |" not in md
    assert all(" / " not in line for line in md.splitlines() if line.startswith("| a |"))


def test_speedup_above_tau_is_caught_without_time_split():
    """URL mode (no draft/verify split): the bound is tau itself (1.57x at tau 1.27 is impossible)."""
    cfg = BenchConfig([0, 3], repeats=1)
    s = _samples(cfg.steps, {3: 0}, t0_ms=50, draft_ms={3: 0}, verify_ms={3: 20}, repeats=1)
    for x in s:
        if x.steps:
            x.draft_s = x.verify_s = 0.0
    res = summarize(s, cfg)
    assert res["overall"][3]["tau"] == pytest.approx(1.0)
    chk = res["timing_check"]
    assert chk["contaminated"] and "one repeat" in chk["note"]


def test_verify_cheaper_than_plain_step_is_caught():
    cfg = BenchConfig([0, 2])
    # verifying 3 tokens (20 ms) "beat" a 1-token step (30 ms): the K=0 runs were slowed
    s = _samples(cfg.steps, {2: 0}, t0_ms=30, draft_ms={2: 1}, verify_ms={2: 20})
    for x in s:
        if x.steps == 0:
            x.verify_s = x.seconds
    chk = summarize(s, cfg)["timing_check"]
    assert chk["contaminated"]
    assert any("less than the plain step" in p for p in chk["problems"])


def test_run_to_run_spread_is_caught():
    cfg = BenchConfig([0, 1])
    s = _samples(cfg.steps, {1: 1}, t0_ms=30, draft_ms={1: 3}, verify_ms={1: 31},
                 k0_scale=[1.0, 1.4, 1.0])
    chk = summarize(s, cfg)["timing_check"]
    assert chk["contaminated"]
    assert any("varied by" in p and "K=0" in p for p in chk["problems"])
    # within the bound: passes
    s = _samples(cfg.steps, {1: 1}, t0_ms=30, draft_ms={1: 3}, verify_ms={1: 31},
                 k0_scale=[1.0, 1.05, 0.97])
    assert not summarize(s, cfg)["timing_check"]["contaminated"]


def test_category_outlier_is_caught():
    """One category's baseline disturbed (the demo's 22x in one category)."""
    cfg = BenchConfig([0, 1])
    s = _samples(cfg.steps, {1: 1}, t0_ms=30, draft_ms={1: 3}, verify_ms={1: 31})
    for x in s:
        if x.steps == 0 and x.category == "b":
            x.seconds *= 11
    chk = summarize(s, cfg)["timing_check"]
    assert chk["contaminated"]
    assert any(p.startswith("category b") for p in chk["problems"])


def test_rotation_puts_every_k_first_equally():
    steps = [0, 1, 2, 3]
    firsts = [rotated(steps, i)[0] for i in range(8)]
    assert sorted(firsts) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(sorted(rotated(steps, i)) == steps for i in range(8))


def test_guard_bounds_are_validated():
    with pytest.raises(ValueError):
        BenchConfig([0, 1], max_spread=0)
    assert timing_guard({"overall": {}, "categories": {}}, BenchConfig([0]))["problems"]


def _meta(cfg):
    return {"label": "t", "command": "c", "target": "T", "draft": None, "prompts": 4,
            "config": cfg.__dict__, "engine": "synthetic"}


def _drifting(samples, factor_of_position, steps, prompts=4):
    """Scale every run's seconds by the machine's speed at the time it ran: runs are in the bench's
    order (repeat, prompt, arms rotated as run_in_process rotates them), so a slowly drifting VM
    slows neighbours alike."""
    def when(x):
        i = x.repeat * prompts + int(x.prompt_id[1:])
        return (x.repeat, int(x.prompt_id[1:]), rotated(list(steps), i).index(x.steps))
    order = sorted(samples, key=when)
    n = len(order)
    for i, x in enumerate(order):
        f = factor_of_position(i / max(n - 1, 1))
        x.seconds *= f
        x.draft_s *= f
        x.verify_s *= f
    return samples


def test_slow_drift_of_the_machine_is_not_contamination():
    """The machine doubles its step time over the run (the issue's 87 -> 43 ms per plain step,
    reversed): raw tokens/s of every arm varies by ~2x across repeats, but each arm and its K=0
    run on the same prompt saw the same machine, so the paired speedup stays the true 1.76x."""
    cfg = BenchConfig([0, 1, 3])
    s = _samples(cfg.steps, {1: 1, 3: 1}, t0_ms=30, draft_ms={1: 3, 3: 9}, verify_ms={1: 31, 3: 33})
    _drifting(s, lambda t: 1.0 + t, cfg.steps)
    res = summarize(s, cfg)
    chk = res["timing_check"]
    assert not chk["contaminated"], chk["problems"]
    assert chk["plain_drift"] > 0.3  # the raw K=0 tokens/s drifted far past the 15% bound
    assert res["overall"][1]["speedup"] == pytest.approx(2 * 30 / 34, rel=0.03)
    assert res["overall"][3]["speedup"] == pytest.approx(2 * 30 / 42, rel=0.03)
    assert res["overall"][0]["speedup"] == 1.0


def test_a_disturbance_inside_a_pair_is_still_caught():
    """A concurrent job hits the K=1 runs of one repeat only: the pair disagrees, the run is
    contaminated, even though the machine's overall speed did not drift."""
    cfg = BenchConfig([0, 1])
    s = _samples(cfg.steps, {1: 1}, t0_ms=30, draft_ms={1: 3}, verify_ms={1: 31})
    for x in s:
        if x.steps == 1 and x.repeat == 2:
            x.seconds *= 1.5
    chk = summarize(s, cfg)["timing_check"]
    assert chk["contaminated"]
    assert any("K=1" in p and "varied by" in p for p in chk["problems"])


def test_paired_speedup_is_the_geometric_mean_of_the_prompts_ratios():
    from fastmtp_sglang.benchmark.sweep import paired_speedups

    cfg = BenchConfig([0, 1], repeats=1)
    s = _samples(cfg.steps, {1: 1}, t0_ms=30, draft_ms={1: 3}, verify_ms={1: 31}, repeats=1, prompts=2)
    k1 = [x for x in s if x.steps == 1]
    k1[0].seconds *= 2  # prompt 0's K=1 run at half speed: ratios r/2 and r
    r = _samples(cfg.steps, {1: 1}, t0_ms=30, draft_ms={1: 3}, verify_ms={1: 31}, repeats=1, prompts=1)
    base = summarize(r, cfg)["overall"][1]["speedup"]
    assert paired_speedups(s, 1, "head", None, 1) == [pytest.approx(base / 2 ** 0.5)]
