"""Compressed draft head: Triton kernel vs torch reference vs a naive full-vocabulary computation.

The Triton comparisons run in one subprocess with ``TRITON_INTERPRET=1``: triton reads that
variable when a kernel is decorated (module import), so it must be set before
``fastmtp_sglang.kernels.compressed_head`` is first imported, and setting it in the pytest process
would leak into every other test. The worker is this file run as a script:

    TRITON_INTERPRET=1 python tests/test_compressed_head.py --worker OUT.json

On a CUDA machine, ``pytest -m gpu tests/test_compressed_head.py`` compiles the real kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# (name, B, H, V, table lengths, E, dtype, return_logits, pregathered)
# Odd sizes on purpose: H not a power of two, tables of different lengths (one longer than the
# interpreter's 512-wide tile, one of length 1), B=17 spans two 16-row blocks, E=40 two extra tiles.
CASES = [
    ("b1_h96_fp32_logits", 1, 96, 700, (300,), 0, "float32", True, False),
    ("b1_h200_fp16_extra", 1, 200, 700, (300, 120), 24, "float16", False, False),
    ("b3_h96_fp32_extra_logits", 3, 96, 900, (257, 100, 33), 10, "float32", True, False),
    ("b3_h200_fp16_logits", 3, 200, 900, (600, 64), 0, "float16", True, False),
    ("b3_h96_bf16_extra", 3, 96, 800, (200, 77), 12, "bfloat16", True, False),
    ("b17_h96_fp16_extra_logits", 17, 96, 1000, (513, 150), 40, "float16", True, False),
    ("b17_h200_fp32", 17, 200, 1000, (129, 1, 700), 0, "float32", False, False),
    ("b17_h200_fp32_extra", 17, 200, 1000, (129, 700), 40, "float32", True, False),
    ("b3_h96_fp16_pregathered", 3, 96, 600, (250, 90), 8, "float16", True, True),
]
ATOL, RTOL = 2e-4, 1e-5  # kernel vs reference on fp32-upcast inputs: only summation order differs


def make_case(B, H, V, lens, E, dtype, seed=0, pad_value=-1):
    """Random inputs: tables of distinct ids padded with ``pad_value``; extra ids mixing padding,
    ids already in the row's table, repeats, out-of-range ids and fresh ids."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    hidden = torch.randn(B, H, generator=g).to(dt)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dt)
    L, S = len(lens), max(lens)
    tables = torch.full((L, S), pad_value, dtype=torch.int64)
    for i, n in enumerate(lens):
        tables[i, :n] = torch.randperm(V, generator=g)[:n]
    table_lens = torch.tensor(lens, dtype=torch.int64)
    table_idx = torch.randint(0, L, (B,), generator=g)
    extra = None
    if E:
        extra = torch.randint(0, V, (B, E), generator=g)
        for b in range(B):
            row_table = tables[table_idx[b], : lens[table_idx[b]]]
            extra[b, 0] = row_table[0]  # already in the table
            if E > 3:
                extra[b, 2] = extra[b, 1]  # repeat
                extra[b, 3] = V + 5  # out of range
            extra[b, -1] = -1  # padding
    return hidden, weight, tables, table_lens, table_idx, extra


def first_mismatches(a, b, atol, rtol, k=5) -> str:
    a, b = a.float(), b.float()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    bad = ~(both_inf | torch.isclose(a, b, atol=atol, rtol=rtol))
    idx = bad.nonzero()[:k].tolist()
    vals = [(tuple(i), a[tuple(i)].item(), b[tuple(i)].item()) for i in idx]
    return f"{int(bad.sum())} mismatches of {a.numel()}; first (index, got, want): {vals}"


