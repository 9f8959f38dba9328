"""The cost curve's measurement: every call of a cycle is timed through the engine's own modules,
the floors come from the weights actually read, and the measurement leaves the caches as it found
them (no timing values are asserted: that is what bench/ is for)."""

from __future__ import annotations

import torch

from fastmtp_sglang.decode.costs import CostCurve, cpu_description, markdown, measure, weight_bytes
from test_engine import random_head, tiny_target


def test_weight_bytes_counts_tied_weights_once_and_excludes_the_target():
    t = tiny_target("llama")
    n = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in t.model.parameters()}.values())
    assert weight_bytes(t.model) == n
    head = random_head(t)
    own = sum(p.numel() * p.element_size() for p in head.parameters())
    assert weight_bytes(head, exclude=t.model) == own  # the shared embedding and lm_head are the target's


def test_measure_times_every_call_of_a_cycle():
    t = tiny_target("llama")
    head = random_head(t)
    before = [p.clone() for p in head.parameters()]
    curve = measure(t, head, ns=(1, 2, 4), context=16, repeats=3, warmup=1, bandwidth_mib=16)
    assert isinstance(curve, CostCurve)
    assert curve.plain_sampled_ms is None and curve.draft_step_sampled_ms is None  # (sampled=False)
    assert sorted(curve.verify_ms) == [1, 2, 4] and sorted(curve.extend_ms) == [1, 2, 4]
    assert all(v > 0 for v in curve.verify_ms.values()) and curve.draft_step_ms > 0
    assert curve.plain_ms == curve.verify_ms[1] and curve.verify_ratio(1) == 1.0
    assert curve.bandwidth_gbs > 0 and curve.verify_floor_ms > 0 and curve.draft_floor_ms > 0
    # the floor is the target's weights over the bandwidth
    assert abs(curve.verify_floor_ms - weight_bytes(t.model) / (curve.bandwidth_gbs * 1e9) * 1e3) < 1e-9
    assert all(torch.equal(a, b) for a, b in zip(before, head.parameters()))
    js = curve.to_json()
    assert js["plain_over_floor"] > 0 and js["verify_ratio"][4] == curve.verify_ratio(4)
    text = markdown(curve)
    assert "plain step (1 token)" in text and "verify 4 tokens" in text and "draft step" in text


def test_sampled_calls_join_the_curve_when_asked():
    """temperature 1: the plain step's token and the draft step's (over a compressed table too)
    are drawn as the engine draws them; both rows appear in the table."""
    from test_engine_vocab import make_vocab

    t = tiny_target("llama")
    head = random_head(t)
    vocab = make_vocab(t, [list(range(0, 97, 3))], ["en"])
    for dv in (None, vocab):
        curve = measure(t, head, dv, ns=(1, 2), context=8, repeats=2, warmup=1, bandwidth_mib=16,
                        sampled=True)
        assert curve.plain_sampled_ms > 0 and curve.draft_step_sampled_ms > 0
        text = markdown(curve)
        assert "plain step, sampled (T=1)" in text and "draft step, sampled (T=1)" in text


def test_measure_without_a_head_times_the_target_only():
    curve = measure(tiny_target("qwen2"), None, ns=(1, 3), context=8, repeats=2, warmup=1, bandwidth_mib=16)
    assert curve.draft_step_ms is None and curve.extend_ms == {} and sorted(curve.verify_ms) == [1, 3]
    assert "draft step" not in markdown(curve)


def test_cpu_description_names_the_cpu():
    d = cpu_description()
    assert d["model"] and isinstance(d["flags"], list) and d["threads"] >= 1


def test_dtype_auto_follows_the_cpus_bf16_units():
    from fastmtp_sglang.core.hardware import auto_dtype_name, fast_bf16
    from fastmtp_sglang.core.target import parse_dtype

    avx2 = frozenset({"avx2", "fma"})
    assert not fast_bf16(avx2) and auto_dtype_name("cpu", avx2) == "float32"
    assert auto_dtype_name("cpu", avx2 | {"avx512f", "avx512_bf16"}) == "bfloat16"
    assert auto_dtype_name("cpu", avx2 | {"amx_tile", "amx_bf16"}) == "bfloat16"
    assert auto_dtype_name("cuda", avx2) == "bfloat16"
    assert parse_dtype("auto") == (torch.bfloat16 if fast_bf16() else torch.float32)
    assert parse_dtype("auto", "cuda:0") == torch.bfloat16
