"""Data-parallel training under torchrun (training/parallel.py): two gloo processes on the CPU
train the head the single process trains.

- the weighting: a batch's loss is a mean over its response tokens, so shards whose sums are
  divided by the whole batch's token counts sum to the batch's loss and gradient (a naive mean of
  the shards' own means does not, when their token counts differ);
- the held-out score combined from shards equals the whole split's, bit for bit;
- end to end, `fastmtp train` in two processes launched by torchrun: after 8 optimizer steps at
  global batch 4 (grad-accum 2, an epoch's last micro-batch holding a single row) the head equals
  the single-process head (fp32, atol 1e-6); a checkpoint of the 2-process run resumes in one
  process, and one of a single process in two, to that same head; with the gradient all-reduce
  switched off the head differs; rank 0 alone writes the log; mismatched launches are refused.

Run: .venv/bin/pytest tests/test_train_ddp.py (one torchrun launch of 2 processes, ~1 min on 2
cores); `-m slow` adds the plain `torchrun -m fastmtp_sglang train` command (a second launch).
Under torchrun this file is also the worker: its __main__ block runs the `fastmtp` commands of a
plan in each process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastmtp_sglang.core.draft_dir import make_draft_config, save_draft_dir
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training import parallel
from fastmtp_sglang.training.checkpoints import load_trainer_state
from fastmtp_sglang.training.data import Example, collate
from fastmtp_sglang.training.objective import Projection, batch_loss, evaluate
from test_train import TOY_PROMPT, TOY_V, greedy, one_thread, random_head, tiny_target  # noqa: F401

K = 3
ROWS = 31            # 25 train rows (6 held out): 7 micro-batches of 4 per epoch, the last of 1
FLAGS = ["--steps", str(K), "--epochs", "2", "--batch-size", "4", "--grad-accum", "2",
         "--lr", "3e-3", "--warmup", "0.1", "--max-len", "64", "--ce-chunk", "16",
         "--heldout-fraction", "0.2", "--seed", "0", "--device", "cpu", "--no-progress"]
TOTAL = 8            # optimizer steps: 4 per epoch (micro-batches 2+2+2+1), 2 epochs
HALT = 3             # a mid-epoch checkpoint; step 4 is the single-row micro-batch


def _rows_of_varied_length(target, n: int, seed: int) -> list[Example]:
    """Greedy text with responses cut at seeded lengths 3..28: ranks hold unequal token counts."""
    g = torch.Generator().manual_seed(seed)
    seqs = greedy(target, torch.randint(0, TOY_V, (n, TOY_PROMPT), generator=g), 28)
    cut = torch.randint(3, 29, (n,), generator=g).tolist()
    return [Example(s[: TOY_PROMPT + c].clone(), TOY_PROMPT) for s, c in zip(seqs, cut)]


def _hidden(target, e: Example) -> torch.Tensor:
    with torch.no_grad():
        return target.model.model(input_ids=e.ids[None]).last_hidden_state[0]


# ------------------------------------------------------------------------------------------------
# the pieces, in one process
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,table", [("ce", False), ("ce+kl", True)])
def test_shards_weighted_by_the_batch_tokens_sum_to_the_batch_loss(kind, table):
    target = tiny_target(vocab=TOY_V, hidden=32, layers=1, lm_scale=30.0)
    head = random_head(target, "deepseek", seed=2).train()
    rows = _rows_of_varied_length(target, 5, seed=3)
    hiddens = [_hidden(target, e) for e in rows]
    vocab = torch.arange(0, TOY_V, 2) if table else None  # half the ids: in_table < targets
    proj = Projection(target.lm_head, vocab)
    in_table = proj.index.cpu() >= 0 if table else None
    weights = [0.5, 0.3, 0.2]

    def loss_and_grads(idx, denominators=None):
        head.zero_grad(set_to_none=True)
        batch = collate([rows[i] for i in idx], [hiddens[i] for i in idx], torch.device("cpu"))
        loss, st = batch_loss(head, batch, proj, K, weights, kind, "serve", 8,
                              denominators=denominators)
        loss.backward()
        return loss.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                               for p in head.parameters()], st

    whole, g_whole, st = loss_and_grads(range(5))
    counts = parallel.token_counts(rows, in_table, K)
    assert counts == (st["targets"], st["in_table"])       # what batch_loss divides by
    assert counts[1] != counts[0] if table else counts[1] == counts[0]
    shards = [parallel.Ranks(r, 2).shard(list(range(5))) for r in (0, 1)]  # [0, 2, 4], [1, 3]
    parts = [loss_and_grads(s, counts) for s in shards]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole, atol=1e-6, rtol=0)
    for a, b, w in zip(parts[0][1], parts[1][1], g_whole):
        torch.testing.assert_close(a + b, w, atol=1e-6, rtol=1e-5)
    own = [loss_and_grads(s)[0] for s in shards]  # each shard averaged over its own tokens
    assert abs(float((own[0] + own[1]) / 2 - whole)) > 1e-3


def test_heldout_score_from_shards_equals_the_whole_split():
    target = tiny_target(vocab=TOY_V, hidden=32, layers=1, lm_scale=30.0)
    head = random_head(target, "deepseek", seed=2)
    rows = _rows_of_varied_length(target, 7, seed=4)
    held = list(enumerate(rows))
    proj = Projection(target.lm_head)

    def hidden_fn(i, ids):
        return _hidden(target, rows[i])

    whole = evaluate(head, hidden_fn, held, proj, K, batch_size=2, chunk=16)
    for world in (2, 3, 8):  # 8 > 7 rows: one shard is empty
        parts = []
        for r in range(world):
            mine = parallel.Ranks(r, world).shard(held)
            parts.append((evaluate(head, hidden_fn, mine, proj, K, batch_size=2, chunk=16),
                          parallel.token_counts([e for _, e in mine], None, K)[0]))
        assert parallel.combine_evals(parts) == whole, world
    assert 1 < whole["tau_train"] and whole["anchors"] > 0


def test_torchrun_environment_is_read_or_refused():
    assert parallel.torchrun_env({}) is None
    assert parallel.torchrun_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (1, 4, 1)
    with pytest.raises(FastMTPError, match="LOCAL_RANK not"):
        parallel.torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(FastMTPError, match="RANK=2, WORLD_SIZE=2"):
        parallel.torchrun_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(FastMTPError, match="integers"):
        parallel.torchrun_env({"RANK": "a", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


# ------------------------------------------------------------------------------------------------
# end to end: torchrun, 2 gloo processes
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    """A saved tiny target (with a tokenizer: load_target wants one; the rows are ids), ROWS rows
    of varied length, and an initial draft."""
    root = tmp_path_factory.mktemp("ddp")
    target = tiny_target(vocab=TOY_V, hidden=32, layers=1, lm_scale=30.0)
    tdir = root / "target"
    target.model.save_pretrained(str(tdir))
    tiny_tokenizer.save_pretrained(str(tdir))
    rows = _rows_of_varied_length(target, ROWS, seed=1)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": e.ids[:e.prompt_len].tolist(),
                                        "response_ids": e.ids[e.prompt_len:].tolist()}) + "\n"
                            for e in rows))
    head = random_head(target, "deepseek", seed=2)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(0.5)
    init = root / "init"
    save_draft_dir(init, make_draft_config(target.config, "deepseek", dtype="float32"),
                   head.state_dict())
    return root, tdir, data, init


def _cli(*args) -> int:
    from fastmtp_sglang.cli import main

    return main([str(a) for a in args])


def _torchrun_2() -> list[str]:
    """torchrun for 2 processes on this machine (--standalone: its store on a free local port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _torchrun(plan: list[dict], root: Path) -> tuple[list[list[int]], str]:
    """Run the plan's `fastmtp` commands in 2 gloo processes started by torchrun; (each rank's
    exit codes, the combined output)."""
    plan_file = root / "plan.json"
    plan_file.write_text(json.dumps(plan))
    proc = subprocess.run([*_torchrun_2(), __file__, str(plan_file)], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return [json.loads((root / f"plan.json.rank{r}").read_text()) for r in (0, 1)], out


def _head_diff(a: Path, b: Path) -> float:
    """Largest absolute difference of two checkpoints' fp32 heads."""
    ha, hb = load_trainer_state(a)["head"], load_trainer_state(b)["head"]
    assert set(ha) == set(hb)
    return max(float((ha[k] - hb[k]).abs().max()) for k in ha)


def _log(path: Path) -> list[dict]:
    return [json.loads(x) for x in (path / "train_log.jsonl").read_text().splitlines()]


def test_two_processes_train_the_single_process_head(setup):
    root, tdir, data, init = setup
    base = ["train", "--target", tdir, "--data", data, *FLAGS]
    # the single process: uninterrupted, and halted mid-epoch
    assert _cli(*base, "--init", init, "--out", root / "one") == 0
    assert _cli(*base, "--init", init, "--out", root / "one_half", "--halt-after-steps", HALT) == 0
    plan = [
        {"argv": base + ["--init", init, "--out", root / "two"], "sync": True},
        {"argv": base + ["--init", init, "--out", root / "two_half", "--halt-after-steps", HALT],
         "sync": True},
        {"argv": base + ["--resume", root / "one_half", "--out", root / "one_then_two"],
         "sync": True},
        {"argv": base + ["--init", init, "--out", root / "two_unsynced"], "sync": False},
        # refused: a global batch the 2 processes cannot share; a resume with another batch
        {"argv": base + ["--init", init, "--out", root / "x", "--batch-size", "1"], "sync": True},
        {"argv": base + ["--resume", root / "one_half", "--out", root / "y", "--batch-size", "2"],
         "sync": True},
    ]
    plan = [{"argv": [str(a) for a in c["argv"]], "sync": c["sync"]} for c in plan]
    rcs, out = _torchrun(plan, root)
    assert rcs[0] == rcs[1] == [0, 0, 0, 0, 1, 1], out[-4000:]
    assert "is the global batch, which the 2 processes share: it must be at least 2" in out
    assert "batch_size: checkpoint 4, now 2" in out
    assert not (root / "x").exists() and not (root / "y").exists()
    # the 2-process checkpoint resumed in one process
    assert _cli("train", "--target", tdir, "--data", data, "--resume", root / "two_half",
                "--out", root / "two_then_one", "--device", "cpu", "--no-progress") == 0

    for name in ("two", "one_then_two", "two_then_one"):
        st = load_trainer_state(root / name)
        assert (st["global_step"], st["epoch"], st["batch_in_epoch"]) == (TOTAL, 2, 0), name
        assert _head_diff(root / name, root / "one") <= 1e-6, name
    assert load_trainer_state(root / "two")["world_size"] == 2
    # without the gradient all-reduce each rank follows its own rows: another head
    assert _head_diff(root / "two_unsynced", root / "one") > 1e-3

    one, two = _log(root / "one"), _log(root / "two")
    steps1 = [r for r in one if r["event"] == "step"]
    steps2 = [r for r in two if r["event"] == "step"]  # rank 0 alone wrote: each step once
    assert [r["step"] for r in steps2] == list(range(1, TOTAL + 1))
    for a, b in zip(steps1, steps2):
        assert a["targets"] == b["targets"] and a["acc_k"] == b["acc_k"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    # the held-out score, each rank scoring half the rows, is the single process's exactly
    evals1 = [r for r in one if r["event"] == "eval"]
    evals2 = [r for r in two if r["event"] == "eval"]
    assert evals1 == evals2 and len(evals1) == 2
    assert [r.get("world_size") for r in two if r["event"] == "start"] == [2]
    resumed = _log(root / "one_then_two")
    assert [r["world_size"] for r in resumed if r["event"] in ("start", "resume")] == [1, 2]
    assert [r["step"] for r in resumed if r["event"] == "step"] == list(range(1, TOTAL + 1))
    assert out.count("wrote draft directory") == 4  # rank 0's line of each finished command


@pytest.mark.slow
def test_torchrun_module_command(setup):
    """The command users type, `torchrun --nproc-per-node 2 -m fastmtp_sglang train`: the CLI
    starts and ends the process group itself (~40 s on 2 cores: a second launch)."""
    root, tdir, data, init = setup
    base = ["train", "--target", tdir, "--data", data, *FLAGS]
    if not (root / "one").is_dir():
        assert _cli(*base, "--init", init, "--out", root / "one") == 0
    cmd = [*_torchrun_2(), "-m", "fastmtp_sglang", *[str(a) for a in base], "--init", str(init),
           "--out", str(root / "cli")]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("wrote draft directory") == 1
    assert _head_diff(root / "cli", root / "one") <= 1e-6
    assert [r["step"] for r in _log(root / "cli") if r["event"] == "step"] == list(range(1, TOTAL + 1))


# ------------------------------------------------------------------------------------------------
# the worker: `python -m torch.distributed.run ... tests/test_train_ddp.py PLAN` runs this in
# every process
# ------------------------------------------------------------------------------------------------

def _worker(plan_file: str) -> None:
    from fastmtp_sglang.cli import main

    torch.set_num_threads(1)
    # one group for all the commands: `fastmtp train` joins a group that exists (and starts and
    # ends its own otherwise, as under `torchrun -m fastmtp_sglang train`)
    _, started = parallel.start("cpu")
    rank = parallel.current().rank
    synced = parallel.all_reduce_grads
    rcs = []
    for call in json.loads(Path(plan_file).read_text()):
        # the switch the unsynced run needs: each rank keeps its own gradient
        parallel.all_reduce_grads = synced if call["sync"] else (lambda params: None)
        rcs.append(main(call["argv"]))
    parallel.all_reduce_grads = synced
    parallel.end(started)
    Path(f"{plan_file}.rank{rank}").write_text(json.dumps(rcs))


if __name__ == "__main__":
    _worker(sys.argv[1])