def check_against_reference(got, want, atol=ATOL, rtol=RTOL, tie_logits=None) -> list[str]:
    """Compare (top_id, top_logprob, logits) triples; ids may differ only where the reference's
    top two logits (``tie_logits``, default the reference's own) are within tolerance."""
    errors = []
    g_id, g_lp, g_lg = got
    w_id, w_lp, w_lg = want
    if not torch.allclose(g_lp, w_lp, atol=atol, rtol=rtol):
        errors.append("top_logprob: " + first_mismatches(g_lp, w_lp, atol, rtol))
    if (g_lg is None) != (w_lg is None):
        errors.append(f"logits presence differs: got {g_lg is not None}, want {w_lg is not None}")
    elif g_lg is not None:
        if g_lg.shape != w_lg.shape:
            errors.append(f"logits shape {tuple(g_lg.shape)} != {tuple(w_lg.shape)}")
        elif not torch.equal(torch.isinf(g_lg), torch.isinf(w_lg)) or not torch.allclose(
            g_lg.nan_to_num(neginf=0.0), w_lg.nan_to_num(neginf=0.0), atol=atol, rtol=rtol
        ):
            errors.append("logits: " + first_mismatches(g_lg, w_lg, atol, rtol))
    diff = (g_id != w_id).nonzero().squeeze(1).tolist()
    tie_logits = w_lg if tie_logits is None else tie_logits
    if diff and tie_logits is not None:
        top2 = tie_logits.topk(2, dim=1).values
        diff = [b for b in diff if (top2[b, 0] - top2[b, 1]).item() > 10 * atol]
    if diff:
        errors.append(f"top_id differs at rows {diff[:5]}: got {g_id[diff[:5]].tolist()}, want {w_id[diff[:5]].tolist()}")
    return errors


def run_worker(out_path: str) -> None:
    """Interpreter side: every CASE through the Triton launcher and the torch reference."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker needs TRITON_INTERPRET=1"
    from fastmtp_sglang.kernels import compressed_head as ch

    results = {}
    for name, B, H, V, lens, E, dtype, ret, pregathered in CASES:
        hidden, weight, tables, lens_t, idx, extra = make_case(B, H, V, lens, E, dtype, pad_value=V + 1000)
        tw = weight[tables.clamp(0, V - 1)].contiguous() if pregathered else None
        try:
            got = ch.compressed_head_triton(hidden, weight, tables, lens_t, idx, extra, ret, table_weight=tw)
            # reference on fp32-upcast inputs, always with logits (for the near-tie check)
            want = ch.compressed_head_torch(hidden.float(), weight.float(), tables, lens_t, idx, extra, True)
            errors = check_against_reference(got, (want[0], want[1], want[2] if ret else None), tie_logits=want[2])
        except Exception as exc:  # reported by the pytest side, with the case's name
            errors = [f"{type(exc).__name__}: {exc}"]
        results[name] = errors
    # the dispatcher honours the override on CPU tensors
    os.environ[ch.BACKEND_ENV] = "triton"
    hidden, weight, tables, lens_t, idx, extra = make_case(3, 96, 500, (100, 60), 6, "float32")
    got = ch.compressed_head(hidden, weight, tables, lens_t, idx, extra, True)
    want = ch.compressed_head_torch(hidden, weight, tables, lens_t, idx, extra, True)
    results["dispatcher_env_triton"] = check_against_reference(got, want)
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("interp") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2")
    env.pop("FASTMTP_COMPRESSED_HEAD", None)
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(f"interpreter worker failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", [c[0] for c in CASES] + ["dispatcher_env_triton"])
def test_triton_interpreter_matches_torch(interpreter_results, name):
    errors = interpreter_results[name]
    assert not errors, f"{name}: " + "; ".join(errors)


# ------------------------------------------------------------------------------------------------
# In-process: the torch reference against first principles (no Triton launch here)
# ------------------------------------------------------------------------------------------------

from fastmtp_sglang.kernels import compressed_head as ch  # noqa: E402  (after the worker's docs)


def naive(hidden, weight, tables, table_lens, table_idx, extra):
    """Full-vocabulary logits, then log_softmax restricted to each row's candidate set."""
    V = weight.shape[0]
    full = hidden.float() @ weight.float().T  # [B, V]
    B = hidden.shape[0]
    ids_out, lp_out, rows = [], [], []
    for b in range(B):
        t = int(table_idx[b])
        cand = tables[t, : int(table_lens[t])].tolist()
        seen = set(cand)
        if extra is not None:
            for x in extra[b].tolist():
                if 0 <= x < V and x not in seen:
                    cand.append(x)
                    seen.add(x)
        row = torch.full((V,), float("-inf"))
        row[cand] = full[b, cand]
        logp = torch.log_softmax(row, dim=0)
        best = max(cand, key=lambda i: (full[b, i].item(), -cand.index(i)))
        ids_out.append(best)
        lp_out.append(logp[best].item())
        rows.append(row)
    return torch.tensor(ids_out), torch.tensor(lp_out), torch.stack(rows)


