"""Linear layers on prepared oneDNN weights (cpu_kernels/packed_linear.py): the same numbers as
``F.linear`` (bit-identical on CPUs with native bf16, where the engine uses them), autograd and
non-bf16 calls untouched, a weight changed in place is repacked, and the engine's bf16 greedy
output does not change when they are on."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fastmtp_sglang.core.hardware import fast_bf16
from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.cpu_kernels import packed_linear as pl
from fastmtp_sglang.decode.engine import ReferenceEngine, Request
from fastmtp_sglang.decode.sampling import SamplingParams
from test_continuous import live_successor_world

pytestmark = pytest.mark.skipif(not pl.available(), reason=str(pl.unavailable_reason()))


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    if fast_bf16() and not amx.available():  # oneDNN's prepared weights: not a bit moves
        assert torch.equal(a, b)
    else:  # AMX tiles (cpu_kernels/amx.py) sum in another order; emulated bf16 may pick
        # another kernel: the same product within bf16's rounding
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("inp,out,bias", [(72, 101, False), (64, 160, True), (576, 960, False)])
def test_packed_forward_equals_f_linear(inp, out, bias):
    g = torch.Generator().manual_seed(inp + out)
    lin = torch.nn.Linear(inp, out, bias=bias).to(torch.bfloat16)
    ref = copy.deepcopy(lin)
    assert pl.pack_linears(lin) == 1 and pl.is_packed(lin)
    with torch.inference_mode():
        for shape in [(1, inp), (3, inp), (5, inp), (8, inp), (17, inp), (2, 4, inp), (3, 1, inp)]:
            x = torch.randn(*shape, generator=g).to(torch.bfloat16)
            y = lin(x)
            assert y.shape == (*shape[:-1], out)
            _same(y, F.linear(x, ref.weight, ref.bias))


def test_autograd_and_fp32_calls_take_f_linear():
    lin = torch.nn.Linear(24, 12)
    pl.pack_linears(lin)
    x = torch.randn(3, 24)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))  # fp32: untouched
    lb = torch.nn.Linear(24, 12).to(torch.bfloat16)
    ref = copy.deepcopy(lb)
    pl.pack_linears(lb)
    xb = torch.randn(3, 24, dtype=torch.bfloat16, requires_grad=True)
    xr = xb.detach().clone().requires_grad_(True)
    lb(xb).float().square().sum().backward()
    F.linear(xr, ref.weight, ref.bias).float().square().sum().backward()
    assert torch.equal(xb.grad, xr.grad) and torch.equal(lb.weight.grad, ref.weight.grad)
    assert pl.__dict__["_ATTR"] not in lb.__dict__  # the training call never prepared a copy


def test_weight_changed_in_place_is_repacked():
    lin = torch.nn.Linear(32, 40, bias=False).to(torch.bfloat16)
    pl.pack_linears(lin)
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(-2.0)          # what an optimizer step does to a head between scorings
        after = lin(x)
        _same(after, F.linear(x, lin.weight))
        assert not torch.equal(before, after)
        lin.weight = torch.nn.Parameter(torch.randn(40, 32).to(torch.bfloat16))  # a new tensor
        _same(lin(x), F.linear(x, lin.weight))


def test_state_dict_unchanged_and_unpack_restores():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    keys = list(m.state_dict())
    assert pl.pack_linears(m) == 2 and pl.pack_linears(m) == 0  # idempotent
    with torch.inference_mode():
        m(torch.randn(2, 8).to(torch.bfloat16))
    assert list(m.state_dict()) == keys
    assert pl.unpack_linears(m) == 2 and not pl.is_packed(m)
    assert all("forward" not in x.__dict__ and pl.__dict__["_ATTR"] not in x.__dict__ for x in m)


def test_wanted_follows_mode_dtype_and_cpu():
    fp32 = torch.nn.Linear(4, 4)
    bf16 = torch.nn.Linear(4, 4).to(torch.bfloat16)
    assert not pl.wanted(bf16, "off") and pl.wanted(fp32, "on")
    assert not pl.wanted(fp32, "auto")
    assert pl.wanted(bf16, "auto") == fast_bf16()
    with pytest.raises(ValueError, match="auto, on or off"):
        pl.wanted(bf16, "yes")


def test_engine_bf16_greedy_output_is_unchanged_with_packed_layers():
    """A live-attention successor world in bf16 (drafts accepted and rejected): the engine with
    packed layers returns the tokens and acceptance of the engine without."""
    t, head = live_successor_world()
    t.model.to(torch.bfloat16)
    head.to(torch.bfloat16)
    t2, head2 = copy.deepcopy((t, head))
    on = ReferenceEngine(t, head, 3, packed="on")
    off = ReferenceEngine(t2, head2, 3, packed="off")
    assert on.packed and pl.is_packed(t.model) and pl.is_packed(head)
    assert not off.packed and not pl.is_packed(t2.model)
    prompts = [[1, 5, 7, 9, 11], [3, 4], [8, 8, 8, 8, 2, 40, 41], [60, 61, 62]]

    def run(eng):
        return eng.generate([Request(list(p), SamplingParams(max_new_tokens=24)) for p in prompts])

    a, b = run(on), run(off)
    accepted = sum(c.accepted for r in a for c in r.metrics.cycles)
    assert accepted > 0 and any(c.accepted < 3 for r in a for c in r.metrics.cycles)
    if fast_bf16():
        assert [r.output_ids for r in a] == [r.output_ids for r in b]
        assert [[c.accepted for c in r.metrics.cycles] for r in a] == [[c.accepted for c in r.metrics.cycles] for r in b]


def test_prepared_linear_on_a_slice_equals_f_linear_and_follows_changes():
    """The draft vocabulary's batch-1 path: a table's rows (a slice of the gathered [L, S, H]
    weights) through a prepared copy kept per table."""
    g = torch.Generator().manual_seed(3)
    tw = torch.randn(2, 300, 64, generator=g).to(torch.bfloat16)
    store: dict = {}
    with torch.inference_mode():
        for t, n in ((0, 300), (1, 257), (0, 300)):
            w = tw[t, :n]
            x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
            _same(pl.prepared_linear(x, w, store, t), F.linear(x, w))
    assert set(store) == ({0, 1} if fast_bf16() else set())
    x32 = torch.randn(2, 64)
    assert torch.equal(pl.prepared_linear(x32, tw[0].float(), {}, 0), F.linear(x32, tw[0].float()))


def test_fused_projections_give_each_member_its_own_output():
    """q/k/v and gate/up as one prepared product: the members' outputs equal their own layers'
    (called in the modules' order, in another order, with another input, and under autograd)."""
    torch.manual_seed(4)

    class Block(torch.nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(48, n, bias=bias) for n in (48, 16, 16))
            self.gate_proj, self.up_proj = torch.nn.Linear(48, 80), torch.nn.Linear(48, 80)

    for bias in (False, True):
        blk = Block(bias).to(torch.bfloat16)
        ref = copy.deepcopy(blk)
        assert pl.fuse_projections(blk) == 2 and pl.fuse_projections(blk) == 0
        names = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
        with torch.inference_mode():
            for rows in (1, 3, 8, 64, 65):
                x = torch.randn(2, rows, 48).to(torch.bfloat16)[:, :rows]
                got = {n: getattr(blk, n)(x) for n in names}
                for n in names:
                    _same(got[n], getattr(ref, n)(x))
            x, y = torch.randn(4, 48).to(torch.bfloat16), torch.randn(4, 48).to(torch.bfloat16)
            q = blk.q_proj(x)
            _same(blk.k_proj(y), ref.k_proj(y))   # another input: its own product, not x's
            _same(blk.v_proj(x), ref.v_proj(x))
            _same(q, ref.q_proj(x))
            _same(blk.v_proj(y), ref.v_proj(y))   # out of order, nothing waiting
            with torch.no_grad():
                blk.k_proj.weight.mul_(2)
                ref.k_proj.weight.mul_(2)
            blk.q_proj(x)
            _same(blk.k_proj(x), ref.k_proj(x))   # a changed member remakes the fused weight
            if amx.available():  # AMX tiles: fused equals separately packed, exactly
                sep = copy.deepcopy(ref)
                pl.pack_linears(sep)
                for rows in (1, 5, 64):
                    x = torch.randn(rows, 48).to(torch.bfloat16)
                    for n in names:
                        assert torch.equal(getattr(blk, n)(x), getattr(sep, n)(x)), (n, rows)
        xg = torch.randn(3, 48).to(torch.bfloat16)
        assert torch.equal(blk.k_proj(xg), F.linear(xg, blk.k_proj.weight, blk.k_proj.bias))
        assert pl.unpack_linears(blk) == 5 and not pl.is_packed(blk)