@pytest.mark.parametrize("case", [c for c in CASES if c[6] == "float32"] + [
    ("b5_h64_one_table", 5, 64, 300, (300,), 7, "float32", True, False),
], ids=lambda c: c[0])
def test_torch_reference_matches_full_vocab(case):
    _, B, H, V, lens, E, dtype, _, _ = case
    hidden, weight, tables, lens_t, idx, extra = make_case(B, H, V, lens, E, dtype, seed=1)
    top_id, top_lp, logits = ch.compressed_head_torch(hidden, weight, tables, lens_t, idx, extra, True)
    want_id, want_lp, want_rows = naive(hidden, weight, tables, lens_t, idx, extra)
    assert top_id.dtype == torch.int64 and top_lp.dtype == torch.float32
    assert logits.shape == (B, max(lens) + E)
    assert torch.equal(top_id, want_id), f"top_id {top_id.tolist()} != {want_id.tolist()}"
    assert torch.allclose(top_lp, want_lp, atol=1e-5), first_mismatches(top_lp, want_lp, 1e-5, 0)
    full = ch.scatter_to_full(logits, ch.slot_ids(tables, lens_t, idx, extra), V)
    assert torch.equal(torch.isinf(full), torch.isinf(want_rows)), "support differs from the candidate set"
    assert torch.allclose(full.nan_to_num(neginf=0.0), want_rows.nan_to_num(neginf=0.0), atol=1e-4), (
        first_mismatches(full, want_rows, 1e-4, 0)
    )
    # softmax over the scattered row sums to one and gives the same log-prob
    logp = torch.log_softmax(full, dim=1)
    assert torch.allclose(logp.gather(1, top_id[:, None]).squeeze(1), top_lp, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reference_host_grouped_and_sync_free_paths_agree(dtype):
    hidden, weight, tables, lens_t, idx, _ = make_case(9, 40, 300, (100, 50, 70), 0, dtype)
    tw = weight[tables.clamp(0, 299)]
    a = ch._table_logits(hidden, weight, tables, lens_t, idx, None, group_on_host=True)
    b = ch._table_logits(hidden, weight, tables, lens_t, idx, None, group_on_host=False)
    c = ch._table_logits(hidden, weight, tables, lens_t, idx, tw, group_on_host=True)
    valid = torch.arange(tables.shape[1])[None, :] < lens_t[idx][:, None]  # padded slots are masked later
    assert torch.allclose(a[valid], b[valid], atol=1e-2, rtol=1e-3), first_mismatches(a[valid], b[valid], 1e-2, 1e-3)
    assert torch.equal(a, c)


def test_mask_extra_ids_hand_made():
    tables = torch.tensor([[5, 6, 7, -1], [8, 9, 10, 11]])
    lens = torch.tensor([3, 4])
    idx = torch.tensor([0, 1])
    extra = torch.tensor([[6, 11, 11, -1, 20, 3], [6, 11, 12, 12, 5, 99]])
    got = ch.mask_extra_ids(tables, lens, idx, extra, vocab_size=21)
    want = torch.tensor([[-1, 11, -1, -1, 20, 3], [6, -1, 12, -1, 5, -1]])
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"


def test_slot_ids_and_scatter_to_full_duplicates():
    tables = torch.tensor([[2, 0, 4], [1, 3, -7]])
    lens = torch.tensor([3, 2])
    idx = torch.tensor([1, 0])
    ids = ch.slot_ids(tables, lens, idx, torch.tensor([[3, 0], [-1, 2]]))
    assert ids.tolist() == [[1, 3, -1, 3, 0], [2, 0, 4, -1, 2]]
    inf = float("-inf")
    logits = torch.tensor([[1.0, 2.0, inf, inf, 0.5], [3.0, 4.0, 5.0, inf, inf]])
    full = ch.scatter_to_full(logits, ids, 6)
    assert full.tolist() == [[0.5, 1.0, inf, 2.0, inf, inf], [4.0, inf, 3.0, inf, 5.0, inf]]


def test_ties_go_to_the_lowest_slot():
    weight = torch.zeros(10, 4)
    weight[[3, 7, 2]] = torch.tensor([1.0, 0, 0, 0])  # three equal top rows
    tables = torch.tensor([[7, 3, 2, 0]])
    top_id, top_lp, _ = ch.compressed_head_torch(
        torch.tensor([[2.0, 0, 0, 0]]), weight, tables, torch.tensor([4]), torch.tensor([0])
    )
    assert top_id.tolist() == [7]
    want = torch.log_softmax(torch.tensor([2.0, 2.0, 2.0, 0.0]), 0)[0]
    assert torch.allclose(top_lp, want[None])


def test_row_without_candidates_gives_minus_one():
    weight = torch.randn(10, 4)
    top_id, top_lp, _ = ch.compressed_head_torch(
        torch.randn(2, 4), weight, torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 0]), torch.tensor([0, 1])
    )
    assert top_id[1].item() == -1 and top_lp[1].item() == float("-inf") and top_id[0].item() in (1, 2)


def test_bad_inputs_name_the_offending_values():
    hidden, weight, tables, lens_t, idx, extra = make_case(3, 16, 50, (10,), 4, "float32")
    with pytest.raises(ValueError, match=r"hidden must be \[B, H\]; got shape \(3, 16, 1\)"):
        ch.compressed_head_torch(hidden[..., None], weight, tables, lens_t, idx)
    with pytest.raises(ValueError, match=r"weight dtype torch.float16 != hidden dtype torch.float32"):
        ch.compressed_head_torch(hidden, weight.half(), tables, lens_t, idx)
    with pytest.raises(ValueError, match=r"tables must be int64"):
        ch.compressed_head_torch(hidden, weight, tables.int(), lens_t, idx)
    with pytest.raises(ValueError, match=r"table_idx must be int64 \[3\]; got torch.int64 \(2,\)"):
        ch.compressed_head_torch(hidden, weight, tables, lens_t, idx[:2])
    with pytest.raises(ValueError, match=r"extra_ids must be int64 \[3, E\]"):
        ch.compressed_head_torch(hidden, weight, tables, lens_t, idx, extra[:1])
    with pytest.raises(ValueError, match=r"weight is \(50, 16\), expected \[V, 17\]"):
        ch.compressed_head_torch(torch.randn(3, 17), weight, tables, lens_t, idx)
    with pytest.raises(ValueError, match=r"table_idx holds 4, outside \[0, 1\)"):
        ch.compressed_head_torch(hidden, weight, tables, lens_t, torch.tensor([0, 4, 0]))


def test_triton_launcher_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hidden, weight, tables, lens_t, idx, _ = make_case(2, 16, 50, (10,), 0, "float32")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ch.compressed_head_triton(hidden, weight, tables, lens_t, idx)
    # past the device check (interpreter flag read at call time), contiguity is checked before launch
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"hidden must be contiguous; got strides \(1, 2\)"):
        ch.compressed_head_triton(hidden.T.contiguous().T, weight, tables, lens_t, idx)


def test_dispatcher_uses_torch_on_cpu_and_rejects_bad_override(monkeypatch):
    hidden, weight, tables, lens_t, idx, extra = make_case(2, 16, 50, (10, 5), 3, "float32")
    monkeypatch.delenv(ch.BACKEND_ENV, raising=False)
    got = ch.compressed_head(hidden, weight, tables, lens_t, idx, extra, True)
    want = ch.compressed_head_torch(hidden, weight, tables, lens_t, idx, extra, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    monkeypatch.setenv(ch.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="expected 'torch', 'triton' or unset"):
        ch.compressed_head(hidden, weight, tables, lens_t, idx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("B", [1, 3, 17, 64])
def test_triton_on_gpu_matches_torch(dtype, B):
    hidden, weight, tables, lens_t, idx, extra = make_case(B, 200, 5000, (2049, 777), 40, dtype)
    args = [t.cuda() if t is not None else None for t in (hidden, weight, tables, lens_t, idx, extra)]
    got = ch.compressed_head_triton(*args, True)
    h, w = args[0].float(), args[1].float()
    want = ch.compressed_head_torch(h, w, *args[2:], True)
    errors = check_against_reference(tuple(t.cpu() for t in got), tuple(t.cpu() for t in want), atol=1e-3, rtol=1e-4)
    assert not errors, "; ".join(errors)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2])
    else:
        sys.exit("usage: TRITON_INTERPRET=1 python tests/test_compressed_head.py --worker OUT.json")
